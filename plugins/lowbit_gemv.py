"""The one-row (single chat) low-bit kernels, on the CUDA cores: at batch 1 the tensor cores would
multiply 15 rows of padding, and the layout change into their operands costs more instructions than
the product. `_gemv_kernel` (int4 and int8, bf16 and fp16) dequantizes into fp32 mantissas;
`_packed_gemv_kernel` (int4, bf16) works on packed bf16 pairs, two weights per instruction. Which one
runs a layer is timed per GPU and shape (`plugins.lowbit_tuning`). Both also take a few rows (`ROWS`)
that must each get exactly a one-row launch's numbers (a speculative verify step's: `rows_as_one_row`):
the weights are dequantized once and every row runs the one-row arithmetic on them.

A chunk's 16 words (64 bytes of a row) are held as [rows, GROUPS, 16 / GROUPS]: int4 in groups of 128
has one scale and zero point per chunk (GROUPS = 1, the layout they always had), a GGUF file's groups of
32 have four, each applied to its own 4 words by broadcasting, so the per-group work stays one per
thread and group as it was one per thread and row. No sum across a chunk's groups is taken inside the
loop (the fp32 GEMV takes its known terms out per word there): only the final sum of the accumulators,
whose order is the same at any `ROWS`; a per-chunk sum over the groups rounded differently at 2 rows
than at one on an H200 (the verify rows of `rows_as_one_row` then differed in the last bit)."""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the caller's reference path is used
    triton = None

if triton is not None:  # the kernels and their helpers exist only where triton does
    from plugins.lowbit_tiles import _chunks, _finish, _row_chunk, _rows

    ONE = tl.constexpr(0x3F803F80)  # the bf16 pair (1, 1)

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, scale_ptr, zero_ptr, bias_ptr, out_ptr, part_ptr, count_ptr, N, K, stride_om,
                     SPLIT_K, BITS: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr, X_BF16: tl.constexpr,
                     BLOCK_N: tl.constexpr, STEPS: tl.constexpr, STAGES: tl.constexpr, ROWS: tl.constexpr,
                     BLOCK_M: tl.constexpr, GROUP: tl.constexpr):
        """ROWS rows of activations times BLOCK_N weight rows, on the CUDA cores: two instructions per
        weight and row.

        Each 32-bit word is shifted so that one byte lands on bits 15–22, the top of an fp32 mantissa;
        an AND-OR under the bits of 1.0 makes the float 1 + q·2^(p−23), exactly (p: the value's lowest
        bit there: int4's low nibble at 15, its high one at 19; int8's byte, stored as q + 128, at 15),
        and one FMA with the input pre-scaled by 2^(23−p) adds q·x plus that scaled input. What is
        known besides Σ q·x (the scaled inputs, and the zero point times the inputs) depends on the
        chunk, not the row: it is summed once per chunk and taken out per row as one number. bf16
        inputs are read in pairs (one 32-bit load, two bit operations make the fp32 values). The loop
        is software-pipelined (`STAGES`): the next chunks' loads are in flight while one is computed.
        Each activation row runs the one-row arithmetic on the weights made once (`_row_values`)."""
        pid_n, pid_k = tl.program_id(0), tl.program_id(1)
        rv, rn = _rows(pid_n, N, BLOCK_N, GATED)
        GROUPS: tl.constexpr = 128 // GROUP if BITS == 4 else 1  # scale and zero pairs per chunk
        rg = tl.arange(0, GROUPS)
        rw = rg[:, None] * (16 // GROUPS) + tl.arange(0, 16 // GROUPS)[None, :]  # a chunk's 16 words, by group
        n_ok = rv < N
        first, last = _chunks(pid_k, K, BITS, STEPS, SPLIT_K)
        accs, knowns = (), ()  # per activation row: the sums, and what they hold besides Σ q·x·scale
        for r in tl.static_range(ROWS):
            accs = accs + (tl.zeros((BLOCK_N, GROUPS, 16 // GROUPS), tl.float32),)
            knowns = knowns + (tl.zeros((BLOCK_N,), tl.float32),)
        for start in tl.range(first, last, STEPS, num_stages=STAGES):
            for i in tl.static_range(STEPS):
                c = start + i
                ok = (rw * 0 + c) < last
                w = tl.load(w_ptr + _row_chunk(rn, c, K, BITS)[:, None, None] * 16 + rw[None, :, :],
                            mask=n_ok[:, None, None] & ok[None, :, :], other=0)  # [BLOCK_N, GROUPS, words] int32
                if BITS == 4:
                    at = (c * GROUPS + rg)[None, :] * N + rn[:, None]
                    c_ok = n_ok[:, None] & (at * 0 + c < last)
                    sc = tl.load(scale_ptr + at, mask=c_ok, other=0.0).to(tl.float32)  # [BLOCK_N, GROUPS]
                    zp = tl.load(zero_ptr + at, mask=c_ok, other=0.0).to(tl.float32)
                new_accs, new_knowns = (), ()
                for r in tl.static_range(ROWS):
                    acc, known = accs[r], knowns[r]
                    t = tl.zeros_like(acc)
                    scaled = tl.zeros((GROUPS, 16 // GROUPS), tl.float32)  # the scaled inputs t holds besides Σ q·x
                    xs = tl.zeros((GROUPS, 16 // GROUPS), tl.float32)
                    for j in tl.static_range(4):  # byte j of every word
                        v = w << (15 - 8 * j) if j < 2 else w >> (8 * j - 15)
                        if BITS == 4:
                            if X_BF16:  # inputs 2j and 2j + 1 of each word's eight, in one load
                                pair = tl.load(x_ptr.to(tl.pointer_type(tl.int32)) + r * (K // 2) + c * 64 + rw * 4
                                               + j, mask=ok, other=0)
                                x_lo = (pair << 16).to(tl.float32, bitcast=True)
                                x_hi = (pair & -65536).to(tl.float32, bitcast=True)
                            else:
                                x_at = x_ptr + r * K + c * 128 + rw * 8 + 2 * j
                                x_lo = tl.load(x_at, mask=ok, other=0.0).to(tl.float32)
                                x_hi = tl.load(x_at + 1, mask=ok, other=0.0).to(tl.float32)
                            lo = ((v & 0x78000) | 0x3F800000).to(tl.float32, bitcast=True)  # 1 + q/256
                            hi = ((v & 0x780000) | 0x3F800000).to(tl.float32, bitcast=True)  # 1 + q/16
                            t += lo * (x_lo * 256.0)[None, :, :]  # two FMAs: one sum `lo·a + hi·b` was a multiply
                            t += hi * (x_hi * 16.0)[None, :, :]
                            scaled += x_lo * 256.0 + x_hi * 16.0
                            xs += x_lo + x_hi
                        else:
                            x_j = tl.load(x_ptr + r * K + c * 64 + rw * 4 + j, mask=ok, other=0.0).to(tl.float32)
                            x_j *= 256.0
                            u = ((v & 0x7F8000) | 0x3F800000).to(tl.float32, bitcast=True)  # 1 + u/256
                            acc += u * x_j[None, :, :]
                            scaled += x_j * 1.5  # u = q + 128
                    if BITS == 4 and GROUPS == 1:
                        acc += t * sc[:, :, None]
                        known += tl.sum((tl.sum(scaled, 1)[None, :] + zp * tl.sum(xs, 1)[None, :]) * sc, 1)
                    elif BITS == 4:  # taken out per word: a sum over the groups here rounded otherwise at 2 rows
                        acc += (t - (scaled[None, :, :] + zp[:, :, None] * xs[None, :, :])) * sc[:, :, None]
                    else:
                        known += tl.sum(tl.sum(scaled, 1), 0)
                    new_accs, new_knowns = new_accs + (acc,), new_knowns + (known,)
                accs, knowns = new_accs, new_knowns
        if BITS == 8:
            sc = tl.load(scale_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
        cols = tl.arange(0, BLOCK_M)
        out = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        for r in tl.static_range(ROWS):
            row = tl.sum(tl.sum(accs[r], 2), 1) - knowns[r]
            if BITS == 8:
                row *= sc
            out = tl.where(cols[None, :] == r, row[:, None], out)
        _finish(out, rv, rn, cols, n_ok, cols < ROWS, pid_n, pid_k, N, bias_ptr, out_ptr, stride_om, part_ptr,
                count_ptr, SPLIT_K, HAS_BIAS, GATED, BLOCK_N, BLOCK_M)

    @triton.jit
    def _pair_fma(a, b, c, EMULATE: tl.constexpr):
        """a·b + c on the two bf16 packed in each int32, rounded once: one `fma.rn.bf16x2` (a sum too,
        with b = `ONE`). Under the
        interpreter, which runs no PTX, the same in fp32 (exact products; the sum rounded to fp32 first,
        which can differ from one rounding in the last bit)."""
        if EMULATE:
            a0, a1 = _halves(a)
            b0, b1 = _halves(b)
            c0, c1 = _halves(c)
            return _pair(a0 * b0 + c0, a1 * b1 + c1)
        return tl.inline_asm_elementwise("fma.rn.bf16x2 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32,
                                         is_pure=True, pack=1)

    @triton.jit
    def _pair_sub(a, b, EMULATE: tl.constexpr):
        """a − b on packed bf16 pairs (`sub.rn.bf16x2`), as `_pair_fma` (the same as an `fma` by −1, which
        compiled to a loop 2 % slower on gate_up and down: H100, 2026-11-27)."""
        if EMULATE:
            a0, a1 = _halves(a)
            b0, b1 = _halves(b)
            return _pair(a0 - b0, a1 - b1)
        return tl.inline_asm_elementwise("sub.rn.bf16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.int32,
                                         is_pure=True, pack=1)

    @triton.jit
    def _halves(v):
        """The two bf16 packed in int32 `v` (low half first) as fp32: two bit operations."""
        return (v << 16).to(tl.float32, bitcast=True), (v & -65536).to(tl.float32, bitcast=True)

    @triton.jit
    def _pair(lo, hi):
        """Two fp32 values rounded to the nearest bf16 (ties to even, as the hardware rounds) and packed
        in an int32, low first."""
        a, b = lo.to(tl.int32, bitcast=True), hi.to(tl.int32, bitcast=True)
        a = ((a + 0x7FFF + ((a >> 16) & 1)) >> 16) & 0xFFFF
        b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
        return a | b

    @triton.jit
    def _bytes(a, b, SELECT: tl.constexpr, EMULATE: tl.constexpr):
        """Four bytes picked from the eight of (a, b) (a's are 0–3, b's 4–7; `SELECT`'s hex digits name
        them, lowest byte first): one `prmt.b32`."""
        if EMULATE:
            out = tl.zeros_like(a)
            for i in tl.static_range(4):
                pick: tl.constexpr = (SELECT >> (4 * i)) & 7
                word = a if pick < 4 else b
                out |= ((word >> (8 * (pick % 4))) & 255) << (8 * i)
            return out
        return tl.inline_asm_elementwise(f"prmt.b32 $0, $1, $2, {SELECT};", "=r,r,r", [a, b], dtype=tl.int32,
                                         is_pure=True, pack=1)

    @triton.jit
    def _group_values(scale_ptr, zero_ptr, rs, start, last, N, STEPS: tl.constexpr, GROUPS: tl.constexpr):
        """Rows `rs`' scales and zero points of chunks start … start + STEPS − 1, fp32 [rows, STEPS, GROUPS]:
        a loop step's, loaded a step ahead (loads inside the step would stall it for a memory latency). A
        chunk past `last` reads the last one's, with a zero scale."""
        c = start + tl.arange(0, STEPS)[None, :, None]
        at = (tl.minimum(c, last - 1) * GROUPS + tl.arange(0, GROUPS)[None, None, :]) * N + rs[:, None, None]
        scales = tl.where(c < last, tl.load(scale_ptr + at).to(tl.float32), 0.0)
        return scales, tl.load(zero_ptr + at).to(tl.float32)

    @triton.jit
    def _packed_gemv_kernel(x_ptr, w_ptr, scale_ptr, zero_ptr, bias_ptr, out_ptr, part_ptr, count_ptr, N, K, stride_om,
                            SPLIT_K, HAS_BIAS: tl.constexpr, GATED: tl.constexpr, BLOCK_N: tl.constexpr,
                            STEPS: tl.constexpr, STAGES: tl.constexpr, EMULATE: tl.constexpr, ROWS: tl.constexpr,
                            BLOCK_M: tl.constexpr, GROUP: tl.constexpr):
        """int4, ROWS rows of bf16 activations: two weights per instruction, on packed bf16 pairs.

        A word holds 8 weights; masks and `prmt` put the nibbles of inputs s and s + 4 under the upper
        byte of 128.0, making the pair (128 + q, 128 + q') exactly; one `sub.rn.bf16x2` takes out
        (128 + zi, 128 + zi), the zero point rounded to a whole number (exact: q − zi); one
        `fma.rn.bf16x2` multiplies by the matching inputs (x_s, x_s+4) and adds, so a lane sums four
        products, each rounded once to bf16; one more takes out the zero point's fraction times the
        word's inputs; only then is the pair widened to fp32 and scaled. The inputs' pairing (`prmt`)
        and sums depend on the column, not the row: each thread makes them once for all of its rows.
        Products rounded to bf16 cost accuracy: 0.0041 relative error against the dequantizing
        reference where the fp32 GEMV has 0.0026 (H100, 2026-11-27). Scales and zero points are
        loaded a loop step ahead (inside the step, every step waited a memory latency for them: 12 %
        of gate_up's time). Chunks past this split's end (the last step of an uneven split) re-read
        its last chunk with a zero scale: no masked loads. Several activation rows share the weights'
        pairs (q − zi) and each runs the one-row arithmetic on them."""
        pid_n, pid_k = tl.program_id(0), tl.program_id(1)
        rv, rn = _rows(pid_n, N, BLOCK_N, GATED)
        rs = tl.minimum(rn, N - 1)  # rows past the end read a real row's scale; they are never stored
        GROUPS: tl.constexpr = 128 // GROUP  # scale and zero pairs per chunk
        rw = tl.arange(0, GROUPS)[:, None] * (16 // GROUPS) + tl.arange(0, 16 // GROUPS)[None, :]  # words, by group
        first, last = _chunks(pid_k, K, 4, STEPS, SPLIT_K)
        accs = ()  # per activation row
        for r in tl.static_range(ROWS):
            accs = accs + (tl.zeros((BLOCK_N, GROUPS, 16 // GROUPS), tl.float32),)
        steps = tl.arange(0, STEPS)[None, :, None]
        scales, zeros = _group_values(scale_ptr, zero_ptr, rs, first, last, N, STEPS, GROUPS)
        for start in tl.range(first, last, STEPS, num_stages=STAGES):
            sc_step, zp_step = scales, zeros
            scales, zeros = _group_values(scale_ptr, zero_ptr, rs, start + STEPS, last, N, STEPS, GROUPS)  # next's
            for i in tl.static_range(STEPS):
                c = tl.minimum(start + i, last - 1)
                w = tl.load(w_ptr + _row_chunk(rn, c, K, 4)[:, None, None] * 16 + rw[None, :, :])  # int32 words
                sc = tl.sum(tl.where(steps == i, sc_step, 0.0), 1)  # [BLOCK_N, GROUPS]
                zp = tl.sum(tl.where(steps == i, zp_step, 0.0), 1)
                zi = tl.minimum(tl.maximum(tl.floor(zp + 0.5), 0.0), 15.0)  # a whole zero point, 0–15
                offset = _pair(zi + 128.0, zi + 128.0)[:, :, None]  # (128 + zi, 128 + zi), exact
                fraction = _pair(zi - zp, zi - zp)[:, :, None]  # what the whole zero point left out, negated
                even, odd = w & 0x0F0F0F0F, (w >> 4) & 0x0F0F0F0F  # bytes: inputs 0, 2, 4, 6 and 1, 3, 5, 7
                high = tl.zeros_like(w) + 0x43434343  # 0x43: the upper byte of 128.0
                d0 = _pair_sub(_bytes(even, high, 0x4240, EMULATE), offset, EMULATE)  # (q0 − zi, q4 − zi), exact
                d1 = _pair_sub(_bytes(odd, high, 0x4240, EMULATE), offset, EMULATE)  # (q1 − zi, q5 − zi)
                d2 = _pair_sub(_bytes(even, high, 0x4341, EMULATE), offset, EMULATE)  # (q2 − zi, q6 − zi)
                d3 = _pair_sub(_bytes(odd, high, 0x4341, EMULATE), offset, EMULATE)  # (q3 − zi, q7 − zi)
                new_accs = ()
                for r in tl.static_range(ROWS):
                    # this row's inputs (0, 1), (2, 3), ... of each word
                    xw = x_ptr.to(tl.pointer_type(tl.int32)) + r * (K // 2) + c * 64 + rw * 4
                    xa, xb, xc, xd = tl.load(xw), tl.load(xw + 1), tl.load(xw + 2), tl.load(xw + 3)
                    p0, p1 = _bytes(xa, xc, 0x5410, EMULATE), _bytes(xa, xc, 0x7632, EMULATE)  # (x0, x4), (x1, x5)
                    p2, p3 = _bytes(xb, xd, 0x5410, EMULATE), _bytes(xb, xd, 0x7632, EMULATE)  # (x2, x6), (x3, x7)
                    one = tl.zeros_like(xa) + ONE
                    xs = _pair_fma(_pair_fma(xa, one, xb, EMULATE), one, _pair_fma(xc, one, xd, EMULATE),
                                   EMULATE)  # the word's inputs summed in pairs
                    t = _pair_fma(d0, p0[None, :, :], tl.zeros_like(w), EMULATE)
                    t = _pair_fma(d1, p1[None, :, :], t, EMULATE)
                    t = _pair_fma(d2, p2[None, :, :], t, EMULATE)
                    t = _pair_fma(d3, p3[None, :, :], t, EMULATE)
                    lo, hi = _halves(_pair_fma(fraction, xs[None, :, :], t, EMULATE))
                    new_accs = new_accs + (accs[r] + (lo + hi) * sc[:, :, None],)
                accs = new_accs
        cols = tl.arange(0, BLOCK_M)
        out = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        for r in tl.static_range(ROWS):
            out = tl.where(cols[None, :] == r, tl.sum(tl.sum(accs[r], 2), 1)[:, None], out)
        _finish(out, rv, rn, cols, rv < N, cols < ROWS, pid_n, pid_k, N, bias_ptr, out_ptr, stride_om, part_ptr,
                count_ptr, SPLIT_K, HAS_BIAS, GATED, BLOCK_N, BLOCK_M)
