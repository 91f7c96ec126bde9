"""The one-row kernel on GGUF weights as the file stores them (Triton, the CUDA cores): a chat's decode step,
and a speculative verify step's rows, each row getting exactly its one-row numbers. Launched by
`plugins.gguf_matmul.GGUFWeight`, which reads the same planes (`plugins.gguf_blocks`) on the tensor cores for
2–16 rows of different chats and for prefill.

Why a second kernel: at one row the tensor cores multiply 15 rows of padding, and the layout changes into their
operands took about 20 instructions a weight (sm_90); here about 4: the quants read as 32-bit words, masked
four at a time, each byte made an fp32 operand by one `prmt`, one FMA a weight."""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: GGUF files run as float there
    triton = None

if triton is not None:
    from plugins.lowbit_tiles import _finish, _rows

    @triton.jit
    def _part_words(FORMAT: tl.constexpr, qs_ptr, qh_ptr, c, rs, N, p: tl.constexpr, W: tl.constexpr,
                    QS_W: tl.constexpr, QH_W: tl.constexpr):
        """Part `p` of chunk `c` of rows `rs` (a run of weights sharing one scale and offset: `_PARTS`) as int32
        words [rows, W] whose byte i is the unsigned quant q of the part's weight 4·w + i, whole (the fifth and
        high bits in place; Q8_0's signed bytes offset by 128). Read in 32-bit words, masked four at a time."""
        w = tl.arange(0, W)[None, :]
        at = (c * N + rs)[:, None]
        qs32 = qs_ptr.to(tl.pointer_type(tl.int32))
        qh32 = qh_ptr.to(tl.pointer_type(tl.int32))
        if FORMAT <= 3:  # part 0: the low nibbles of the block's 16 bytes (weights 0–15), part 1 the high ones
            q = (tl.load(qs32 + at * (QS_W // 4) + w) >> (4 * p)) & 0x0F0F0F0F
            if FORMAT >= 2:  # bit k of the block's qh word: weight k's fifth bit, spread to bit 4 of byte i
                bits = (tl.load(qh32 + at + w * 0) >> (16 * p + 4 * w)) & 0xF
                q |= ((bits * 0x00204081) & 0x01010101) << 4
        elif FORMAT == 4:
            q = tl.load(qs32 + at * (QS_W // 4) + w) ^ -2139062144  # 0x80808080: each byte + 128
        elif FORMAT <= 6:  # sub-block p: the low (even p) or high nibbles of bytes 32·(p // 2) …
            q = (tl.load(qs32 + at * (QS_W // 4) + (p // 2) * 8 + w) >> (4 * (p % 2))) & 0x0F0F0F0F
            if FORMAT == 6:  # bit p of qh[j]: weight j's fifth bit
                q |= ((tl.load(qh32 + at * (QH_W // 4) + w) >> p) & 0x01010101) << 4
        else:  # Q6_K, weights 16·p …: half h = p // 8, at i = (p % 8)·16 within it
            i: tl.constexpr = (p % 8) * 16
            low = tl.load(qs32 + at * (QS_W // 4) + 16 * (p // 8) + (i % 64) // 4 + w)
            high = tl.load(qh32 + at * (QH_W // 4) + 8 * (p // 8) + (i % 32) // 4 + w)
            q = ((low >> (4 * (i // 64))) & 0x0F0F0F0F) | (((high >> (2 * (i // 32))) & 0x03030303) << 4)
        return q

    @triton.jit
    def _part_scale(FORMAT: tl.constexpr, sc_ptr, mn_ptr, d, m, c, rs, N, p: tl.constexpr, SC_W: tl.constexpr):
        """Part `p`'s fp32 scale and offset [rows] (a weight is q·scale − off: gguf-py's exact products)."""
        if FORMAT == 1 or FORMAT == 3:  # d·q + m
            return d, -m
        elif FORMAT == 0:  # d·(q − 8)
            return d, d * 8.0
        elif FORMAT == 2:  # d·(q − 16)
            return d, d * 16.0
        elif FORMAT == 4:  # d·(q − 128): the bytes were offset
            return d, d * 128.0
        elif FORMAT <= 6:  # d·sc·q − dmin·m
            sub_scale = tl.load(sc_ptr + (c * N + rs) * SC_W + p).to(tl.float32)
            return d * sub_scale, m * tl.load(mn_ptr + (c * N + rs) * SC_W + p).to(tl.float32)
        else:  # Q6_K: d·sc·(q − 32)
            scale = d * tl.load(sc_ptr + (c * N + rs) * SC_W + p).to(tl.float32)
            return scale, scale * 32.0

    @triton.jit
    def _two_plus(q, EMULATE: tl.constexpr, CONVERT: tl.constexpr):
        """The four bytes of words q as fp32 2 + byte/64, exactly: one `prmt` a weight puts the byte under the
        bits of 2.0 (its mantissa's top seven bits, so a byte must be below 128), where widening, masking and
        converting took three. Under the interpreter, which runs no PTX, the same bits by integer operations.
        CONVERT (Q8_0's offset bytes, up to 255): by conversion, on the GPU too."""
        if CONVERT:
            return (((q >> 0) & 0xFF).to(tl.float32) / 64.0 + 2.0, ((q >> 8) & 0xFF).to(tl.float32) / 64.0 + 2.0,
                    ((q >> 16) & 0xFF).to(tl.float32) / 64.0 + 2.0, ((q >> 24) & 0xFF).to(tl.float32) / 64.0 + 2.0)
        if EMULATE:
            return ((((q >> 0) & 0xFF) << 16 | 0x40000000).to(tl.float32, bitcast=True),
                    (((q >> 8) & 0xFF) << 16 | 0x40000000).to(tl.float32, bitcast=True),
                    (((q >> 16) & 0xFF) << 16 | 0x40000000).to(tl.float32, bitcast=True),
                    (((q >> 24) & 0xFF) << 16 | 0x40000000).to(tl.float32, bitcast=True))
        return tl.inline_asm_elementwise(
            "{ .reg .b32 b; mov.b32 b, 0x40000000; prmt.b32 $0, $4, b, 0x7054; prmt.b32 $1, $4, b, 0x7154; "
            "prmt.b32 $2, $4, b, 0x7254; prmt.b32 $3, $4, b, 0x7354; }",
            "=r,=r,=r,=r,r", [q], dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)

    @triton.jit
    def _part_inputs(x_ptr, r, M, at, W: tl.constexpr, X_BF16: tl.constexpr):
        """Row r's inputs at..at + 4·W as four fp32 [1, W] (input 4·w + i in the i-th; 2-D, so that their sums
        stay within a warp); bf16 ones read in pairs (one 32-bit load and one bit operation each)."""
        wi = tl.arange(0, W)[None, :]
        ok = (wi * 0 + r) < M
        if X_BF16:
            x32 = x_ptr.to(tl.pointer_type(tl.int32))
            a = tl.load(x32 + at // 2 + 2 * wi, mask=ok, other=0)
            b = tl.load(x32 + at // 2 + 2 * wi + 1, mask=ok, other=0)
            return ((a << 16).to(tl.float32, bitcast=True), (a & -65536).to(tl.float32, bitcast=True),
                    (b << 16).to(tl.float32, bitcast=True), (b & -65536).to(tl.float32, bitcast=True))
        return (tl.load(x_ptr + at + 4 * wi, mask=ok, other=0.0).to(tl.float32),
                tl.load(x_ptr + at + 4 * wi + 1, mask=ok, other=0.0).to(tl.float32),
                tl.load(x_ptr + at + 4 * wi + 2, mask=ok, other=0.0).to(tl.float32),
                tl.load(x_ptr + at + 4 * wi + 3, mask=ok, other=0.0).to(tl.float32))

    @triton.jit
    def _gemv_kernel(x_ptr, qs_ptr, qh_ptr, sc_ptr, mn_ptr, d_ptr, m_ptr, bias_ptr, out_ptr, part_ptr, count_ptr,
                     M, N, CHUNKS, stride_xm, stride_om, SPLIT_K,
                     FORMAT: tl.constexpr, S: tl.constexpr, QS_W: tl.constexpr, QH_W: tl.constexpr,
                     SC_W: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr, BLOCK_N: tl.constexpr,
                     ROWS: tl.constexpr, BLOCK_M: tl.constexpr, X_BF16: tl.constexpr, EMULATE: tl.constexpr):
        """ROWS activation rows (a tile of BLOCK_M, the power of two at least ROWS) times BLOCK_N weight rows on the CUDA cores, for one row (at batch 1 the
        tensor cores would multiply 15 rows of padding). Per part (`_part_words`: a run of weights with one
        scale) and row: Σ (2 + q/64)·x − 2·Σ x = Σ q·x / 64 by one `prmt` and one FMA a weight (`_two_plus`),
        and the part adds 64·scale times it − off·Σ x. The tensor-core kernel's layout changes
        took 20 instructions a weight. A row's arithmetic is the same whatever ROWS and BLOCK_N are, so each
        row of a verify step gets its one-row numbers, bit for bit."""
        pid_n, pid_k = tl.program_id(0), tl.program_id(1)
        rv, rn = _rows(pid_n, N, BLOCK_N, GATED)
        rs = tl.minimum(rn, N - 1)  # rows past the end read a real row; they are never stored
        rm = tl.arange(0, BLOCK_M)
        n_ok, m_ok = rv < N, rm < M
        PARTS: tl.constexpr = 2 if FORMAT <= 3 else 1 if FORMAT == 4 else 8 if FORMAT <= 6 else 16
        W: tl.constexpr = S // PARTS // 4  # words per part
        per_split = tl.cdiv(CHUNKS, SPLIT_K)
        first = pid_k * per_split
        last = tl.minimum(first + per_split, CHUNKS)
        accs = ()
        for r in tl.static_range(ROWS):
            accs = accs + (tl.zeros((BLOCK_N, W), tl.float32),)  # in the weights' layout, summed at the end
        for c in range(first, last):
            d = tl.load(d_ptr + c * N + rs).to(tl.float32)
            if FORMAT == 1 or FORMAT == 3 or FORMAT == 5 or FORMAT == 6:
                m = tl.load(m_ptr + c * N + rs).to(tl.float32)
            else:
                m = d
            for p in tl.static_range(PARTS):
                f0, f1, f2, f3 = _two_plus(_part_words(FORMAT, qs_ptr, qh_ptr, c, rs, N, p, W, QS_W, QH_W), EMULATE,
                                           FORMAT == 4)
                scale, off = _part_scale(FORMAT, sc_ptr, mn_ptr, d, m, c, rs, N, p, SC_W)
                added = ()
                for r in tl.static_range(ROWS):
                    x0, x1, x2, x3 = _part_inputs(x_ptr + r * stride_xm, r, M, c * S + p * 4 * W, W, X_BF16)
                    xs = x0 + x1 + x2 + x3
                    # Σ q·x / 64, and the part's scale and offset: every FMA written out, so that the compiler
                    # cannot contract a·b − c·d one way in one launch and the other way in another (Q5_0's
                    # verify rows differed from one row in the last bit, H200)
                    t = tl.fma(f0, x0, tl.fma(f1, x1, tl.fma(f2, x2, tl.fma(f3, x3, -2.0 * xs))))
                    added = added + (tl.fma((scale * 64.0)[:, None], t, tl.fma(-off[:, None], xs, accs[r])),)
                accs = added
        acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        for r in tl.static_range(ROWS):
            acc = tl.where(rm[None, :] == r, tl.sum(accs[r], 1, keep_dims=True), acc)
        _finish(acc, rv, rn, rm, n_ok, m_ok, pid_n, pid_k, N, bias_ptr, out_ptr, stride_om, part_ptr, count_ptr,
                SPLIT_K, HAS_BIAS, GATED, BLOCK_N, BLOCK_M)
