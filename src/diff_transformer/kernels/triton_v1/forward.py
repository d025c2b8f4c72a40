"""Prefill/training forward (FlashAttention-2 on two maps): one program per (query tile, head); each K/V tile is loaded
once and feeds both maps' online softmaxes, and the program writes out = A1 V - λ A2 V, both log-sum-exps and, when
the backward will need it, O2 = A2 V. Layouts and conventions: common.py."""

import triton
import triton.language as tl

from .common import (
    _causal_key_bounds,
    _group_bases,
    _load_rows,
    _lse,
    _masked_scores,
    _online_softmax_step,
    _query_program,
    _seq_bounds,
)


@triton.jit
def _fwd_inner(
    acc1a, acc1b, acc2a, acc2b, m1, l1, m2, l2,
    q1, q2, k1_base, k2_base, va_base, vb_base, stride_kn, stride_vn,
    mask_ptr, stride_mn, stride_ml,
    rows, local_rows, n_q, n_k, causal_off, qk_scale, lo, hi,
    CAUSAL: tl.constexpr, BOUNDS: tl.constexpr, MASK_KIND: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PREC: tl.constexpr,
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
def _fwd_kernel(
    Q, K, V, Lam, Out, O2, Lse1, Lse2, Mask, CuSeqlens,
    stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_ob, stride_on, stride_oh, stride_lb, stride_lh, stride_mb, stride_mh, stride_mn, stride_ml,
    H, H_KV, N, L, qk_scale,
    CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, VARLEN: tl.constexpr, SAVE_O2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
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
    k1_base, k2_base, va_base, vb_base = _group_bases(
        K, V, batch, start, g, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn, H_KV
    )
    mask_ptr = Mask + batch * stride_mb + h * stride_mh + m0.to(tl.int64) * stride_mn

    m1 = tl.full([BLOCK_M], float("-inf"), tl.float32)
    m2 = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l1 = tl.full([BLOCK_M], 0.0, tl.float32)
    l2 = tl.full([BLOCK_M], 0.0, tl.float32)
    acc1a = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
    acc1b = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
    acc2a = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
    acc2b = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)

    causal_off, full, hi = _causal_key_bounds(m0, n_q, n_k, CAUSAL, BLOCK_M, BLOCK_N)
    acc1a, acc1b, acc2a, acc2b, m1, l1, m2, l2 = _fwd_inner(
        acc1a, acc1b, acc2a, acc2b, m1, l1, m2, l2,
        q1, q2, k1_base, k2_base, va_base, vb_base, stride_kn, stride_vn,
        mask_ptr, stride_mn, stride_ml,
        rows, tl.arange(0, BLOCK_M), n_q, n_k, causal_off, qk_scale, 0, full,
        CAUSAL, False, MASK_KIND, BLOCK_N, HEAD_DIM, BLOCK_D, DOT_PREC,
    )
    acc1a, acc1b, acc2a, acc2b, m1, l1, m2, l2 = _fwd_inner(
        acc1a, acc1b, acc2a, acc2b, m1, l1, m2, l2,
        q1, q2, k1_base, k2_base, va_base, vb_base, stride_kn, stride_vn,
        mask_ptr, stride_mn, stride_ml,
        rows, tl.arange(0, BLOCK_M), n_q, n_k, causal_off, qk_scale, full, hi,
        CAUSAL, True, MASK_KIND, BLOCK_N, HEAD_DIM, BLOCK_D, DOT_PREC,
    )

    _store_output(
        acc1a, acc1b, acc2a, acc2b, l1, l2, Lam,
        Out + batch * stride_ob + start * stride_on + h * stride_oh,
        O2 + batch * stride_ob + start * stride_on + h * stride_oh,
        rows, stride_on, n_q,
        SAVE_O2, HEAD_DIM, BLOCK_D,
    )
    lse_off = batch * stride_lb + h * stride_lh + start + rows
    tl.store(Lse1 + lse_off, _lse(m1, l1), mask=rows < n_q)
    tl.store(Lse2 + lse_off, _lse(m2, l2), mask=rows < n_q)


@triton.jit
def _store_output(
    acc1a, acc1b, acc2a, acc2b, l1, l2, Lam, out_base, o2_base, rows, stride_on, n_q,
    SAVE_O2: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
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

