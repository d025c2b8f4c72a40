"""Backward: a preprocess kernel (δ1, δ2), then dK/dV per (key tile, KV group) and dQ per (query tile, head).

With O_c = A_c V and out = O1 - λ O2, dO given:
  dP = dO Vᵀ                       (shared by both maps: V is shared)
  dZ1 = A1 ∘ (dP - δ1),  δ1 = rowsum(dO ∘ O1) = rowsum(dO ∘ out) + λ rowsum(dO ∘ O2)
  dZ2 = -λ A2 ∘ (dP - δ2), δ2 = rowsum(dO ∘ O2)
  dV = (A1 - λ A2)ᵀ dO,  dq_c = scaling dZ_c k_c,  dk_c = scaling dZ_cᵀ q_c,  dλ = -Σ δ2
so the backward costs the same 10 tile matmuls as FlashAttention-2 on 2H heads of size d. The dK/dV kernel sums the
G heads of a KV group in registers (no atomics for GQA); dQ comes from a kernel recomputing the scores
(deterministic) or, with ATOMIC_DQ, from fp32 atomics in the dK/dV kernel. Layouts and conventions: common.py.
"""

import triton
import triton.language as tl

from .common import (
    _causal_key_bounds,
    _group_bases,
    _group_program,
    _load_rows,
    _masked_scores,
    _masked_scores_t,
    _query_program,
    _row_sum,
    _seq_bounds,
)


@triton.jit
def _bwd_preprocess_kernel(
    Out, O2, DO, Lam, Delta1, Delta2,
    stride_ob, stride_on, stride_oh, stride_db, stride_dn, stride_dh, stride_lb, stride_lh,
    H, N,
    BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
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
    dk1, dk2, dva, dvb, k1, k2, va, vb, cols, key_bias,
    q1_base, q2_base, stride_qn, do_base, stride_dn, lse1_base, lse2_base, d1_base, d2_base,
    dq1_base, dq2_base, stride_dqn, mask_ptr, stride_mn, stride_ml,
    lam, n_q, n_k, causal_off, qk_scale, sm_scale, lo, hi,
    CAUSAL: tl.constexpr, BOUNDS: tl.constexpr, MASK_KIND: tl.constexpr, ATOMIC_DQ: tl.constexpr,
    BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PREC: tl.constexpr,
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
def _bwd_dkdv_kernel(
    Q, K, V, DO, Lam, Lse1, Lse2, Delta1, Delta2, Mask, CuSeqlens, DK, DV, DQ,
    stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_db, stride_dn, stride_dh, stride_lb, stride_lh, stride_mb, stride_mh, stride_mn, stride_ml,
    H, H_KV, N, L, qk_scale, sm_scale,

    CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, VARLEN: tl.constexpr, ATOMIC_DQ: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Program (key tile, b·g): dK/dV of one key tile of group g, summed over the group's G heads in registers
    (no atomics for GQA); with ATOMIC_DQ it also scatters dQ into an fp32 buffer (DQ has query's strides)."""
    pid_n = tl.program_id(0)
    b, g = _group_program(tl.program_id(1), H_KV)
    batch, start, n_q, n_k = _seq_bounds(CuSeqlens, b, N, L, VARLEN)
    n0 = pid_n * BLOCK_N
    if n0 >= n_k:
        return
    batch = batch.to(tl.int64)
    g = g.to(tl.int64)
    group = H // H_KV
    offs_d = tl.arange(0, BLOCK_D)
    cols = n0 + tl.arange(0, BLOCK_N)
    k1_base, k2_base, va_base, vb_base = _group_bases(
        K, V, batch, start, g, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn, H_KV
    )
    k1 = _load_rows(k1_base, cols, stride_kn, n_k, offs_d, True, HEAD_DIM, BLOCK_D)
    k2 = _load_rows(k2_base, cols, stride_kn, n_k, offs_d, True, HEAD_DIM, BLOCK_D)
    va = _load_rows(va_base, cols, stride_vn, n_k, offs_d, True, HEAD_DIM, BLOCK_D)
    vb = _load_rows(vb_base, cols, stride_vn, n_k, offs_d, True, HEAD_DIM, BLOCK_D)
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
                dk1, dk2, dva, dvb, k1, k2, va, vb, cols, key_bias,
                q_base + h * stride_qh, q_base + (H + h) * stride_qh, stride_qn, do_base, stride_dn,
                Lse1 + lse_off, Lse2 + lse_off, Delta1 + lse_off, Delta2 + lse_off,
                dq_base + h * stride_qh, dq_base + (H + h) * stride_qh, stride_qn, mask_ptr, stride_mn, stride_ml,
                lam, n_q, n_k, causal_off, qk_scale, sm_scale, a, z,
                CAUSAL, part != 1, MASK_KIND, ATOMIC_DQ, BLOCK_M, HEAD_DIM, BLOCK_D, DOT_PREC,
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
    dq1, dq2, q1, q2, do_a, do_b, lse1, lse2, delta1, delta2, rows, local_rows,
    k1_base, k2_base, va_base, vb_base, stride_kn, stride_vn, mask_ptr, stride_mn, stride_ml,
    lam, n_q, n_k, causal_off, qk_scale, lo, hi,
    CAUSAL: tl.constexpr, BOUNDS: tl.constexpr, MASK_KIND: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PREC: tl.constexpr,
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
    Q, K, V, DO, Lam, Lse1, Lse2, Delta1, Delta2, Mask, CuSeqlens, DQ,
    stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_db, stride_dn, stride_dh, stride_lb, stride_lh, stride_mb, stride_mh, stride_mn, stride_ml,
    H, H_KV, N, L, qk_scale, sm_scale,

    CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, VARLEN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Program (query tile, b·h): dq1 and dq2 of one query tile, recomputing the scores (no atomics, deterministic).
    DQ has query's strides."""
    pid_m = tl.program_id(0)
    b, h, g = _query_program(tl.program_id(1), H, H_KV)
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
    k1_base, k2_base, va_base, vb_base = _group_bases(
        K, V, batch, start, g, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn, H_KV
    )
    mask_ptr = Mask + batch * stride_mb + h * stride_mh + m0.to(tl.int64) * stride_mn
    dq1 = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
    dq2 = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)

    causal_off, full, hi = _causal_key_bounds(m0, n_q, n_k, CAUSAL, BLOCK_M, BLOCK_N)
    dq1, dq2 = _bwd_dq_inner(
        dq1, dq2, q1, q2, do_a, do_b, lse1, lse2, delta1, delta2, rows, tl.arange(0, BLOCK_M),
        k1_base, k2_base, va_base, vb_base, stride_kn, stride_vn, mask_ptr, stride_mn, stride_ml,
        lam, n_q, n_k, causal_off, qk_scale, 0, full,
        CAUSAL, False, MASK_KIND, BLOCK_N, HEAD_DIM, BLOCK_D, DOT_PREC,
    )
    dq1, dq2 = _bwd_dq_inner(
        dq1, dq2, q1, q2, do_a, do_b, lse1, lse2, delta1, delta2, rows, tl.arange(0, BLOCK_M),
        k1_base, k2_base, va_base, vb_base, stride_kn, stride_vn, mask_ptr, stride_mn, stride_ml,
        lam, n_q, n_k, causal_off, qk_scale, full, hi,
        CAUSAL, True, MASK_KIND, BLOCK_N, HEAD_DIM, BLOCK_D, DOT_PREC,
    )
    ok = (rows[:, None] < n_q) & (offs_d[None, :] < HEAD_DIM)
    ptrs = rows[:, None] * stride_qn + offs_d[None, :]
    dq_base = DQ + batch * stride_qb + start * stride_qn
    tl.store(dq_base + h * stride_qh + ptrs, (dq1 * sm_scale).to(DQ.dtype.element_ty), mask=ok)
    tl.store(dq_base + (H + h) * stride_qh + ptrs, (dq2 * sm_scale).to(DQ.dtype.element_ty), mask=ok)
