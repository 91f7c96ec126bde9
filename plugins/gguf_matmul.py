"""Matrix products on GGUF weights as the file stores them (Triton): Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K,
Q5_K and Q6_K, read from their planes (`plugins.gguf_blocks`) and dequantized inside the kernel.

One row (a chat's decode step) and a verify step's rows run on the CUDA cores (`plugins.gguf_gemv`); 2–16
rows of different chats and prefill on the tensor cores, here. How (one kernel, one branch per format, chosen
when it compiles):
- **Exact weights, no re-rounding.** A sub-block's quants q (unsigned: 4, 5 or 6 bits) become the tensor
  cores' operand as MAGIC + q, exactly (OR-ed under the bits of 128.0 in bf16, 1024.0 in fp16: no
  conversion instruction). Each sub-block (32 weights; 16 for Q6_K's scales and the 32-weight blocks'
  halves) is one dot, and its scale and offset come out of it in fp32:
  Σ x·(scale·q − off) = scale·Σ x·(MAGIC + q) − (off + MAGIC·scale)·Σ x. So the weights are the file's
  to the last bit (gguf-py's dequantization, which `_decode` is tested against bit for bit by
  `dequantize_rows`, the embedding's lookup), never rounded to bf16 as llama.cpp's cuBLAS path does.
- **Batch-invariant.** 2–16 activation rows run as one padded tile of 16 (`BLOCK_M`), with the same
  launch shape whatever their number: the same compiled code computes every row, the tensor cores
  reduce each output on its own, and a row's numbers do not depend on the others or its place among
  them, bit for bit. (A verify step's rows take the one-row kernel instead, so that they get the decode
  step's numbers.) Longer prompts run in tiles of 64 rows.
- **Split-K** where a matrix has few output tiles, with `plugins.lowbit_tiles._finish`'s epilogue: fp32
  partials, the last program to arrive adds them in a fixed order (deterministic) and resets its counter.
- Gated (a gate projection above an up projection): SiLU(gate)·up is made on the way out.

On the CPU the kernels run under Triton's interpreter in the tests, whose bf16 `tl.dot` is broken: there
the operands are widened to fp32 first (exact for these values).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from plugins.gguf_blocks import FORMATS, PLANES, nbytes, repack
from plugins.lowbit import as_one_row
from plugins.lowbit_tiles import INTERPRETED, MAX_SPLIT, unavailable

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: GGUF files run as float there
    triton = None

if triton is not None:
    from plugins.gguf_gemv import _gemv_kernel
    from plugins.lowbit_tiles import _finish, _rows

BLOCK_M = 16  # activation rows per program up to 16: tl.dot's smallest tile (and the batch-invariant one)
PREFILL_M = 64  # activation rows per program past 16
SUB = {"Q4_0": 16, "Q4_1": 16, "Q5_0": 16, "Q5_1": 16, "Q8_0": 32, "Q4_K": 32, "Q5_K": 32, "Q6_K": 16}  # per dot
WIDTHS = {  # bytes per chunk of the byte planes: qs, qh, sc/mn
    "Q4_0": (16, 1, 1), "Q4_1": (16, 1, 1), "Q5_0": (16, 4, 1), "Q5_1": (16, 4, 1), "Q8_0": (32, 1, 1),
    "Q4_K": (128, 1, 8), "Q5_K": (128, 32, 8), "Q6_K": (128, 64, 16)}


@dataclasses.dataclass(frozen=True)
class Config:
    """A launch shape: output rows per program, programs per output tile along the inputs, warps, Triton's
    software-pipeline depth, and whether the next chunk is loaded while one is computed."""

    block_n: int = 64
    split_k: int = 1
    warps: int = 4
    stages: int = 1
    prefetch: bool = False


if triton is not None:
    @triton.jit
    def _load_chunk(FORMAT: tl.constexpr, qs_ptr, qh_ptr, sc_ptr, mn_ptr, d_ptr, m_ptr, c, rs, N,
                    SUBS: tl.constexpr, D: tl.constexpr, QS_W: tl.constexpr, QH_W: tl.constexpr,
                    SC_W: tl.constexpr):
        """Every load chunk `c` (a block, or a K type's super-block) of rows `rs` needs, issued together: per
        sub-block the bytes of its quants (and fifth or high bits) [rows, D] and its sub-scale and min
        [rows], then the chunk's fp16 scales. Why together: a sub-block's loads issued after the previous
        sub-block's dot wait a memory latency each (the dot's operand shuffle is a barrier), and at 16 such
        waits a call the kernel read 0.13 of the bandwidth (H200, 2026-11-28)."""
        j = tl.arange(0, D)[None, :]
        at = (c * N + rs)[:, None]  # the row's place in every [chunks, rows, …] plane
        subs = ()
        for s in tl.static_range(SUBS):
            if FORMAT <= 3:  # the low nibbles are weights 0–15, the high ones 16–31
                low = tl.load(qs_ptr + at * QS_W + j)
            elif FORMAT == 4:
                low = tl.load(qs_ptr + at * QS_W + s * D + j)
            elif FORMAT <= 6:  # sub-block s: the low (even s) or high nibbles of bytes 32·(s // 2) …
                low = tl.load(qs_ptr + at * QS_W + (s // 2) * 32 + j)
            else:  # Q6_K, weights 16·s …: half h = s // 8 of 128, at i = (s % 8)·16 within it
                low = tl.load(qs_ptr + at * QS_W + 64 * (s // 8) + ((s % 8) * 16) % 64 + j)
            if FORMAT == 2 or FORMAT == 3:  # bit i of the little-endian qh word is weight i's fifth bit
                high = tl.load(qh_ptr + at * QH_W + (s * D + j) // 8)
            elif FORMAT == 6:
                high = tl.load(qh_ptr + at * QH_W + j)
            elif FORMAT == 7:
                high = tl.load(qh_ptr + at * QH_W + 32 * (s // 8) + ((s % 8) * 16) % 32 + j)
            else:
                high = low
            if FORMAT == 5 or FORMAT == 6:
                sub_scale = tl.load(sc_ptr + (c * N + rs) * SC_W + s)
                sub_min = tl.load(mn_ptr + (c * N + rs) * SC_W + s)
            elif FORMAT == 7:
                sub_scale = tl.load(sc_ptr + (c * N + rs) * SC_W + s)
                sub_min = sub_scale
            else:
                sub_scale = rs
                sub_min = rs
            subs = subs + ((low, high, sub_scale, sub_min),)
        d = tl.load(d_ptr + c * N + rs).to(tl.float32)
        if FORMAT == 1 or FORMAT == 3 or FORMAT == 5 or FORMAT == 6:  # Q4_1 and Q5_1's m, the K types' dmin
            m = tl.load(m_ptr + c * N + rs).to(tl.float32)
        else:
            m = d
        return subs, d, m

    @triton.jit
    def _nibble_operand(low, HIGH: tl.constexpr, MAGIC_BITS: tl.constexpr, compute: tl.constexpr,
                        EMULATE: tl.constexpr):
        """The low (HIGH = 0) or high nibbles of bytes `low` as the dot's operand MAGIC + q, four at a time: two
        `prmt` spread four bytes over two registers, a shift takes the high nibbles down, and one `lop3` per
        register masks two nibbles and ORs them under MAGIC: about one instruction per weight, where the
        elementwise steps (widen, shift, mask, OR, narrow) took five. Under the interpreter, which runs no
        PTX, the elementwise steps (the same values)."""
        if EMULATE:
            q = (low.to(tl.int32) >> (4 * HIGH)) & 15
            return (q | MAGIC_BITS).to(tl.int16).to(compute, bitcast=True)
        if HIGH and MAGIC_BITS == 0x4300:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 t0, t1, z; mov.b32 z, 0; prmt.b32 t0, $2, z, 0x4140; prmt.b32 t1, $2, z, 0x4342; "
                "shr.b32 t0, t0, 4; shr.b32 t1, t1, 4; "
                "lop3.b32 $0, t0, 0x000F000F, 0x43004300, 0xEA; lop3.b32 $1, t1, 0x000F000F, 0x43004300, 0xEA; }",
                "=r,=r,r", [low], dtype=tl.bfloat16, is_pure=True, pack=4)
        elif MAGIC_BITS == 0x4300:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 t0, t1, z; mov.b32 z, 0; prmt.b32 t0, $2, z, 0x4140; prmt.b32 t1, $2, z, 0x4342; "
                "lop3.b32 $0, t0, 0x000F000F, 0x43004300, 0xEA; lop3.b32 $1, t1, 0x000F000F, 0x43004300, 0xEA; }",
                "=r,=r,r", [low], dtype=tl.bfloat16, is_pure=True, pack=4)
        elif HIGH:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 t0, t1, z; mov.b32 z, 0; prmt.b32 t0, $2, z, 0x4140; prmt.b32 t1, $2, z, 0x4342; "
                "shr.b32 t0, t0, 4; shr.b32 t1, t1, 4; "
                "lop3.b32 $0, t0, 0x000F000F, 0x64006400, 0xEA; lop3.b32 $1, t1, 0x000F000F, 0x64006400, 0xEA; }",
                "=r,=r,r", [low], dtype=tl.float16, is_pure=True, pack=4)
        else:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 t0, t1, z; mov.b32 z, 0; prmt.b32 t0, $2, z, 0x4140; prmt.b32 t1, $2, z, 0x4342; "
                "lop3.b32 $0, t0, 0x000F000F, 0x64006400, 0xEA; lop3.b32 $1, t1, 0x000F000F, 0x64006400, 0xEA; }",
                "=r,=r,r", [low], dtype=tl.float16, is_pure=True, pack=4)

    @triton.jit
    def _decode(FORMAT: tl.constexpr, sub, d, m, s: tl.constexpr, D: tl.constexpr):
        """Sub-block `s` of a loaded chunk (`_load_chunk`): its quants q as int32 [rows, D] (unsigned; Q8_0's
        signed) and the fp32 scale and offset of `scale·q − off`, each [rows]: the exact products gguf-py
        forms (d·sc, dmin·m, 8·d …), so that q·scale − off is its value."""
        low, high, sub_scale, sub_min = sub
        j = tl.arange(0, D)[None, :]
        if FORMAT <= 3:  # Q4_0, Q4_1, Q5_0, Q5_1
            q = (low.to(tl.int32) >> (4 * s)) & 15
            if FORMAT >= 2:
                q |= ((high.to(tl.int32) >> ((s * D + j) % 8)) & 1) << 4
            scale = d
            if FORMAT == 1 or FORMAT == 3:  # d·q + m
                off = -m
            elif FORMAT == 0:  # d·(q − 8)
                off = d * 8.0
            else:  # d·(q − 16)
                off = d * 16.0
        elif FORMAT == 4:  # Q8_0
            q, scale, off = low.to(tl.int32), d, d * 0.0
        elif FORMAT <= 6:  # Q4_K, Q5_K: d·sc·q − dmin·m
            q = (low.to(tl.int32) >> (4 * (s % 2))) & 15
            if FORMAT == 6:
                q |= ((high.to(tl.int32) >> s) & 1) << 4
            scale, off = d * sub_scale.to(tl.float32), m * sub_min.to(tl.float32)
        else:  # Q6_K: d·sc·(q − 32), 4 bits from ql and 2 from qh
            i: tl.constexpr = (s % 8) * 16
            q = ((low.to(tl.int32) >> (4 * (i // 64))) & 15) | (((high.to(tl.int32) >> (2 * (i // 32))) & 3) << 4)
            scale = d * sub_scale.to(tl.float32)
            off = scale * 32.0
        return q, scale, off

    @triton.jit
    def _matmul_kernel(x_ptr, qs_ptr, qh_ptr, sc_ptr, mn_ptr, d_ptr, m_ptr, bias_ptr, out_ptr, part_ptr, count_ptr,
                       M, N, CHUNKS, stride_xm, stride_om, SPLIT_K,
                       FORMAT: tl.constexpr, S: tl.constexpr, D: tl.constexpr, QS_W: tl.constexpr,
                       QH_W: tl.constexpr, SC_W: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
                       MAGIC: tl.constexpr, DOT_F32: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                       PREFETCH: tl.constexpr):
        """One [BLOCK_N, BLOCK_M] tile of out over this split's chunks: per sub-block one dot of the quants
        (MAGIC + q, exact) with the inputs, then its scale and offset in fp32 (the module docstring)."""
        pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rv, rn = _rows(pid_n, N, BLOCK_N, GATED)
        rs = tl.minimum(rn, N - 1)  # rows past the end read a real row; they are never stored
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        n_ok, m_ok = rv < N, rm < M
        compute: tl.constexpr = x_ptr.dtype.element_ty
        magic_bits: tl.constexpr = 0x4300 if MAGIC == 128.0 else 0x6400
        magic: tl.constexpr = 0.0 if FORMAT == 4 else MAGIC  # Q8_0's signed bytes convert as they are
        SUBS: tl.constexpr = S // D
        per_split = tl.cdiv(CHUNKS, SPLIT_K)
        first = pid_k * per_split
        last = tl.minimum(first + per_split, CHUNKS)
        acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        if PREFETCH:  # the next chunk's loads in flight while this one is computed
            ahead = _load_chunk(FORMAT, qs_ptr, qh_ptr, sc_ptr, mn_ptr, d_ptr, m_ptr, tl.minimum(first, CHUNKS - 1), rs,
                                N, SUBS, D, QS_W, QH_W, SC_W)
        for c in range(first, last):
            if PREFETCH:
                subs, d, m = ahead
                ahead = _load_chunk(FORMAT, qs_ptr, qh_ptr, sc_ptr, mn_ptr, d_ptr, m_ptr, tl.minimum(c + 1, last - 1),
                                    rs, N, SUBS, D, QS_W, QH_W, SC_W)
            else:
                subs, d, m = _load_chunk(FORMAT, qs_ptr, qh_ptr, sc_ptr, mn_ptr, d_ptr, m_ptr, c, rs, N, SUBS, D,
                                         QS_W, QH_W, SC_W)
            xs = ()
            for s in tl.static_range(SUBS):
                xs = xs + (tl.load(x_ptr + rm[None, :] * stride_xm + (c * S + s * D + tl.arange(0, D))[:, None],
                                   mask=m_ok[None, :], other=0.0),)  # [D, BLOCK_M]
            for s in tl.static_range(SUBS):
                q, scale, off = _decode(FORMAT, subs[s], d, m, s, D)
                if FORMAT == 4:
                    w = q.to(tl.float32 if DOT_F32 else compute)
                elif FORMAT == 0 or FORMAT == 1 or FORMAT == 5:  # 4-bit quants: straight from the bytes
                    if FORMAT == 5:  # sub-block s: the high nibbles for odd s
                        w = _nibble_operand(subs[s][0], s % 2, magic_bits, compute, DOT_F32)
                    else:  # weights 16–31: the high nibbles
                        w = _nibble_operand(subs[s][0], s, magic_bits, compute, DOT_F32)
                else:
                    w = (q | magic_bits).to(tl.int16).to(compute, bitcast=True)  # MAGIC + q, exact
                x = xs[s]
                if DOT_F32:
                    w, x = w.to(tl.float32), x.to(tl.float32)
                part = tl.dot(w, x)
                xsum = tl.sum(x.to(tl.float32), 0)
                acc += part * scale[:, None] - (off + magic * scale)[:, None] * xsum[None, :]
        _finish(acc, rv, rn, rm, n_ok, m_ok, pid_n, pid_k, N, bias_ptr, out_ptr, stride_om, part_ptr, count_ptr,
                SPLIT_K, HAS_BIAS, GATED, BLOCK_N, BLOCK_M)

    @triton.jit
    def _dequantize_kernel(ids_ptr, qs_ptr, qh_ptr, sc_ptr, mn_ptr, d_ptr, m_ptr, out_ptr, R, N, K,
                           FORMAT: tl.constexpr, S: tl.constexpr, D: tl.constexpr, QS_W: tl.constexpr,
                           QH_W: tl.constexpr, SC_W: tl.constexpr, BLOCK_R: tl.constexpr):
        """Rows `ids` of the weight, dequantized as gguf-py does (q·scale − off: exact products, one rounding)
        by the decoding the products use, into out [R, K] (cast to its dtype): chunk `program_id(1)` of
        BLOCK_R rows."""
        pid_r, c = tl.program_id(0), tl.program_id(1)
        r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        r_ok = r < R
        rs = tl.load(ids_ptr + r, mask=r_ok, other=0)
        subs, d, m = _load_chunk(FORMAT, qs_ptr, qh_ptr, sc_ptr, mn_ptr, d_ptr, m_ptr, c, rs, N, S // D, D,
                                 QS_W, QH_W, SC_W)
        for s in tl.static_range(S // D):
            q, scale, off = _decode(FORMAT, subs[s], d, m, s, D)
            value = q.to(tl.float32) * scale[:, None] - off[:, None]
            tl.store(out_ptr + r[:, None] * K + c * S + s * D + tl.arange(0, D)[None, :],
                     value.to(out_ptr.dtype.element_ty), mask=r_ok[:, None])


def available(device: torch.device, dtype: torch.dtype, kind: str) -> str | None:
    """None when the kernels can run a `kind` matrix in `dtype` on `device`, else why not."""
    if why := unavailable(device, dtype):
        return why
    if kind not in FORMATS:
        return f"{kind} blocks have no kernel (those that do: {', '.join(FORMATS)})"
    return None


RESIDENT = 3  # programs of the tensor-core kernel per SM (175 registers a thread at 4 warps: sm_90, 2026-11-28)
GEMV_BLOCK_N = 256  # weight rows per program of the one-row kernel (128 was as fast, or slower: gate_up 1.7×)
GEMV_PROGRAMS = 3.4  # its programs per SM, about: the split that gives each shape about this many was the fastest
GEMV_ROWS = 2  # activation rows per launch of it at most (a verify step's 9 rows take five launches): launches of 3
# or 4 rows gave Q5_0 and Q5_1 rows that differed from their one-row numbers in the last bit (H200, 128 weight rows a
# program), and at 256 weight rows 4 rows spilled registers (Q6_K, compiled for sm_90)


def default_config(kind: str, out_features: int, in_features: int, processors: int) -> Config:
    """Tiles of 64 output rows, their inputs split so that the programs fill one wave (`RESIDENT` per SM) and no
    more: a second, partial wave cost up to half the time (Nsight Compute). The next chunk's loads are issued
    early only where a matrix takes many waves (the LM head: 597 µs against 694; gate_up's 1.5 waves: 121 against
    104). Each the fastest of a sweep at Qwen2.5-7B's shapes (H200, 2026-11-28, `bench/gguf_native.py`)."""
    chunks = in_features // FORMATS[kind].size
    tiles, wave = -(-out_features // 64), RESIDENT * processors
    split = max(1, min(MAX_SPLIT, chunks, wave // tiles))
    return Config(block_n=64, split_k=split, prefetch=tiles >= 4 * wave)


def default_gemv_config(kind: str, out_features: int, in_features: int, processors: int) -> Config:
    """The one-row kernel's launch shape: tiles of GEMV_BLOCK_N rows, their inputs split until there are about
    GEMV_PROGRAMS programs per SM (q/k/v's 18 tiles would otherwise stream through a seventh of the GPU). The
    fastest of a sweep at Qwen2.5-7B's shapes (H200, 2026-11-28, `bench/gguf_native.py`: q/k/v 8.8 µs where 128
    rows in 7 splits took 11.3; gate_up 38.6 µs in 3 splits where one took 62.9)."""
    chunks = in_features // FORMATS[kind].size
    tiles = -(-out_features // GEMV_BLOCK_N)
    split = round(GEMV_PROGRAMS * processors / tiles)
    return Config(block_n=GEMV_BLOCK_N, split_k=max(1, min(MAX_SPLIT, chunks, split)))


class GGUFWeight:
    """One matrix of a GGUF file on the kernels: its planes, shape and launch shape. `gated`: a gate
    projection above an up projection, returning SiLU(gate)·up."""

    def __init__(self, planes: dict[str, Tensor], kind: str, out_features: int, in_features: int,
                 bias: Tensor | None, workspace, gated: bool = False):
        self.planes, self.kind, self.bias, self.workspace, self.gated = planes, kind, bias, workspace, gated
        self.out_features, self.in_features = out_features, in_features
        device = planes["qs"].device
        processors = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
        self.config = default_config(kind, out_features, in_features, processors)  # 2–16 rows, and prefill
        self.one_row = default_gemv_config(kind, out_features, in_features, processors)

    @classmethod
    def from_raw(cls, raw: Tensor, kind: str, in_features: int, bias: Tensor | None, workspace,
                 gated: bool = False) -> "GGUFWeight":
        """From the file's bytes of a matrix, uint8 [rows, row bytes], repacked where they are."""
        return cls(repack(raw, kind), kind, raw.shape[0], in_features, bias, workspace, gated)

    @property
    def nbytes(self) -> int:
        return nbytes(self.planes) + (self.bias.numel() * self.bias.element_size() if self.bias is not None else 0)

    def _pointers(self) -> list[Tensor]:
        return [self.planes.get(name, self.planes["d"]) for name in PLANES]

    def _constants(self) -> dict:
        qs_w, qh_w, sc_w = WIDTHS[self.kind]
        return dict(FORMAT=FORMATS[self.kind].code, S=FORMATS[self.kind].size, D=SUB[self.kind], QS_W=qs_w,
                    QH_W=qh_w, SC_W=sc_w)

    def __call__(self, x: Tensor, out: Tensor | None = None) -> Tensor:
        """x [..., in] @ the weight's transpose (+ bias; gated: SiLU(gate)·up) in x's dtype, into `out`
        ([rows, outputs]: a slice of a wider output, say) where given. One row runs on the one-row kernel, and
        so do 2–16 within `plugins.lowbit.rows_as_one_row` (a verify step: each row gets its one-row numbers);
        other calls on the tensor-core kernel."""
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        m, n = x2.shape[0], self.out_features
        n_out = n // 2 if self.gated else n
        if out is None:
            out = torch.empty(m, n_out, dtype=x.dtype, device=x.device)
        if m == 1 or (m <= BLOCK_M and as_one_row()):
            for start in range(0, m, GEMV_ROWS):
                self._launch(x2[start:start + GEMV_ROWS], out[start:start + GEMV_ROWS], True)
        else:
            self._launch(x2, out, False)
        return out.view(*shape[:-1], n_out)

    def _launch(self, x: Tensor, out: Tensor, one_row: bool) -> None:
        """One launch of the one-row kernel (up to GEMV_ROWS rows) or of the tensor-core kernel."""
        m, n = x.shape[0], self.out_features
        block_m = triton.next_power_of_2(m) if one_row else BLOCK_M if m <= BLOCK_M else PREFILL_M
        config = self.one_row if one_row else self.config
        tiles = triton.cdiv(n, config.block_n)
        if config.split_k > 1:
            self.workspace.reserve(config.split_k * block_m * n, tiles)
            partials, counters = self.workspace.partials, self.workspace.counters
        else:
            partials = counters = out  # unused
        common = (x, *self._pointers(), self.bias if self.bias is not None else out, out, partials, counters,
                  m, n, self.in_features // FORMATS[self.kind].size, x.stride(0), out.stride(0), config.split_k)
        flags = dict(HAS_BIAS=self.bias is not None, GATED=self.gated, BLOCK_N=config.block_n, BLOCK_M=block_m,
                     num_warps=config.warps, **self._constants())
        if one_row:
            flags.pop("D")
            _gemv_kernel[(tiles, config.split_k)](*common, ROWS=m, X_BF16=x.dtype == torch.bfloat16,
                                                  EMULATE=INTERPRETED, **flags)
        else:
            _matmul_kernel[(tiles, config.split_k, triton.cdiv(m, block_m))](
                *common, MAGIC=128.0 if x.dtype == torch.bfloat16 else 1024.0, DOT_F32=INTERPRETED,
                num_stages=config.stages, PREFETCH=config.prefetch, **flags)

    def dequantize_rows(self, ids: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
        """Rows `ids` (int64, any shape) of the weight in `dtype`: [*ids.shape, in] (an embedding's lookup)."""
        flat = ids.reshape(-1)
        out = torch.empty(flat.numel(), self.in_features, dtype=dtype, device=flat.device)
        block_r = 16
        grid = (triton.cdiv(flat.numel(), block_r), self.in_features // FORMATS[self.kind].size)
        _dequantize_kernel[grid](flat, *self._pointers(), out, flat.numel(), self.out_features, self.in_features,
                                 BLOCK_R=block_r, **self._constants())
        return out.view(*ids.shape, self.in_features)
