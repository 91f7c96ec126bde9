"""Sampler: everything about choosing a request's next token, in one place for the engine.

Its inputs are a step's logits and the requests in consecutive cache rows; in order it applies each
request's `logit_bias` row (made once when the request starts), its grammar mask (made on the host
while the GPU runs the forward pass, uploaded in one asynchronous copy), its penalties (the per-row
`seen` mask and reply `counts`, kept beside the cache rows so that they move with them) and the draw
(`pipeline.llm.engine.sampling.sample`, fed one uniform number per row from the request's own random
stream), and reports log-probabilities of the model's own logits where a request asks for them.
The numbers a draw reads go up through pinned buffers in pairs (one step may be queued while the
next is prepared), so the host never waits for the GPU here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from pipeline.llm.engine.cache_rows import CacheRows
from pipeline.llm.engine.grammar_masks import apply_masks, fill_masks
from pipeline.llm.text.grammar import bitmask_words
from pipeline.llm.engine.sampling import COLUMNS, counts_penalized, sample, sampling_columns
from pipeline.llm.engine.plan import Request


class Sampler:
    """`width`: the most tokens a row feeds in a step (its last one and those proposed after it)."""

    def __init__(self, rows: CacheRows, vocab_size: int, max_batch: int, device: torch.device, width: int = 1):
        self.rows, self.vocab_size, self.max_batch, self.device = rows, vocab_size, max_batch, device
        self.width = width
        pinned = device.type == "cuda"
        # Host buffers are flat and viewed per step: a copy from a strided view would go through pageable
        # memory, which waits for the GPU. Two, used in turn: a step may be queued while the next is prepared.
        size = len(COLUMNS) * width * max_batch
        self._columns_host = torch.zeros(2, size, dtype=torch.float32, pin_memory=pinned)
        self._columns = torch.zeros(size, dtype=torch.float32, device=device)
        self._ones = torch.ones(max_batch, 1, dtype=torch.float32, device=device)
        self._ones_long = torch.ones(max_batch, dtype=torch.long, device=device)
        self._bitmask: Tensor | None = None  # grammar masks on the host, two steps' worth (made at first use)
        self._flip = self._flip_mask = 0

    def start(self, request: Request) -> None:
        """`request` starts its reply in row `request.row`: the row's penalty state is reset (the prompt's
        own ids count as seen, as transformers counts them; an image prompt's placeholders do not) and its
        `logit_bias` becomes one row over the vocabulary, so a step uploads nothing for it."""
        row, prompt, params = request.row, request.prompt, request.params
        self.rows.seen[row] = False
        if counts_penalized([params]):
            self.rows.counts[row] = 0
        if not prompt.slots:  # scatter, not index_put_: that waits for the GPU
            self.rows.seen[row].scatter_(0, self._upload(prompt.ids, torch.long), True)
        if params.logit_bias:
            ids, biases = zip(*params.logit_bias)
            request.bias = torch.zeros(self.vocab_size, device=self.device).scatter_(
                0, self._upload(ids, torch.long), self._upload(biases, torch.float32))

    def _upload(self, values: Sequence, dtype: torch.dtype) -> Tensor:
        """`values` on the device without waiting for the GPU (from page-locked memory): a request starts
        while the steps before it still run."""
        host = torch.tensor(values, dtype=dtype, pin_memory=self.device.type == "cuda")
        return host.to(self.device, non_blocking=True)

    def draw(self, requests: Sequence[Request], logits: Tensor, proposed: Sequence[Sequence[int]] = (),
             behind: tuple[Tensor, int] | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
        """Every position's token for a step's drawing requests (the running ones, in cache rows 0..n-1, and
        the prompts read to their end, in their rows): `logits` [n, T, vocab] score each request's fed tokens,
        its last token and the tokens proposed after it (`proposed[i]`, up to T - 1; none in a decode step,
        T = 1; a prompt's last position at 0). At each position a row draws its token
        exactly as a decode step would there if the proposed tokens before it were kept (bias, grammar,
        penalties counting those tokens, its own next uniform number), all positions in one batch; a
        proposed token is kept while the drawn token equals it. That is Leviathan et al.'s and Chen et al.'s
        acceptance rule for a proposal of one token for certain, q = 1 at the proposed token: it is kept
        with probability min(1, p/q) = p(proposed), and on rejection the token comes from max(0, p - q)
        renormalised, p without the proposed token; one draw from p does both. So the reply has plain
        decoding's distribution, and a seeded one its very tokens. Returns on the device: the drawn
        tokens [n, T], how many each row keeps [n] (its kept proposed tokens + 1)
        and the log-probabilities [n, T, ...] where a request asks for them (see `logprobs_of`). The rows'
        penalty state takes the kept tokens; the uniform numbers are the caller's to `skip` (kept ones).
        `behind`: the first rows follow a verify step not yet settled ((its kept counts [m] on the device, its
        width W)): the host does not know which of their numbers come next, so each row's next W - 1 + T go up
        and the device takes T of them from where its kept count says. The host never waits for the GPU here."""
        n, positions, vocab = logits.shape
        proposed = proposed or [()] * n
        params = [r.params for r in requests for _ in range(positions)]  # row i's position j: entry i*T + j
        uniforms = [u for r in requests for u in r.draws.peek(positions)]
        columns = self._columns[:len(COLUMNS) * n * positions].view(len(COLUMNS), n * positions)
        if counts_penalized(params) or any(p.temperature or p.repetition_penalty != 1.0 for p in params):
            self._flip ^= 1  # the other buffer's upload may still be queued behind the step in flight
            host = self._columns_host[self._flip, :len(COLUMNS) * n * positions].view(len(COLUMNS), n * positions)
            host.numpy()[:] = sampling_columns(params, uniforms, self.vocab_size)
            columns.copy_(host, non_blocking=True)
            if behind is not None and any(p.temperature for p in params):
                kept, width = behind
                ahead = self._upload([r.draws.peek(width - 1 + positions) for r in requests[:len(kept)]], torch.float32)
                at = kept[:, None] - 1 + torch.arange(positions, device=self.device)[None]
                columns[0, :len(kept) * positions] = ahead.gather(1, at).view(-1)
        rows = self._rows([r.row for r in requests])
        seen, counts = self._penalty_state(rows, proposed, positions, counts_penalized(params))
        flat = logits.reshape(n * positions, vocab)
        allowed = _biased([r for r in requests for _ in range(positions)], flat) \
            if any(r.bias is not None for r in requests) else flat
        if any(r.grammar is not None for r in requests):
            allowed = apply_masks(allowed, self._masks(requests, proposed, positions))
        drawn = sample(allowed, params, seen, columns, counts).view(n, positions)  # greedy alone reads no columns
        if positions == 1:  # the state was the rows' own (or their copy)
            kept = self._ones_long[:n]
            seen.scatter_(1, drawn, True)
            if counts is not None:
                counts.scatter_add_(1, drawn, self._ones[:n])
        else:
            fed = self._upload([[*p, *[-1] * (positions - len(p))] for p in proposed], torch.long)
            kept = (drawn == fed).long().cumprod(1).sum(1) + 1
            taken = torch.arange(positions, device=self.device)[None] < kept[:, None]
            seen, counts = self.rows.seen[rows], self.rows.counts[rows] if counts is not None else None
            seen.scatter_(1, torch.where(taken, drawn, drawn[:, :1]), True)  # every write True
            if counts is not None:
                counts.scatter_add_(1, drawn, taken.float())
        if isinstance(rows, Tensor):  # copies of rows apart: written back
            self.rows.seen.index_copy_(0, rows, seen)
            if counts is not None:
                self.rows.counts.index_copy_(0, rows, counts)
        wanted = [r.params.logprobs for r in requests if r.params.logprobs is not None]
        logprobs = _chosen_and_top(flat.float().log_softmax(-1), drawn.view(-1), max(wanted)).view(n, positions, -1) \
            if wanted else None  # log-softmax of the model's own logits, before any setting or grammar, as OpenAI's
        return drawn, kept, logprobs

    def _rows(self, rows: list[int]) -> slice | Tensor:
        """The cache rows drawn for: a slice where they are consecutive (views of the rows' state, written in
        place), else their indices on the device (copies, written back)."""
        if rows == list(range(rows[0], rows[0] + len(rows))):
            return slice(rows[0], rows[0] + len(rows))
        return self._upload(rows, torch.long)

    def _penalty_state(self, rows: slice | Tensor, proposed: Sequence[Sequence[int]], positions: int,
                       counted: bool) -> tuple[Tensor, Tensor | None]:
        """The repetition mask and reply counts each position draws with: the rows' own (one position), or
        a copy per position (repeat_interleave waits for the GPU) with the proposed tokens before it added."""
        seen, counts = self.rows.seen[rows], self.rows.counts[rows] if counted else None
        if positions == 1:
            return seen, counts
        n, vocab = seen.shape

        def each_position(state: Tensor) -> Tensor:
            return state[:, None].expand(n, positions, vocab).contiguous().view(n * positions, vocab)

        seen, counts = each_position(seen), each_position(counts) if counted else None
        before = [(i * positions + j) * vocab + t for i, p in enumerate(proposed) for j in range(1, len(p) + 1)
                  for t in p[:j]]  # as flat indices
        if before:  # index_fill_ and index_add_: an assigned Python value would come up from pageable memory
            at = self._upload(before, torch.long)
            seen.view(-1).index_fill_(0, at, True)
            if counts is not None:
                counts.view(-1).index_add_(0, at, torch.ones(len(before), device=self.device))
        return seen, counts

    def _masks(self, requests: Sequence[Request], proposed: Sequence[Sequence[int]], positions: int) -> Tensor:
        """Each position's grammar masks [n * T, words] on the device: made on the host (while the GPU runs
        the forward pass), uploaded in one asynchronous copy from the buffer the step before did not use. A
        row's grammar is stepped through its proposed tokens (all of which it allows: none other is
        proposed) to make the masks of the positions after them, then rolled back; rows without a grammar,
        and positions past a row's proposed tokens, allow everything."""
        words = bitmask_words(self.vocab_size)
        if self._bitmask is None:
            self._bitmask = torch.zeros(2, self.width * self.max_batch * words, dtype=torch.int32,
                                        pin_memory=self.device.type == "cuda")
        self._flip_mask ^= 1
        host = self._bitmask[self._flip_mask, :positions * len(requests) * words].view(positions, len(requests), words)
        taken = [0] * len(requests)
        for j in range(positions):
            fill_masks([r.grammar if j <= len(p) else None for r, p in zip(requests, proposed)], host[j])
            for i, (r, p) in enumerate(zip(requests, proposed)):
                if r.grammar is not None and j < len(p):
                    taken[i] += r.grammar.consume(p[j])
        for r, n in zip(requests, taken):
            if r.grammar is not None:
                r.grammar.rollback(n)
        return host.to(self.device, non_blocking=True).transpose(0, 1).reshape(len(requests) * positions, -1)


def logprobs_of(values: Tensor, k: int) -> tuple[float, list[tuple[int, float]]]:
    """A token's row of `Sampler.draw`'s log-probabilities (on the host) as (its log-probability,
    [(id, log-probability)] of the `k` most likely tokens, most likely first)."""
    row = values.tolist()
    return row[0], [(int(i), v) for v, i in zip(row[1:1 + k], row[(len(row) + 1) // 2:][:k])]


def _biased(requests: Sequence[Request], logits: Tensor) -> Tensor:
    """A copy of `logits` in fp32 with each request's `logit_bias` row added (OpenAI's: before any other
    sampling setting, so +100 all but forces a token and -100 all but bans it). The rows were made when
    the requests started: a step uploads nothing."""
    out = logits.to(torch.float32, copy=True)
    for i, r in enumerate(requests):
        if r.bias is not None:
            out[i] += r.bias
    return out


def _chosen_and_top(logprobs: Tensor, drawn: Tensor, k: int) -> Tensor:
    """Per row [the drawn token's log-probability, the k largest log-probabilities, their ids] (ids as
    floats: exact below 2^24), so one copy brings them to the host."""
    parts = [logprobs.gather(1, drawn[:, None])]
    if k:
        top = logprobs.topk(k, dim=-1)
        parts += [top.values, top.indices.float()]
    return torch.cat(parts, dim=1)
