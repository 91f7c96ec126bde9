"""Weight-only int4 (grouped) and int8 (per channel) matrix products for batch 1–16 and prefill (Triton).

Why our own kernel: a quantized decode step reads every weight once, so its time is the weight bytes
over memory bandwidth, provided dequantization keeps up; on Hopper the usual way (integer unpack,
then an int→float conversion at 16 per SM per clock, per row of the batch) falls behind. So:

- **Magic-number dequantization.** A nibble OR-ed under the bits of 128.0 is the bf16 128 + q,
  exactly (fp16: 1024.0): one AND-OR per weight, no conversion instruction. int8 is stored + 128.
- **The offset and the zero point come out once per group**, from the activations' group sum:
  Σ x·(q − z)·s = (Σ x·(128 + q) − (128 + z)·Σ x)·s, in fp32.
- **Tensor cores at any batch.** The operands come from the loaded bytes by elementwise steps only
  (int4: the low nibbles dotted with the even inputs, the high nibbles with the odd ones), so Triton
  can dequantize in the tensor cores' operand layout; the activations are padded to 16 rows and a
  batch of 8 chats costs about what one does.
- **Split-K without fills or a reduction launch.** Where a layer has few output tiles (the down
  projection), several programs share a tile's inputs, write fp32 partials to a workspace, and the
  last one to arrive (an atomic counter) adds them in a fixed order and resets the counter. One
  launch, no zero-fill, deterministic sums.
- **One row (the single chat) has CUDA-core GEMVs** (`plugins/lowbit_gemv.py`): at batch 1 the
  tensor cores would multiply 15 rows of padding. For bf16 int4 (the usual case) the packed-pair
  kernel: two weights per instruction, scales a loop step ahead; it reads gate_up at 0.71 and down
  at 0.58 of copy bandwidth, qkv and o at 0.33 and 0.30 (H100, 2026-11-27; the fp32-mantissa GEMV
  it replaced: 0.64 / 0.45 / 0.28 / 0.23).
- **A speculative verify step's rows round as one-row calls** (`rows_as_one_row`): the one-row launch
  for each of a chat's 2–9 positions, so greedy replies stay those of plain decoding.
- Launch shapes (kernel, tile, loop step, split) are timed per GPU and layer shape
  (`plugins/lowbit_tuning.py`): whichever kernel is fastest for a shape and batch runs it.

Layouts (`kernel_bytes`): the canonical bytes of `pipeline/llm/weights/quant.py` (int8 with its sign
bit flipped), rows stored in tiles of 256 so that a program's loads are long contiguous runs (the
GEMV reached 0.97 of copy bandwidth reading this layout, 0.85 reading plain rows: H100, 2026-11-23);
`scale` [groups, out] in the model's dtype (int4; `zero` likewise) or float32 [1, out]. The file
format on disk stays the canonical one: the tiling is done at load, in a few milliseconds per layer.

On the CPU the kernel runs under Triton's interpreter in the tests (`tests/test_lowbit.py`), whose
bf16 `tl.dot` is broken (Triton 3.9): there the dot operands are widened to fp32 first (exact for
these values). Everything else is the code the GPU runs.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Iterator

import torch
from torch import Tensor

from plugins.fused import silu_mul_fused
from plugins.lowbit_tiles import BLOCK_M, GROUP, GROUPS, INTERPRETED, MAX_SPLIT, TILE, unavailable

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs (no triton wheel): the caller's reference path is used
    triton = None

if triton is not None:  # the kernels and their helpers exist only where triton does
    from plugins.lowbit_gemv import _gemv_kernel, _packed_gemv_kernel
    from plugins.lowbit_tiles import _chunks, _finish, _row_chunk, _rows


@dataclasses.dataclass(frozen=True)
class Config:
    """One launch shape: output rows per program, chunks (64 bytes of every row) per loop step, programs
    per output tile along the inputs (split-K), Triton's warps and pipeline depth, and which kernel."""

    block_n: int = 64
    steps: int = 1
    split_k: int = 1
    warps: int = 4
    stages: int = 3
    kernel: str = "mma"  # one row on CUDA cores: "gemv" (`_gemv_kernel`), "packed" (bf16 int4: `_packed_gemv_kernel`)


if triton is not None:
    @triton.jit
    def _lowbit_kernel(x_ptr, w_ptr, scale_ptr, zero_ptr, bias_ptr, out_ptr, part_ptr, count_ptr,
                     M, N, K, stride_xm, stride_om, SPLIT_K,
                     BITS: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr, MAGIC: tl.constexpr,
                     DOT_F32: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, STEPS: tl.constexpr,
                     GROUP: tl.constexpr):
        """One [BLOCK_N, BLOCK_M] tile of out, over this split's chunks of the inputs. The dot operands come
        from the stored bytes by elementwise steps only (int4: the low and the high nibbles as two
        operands, dotted with the even and the odd inputs; int8: the byte), which Triton can apply after
        loading straight into the tensor cores' operand layout. int4 in groups of GROUP < 128 (a GGUF
        file's 32): each group of a chunk is its own pair of dots (GROUP / 2 bytes deep, at least the
        tensor cores' 16), scaled by its own scale and zero point."""
        pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rv, rn = _rows(pid_n, N, BLOCK_N, GATED)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        GROUPS: tl.constexpr = 128 // GROUP if BITS == 4 else 1  # scale and zero pairs per chunk
        WIDTH: tl.constexpr = 64 // GROUPS  # bytes of a row per group of a chunk
        rb = tl.arange(0, WIDTH)
        n_ok, m_ok = rv < N, rm < M
        compute: tl.constexpr = x_ptr.dtype.element_ty
        magic_half: tl.constexpr = 0x4300 if MAGIC == 128.0 else 0x6400
        CHUNK: tl.constexpr = 128 if BITS == 4 else 64
        first, last = _chunks(pid_k, K, BITS, STEPS, SPLIT_K)
        acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        xsum_all = tl.zeros((BLOCK_M,), tl.float32)
        for start in range(first, last, STEPS):
            for i in tl.static_range(STEPS):
                for g in tl.static_range(GROUPS):  # the groups of chunk start + i
                    b = start + i
                    ok = (rb * 0 + b) < last
                    w = tl.load(w_ptr + _row_chunk(rn, b, K, BITS)[:, None] * 64 + g * WIDTH + rb[None, :],
                                mask=n_ok[:, None] & ok[None, :], other=0).to(tl.int16)  # [BLOCK_N, WIDTH] bytes
                    x_at = x_ptr + rm[None, :] * stride_xm + b * CHUNK + (g * WIDTH + rb[:, None]) * (CHUNK // 64)
                    x_ok = m_ok[None, :] & ok[:, None]
                    if BITS == 4:
                        x_even = tl.load(x_at, mask=x_ok, other=0.0)  # [WIDTH, BLOCK_M]: inputs 2i
                        x_odd = tl.load(x_at + 1, mask=x_ok, other=0.0)
                        lo = ((w & 15) | magic_half).to(compute, bitcast=True)  # MAGIC + q, exact
                        hi = ((w >> 4) | magic_half).to(compute, bitcast=True)
                        if DOT_F32:
                            lo, hi, x_even, x_odd = lo.to(tl.float32), hi.to(tl.float32), x_even.to(tl.float32), \
                                x_odd.to(tl.float32)
                        part = tl.dot(hi, x_odd, tl.dot(lo, x_even))
                        xsum = tl.sum(x_even.to(tl.float32), 0) + tl.sum(x_odd.to(tl.float32), 0)
                        at = (b * GROUPS + g) * N + rn
                        sc = tl.load(scale_ptr + at, mask=n_ok & (rn * 0 + b < last), other=0.0).to(tl.float32)
                        zp = tl.load(zero_ptr + at, mask=n_ok & (rn * 0 + b < last), other=0.0).to(tl.float32)
                        acc += (part - (zp + MAGIC)[:, None] * xsum[None, :]) * sc[:, None]
                    else:
                        x = tl.load(x_at, mask=x_ok, other=0.0)
                        u = (w & 255).to(tl.float32 if DOT_F32 else compute)  # the stored byte, q + 128: exact
                        if DOT_F32:
                            x = x.to(tl.float32)
                        acc = tl.dot(u, x, acc)
                        xsum_all += tl.sum(x.to(tl.float32), 0)
        if BITS == 8:
            sc = tl.load(scale_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
            acc = (acc - 128 * xsum_all[None, :]) * sc[:, None]
        _finish(acc, rv, rn, rm, n_ok, m_ok, pid_n, pid_k, N, bias_ptr, out_ptr, stride_om, part_ptr, count_ptr,
                SPLIT_K, HAS_BIAS, GATED, BLOCK_N, BLOCK_M)


def available(device: torch.device, dtype: torch.dtype, bits: int, in_features: int, group: int = GROUP) -> str | None:
    """None when the kernel can run a layer like this (int4: in groups of `group` inputs), else why not (the
    caller keeps its reference)."""
    if why := unavailable(device, dtype):
        return why
    if bits == 4 and group not in GROUPS:
        return f"the int4 kernels run groups of {', '.join(map(str, GROUPS))} inputs, not {group}"
    if bits == 8 and in_features % 64:  # int4 widths are padded to whole chunks (`LowBitWeight.from_parts`)
        return f"input width {in_features} is not a multiple of 64"
    return None


def kernel_bytes(q: Tensor, bits: int) -> Tensor:
    """The stored weight as the kernels read it, uint8 [tiles, chunks, TILE, 64]: for every chunk (64 bytes
    of a row) the TILE rows of a tile side by side, so a program's loads are long contiguous runs. Each
    row's bytes are the canonical ones (int4: input 2i in the low nibble of byte i; int8 with its sign
    bit flipped, q + 128); rows past the last tile's end are zeros."""
    q = q.contiguous().view(torch.uint8)
    q = q if bits == 4 else q ^ 0x80
    rows, width = q.shape
    tiles = -(-rows // TILE)
    padded = torch.zeros(tiles * TILE, width, dtype=torch.uint8, device=q.device)
    padded[:rows] = q
    return padded.view(tiles, TILE, width // 64, 64).transpose(1, 2).contiguous()


class Workspace:
    """Split-K partial sums and arrival counters, shared by one model's layers (its engine runs them
    one at a time on one stream). Counters start at zero once and every call leaves them at zero."""

    def __init__(self, device: torch.device):
        self.device = device
        self.partials = torch.empty(0, device=device)
        self.counters = torch.zeros(0, dtype=torch.int32, device=device)
        self._outgrown: list[Tensor] = []  # buffers a CUDA graph captured earlier may still use: never freed

    def reserve(self, partial_floats: int, counters: int) -> None:
        """Grow to at least these sizes (in a graph's eager warm-up: allocation is not graphable). An
        outgrown buffer is kept, not freed: a graph captured before (a decode step's) keeps its address,
        and a verify step with more rows of partials must not hand that memory to anything else. Never inside a
        capture: the new counters' zeros would be written only as that graph replays, and a graph captured
        after it could replay first on whatever the memory held (a speculating int4 engine's replies parted
        from plain decoding's, H200, 2026-11-30): it raises, and the capture is made again after a run."""
        grows = self.partials.numel() < partial_floats or self.counters.numel() < counters
        if grows and self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the split-K workspace would grow inside a CUDA graph capture: run the call once "
                               "before capturing it")
        if self.partials.numel() < partial_floats:
            self._outgrown.append(self.partials)
            self.partials = torch.empty(partial_floats, dtype=torch.float32, device=self.device)
        if self.counters.numel() < counters:
            self._outgrown.append(self.counters)
            self.counters = torch.zeros(counters, dtype=torch.int32, device=self.device)


def default_config(bits: int, out_features: int, in_features: int, rows: int, processors: int) -> Config:
    """A launch shape without tuning: enough programs to cover the GPU at batch ≤ 16; plain tiles for prefill."""
    if rows > BLOCK_M:
        return Config(block_n=64, steps=1, split_k=1)
    tiles = -(-out_features // 64)
    chunks = in_features // (GROUP if bits == 4 else 64)
    split = 1
    while tiles * split < 2 * processors and chunks // (split * 2) >= 8 and split < MAX_SPLIT:
        split *= 2
    return Config(block_n=64, steps=1, split_k=split)


def rows_per_gemv(config: Config) -> int:
    """Activation rows one GEMV launch takes at most: each keeps its own sums in registers, BLOCK_N / 8
    a thread at 4 warps, and past about 576 sums a program they spill (compiled for sm_90; the int8 LM
    head's 256-row tiles took 141× one row's time for 9 rows: H100, 2026-11-27). More rows run in
    several launches; each row's arithmetic is the same in any of them."""
    return max(1, 576 * config.warps // (4 * config.block_n))


def kernel_for(config: Config, bits: int, dtype: torch.dtype, rows: int) -> str:
    """The kernel `config` runs for `rows` rows: the CUDA-core ones take one row, and "packed" bf16 int4
    weights (elsewhere "gemv" runs instead)."""
    if rows > 1:
        return "mma"
    return "gemv" if config.kernel == "packed" and (bits != 4 or dtype != torch.bfloat16) else config.kernel


def lowbit_matmul(x: Tensor, data: Tensor, scale: Tensor, zero: Tensor | None, bias: Tensor | None, bits: int,
                  config: Config, workspace: Workspace | None, gated: bool = False, compile_only: bool = False,
                  as_one_row: bool = False) -> Tensor:
    """x [..., in] @ the packed weight's transpose (+ bias) → [..., out] in x's dtype; gated (the weight is
    a gate projection above an up projection): SiLU(gate)·up → [..., out / 2]. `compile_only`: compile
    the kernel this call needs (in Triton's `AsyncCompileMode`, in the background) and launch nothing.
    `as_one_row` (at most BLOCK_M rows): `config`'s one-row kernel for every row, each row's numbers
    exactly those of a one-row call."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1 or x2.data_ptr() % 16:  # the kernels read the inputs in aligned pairs or more
        x2 = x2.clone(memory_format=torch.contiguous_format)
    m, k = x2.shape
    n = scale.shape[-1]  # output features (the data holds whole tiles)
    n_out = n // 2 if gated else n
    out = torch.empty(m, n_out, dtype=x.dtype, device=x.device)
    split = config.split_k if m <= BLOCK_M else 1
    assert split <= MAX_SPLIT and (m <= BLOCK_M or not as_one_row), config
    kernel = kernel_for(config, bits, x.dtype, 1 if as_one_row else m)
    gemv = kernel != "mma"
    per_launch = min(m, rows_per_gemv(config)) if gemv else m
    block_m = triton.next_power_of_2(per_launch) if gemv else BLOCK_M if m <= BLOCK_M else 64
    tiles = triton.cdiv(n, config.block_n)
    if split > 1:
        workspace.reserve(split * block_m * n, tiles)
        partials, counters = workspace.partials, workspace.counters
    else:
        partials = counters = out  # unused
    group = k // scale.shape[0] if bits == 4 else GROUP  # int8: one scale per row, no groups
    common = dict(BITS=bits, HAS_BIAS=bias is not None, GATED=gated, BLOCK_N=config.block_n, STEPS=config.steps,
                  GROUP=group, num_warps=config.warps, num_stages=config.stages)
    weights = (data.view(torch.int32) if gemv else data, scale, zero if zero is not None else scale,
               bias if bias is not None else scale)
    def launcher(kernel, grid):
        return functools.partial(kernel.warmup, grid=grid) if compile_only else kernel[grid]

    if gemv:  # in launches of `per_launch` rows (each row's numbers are the same in any of them)
        for i in range(0, m, per_launch):
            rows = min(per_launch, m - i)
            tensors = (x2[i:i + rows], *weights, out[i:i + rows], partials, counters)
            block = dict(ROWS=rows, BLOCK_M=triton.next_power_of_2(rows), STAGES=config.stages, **common)
            if kernel == "packed":
                del block["BITS"]
                launcher(_packed_gemv_kernel, (tiles, split))(*tensors, n, k, out.stride(0), split,
                                                               EMULATE=INTERPRETED, **block)
            else:
                launcher(_gemv_kernel, (tiles, split))(*tensors, n, k, out.stride(0), split,
                                                        X_BF16=x.dtype == torch.bfloat16, **block)
    else:
        tensors = (x2, *weights, out, partials, counters)
        launcher(_lowbit_kernel, (tiles, split, triton.cdiv(m, block_m)))(
            *tensors, m, n, k, x2.stride(0), out.stride(0), split,  # split: a value, not compiled in
            MAGIC=128.0 if x.dtype == torch.bfloat16 else 1024.0, DOT_F32=INTERPRETED, BLOCK_M=block_m, **common)
    return out.view(*shape[:-1], n_out)


_AS_ONE_ROW: contextvars.ContextVar[bool] = contextvars.ContextVar("lowbit_as_one_row", default=False)
_WORKSPACE: contextvars.ContextVar[Workspace | None] = contextvars.ContextVar("lowbit_workspace", default=None)


@contextlib.contextmanager
def using_workspace(workspace: Workspace) -> Iterator[None]:
    """Within it, `LowBitWeight` calls take their split-K partials and arrival counters from `workspace`
    instead of their model's. Why: two streams running one model's layers at once (a benchmark's plain and
    speculating engines, a warm-up beside a step in flight) shared the counters; a counter left off zero
    by the race made every later call on that tile add the wrong partials, and replies parted from plain
    decoding's from run to run. Read when a call is traced: a CUDA graph keeps the workspace it captured."""
    token = _WORKSPACE.set(workspace)
    try:
        yield
    finally:
        _WORKSPACE.reset(token)


@contextlib.contextmanager
def rows_as_one_row(on: bool = True) -> Iterator[None]:
    """Within it (where `on`), a `LowBitWeight` call of 2–BLOCK_M rows gives each row exactly the numbers
    a one-row call gives it: the one-row launch shape and kernel, each row's arithmetic unchanged.
    Why: speculative decoding's verify step scores a chat's next positions in one call, and its greedy
    tokens must be those of the one-row decode steps it stands for; the batch kernels round otherwise
    (0.25 % from the reference where the packed GEMV is 0.4 %), enough to flip a close choice. Read
    when a call is traced: a CUDA graph captured within it keeps it."""
    token = _AS_ONE_ROW.set(on)
    try:
        yield
    finally:
        _AS_ONE_ROW.reset(token)


def as_one_row() -> bool:
    """Whether calls of 2–16 rows must give each row its one-row numbers here (`rows_as_one_row`)."""
    return _AS_ONE_ROW.get()


class LowBitWeight:
    """One layer's packed weight and how to launch on it: `config` for one row, `batch_config` for 2–16
    rows (the decode step; both tuned per GPU by `plugins.lowbit_tuning`), plain tiles for prefill.
    `gated`: a fused gate and up projection whose output is SiLU(gate)·up: for one row (the single
    chat's decode step) made in the kernel's last step, with no separate launch; for more rows by
    `plugins.fused`'s SiLU·mul kernel after the plain product, which measured faster there."""

    def __init__(self, data: Tensor, scale: Tensor, zero: Tensor | None, bias: Tensor | None, bits: int,
                 dtype: torch.dtype, workspace: Workspace, gated: bool = False, pad: int = 0):
        self.data, self.scale, self.zero, self.bias, self.bits, self.dtype = data, scale, zero, bias, bits, dtype
        self.workspace, self.gated, self.pad = workspace, gated, pad
        self.out_features = scale.shape[-1]
        self.in_features = data.shape[1] * 64 * 8 // bits  # whole chunks: `pad` zero inputs past the layer's
        self.group = self.in_features // scale.shape[0] if bits == 4 else 0
        processors = torch.cuda.get_device_properties(data.device).multi_processor_count if data.is_cuda else 132
        self.config = default_config(bits, self.out_features, self.in_features, 1, processors)
        self.batch_config = default_config(bits, self.out_features, self.in_features, 8, processors)
        self.prefill = default_config(bits, self.out_features, self.in_features, BLOCK_M + 1, processors)

    @classmethod
    def from_parts(cls, parts: dict[str, Tensor], bits: int, dtype: torch.dtype, bias: Tensor | None,
                   workspace: Workspace, gated: bool = False) -> "LowBitWeight":
        """From the canonical format's tensors (`pipeline.llm.weights.quant.quantize`: q, scale[, zero]). An
        int4 width that is not whole chunks of 128 inputs (SmolLM2's 576: 4.5) is padded to them with groups
        whose weights, scale and zero point are 0, and the inputs with zeros at each call: each adds an exact
        0, so the layer's numbers are its own."""
        q, pad = parts["q"], 0
        if bits == 4:
            scale, zero = parts["scale"], parts["zero"]
            pad = -q.shape[1] * 2 % 128
            if pad:
                groups = pad // (q.shape[1] * 2 // scale.shape[1])
                q = torch.nn.functional.pad(q, (0, pad // 2))
                scale, zero = (torch.nn.functional.pad(t, (0, groups)) for t in (scale, zero))
            scale, zero = scale.t().contiguous(), zero.t().contiguous()
        else:
            scale, zero = parts["scale"].view(1, -1).contiguous(), None
        return cls(kernel_bytes(q, bits), scale, zero, bias, bits, dtype, workspace, gated, pad)

    @classmethod
    def stand_in(cls, bits: int, dtype: torch.dtype, in_features: int, out_features: int, group: int, bias: bool,
                 device: torch.device, workspace: Workspace, gated: bool = False) -> "LowBitWeight":
        """A layer of this shape whose weight bytes are not there (one chunk's worth): every launch argument
        a kernel is compiled for (dtypes, alignment, widths) is that of the layer `from_parts` makes, so its
        kernels can compile (`compile_only`) while the real weights are still being read. Never run it."""
        pad = -in_features % 128 if bits == 4 else 0
        width = in_features + pad
        data = torch.empty(1, width * bits // 512, 1, 64, dtype=torch.uint8, device=device)  # [tiles, chunks, ...]
        if bits == 4:
            scale = torch.empty(width // group, out_features, dtype=dtype, device=device)
            zero = torch.empty_like(scale)
        else:
            scale, zero = torch.empty(1, out_features, dtype=torch.float32, device=device), None
        bias_ = torch.empty(out_features, dtype=dtype, device=device) if bias else None
        return cls(data, scale, zero, bias_, bits, dtype, workspace, gated, pad)

    def shape_key(self) -> str:
        """What a tuned launch shape is chosen for (layers alike in this run alike). Groups other than
        GROUP are named (a GGUF file's 32 load more scales: their best shape may differ); GROUP's keys
        stay those stored before groups varied."""
        extras = (" +bias" if self.bias is not None else "") + (" +silu_mul" if self.gated else "")
        extras += f" g{self.group}" if self.group not in (0, GROUP) else ""
        return f"int{self.bits} {self.in_features}->{self.out_features}{extras}"

    def __call__(self, x: Tensor, config: Config | None = None, compile_only: bool = False) -> Tensor:
        if self.pad:
            x = torch.nn.functional.pad(x, (0, self.pad))
        rows = x.numel() // x.shape[-1]
        one_row_numbers = 1 < rows <= BLOCK_M and as_one_row()
        chosen = config or (self.config if rows == 1 or one_row_numbers else self.batch_config if rows <= BLOCK_M
                            else self.prefill)
        # more rows: the gated tile was slower (int4 prefill 1.3×, H100), unless they must round as one row does
        in_kernel = self.gated and (rows == 1 or one_row_numbers)
        out = lowbit_matmul(x, self.data, self.scale, self.zero, self.bias, self.bits, chosen,
                            _WORKSPACE.get() or self.workspace,
                            in_kernel, compile_only, one_row_numbers)
        return silu_mul_fused(out) if self.gated and not in_kernel and not compile_only else out
