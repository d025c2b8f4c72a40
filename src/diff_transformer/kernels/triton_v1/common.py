"""What every kernel of Diff Transformer V1 attention shares: the prologue (program id -> sequence, head and group;
base pointers; causal tile bounds), tile loads, masking, the online softmax, sequence bounds.

Layouts (component-major, as DiffAttentionV1's forward in modeling_diff.py builds them):
    query (B, 2H, N, d)      [q1 of heads 0..H-1 | q2 of heads 0..H-1]
    key   (B, 2H_kv, L, d)   [k1 of groups | k2 of groups]
    value (B, 2H_kv, L, d)   [first d-wide half of V_g | second half]
    out   (B, N, H, 2d)      A1 V - λ A2 V;  o2 = A2 V (kept for the backward)
    lse1, lse2 (B, H, N)     log2-sum-exp2 of the scaled scores of each map; +inf marks a row with nothing to attend
Scores live in the log2 domain: z = q·k · scaling · log2(e), so softmax is exp2(z - lse).
Every head dimension is padded to BLOCK_D (a power of two >= 16) with zeros on load; zeros leave the dots unchanged.
Offsets inside one head's (rows, d) slice are int32 (64-bit address tiles cost registers the inner loops need; the
host checks rows x row stride < 2^31), batch/head offsets and mask offsets int64.

The kernels call only Triton builtins and the @triton.jit functions of this package, never the @jit helpers of
triton.language.standard (tl.zeros, tl.max, tl.sum: their mode is fixed when triton.language is first imported, and
the interpreted twins of __init__.interpreted() replace only this package's helpers); reductions go through the
builtin tl.reduce with the standard combine functions, which the interpreter runs with numpy.
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


# ----------------------------------------------------------------------------------------------------------- prologue


@triton.jit
def _query_program(pid_bh, H, H_KV):
    """(b, h, g) of a program over batch x query heads: its sequence, query head and key/value group."""
    b = pid_bh // H
    h = pid_bh % H
    return b, h, h // (H // H_KV)


@triton.jit
def _group_program(pid_bg, H_KV):
    """(b, g) of a program over batch x key/value groups."""
    return pid_bg // H_KV, pid_bg % H_KV


@triton.jit
def _group_bases(
    K, V, batch, start, g,
    stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    H_KV,
):
    """Base pointers of group g's k1, k2 and value halves in sequence `start` of batch row `batch`."""
    k_base = K + batch * stride_kb + start * stride_kn
    v_base = V + batch * stride_vb + start * stride_vn
    return (
        k_base + g * stride_kh,
        k_base + (H_KV + g) * stride_kh,
        v_base + g * stride_vh,
        v_base + (H_KV + g) * stride_vh,
    )


@triton.jit
def _causal_key_bounds(m0, n_q, n_k, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(causal_off, full, hi) of the query tile starting at row m0: the queries are the last n_q of n_k positions, so
    row i sees keys j <= i + causal_off; key tiles before `full` (a multiple of BLOCK_N) need no causal or bounds
    test, [full, hi) do (the diagonal and the ragged tail)."""
    causal_off = n_k - n_q
    if CAUSAL:
        hi = tl.minimum(n_k, tl.maximum(m0 + BLOCK_M + causal_off, 0))
        full = tl.minimum(tl.maximum(m0 + causal_off + 1, 0), n_k)  # keys every row of the tile may see
    else:
        hi = n_k
        full = n_k
    return causal_off, full // BLOCK_N * BLOCK_N, hi


# ------------------------------------------------------------------------------------------------------------ masking


@triton.jit
def _masked_scores(
    z, rows, local_rows, cols, n_q, n_k, causal_off,
    mask_ptr, stride_mn, stride_ml,
    CAUSAL: tl.constexpr, BOUNDS: tl.constexpr, MASK_KIND: tl.constexpr,
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
def _masked_scores_t(
    z, rows, local_rows, cols, n_q, n_k, causal_off,
    mask_ptr, stride_mn, stride_ml,
    CAUSAL: tl.constexpr, BOUNDS: tl.constexpr, MASK_KIND: tl.constexpr,
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


# ------------------------------------------------------------------------------------------------------------ softmax


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
def _lse(m, l):
    """log2-sum-exp2 of a row from its running max and sum; +inf for a row with nothing to attend, so that the
    backward's exp2(z - lse) is 0 there."""
    return tl.where(l == 0.0, float("inf"), m + tl.log2(tl.where(l == 0.0, 1.0, l)))
