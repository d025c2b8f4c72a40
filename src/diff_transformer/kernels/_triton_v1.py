"""Triton kernels of Diff Transformer V1 attention; the torch side (validation, launch, autograd) is in
diff_attention_v1.py.

Layouts (component-major, as `_forward_v1` of modeling_diff.py builds them):
    query (B, 2H, N, d)      [q1 of heads 0..H-1 | q2 of heads 0..H-1]
    key   (B, 2H_kv, L, d)   [k1 of groups | k2 of groups]
    value (B, 2H_kv, L, d)   [first d-wide half of V_g | second half]
    out   (B, N, H, 2d)      A1 V - λ A2 V;  o2 = A2 V (kept for the backward)
    lse1, lse2 (B, H, N)     log2-sum-exp2 of the scaled scores of each map; +inf marks a row with nothing to attend
Scores live in the log2 domain: z = q·k · scaling · log2(e), so softmax is exp2(z - lse).
Every head dimension is padded to BLOCK_D (a power of two >= 16) with zeros on load; zeros leave the dots unchanged.
Offsets inside one head's (rows, d) slice are int32 (64-bit address tiles cost registers the inner loops need; the
host checks rows x row stride < 2^31), batch/head offsets and mask offsets int64.

This file is imported twice by diff_attention_v1.py: once as is (compiled kernels for GPU tensors) and once with
TRITON_INTERPRET=1 set while it is executed (interpreted kernels for CPU tensors), so both live in one process.
For that the kernels call only Triton builtins and functions of this file, never the @jit helpers of
triton.language.standard (tl.zeros, tl.max, tl.sum: their mode is fixed when triton.language is first imported);
reductions go through the builtin tl.reduce with the standard combine functions, which the interpreter runs with numpy.
"""

import triton
import triton.language as tl


LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _row_max(x):
    return tl.reduce(x, 1, tl.standard._elementwise_max)


@triton.jit
def _row_sum(x):
    return tl.reduce(x, 1, tl.standard._sum_combine)


@triton.jit
def _masked_scores(
    z,
    rows,
    local_rows,
    cols,
    n_q,
    n_k,
    causal_off,
    mask_ptr,
    stride_mn,
    stride_ml,
    CAUSAL: tl.constexpr,
    BOUNDS: tl.constexpr,
    MASK_KIND: tl.constexpr,
):
    """Applies key bounds + causality (only where BOUNDS: tiles the caller knows to be partly masked) and the user
    mask (every tile) to scores z (R, C) of query rows (R,) and key columns (C,). mask_ptr points at the mask row of
    the tile's first query (int64 offset, once), local_rows = rows - that row (int32 offsets in the tile). The mask
    tile is reloaded per map: an L1/L2 hit, cheaper than keeping it in registers."""
    if BOUNDS:
        ok = cols[None, :] < n_k
        if CAUSAL:
            ok = ok & (cols[None, :] <= rows[:, None] + causal_off)
        z = tl.where(ok, z, float("-inf"))
    if MASK_KIND != 0:
        in_range = (rows[:, None] < n_q) & (cols[None, :] < n_k)
        ptrs = mask_ptr + local_rows[:, None] * stride_mn + cols[None, :] * stride_ml
        if MASK_KIND == 1:  # boolean, True = attend
            z = tl.where(tl.load(ptrs, mask=in_range, other=0) != 0, z, float("-inf"))
        else:  # additive, natural-log units
            z = z + tl.load(ptrs, mask=in_range, other=0.0).to(tl.float32) * LOG2E
    return z


@triton.jit
def _load_rows(
    base, rows, stride, n_rows, offs_d, BOUNDS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr
):
    """(len(rows), BLOCK_D) tile of a (rows, d) matrix with unit column stride; zeros outside."""
    ptrs = base + rows[:, None] * stride + offs_d[None, :]
    if BOUNDS:
        if BLOCK_D == HEAD_DIM:
            tile = tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
        else:
            tile = tl.load(ptrs, mask=(rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM), other=0.0)
    else:
        if BLOCK_D == HEAD_DIM:
            tile = tl.load(ptrs)
        else:
            tile = tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    return tile


@triton.jit
def _lse(m, l):
    """log2-sum-exp2 of a row from its running max and sum; +inf for a row with nothing to attend, so that the
    backward's exp2(z - lse) is 0 there."""
    return tl.where(l == 0.0, float("inf"), m + tl.log2(tl.where(l == 0.0, 1.0, l)))


@triton.jit
def _online_softmax_step(z, m, l):
    """One FlashAttention online-softmax update; rows that saw only -inf so far keep m = -inf, p = 0."""
    m_new = tl.maximum(m, _row_max(z))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_safe)
    p = tl.exp2(z - m_safe[:, None])
    l = l * alpha + _row_sum(p)
    return p, alpha, m_new, l


@triton.jit
def _fwd_inner(
    acc1a,
    acc1b,
    acc2a,
    acc2b,
    m1,
    l1,
    m2,
    l2,
    q1,
    q2,
    k1_base,
    k2_base,
    va_base,
    vb_base,
    stride_kn,
    stride_vn,
    mask_ptr,
    stride_mn,
    stride_ml,
    rows,
    local_rows,
    n_q,
    n_k,
    causal_off,
    qk_scale,
    lo,
    hi,
    CAUSAL: tl.constexpr,
    BOUNDS: tl.constexpr,
    MASK_KIND: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        # Each K/V tile is loaded once and serves both maps.
        k1 = _load_rows(k1_base, cols, stride_kn, n_k, offs_d, BOUNDS, HEAD_DIM, BLOCK_D)
        k2 = _load_rows(k2_base, cols, stride_kn, n_k, offs_d, BOUNDS, HEAD_DIM, BLOCK_D)
        va = _load_rows(va_base, cols, stride_vn, n_k, offs_d, BOUNDS, HEAD_DIM, BLOCK_D)
        vb = _load_rows(vb_base, cols, stride_vn, n_k, offs_d, BOUNDS, HEAD_DIM, BLOCK_D)
        # One map after the other, so only one score tile is live at a time.
        z1 = tl.dot(q1, tl.trans(k1), input_precision=DOT_PREC) * qk_scale
        z1 = _masked_scores(
            z1, rows, local_rows, cols, n_q, n_k, causal_off, mask_ptr, stride_mn, stride_ml, CAUSAL, BOUNDS, MASK_KIND
        )
        p1, alpha1, m1, l1 = _online_softmax_step(z1, m1, l1)
        p1 = p1.to(va.dtype)
        acc1a = tl.dot(p1, va, acc1a * alpha1[:, None], input_precision=DOT_PREC)
        acc1b = tl.dot(p1, vb, acc1b * alpha1[:, None], input_precision=DOT_PREC)
        z2 = tl.dot(q2, tl.trans(k2), input_precision=DOT_PREC) * qk_scale
        z2 = _masked_scores(
            z2, rows, local_rows, cols, n_q, n_k, causal_off, mask_ptr, stride_mn, stride_ml, CAUSAL, BOUNDS, MASK_KIND
        )
        p2, alpha2, m2, l2 = _online_softmax_step(z2, m2, l2)
        p2 = p2.to(va.dtype)
        acc2a = tl.dot(p2, va, acc2a * alpha2[:, None], input_precision=DOT_PREC)
        acc2b = tl.dot(p2, vb, acc2b * alpha2[:, None], input_precision=DOT_PREC)
    return acc1a, acc1b, acc2a, acc2b, m1, l1, m2, l2


@triton.jit
def _seq_bounds(CuSeqlens, b, N, L, VARLEN: tl.constexpr):
    """(batch index into the tensors, first row, query count, key count) of sequence b."""
    if VARLEN:  # packed sequences in batch row 0; queries and keys share cu_seqlens
        start = tl.load(CuSeqlens + b)
        n_q = tl.load(CuSeqlens + b + 1) - start
        n_k = n_q
        batch = b * 0
    else:
        # `+ b * 0` keeps every bound a tensor even when Triton specialises N or L == 1 into a constant.
        batch = b
        start = b * 0
        n_q = N + b * 0
        n_k = L + b * 0
    return batch, start, n_q, n_k


@triton.jit
def _fwd_kernel(
    Q,
    K,
    V,
    Lam,
    Out,
    O2,
    Lse1,
    Lse2,
    Mask,
    CuSeqlens,
    stride_qb,
    stride_qh,
    stride_qn,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_ob,
    stride_on,
    stride_oh,
    stride_lb,
    stride_lh,
    stride_mb,
    stride_mh,
    stride_mn,
    stride_ml,
    H,
    H_KV,
    N,
    L,
    qk_scale,
    CAUSAL: tl.constexpr,
    MASK_KIND: tl.constexpr,
    VARLEN: tl.constexpr,
    SAVE_O2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    g = h // (H // H_KV)
    batch, start, n_q, n_k = _seq_bounds(CuSeqlens, b, N, L, VARLEN)
    m0 = pid_m * BLOCK_M
    if m0 >= n_q:
        return
    batch = batch.to(tl.int64)
    h = h.to(tl.int64)
    g = g.to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    rows = m0 + tl.arange(0, BLOCK_M)

    q_base = Q + batch * stride_qb + start * stride_qn
    q1 = _load_rows(q_base + h * stride_qh, rows, stride_qn, n_q, offs_d, True, HEAD_DIM, BLOCK_D)
    q2 = _load_rows(q_base + (H + h) * stride_qh, rows, stride_qn, n_q, offs_d, True, HEAD_DIM, BLOCK_D)
    k_base = K + batch * stride_kb + start * stride_kn
    v_base = V + batch * stride_vb + start * stride_vn
    k1_base = k_base + g * stride_kh
    k2_base = k_base + (H_KV + g) * stride_kh
    va_base = v_base + g * stride_vh
    vb_base = v_base + (H_KV + g) * stride_vh
    mask_ptr = Mask + batch * stride_mb + h * stride_mh + m0.to(tl.int64) * stride_mn

    m1 = tl.full([BLOCK_M], float("-inf"), tl.float32)
    m2 = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l1 = tl.full([BLOCK_M], 0.0, tl.float32)
    l2 = tl.full([BLOCK_M], 0.0, tl.float32)
    acc1a = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
    acc1b = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
    acc2a = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
    acc2b = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)

    # The queries are the last n_q of n_k positions: row i may see keys j <= i + causal_off.
    causal_off = n_k - n_q
    if CAUSAL:
        hi = tl.minimum(n_k, tl.maximum(m0 + BLOCK_M + causal_off, 0))
        full = tl.minimum(tl.maximum(m0 + causal_off + 1, 0), n_k)  # keys every row of the tile may see
    else:
        hi = n_k
        full = n_k
    full = full // BLOCK_N * BLOCK_N
    # Tiles before `full` need no causal/bounds test; the rest (diagonal and tail) do.
    acc1a, acc1b, acc2a, acc2b, m1, l1, m2, l2 = _fwd_inner(
        acc1a,
        acc1b,
        acc2a,
        acc2b,
        m1,
        l1,
        m2,
        l2,
        q1,
        q2,
        k1_base,
        k2_base,
        va_base,
        vb_base,
        stride_kn,
        stride_vn,
        mask_ptr,
        stride_mn,
        stride_ml,
        rows,
        tl.arange(0, BLOCK_M),
        n_q,
        n_k,
        causal_off,
        qk_scale,
        0,
        full,
        CAUSAL,
        False,
        MASK_KIND,
        BLOCK_N,
        HEAD_DIM,
        BLOCK_D,
        DOT_PREC,
    )
    acc1a, acc1b, acc2a, acc2b, m1, l1, m2, l2 = _fwd_inner(
        acc1a,
        acc1b,
        acc2a,
        acc2b,
        m1,
        l1,
        m2,
        l2,
        q1,
        q2,
        k1_base,
        k2_base,
        va_base,
        vb_base,
        stride_kn,
        stride_vn,
        mask_ptr,
        stride_mn,
        stride_ml,
        rows,
        tl.arange(0, BLOCK_M),
        n_q,
        n_k,
        causal_off,
        qk_scale,
        full,
        hi,
        CAUSAL,
        True,
        MASK_KIND,
        BLOCK_N,
        HEAD_DIM,
        BLOCK_D,
        DOT_PREC,
    )

    _store_output(
        acc1a,
        acc1b,
        acc2a,
        acc2b,
        l1,
        l2,
        Lam,
        Out + batch * stride_ob + start * stride_on + h * stride_oh,
        O2 + batch * stride_ob + start * stride_on + h * stride_oh,
        rows,
        stride_on,
        n_q,
        SAVE_O2,
        HEAD_DIM,
        BLOCK_D,
    )
    lse_off = batch * stride_lb + h * stride_lh + start + rows
    tl.store(Lse1 + lse_off, _lse(m1, l1), mask=rows < n_q)
    tl.store(Lse2 + lse_off, _lse(m2, l2), mask=rows < n_q)


@triton.jit
def _store_output(
    acc1a,
    acc1b,
    acc2a,
    acc2b,
    l1,
    l2,
    Lam,
    out_base,
    o2_base,
    rows,
    stride_on,
    n_q,
    SAVE_O2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """out = acc1/l1 - λ acc2/l2 in both d-wide halves; rows with nothing to attend (l = 0) give 0."""
    lam = tl.load(Lam).to(tl.float32)
    inv1 = (1.0 / tl.where(l1 == 0.0, 1.0, l1))[:, None]  # empty rows have acc = 0
    inv2 = (1.0 / tl.where(l2 == 0.0, 1.0, l2))[:, None]  # empty rows have acc = 0
    offs_d = tl.arange(0, BLOCK_D)
    ptrs = rows[:, None] * stride_on + offs_d[None, :]
    ok = (rows[:, None] < n_q) & (offs_d[None, :] < HEAD_DIM)
    o2a = acc2a * inv2
    o2b = acc2b * inv2
    tl.store(out_base + ptrs, (acc1a * inv1 - lam * o2a).to(out_base.dtype.element_ty), mask=ok)
    tl.store(out_base + HEAD_DIM + ptrs, (acc1b * inv1 - lam * o2b).to(out_base.dtype.element_ty), mask=ok)
    if SAVE_O2:
        tl.store(o2_base + ptrs, o2a.to(o2_base.dtype.element_ty), mask=ok)
        tl.store(o2_base + HEAD_DIM + ptrs, o2b.to(o2_base.dtype.element_ty), mask=ok)


# ---------------------------------------------------------------------------------------------------------- decode


@triton.jit
def _decode_split_kernel(
    Q,
    K,
    V,
    Mask,
    PartAcc,
    PartML,
    stride_qb,
    stride_qh,
    stride_qn,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_mb,
    stride_mh,
    stride_mn,
    stride_ml,
    H,
    H_KV,
    N,
    L,
    qk_scale,
    blocks_per_split,
    num_splits,
    CAUSAL: tl.constexpr,
    MASK_KIND: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Flash-decoding: program (b·g, s) runs every query row of KV group g (G heads x N queries stacked as
    BLOCK_R rows) over split s of the keys, so each cached K/V byte is read once; partial (m, l, acc) go to
    scratch for _decode_combine_kernel."""
    pid_bg = tl.program_id(0)
    pid_s = tl.program_id(1)
    b = (pid_bg // H_KV).to(tl.int64)
    g = (pid_bg % H_KV).to(tl.int64)
    group = H // H_KV
    r = tl.arange(0, BLOCK_R)
    head = g * group + r // N  # (BLOCK_R,) query head of each row
    n = r % N  # query index of each row
    row_ok = r < group * N
    offs_d = tl.arange(0, BLOCK_D)
    q_ok = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    q_ptrs = Q + b * stride_qb + n[:, None] * stride_qn + offs_d[None, :]
    q1 = tl.load(q_ptrs + head[:, None] * stride_qh, mask=q_ok, other=0.0)
    q2 = tl.load(q_ptrs + (H + head[:, None]) * stride_qh, mask=q_ok, other=0.0)
    k1_base = K + b * stride_kb + g * stride_kh
    k2_base = K + b * stride_kb + (H_KV + g) * stride_kh
    va_base = V + b * stride_vb + g * stride_vh
    vb_base = V + b * stride_vb + (H_KV + g) * stride_vh
    mask_ptrs = Mask + b * stride_mb + head[:, None] * stride_mh + n[:, None] * stride_mn

    m1 = tl.full([BLOCK_R], float("-inf"), tl.float32)
    m2 = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l1 = tl.full([BLOCK_R], 0.0, tl.float32)
    l2 = tl.full([BLOCK_R], 0.0, tl.float32)
    acc1a = tl.full([BLOCK_R, BLOCK_D], 0.0, tl.float32)
    acc1b = tl.full([BLOCK_R, BLOCK_D], 0.0, tl.float32)
    acc2a = tl.full([BLOCK_R, BLOCK_D], 0.0, tl.float32)
    acc2b = tl.full([BLOCK_R, BLOCK_D], 0.0, tl.float32)
    causal_off = L - N
    lo = pid_s * blocks_per_split * BLOCK_N
    hi = tl.minimum(L, lo + blocks_per_split * BLOCK_N)
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        k1 = _load_rows(k1_base, cols, stride_kn, L, offs_d, True, HEAD_DIM, BLOCK_D)
        k2 = _load_rows(k2_base, cols, stride_kn, L, offs_d, True, HEAD_DIM, BLOCK_D)
        z1 = tl.dot(q1, tl.trans(k1), input_precision=DOT_PREC) * qk_scale
        z2 = tl.dot(q2, tl.trans(k2), input_precision=DOT_PREC) * qk_scale
        ok = cols[None, :] < L
        if CAUSAL:
            ok = ok & (cols[None, :] <= n[:, None] + causal_off)
        if MASK_KIND == 1:
            ok = ok & (tl.load(mask_ptrs + cols[None, :] * stride_ml, mask=row_ok[:, None] & ok, other=0) != 0)
        z1 = tl.where(ok, z1, float("-inf"))
        z2 = tl.where(ok, z2, float("-inf"))
        if MASK_KIND == 2:
            bias = tl.load(mask_ptrs + cols[None, :] * stride_ml, mask=row_ok[:, None] & ok, other=0.0)
            z1 = z1 + bias.to(tl.float32) * LOG2E
            z2 = z2 + bias.to(tl.float32) * LOG2E
        p1, alpha1, m1, l1 = _online_softmax_step(z1, m1, l1)
        p2, alpha2, m2, l2 = _online_softmax_step(z2, m2, l2)
        va = _load_rows(va_base, cols, stride_vn, L, offs_d, True, HEAD_DIM, BLOCK_D)
        vb = _load_rows(vb_base, cols, stride_vn, L, offs_d, True, HEAD_DIM, BLOCK_D)
        p1 = p1.to(va.dtype)
        p2 = p2.to(va.dtype)
        acc1a = tl.dot(p1, va, acc1a * alpha1[:, None], input_precision=DOT_PREC)
        acc1b = tl.dot(p1, vb, acc1b * alpha1[:, None], input_precision=DOT_PREC)
        acc2a = tl.dot(p2, va, acc2a * alpha2[:, None], input_precision=DOT_PREC)
        acc2b = tl.dot(p2, vb, acc2b * alpha2[:, None], input_precision=DOT_PREC)

    # Scratch: PartML (4, B·H_kv, S, BLOCK_R) = m1, l1, m2, l2; PartAcc (2, B·H_kv, S, BLOCK_R, 2·BLOCK_D).
    plane = tl.num_programs(0) * num_splits * BLOCK_R
    ml_off = (pid_bg * num_splits + pid_s) * BLOCK_R + r
    tl.store(PartML + ml_off, m1)
    tl.store(PartML + plane + ml_off, l1)
    tl.store(PartML + 2 * plane + ml_off, m2)
    tl.store(PartML + 3 * plane + ml_off, l2)
    acc_ptrs = PartAcc + ml_off[:, None].to(tl.int64) * (2 * BLOCK_D) + offs_d[None, :]
    acc_plane = plane.to(tl.int64) * (2 * BLOCK_D)
    acc_ok = q_ok  # only the real rows (often 1-4 of 16) and columns travel through the scratch
    tl.store(acc_ptrs, acc1a, mask=acc_ok)
    tl.store(acc_ptrs + BLOCK_D, acc1b, mask=acc_ok)
    tl.store(acc_ptrs + acc_plane, acc2a, mask=acc_ok)
    tl.store(acc_ptrs + acc_plane + BLOCK_D, acc2b, mask=acc_ok)


@triton.jit
def _decode_combine_kernel(
    PartAcc,
    PartML,
    Lam,
    Out,
    O2,
    Lse1,
    Lse2,
    stride_ob,
    stride_on,
    stride_oh,
    stride_lb,
    stride_lh,
    H,
    H_KV,
    N,
    num_splits,
    SAVE_O2: tl.constexpr,
    BLOCK_R: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Merges the splits of one (b, g): rescale each split's (l, acc) to the common max, sum, then form the output
    and the log-sum-exps the backward needs."""
    pid_bg = tl.program_id(0)
    b = (pid_bg // H_KV).to(tl.int64)
    g = (pid_bg % H_KV).to(tl.int64)
    group = H // H_KV
    r = tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    head = g * group + r // N
    n = r % N
    row_ok = r < group * N
    ok = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    plane = tl.num_programs(0) * num_splits * BLOCK_R
    acc_plane = plane.to(tl.int64) * (2 * BLOCK_D)
    mx1 = tl.full([BLOCK_R], float("-inf"), tl.float32)
    mx2 = tl.full([BLOCK_R], float("-inf"), tl.float32)
    for s in range(num_splits):
        ml_off = (pid_bg * num_splits + s) * BLOCK_R + r
        mx1 = tl.maximum(mx1, tl.load(PartML + ml_off))
        mx2 = tl.maximum(mx2, tl.load(PartML + 2 * plane + ml_off))
    mx1_safe = tl.where(mx1 == float("-inf"), 0.0, mx1)
    mx2_safe = tl.where(mx2 == float("-inf"), 0.0, mx2)
    l1 = tl.full([BLOCK_R], 0.0, tl.float32)
    l2 = tl.full([BLOCK_R], 0.0, tl.float32)
    acc1a = tl.full([BLOCK_R, BLOCK_D], 0.0, tl.float32)
    acc1b = tl.full([BLOCK_R, BLOCK_D], 0.0, tl.float32)
    acc2a = tl.full([BLOCK_R, BLOCK_D], 0.0, tl.float32)
    acc2b = tl.full([BLOCK_R, BLOCK_D], 0.0, tl.float32)
    for s in range(num_splits):
        ml_off = (pid_bg * num_splits + s) * BLOCK_R + r
        w1 = tl.exp2(tl.load(PartML + ml_off) - mx1_safe)
        w2 = tl.exp2(tl.load(PartML + 2 * plane + ml_off) - mx2_safe)
        l1 += w1 * tl.load(PartML + plane + ml_off)
        l2 += w2 * tl.load(PartML + 3 * plane + ml_off)
        acc_ptrs = PartAcc + ml_off[:, None].to(tl.int64) * (2 * BLOCK_D) + offs_d[None, :]
        acc1a += w1[:, None] * tl.load(acc_ptrs, mask=ok, other=0.0)
        acc1b += w1[:, None] * tl.load(acc_ptrs + BLOCK_D, mask=ok, other=0.0)
        acc2a += w2[:, None] * tl.load(acc_ptrs + acc_plane, mask=ok, other=0.0)
        acc2b += w2[:, None] * tl.load(acc_ptrs + acc_plane + BLOCK_D, mask=ok, other=0.0)

    lam = tl.load(Lam).to(tl.float32)
    inv1 = (1.0 / tl.where(l1 == 0.0, 1.0, l1))[:, None]  # empty rows have acc = 0
    inv2 = (1.0 / tl.where(l2 == 0.0, 1.0, l2))[:, None]  # empty rows have acc = 0
    o2a = acc2a * inv2
    o2b = acc2b * inv2
    out_off = b * stride_ob + n[:, None] * stride_on + head[:, None] * stride_oh + offs_d[None, :]
    tl.store(Out + out_off, (acc1a * inv1 - lam * o2a).to(Out.dtype.element_ty), mask=ok)
    tl.store(Out + out_off + HEAD_DIM, (acc1b * inv1 - lam * o2b).to(Out.dtype.element_ty), mask=ok)
    if SAVE_O2:
        tl.store(O2 + out_off, o2a.to(O2.dtype.element_ty), mask=ok)
        tl.store(O2 + out_off + HEAD_DIM, o2b.to(O2.dtype.element_ty), mask=ok)
    lse_off = b * stride_lb + head * stride_lh + n
    tl.store(Lse1 + lse_off, _lse(mx1, l1), mask=row_ok)
    tl.store(Lse2 + lse_off, _lse(mx2, l2), mask=row_ok)


# -------------------------------------------------------------------------------------------------------- backward
#
# With O_c = A_c V and out = O1 - λ O2, dO given:
#   dP = dO Vᵀ                       (shared by both maps: V is shared)
#   dZ1 = A1 ∘ (dP - δ1),  δ1 = rowsum(dO ∘ O1) = rowsum(dO ∘ out) + λ rowsum(dO ∘ O2)
#   dZ2 = -λ A2 ∘ (dP - δ2), δ2 = rowsum(dO ∘ O2)
#   dV = (A1 - λ A2)ᵀ dO,  dq_c = scaling dZ_c k_c,  dk_c = scaling dZ_cᵀ q_c,  dλ = -Σ δ2
# so the backward costs the same 10 tile matmuls as FlashAttention-2 on 2H heads of size d.


@triton.jit
def _bwd_preprocess_kernel(
    Out,
    O2,
    DO,
    Lam,
    Delta1,
    Delta2,
    stride_ob,
    stride_on,
    stride_oh,
    stride_db,
    stride_dn,
    stride_dh,
    stride_lb,
    stride_lh,
    H,
    N,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    ok = (rows[:, None] < N) & (offs_d[None, :] < HEAD_DIM)
    o_ptrs = b * stride_ob + h * stride_oh + rows[:, None] * stride_on + offs_d[None, :]
    d_ptrs = DO + b * stride_db + h * stride_dh + rows[:, None] * stride_dn + offs_d[None, :]
    do_a = tl.load(d_ptrs, mask=ok, other=0.0).to(tl.float32)
    do_b = tl.load(d_ptrs + HEAD_DIM, mask=ok, other=0.0).to(tl.float32)
    t_out = _row_sum(do_a * tl.load(Out + o_ptrs, mask=ok, other=0.0).to(tl.float32))
    t_out += _row_sum(do_b * tl.load(Out + o_ptrs + HEAD_DIM, mask=ok, other=0.0).to(tl.float32))
    t_2 = _row_sum(do_a * tl.load(O2 + o_ptrs, mask=ok, other=0.0).to(tl.float32))
    t_2 += _row_sum(do_b * tl.load(O2 + o_ptrs + HEAD_DIM, mask=ok, other=0.0).to(tl.float32))
    lam = tl.load(Lam).to(tl.float32)
    lse_off = b * stride_lb + h * stride_lh + rows
    tl.store(Delta1 + lse_off, t_out + lam * t_2, mask=rows < N)
    tl.store(Delta2 + lse_off, t_2, mask=rows < N)


@triton.jit
def _bwd_dkdv_inner(
    dk1,
    dk2,
    dva,
    dvb,
    k1,
    k2,
    va,
    vb,
    cols,
    key_bias,
    q1_base,
    q2_base,
    stride_qn,
    do_base,
    stride_dn,
    lse1_base,
    lse2_base,
    d1_base,
    d2_base,
    dq1_base,
    dq2_base,
    stride_dqn,
    mask_ptr,
    stride_mn,
    stride_ml,
    lam,
    n_q,
    n_k,
    causal_off,
    qk_scale,
    sm_scale,
    lo,
    hi,
    CAUSAL: tl.constexpr,
    BOUNDS: tl.constexpr,
    MASK_KIND: tl.constexpr,
    ATOMIC_DQ: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Accumulates dK/dV of one key tile over query tiles [lo, hi) of one head; transposed tiles (keys x queries)
    so the row statistics broadcast along columns."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + offs_m
        q1 = _load_rows(q1_base, rows, stride_qn, n_q, offs_d, BOUNDS, HEAD_DIM, BLOCK_D)
        q2 = _load_rows(q2_base, rows, stride_qn, n_q, offs_d, BOUNDS, HEAD_DIM, BLOCK_D)
        do_a = _load_rows(do_base, rows, stride_dn, n_q, offs_d, BOUNDS, HEAD_DIM, BLOCK_D)
        do_b = _load_rows(do_base + HEAD_DIM, rows, stride_dn, n_q, offs_d, BOUNDS, HEAD_DIM, BLOCK_D)
        if BOUNDS:
            lse1 = tl.load(lse1_base + rows, mask=rows < n_q, other=float("inf"))
            lse2 = tl.load(lse2_base + rows, mask=rows < n_q, other=float("inf"))
            delta1 = tl.load(d1_base + rows, mask=rows < n_q, other=0.0)
            delta2 = tl.load(d2_base + rows, mask=rows < n_q, other=0.0)
        else:
            lse1 = tl.load(lse1_base + rows)
            lse2 = tl.load(lse2_base + rows)
            delta1 = tl.load(d1_base + rows)
            delta2 = tl.load(d2_base + rows)
        dp = tl.dot(va, tl.trans(do_a), input_precision=DOT_PREC)  # (BLOCK_N, BLOCK_M)
        dp = tl.dot(vb, tl.trans(do_b), dp, input_precision=DOT_PREC)
        # One map after the other, so fewer (BLOCK_N, BLOCK_M) tiles are live at a time.
        z1 = tl.dot(k1, tl.trans(q1), input_precision=DOT_PREC) * qk_scale + key_bias[:, None]
        tile_mask = mask_ptr + tl.cast(start_m, tl.int64) * stride_mn
        z1 = _masked_scores_t(
            z1, rows, offs_m, cols, n_q, n_k, causal_off, tile_mask, stride_mn, stride_ml, CAUSAL, BOUNDS, MASK_KIND
        )
        p1 = tl.exp2(z1 - lse1[None, :])
        dz1 = (p1 * (dp - delta1[None, :])).to(q1.dtype)
        dk1 = tl.dot(dz1, q1, dk1, input_precision=DOT_PREC)
        z2 = tl.dot(k2, tl.trans(q2), input_precision=DOT_PREC) * qk_scale + key_bias[:, None]
        z2 = _masked_scores_t(
            z2, rows, offs_m, cols, n_q, n_k, causal_off, tile_mask, stride_mn, stride_ml, CAUSAL, BOUNDS, MASK_KIND
        )
        lam_p2 = lam * tl.exp2(z2 - lse2[None, :])
        dz2 = (-lam_p2 * (dp - delta2[None, :])).to(q2.dtype)
        dk2 = tl.dot(dz2, q2, dk2, input_precision=DOT_PREC)
        p = (p1 - lam_p2).to(do_a.dtype)
        dva = tl.dot(p, do_a, dva, input_precision=DOT_PREC)
        dvb = tl.dot(p, do_b, dvb, input_precision=DOT_PREC)
        if ATOMIC_DQ:
            dq_ptrs = rows[:, None] * stride_dqn + offs_d[None, :]
            dq_ok = (rows[:, None] < n_q) & (offs_d[None, :] < HEAD_DIM)
            dq1 = tl.dot(tl.trans(dz1), k1, input_precision=DOT_PREC) * sm_scale
            tl.atomic_add(dq1_base + dq_ptrs, dq1, mask=dq_ok, sem="relaxed")
            dq2 = tl.dot(tl.trans(dz2), k2, input_precision=DOT_PREC) * sm_scale
            tl.atomic_add(dq2_base + dq_ptrs, dq2, mask=dq_ok, sem="relaxed")
    return dk1, dk2, dva, dvb


@triton.jit
def _masked_scores_t(
    z,
    rows,
    local_rows,
    cols,
    n_q,
    n_k,
    causal_off,
    mask_ptr,
    stride_mn,
    stride_ml,
    CAUSAL: tl.constexpr,
    BOUNDS: tl.constexpr,
    MASK_KIND: tl.constexpr,
):
    """_masked_scores for a transposed tile z (keys, queries)."""
    if BOUNDS:
        ok = (rows[None, :] < n_q) & (cols[:, None] < n_k)
        if CAUSAL:
            ok = ok & (cols[:, None] <= rows[None, :] + causal_off)
        z = tl.where(ok, z, float("-inf"))
    if MASK_KIND != 0:
        in_range = (rows[None, :] < n_q) & (cols[:, None] < n_k)
        ptrs = mask_ptr + local_rows[None, :] * stride_mn + cols[:, None] * stride_ml
        if MASK_KIND == 1:
            z = tl.where(tl.load(ptrs, mask=in_range, other=0) != 0, z, float("-inf"))
        else:
            z = z + tl.load(ptrs, mask=in_range, other=0.0).to(tl.float32) * LOG2E
    return z


@triton.jit
def _bwd_dkdv_kernel(
    Q,
    K,
    V,
    DO,
    Lam,
    Lse1,
    Lse2,
    Delta1,
    Delta2,
    Mask,
    CuSeqlens,
    DK,
    DV,
    DQ,
    stride_qb,
    stride_qh,
    stride_qn,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_db,
    stride_dn,
    stride_dh,
    stride_lb,
    stride_lh,
    stride_mb,
    stride_mh,
    stride_mn,
    stride_ml,
    H,
    H_KV,
    N,
    L,
    qk_scale,
    sm_scale,
    CAUSAL: tl.constexpr,
    MASK_KIND: tl.constexpr,
    VARLEN: tl.constexpr,
    ATOMIC_DQ: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Program (key tile, b·g): dK/dV of one key tile of group g, summed over the group's G heads in registers
    (no atomics for GQA); with ATOMIC_DQ it also scatters dQ into an fp32 buffer (DQ has query's strides)."""
    pid_n = tl.program_id(0)
    pid_bg = tl.program_id(1)
    b = pid_bg // H_KV
    g = pid_bg % H_KV
    batch, start, n_q, n_k = _seq_bounds(CuSeqlens, b, N, L, VARLEN)
    n0 = pid_n * BLOCK_N
    if n0 >= n_k:
        return
    batch = batch.to(tl.int64)
    g = g.to(tl.int64)
    group = H // H_KV
    offs_d = tl.arange(0, BLOCK_D)
    cols = n0 + tl.arange(0, BLOCK_N)
    k_base = K + batch * stride_kb + start * stride_kn
    v_base = V + batch * stride_vb + start * stride_vn
    k1 = _load_rows(k_base + g * stride_kh, cols, stride_kn, n_k, offs_d, True, HEAD_DIM, BLOCK_D)
    k2 = _load_rows(k_base + (H_KV + g) * stride_kh, cols, stride_kn, n_k, offs_d, True, HEAD_DIM, BLOCK_D)
    va = _load_rows(v_base + g * stride_vh, cols, stride_vn, n_k, offs_d, True, HEAD_DIM, BLOCK_D)
    vb = _load_rows(v_base + (H_KV + g) * stride_vh, cols, stride_vn, n_k, offs_d, True, HEAD_DIM, BLOCK_D)
    dk1 = tl.full([BLOCK_N, BLOCK_D], 0.0, tl.float32)
    dk2 = tl.full([BLOCK_N, BLOCK_D], 0.0, tl.float32)
    dva = tl.full([BLOCK_N, BLOCK_D], 0.0, tl.float32)
    dvb = tl.full([BLOCK_N, BLOCK_D], 0.0, tl.float32)
    lam = tl.load(Lam).to(tl.float32)

    causal_off = n_k - n_q
    # Query tiles: [lo, mid) straddle the diagonal, [mid, full_end) see the whole key tile, [full_end, n_q) is
    # the ragged tail; the first and last get the bounds/causal test.
    if CAUSAL:
        lo = tl.maximum(n0 - causal_off, 0) // BLOCK_M * BLOCK_M
        mid = (tl.maximum(n0 + BLOCK_N - 1 - causal_off, 0) + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    else:
        lo = 0
        mid = 0
    full_end = n_q // BLOCK_M * BLOCK_M
    lo = tl.minimum(lo, n_q)
    mid = tl.maximum(lo, tl.minimum(mid, full_end))
    full_end = tl.maximum(mid, full_end)
    # -inf on keys past the end of a ragged last tile: they must get p = 0 in every range (the middle one skips the
    # bounds test, and a zero key would otherwise get exp2(0 - lse), unbounded).
    key_bias = tl.where(cols < n_k, 0.0, float("-inf"))
    for hh in range(group):
        h = (g * group + hh).to(tl.int64)
        q_base = Q + batch * stride_qb + start * stride_qn
        do_base = DO + batch * stride_db + start * stride_dn + h * stride_dh
        lse_off = batch * stride_lb + h * stride_lh + start
        dq_base = DQ + batch * stride_qb + start * stride_qn
        mask_ptr = Mask + batch * stride_mb + h * stride_mh
        for part in tl.static_range(3):
            if part == 0:
                a = lo
                z = mid
            elif part == 1:
                a = mid
                z = full_end
            else:
                a = full_end
                z = n_q
            dk1, dk2, dva, dvb = _bwd_dkdv_inner(
                dk1,
                dk2,
                dva,
                dvb,
                k1,
                k2,
                va,
                vb,
                cols,
                key_bias,
                q_base + h * stride_qh,
                q_base + (H + h) * stride_qh,
                stride_qn,
                do_base,
                stride_dn,
                Lse1 + lse_off,
                Lse2 + lse_off,
                Delta1 + lse_off,
                Delta2 + lse_off,
                dq_base + h * stride_qh,
                dq_base + (H + h) * stride_qh,
                stride_qn,
                mask_ptr,
                stride_mn,
                stride_ml,
                lam,
                n_q,
                n_k,
                causal_off,
                qk_scale,
                sm_scale,
                a,
                z,
                CAUSAL,
                part != 1,
                MASK_KIND,
                ATOMIC_DQ,
                BLOCK_M,
                HEAD_DIM,
                BLOCK_D,
                DOT_PREC,
            )

    ok = (cols[:, None] < n_k) & (offs_d[None, :] < HEAD_DIM)
    ptrs = cols[:, None] * stride_kn + offs_d[None, :]
    dk_base = DK + batch * stride_kb + start * stride_kn
    dv_base = DV + batch * stride_vb + start * stride_vn
    tl.store(dk_base + g * stride_kh + ptrs, (dk1 * sm_scale).to(DK.dtype.element_ty), mask=ok)
    tl.store(dk_base + (H_KV + g) * stride_kh + ptrs, (dk2 * sm_scale).to(DK.dtype.element_ty), mask=ok)
    ptrs = cols[:, None] * stride_vn + offs_d[None, :]
    tl.store(dv_base + g * stride_vh + ptrs, dva.to(DV.dtype.element_ty), mask=ok)
    tl.store(dv_base + (H_KV + g) * stride_vh + ptrs, dvb.to(DV.dtype.element_ty), mask=ok)


@triton.jit
def _bwd_dq_inner(
    dq1,
    dq2,
    q1,
    q2,
    do_a,
    do_b,
    lse1,
    lse2,
    delta1,
    delta2,
    rows,
    local_rows,
    k1_base,
    k2_base,
    va_base,
    vb_base,
    stride_kn,
    stride_vn,
    mask_ptr,
    stride_mn,
    stride_ml,
    lam,
    n_q,
    n_k,
    causal_off,
    qk_scale,
    lo,
    hi,
    CAUSAL: tl.constexpr,
    BOUNDS: tl.constexpr,
    MASK_KIND: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        k1 = _load_rows(k1_base, cols, stride_kn, n_k, offs_d, BOUNDS, HEAD_DIM, BLOCK_D)
        k2 = _load_rows(k2_base, cols, stride_kn, n_k, offs_d, BOUNDS, HEAD_DIM, BLOCK_D)
        va = _load_rows(va_base, cols, stride_vn, n_k, offs_d, BOUNDS, HEAD_DIM, BLOCK_D)
        vb = _load_rows(vb_base, cols, stride_vn, n_k, offs_d, BOUNDS, HEAD_DIM, BLOCK_D)
        dp = tl.dot(do_a, tl.trans(va), input_precision=DOT_PREC)
        dp = tl.dot(do_b, tl.trans(vb), dp, input_precision=DOT_PREC)
        z1 = tl.dot(q1, tl.trans(k1), input_precision=DOT_PREC) * qk_scale
        z1 = _masked_scores(
            z1, rows, local_rows, cols, n_q, n_k, causal_off, mask_ptr, stride_mn, stride_ml, CAUSAL, BOUNDS, MASK_KIND
        )
        dz1 = (tl.exp2(z1 - lse1[:, None]) * (dp - delta1[:, None])).to(k1.dtype)
        dq1 = tl.dot(dz1, k1, dq1, input_precision=DOT_PREC)
        z2 = tl.dot(q2, tl.trans(k2), input_precision=DOT_PREC) * qk_scale
        z2 = _masked_scores(
            z2, rows, local_rows, cols, n_q, n_k, causal_off, mask_ptr, stride_mn, stride_ml, CAUSAL, BOUNDS, MASK_KIND
        )
        dz2 = (-lam * tl.exp2(z2 - lse2[:, None]) * (dp - delta2[:, None])).to(k2.dtype)
        dq2 = tl.dot(dz2, k2, dq2, input_precision=DOT_PREC)
    return dq1, dq2


@triton.jit
def _bwd_dq_kernel(
    Q,
    K,
    V,
    DO,
    Lam,
    Lse1,
    Lse2,
    Delta1,
    Delta2,
    Mask,
    CuSeqlens,
    DQ,
    stride_qb,
    stride_qh,
    stride_qn,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_db,
    stride_dn,
    stride_dh,
    stride_lb,
    stride_lh,
    stride_mb,
    stride_mh,
    stride_mn,
    stride_ml,
    H,
    H_KV,
    N,
    L,
    qk_scale,
    sm_scale,
    CAUSAL: tl.constexpr,
    MASK_KIND: tl.constexpr,
    VARLEN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Program (query tile, b·h): dq1 and dq2 of one query tile, recomputing the scores (no atomics, deterministic).
    DQ has query's strides."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    g = h // (H // H_KV)
    batch, start, n_q, n_k = _seq_bounds(CuSeqlens, b, N, L, VARLEN)
    m0 = pid_m * BLOCK_M
    if m0 >= n_q:
        return
    batch = batch.to(tl.int64)
    h = h.to(tl.int64)
    g = g.to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    rows = m0 + tl.arange(0, BLOCK_M)
    q_base = Q + batch * stride_qb + start * stride_qn
    q1 = _load_rows(q_base + h * stride_qh, rows, stride_qn, n_q, offs_d, True, HEAD_DIM, BLOCK_D)
    q2 = _load_rows(q_base + (H + h) * stride_qh, rows, stride_qn, n_q, offs_d, True, HEAD_DIM, BLOCK_D)
    do_base = DO + batch * stride_db + start * stride_dn + h * stride_dh
    do_a = _load_rows(do_base, rows, stride_dn, n_q, offs_d, True, HEAD_DIM, BLOCK_D)
    do_b = _load_rows(do_base + HEAD_DIM, rows, stride_dn, n_q, offs_d, True, HEAD_DIM, BLOCK_D)
    lse_off = batch * stride_lb + h * stride_lh + start + rows
    lse1 = tl.load(Lse1 + lse_off, mask=rows < n_q, other=float("inf"))
    lse2 = tl.load(Lse2 + lse_off, mask=rows < n_q, other=float("inf"))
    delta1 = tl.load(Delta1 + lse_off, mask=rows < n_q, other=0.0)
    delta2 = tl.load(Delta2 + lse_off, mask=rows < n_q, other=0.0)
    lam = tl.load(Lam).to(tl.float32)
    k_base = K + batch * stride_kb + start * stride_kn
    v_base = V + batch * stride_vb + start * stride_vn
    k1_base = k_base + g * stride_kh
    k2_base = k_base + (H_KV + g) * stride_kh
    va_base = v_base + g * stride_vh
    vb_base = v_base + (H_KV + g) * stride_vh
    mask_ptr = Mask + batch * stride_mb + h * stride_mh + m0.to(tl.int64) * stride_mn
    dq1 = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
    dq2 = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)

    causal_off = n_k - n_q
    if CAUSAL:
        hi = tl.minimum(n_k, tl.maximum(m0 + BLOCK_M + causal_off, 0))
        full = tl.minimum(tl.maximum(m0 + causal_off + 1, 0), n_k)
    else:
        hi = n_k
        full = n_k
    full = full // BLOCK_N * BLOCK_N
    dq1, dq2 = _bwd_dq_inner(
        dq1,
        dq2,
        q1,
        q2,
        do_a,
        do_b,
        lse1,
        lse2,
        delta1,
        delta2,
        rows,
        tl.arange(0, BLOCK_M),
        k1_base,
        k2_base,
        va_base,
        vb_base,
        stride_kn,
        stride_vn,
        mask_ptr,
        stride_mn,
        stride_ml,
        lam,
        n_q,
        n_k,
        causal_off,
        qk_scale,
        0,
        full,
        CAUSAL,
        False,
        MASK_KIND,
        BLOCK_N,
        HEAD_DIM,
        BLOCK_D,
        DOT_PREC,
    )
    dq1, dq2 = _bwd_dq_inner(
        dq1,
        dq2,
        q1,
        q2,
        do_a,
        do_b,
        lse1,
        lse2,
        delta1,
        delta2,
        rows,
        tl.arange(0, BLOCK_M),
        k1_base,
        k2_base,
        va_base,
        vb_base,
        stride_kn,
        stride_vn,
        mask_ptr,
        stride_mn,
        stride_ml,
        lam,
        n_q,
        n_k,
        causal_off,
        qk_scale,
        full,
        hi,
        CAUSAL,
        True,
        MASK_KIND,
        BLOCK_N,
        HEAD_DIM,
        BLOCK_D,
        DOT_PREC,
    )
    ok = (rows[:, None] < n_q) & (offs_d[None, :] < HEAD_DIM)
    ptrs = rows[:, None] * stride_qn + offs_d[None, :]
    dq_base = DQ + batch * stride_qb + start * stride_qn
    tl.store(dq_base + h * stride_qh + ptrs, (dq1 * sm_scale).to(DQ.dtype.element_ty), mask=ok)
    tl.store(dq_base + (H + h) * stride_qh + ptrs, (dq2 * sm_scale).to(DQ.dtype.element_ty), mask=ok)
