"""Decoding (a few queries against a cache): flash-decoding with a split-K combine, as FlashAttention's
flash_fwd_combine. _decode_split_kernel runs, per (batch, KV group, key split), every query head of the group as rows
of one tile, so each cached K/V byte is read once, and writes partial (m, l, acc) to fp32 scratch;
_decode_combine_kernel merges the splits and writes the output and the log-sum-exps (the backward works after either
forward). Layouts and conventions: common.py."""

import triton
import triton.language as tl

from .common import LOG2E, _group_bases, _group_program, _load_rows, _lse, _online_softmax_step


@triton.jit
def _decode_split_kernel(
    Q, K, V, Mask, PartAcc, PartML,
    stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_mb, stride_mh, stride_mn, stride_ml,
    H, H_KV, N, L, qk_scale, blocks_per_split, num_splits,
    CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Flash-decoding: program (b·g, s) runs every query row of KV group g (G heads x N queries stacked as
    BLOCK_R rows) over split s of the keys, so each cached K/V byte is read once; partial (m, l, acc) go to
    scratch for _decode_combine_kernel."""
    pid_bg = tl.program_id(0)
    pid_s = tl.program_id(1)
    b, g = _group_program(pid_bg, H_KV)
    b = b.to(tl.int64)
    g = g.to(tl.int64)
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
    k1_base, k2_base, va_base, vb_base = _group_bases(
        K, V, b, 0, g, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn, H_KV
    )
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
    PartAcc, PartML, Lam, Out, O2, Lse1, Lse2,
    stride_ob, stride_on, stride_oh, stride_lb, stride_lh,
    H, H_KV, N, num_splits,
    SAVE_O2: tl.constexpr, BLOCK_R: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
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
