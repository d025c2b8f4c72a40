"""Diff Transformer V1 attention as one fused, autograd-capable op on the Triton kernels of triton_v1/.

    out_h = (softmax(q1_h k1_gᵀ·s + mask) - λ softmax(q2_h k2_gᵀ·s + mask)) [v_g,a | v_g,b]      g = h // (H / H_kv)

Forward (prefill/training): FlashAttention-2, one program per (query tile, head); each K/V tile is loaded once and
feeds both maps' online softmaxes (m, l, acc for each map, acc 2d wide); it writes out = acc1/l1 - λ acc2/l2, the
log-sum-exps of both maps and O2 = A2 V (the backward needs rowsum(dO ∘ O_c) of each map, and only their λ-combination
is returned).
Backward: dP = dO Vᵀ is shared by the maps (same V), so one step costs 10 tile matmuls, as FA2 on 2H heads of size d.
  * a preprocess kernel: δ1 = rowsum(dO ∘ O1), δ2 = rowsum(dO ∘ O2), and dλ = -Σ δ2;
  * dK/dV kernel, one program per (key tile, KV group), looping over the group's heads and the query tiles: dK1, dK2,
    dV halves accumulate in registers, so GQA needs no atomics and no (B, H, L, d) expansion;
  * dQ kernel, one program per (query tile, head), recomputing the scores: 14 tile matmuls per step instead of the 10
    of accumulating dQ with fp32 atomics from the dK/dV kernel (atomic_dq=True, also implemented), but it is
    deterministic, needs no fp32 dQ buffer and no atomic traffic (one atomic add per element per key tile, which
    grows with L), and its programs outnumber the dK/dV ones, which evens out the causal imbalance. ATOMIC_DQ picks the
    default; measure both with benchmarks/bench_kernel.py.
Decoding (a few queries against a cache): flash-decoding, one program per (batch, KV group, key split) running every
query head of the group as rows of one tile, so each cached K/V byte is read once, then a combine kernel that also
writes the log-sum-exps (the backward works after either forward).

CUDA tensors run compiled kernels; CPU tensors run the same kernels under the Triton interpreter (slow: for tests and
debugging only, the model's CPU path stays on PyTorch).
"""

from __future__ import annotations

import functools
from typing import Literal

import torch


_LOG2E = 1.4426950408889634

# Decoding kernel when cu_seqlens is None and N <= _DECODE_MAX_QUERIES and (H / H_kv)·N <= _DECODE_MAX_ROWS.
_DECODE_MAX_QUERIES = 16
_DECODE_MAX_ROWS = 64

# Launch configurations on GPU: kernel -> {BLOCK_D: (BLOCK_M, BLOCK_N, num_warps, num_stages)}; "decode" ignores
# BLOCK_M. A tuning knob: `benchmarks/bench_kernel.py --sweep` times candidates on a GPU, `--registers` compiles them
# for sm_90 without one and reports registers/spills. head_dim 64 and 128: the fastest of the sweep on an H200 (bf16,
# B=1, N=4096; benchmarks/results/kernel_sweep_h200.md); 256: from the register report only.
CUDA_CONFIGS: dict[str, dict[int, tuple[int, int, int, int]]] = {
    "fwd": {64: (128, 64, 8, 3), 128: (64, 64, 8, 2), 256: (32, 32, 8, 1)},
    "bwd_dkdv": {64: (64, 32, 8, 2), 128: (64, 32, 8, 2), 256: (16, 32, 8, 1)},
    "bwd_dq": {64: (64, 64, 4, 2), 128: (128, 32, 8, 2), 256: (32, 32, 8, 1)},
    "decode": {64: (16, 64, 4, 3), 128: (16, 32, 8, 3), 256: (16, 32, 8, 1)},
}
# fp32 (full-precision dots, a checking mode rather than a fast one): small tiles keep shared memory and compile
# time low.
_CUDA_FP32_CONFIG = (32, 32, 4, 1)
# Under the interpreter small tiles are fastest and make tiny test shapes span several tiles.
_INTERPRETER_CONFIG = (16, 16, 1, 1)

# Backward dQ: False (default) runs a separate dQ kernel that recomputes the scores (deterministic); True adds dQ
# from the dK/dV kernel with fp32 atomics (4 fewer tile matmuls per tile pair, run-to-run differences in the last
# bits).
ATOMIC_DQ = False


@functools.cache
def triton_available() -> bool:
    """True when triton imports (CPU tensors can then run the kernels under the Triton interpreter, for tests)."""
    try:
        import triton
        import triton.language  # noqa: F401
    except Exception:  # ImportError, or a broken install raising anything else at import time
        return False
    return True


def _kernels(device: torch.device):
    """The kernels for `device`: compiled for CUDA, interpreted for CPU (both from one import of triton_v1/)."""
    from . import triton_v1

    return triton_v1 if device.type == "cuda" else triton_v1.interpreted()


def _block_d(head_dim: int) -> int:
    return max(16, _next_power_of_2(head_dim))


def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _config(kind: str, device: torch.device, block_d: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    if device.type != "cuda":
        return _INTERPRETER_CONFIG
    if dtype == torch.float32:
        return (16, *_CUDA_FP32_CONFIG[1:]) if kind == "decode" else _CUDA_FP32_CONFIG
    table = CUDA_CONFIGS[kind]
    # No min(..., default=): dynamo cannot trace it, and generate --compile's fullgraph stops there
    # (tests/kernels/test_kernels.py::test_the_launch_configuration_traces_under_a_fullgraph_compile).
    fitting = [k for k in table if k >= block_d]
    return table[min(fitting) if fitting else max(table)]


_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class _Problem:
    """Shapes, strides and launch arguments shared by the forward and the backward of one call."""

    def __init__(self, query, key, value, scaling, causal, mask, cu_seqlens, max_seqlen):
        self.B, H2, self.N, self.d = query.shape
        self.H, self.H_kv, self.L = H2 // 2, key.shape[1] // 2, key.shape[2]
        self.device, self.dtype = query.device, query.dtype
        self.scaling = float(scaling)
        self.qk_scale = self.scaling * _LOG2E
        self.causal = bool(causal)
        self.block_d = _block_d(self.d)
        self.dot_precision = "ieee" if query.dtype == torch.float32 else "tf32"
        self.cu_seqlens = cu_seqlens
        self.varlen = cu_seqlens is not None
        # Sequences: batch rows, or packed sequences of row 0 whose longest is max_seqlen.
        self.n_seq = cu_seqlens.numel() - 1 if self.varlen else self.B
        self.max_q = max_seqlen if self.varlen else self.N
        self.max_k = max_seqlen if self.varlen else self.L
        if mask is None:
            self.mask_kind, self.mask, self.mask_strides = 0, cu_seqlens if self.varlen else query, (0, 0, 0, 0)
        else:
            self.mask_kind = 1 if mask.dtype == torch.bool else 2
            if mask.dtype == torch.bool:
                # The kernels read bytes. Eager reinterprets the bool mask in place. Inductor (torch 2.11, CUDA) cannot
                # lower that view (torch.iinfo(torch.bool) fails; bench_gpu's train_compile on an H200), so a
                # compiled graph converts instead, a copy it can fuse; its strides are read below.
                mask = mask.to(torch.uint8) if torch.compiler.is_compiling() else mask.view(torch.uint8)
            self.mask = mask
            s_b, s_h, s_n, s_l = mask.stride()
            self.mask_strides = (s_b if mask.shape[0] > 1 else 0, s_h if mask.shape[1] > 1 else 0, s_n, s_l)
        self.seq_arg = cu_seqlens if self.varlen else query  # a dummy pointer when not packed


def _forward(p: _Problem, query, key, value, lam, path: str, save_o2: bool):
    out = query.new_empty(p.B, p.N, p.H, 2 * p.d)  # (B, N, H, 2d)
    o2 = torch.empty_like(out) if save_o2 else out
    lse1 = query.new_empty(p.B, p.H, p.N, dtype=torch.float32)  # (B, H, N)
    lse2 = torch.empty_like(lse1)
    kernels = _kernels(p.device)
    common_strides = (*query.stride()[:3], *key.stride()[:3], *value.stride()[:3])
    if path == "decode":
        _, block_n, num_warps, num_stages = _config("decode", p.device, p.block_d, p.dtype)
        rows = (p.H // p.H_kv) * p.N
        block_r = max(16, _next_power_of_2(rows))
        n_blocks = _cdiv(p.L, block_n)
        if p.device.type == "cuda":  # ~2 programs per SM, at least 2 key tiles per program
            splits = max(1, min(_cdiv(2 * _sm_count(p.device), p.B * p.H_kv), _cdiv(n_blocks, 2)))
        else:
            splits = min(3, n_blocks)
        blocks_per_split = _cdiv(n_blocks, splits)
        splits = _cdiv(n_blocks, blocks_per_split)  # no empty split
        part_ml = torch.empty(4, p.B * p.H_kv, splits, block_r, device=p.device, dtype=torch.float32)
        part_acc = torch.empty(2, p.B * p.H_kv, splits, block_r, 2 * p.block_d, device=p.device, dtype=torch.float32)
        # fmt: off
        kernels._decode_split_kernel[(p.B * p.H_kv, splits)](
            query, key, value, p.mask, part_acc, part_ml,
            *common_strides, *p.mask_strides,
            p.H, p.H_kv, p.N, p.L, p.qk_scale, blocks_per_split, splits,
            CAUSAL=p.causal, MASK_KIND=p.mask_kind,
            BLOCK_R=block_r, BLOCK_N=block_n, HEAD_DIM=p.d, BLOCK_D=p.block_d, DOT_PREC=p.dot_precision,
            num_warps=num_warps, num_stages=num_stages,
        )
        kernels._decode_combine_kernel[(p.B * p.H_kv,)](
            part_acc, part_ml, lam, out, o2, lse1, lse2,
            *out.stride()[:3], *lse1.stride()[:2],
            p.H, p.H_kv, p.N, splits,
            SAVE_O2=save_o2, BLOCK_R=block_r, HEAD_DIM=p.d, BLOCK_D=p.block_d,
            num_warps=4 if block_r > 16 else 2,
        )
        # fmt: on
    else:
        block_m, block_n, num_warps, num_stages = _config("fwd", p.device, p.block_d, p.dtype)
        # fmt: off
        kernels._fwd_kernel[(_cdiv(p.max_q, block_m), p.n_seq * p.H)](
            query, key, value, lam, out, o2, lse1, lse2, p.mask, p.seq_arg,
            *common_strides, *out.stride()[:3], *lse1.stride()[:2], *p.mask_strides,
            p.H, p.H_kv, p.N, p.L, p.qk_scale,
            CAUSAL=p.causal, MASK_KIND=p.mask_kind, VARLEN=p.varlen, SAVE_O2=save_o2,
            BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=p.d, BLOCK_D=p.block_d, DOT_PREC=p.dot_precision,
            num_warps=num_warps, num_stages=num_stages,
        )
        # fmt: on
    return out, o2, lse1, lse2


def _backward(p: _Problem, query, key, value, lam, out, o2, lse1, lse2, grad_out, atomic_dq: bool):
    # Gradients share their input's layout, so one set of strides serves both (hence contiguous copies).
    query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
    grad_out = grad_out.contiguous()  # (B, N, H, 2d); int32 row offsets like out
    kernels = _kernels(p.device)
    small = p.device.type != "cuda"
    delta1 = torch.empty_like(lse1)  # (B, H, N): rowsum(dO ∘ O1)
    delta2 = torch.empty_like(lse1)  # (B, H, N): rowsum(dO ∘ O2)
    block = _INTERPRETER_CONFIG[0] if small else max(16, 4096 // p.block_d)  # 4096 elements of each row tile
    # fmt: off
    kernels._bwd_preprocess_kernel[(_cdiv(p.N, block), p.B * p.H)](
        out, o2, grad_out, lam, delta1, delta2,
        *out.stride()[:3], *grad_out.stride()[:3], *lse1.stride()[:2],
        p.H, p.N,
        BLOCK_M=block, HEAD_DIM=p.d, BLOCK_D=p.block_d,
    )
    # fmt: on
    strides = (*query.stride()[:3], *key.stride()[:3], *value.stride()[:3])  # dQ, dK, dV share them
    strides += (*grad_out.stride()[:3], *lse1.stride()[:2], *p.mask_strides)
    dkey, dvalue = torch.empty_like(key), torch.empty_like(value)
    dquery = torch.zeros_like(query, dtype=torch.float32) if atomic_dq else torch.empty_like(query)
    block_m, block_n, num_warps, num_stages = _config("bwd_dkdv", p.device, p.block_d, p.dtype)
    # fmt: off
    kernels._bwd_dkdv_kernel[(_cdiv(p.max_k, block_n), p.n_seq * p.H_kv)](
        query, key, value, grad_out, lam, lse1, lse2, delta1, delta2, p.mask, p.seq_arg, dkey, dvalue, dquery,
        *strides,
        p.H, p.H_kv, p.N, p.L, p.qk_scale, p.scaling,
        CAUSAL=p.causal, MASK_KIND=p.mask_kind, VARLEN=p.varlen, ATOMIC_DQ=atomic_dq,
        BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=p.d, BLOCK_D=p.block_d, DOT_PREC=p.dot_precision,
        num_warps=num_warps, num_stages=num_stages,
    )
    # fmt: on
    if atomic_dq:
        dquery = dquery.to(query.dtype)
    else:
        block_m, block_n, num_warps, num_stages = _config("bwd_dq", p.device, p.block_d, p.dtype)
        # fmt: off
        kernels._bwd_dq_kernel[(_cdiv(p.max_q, block_m), p.n_seq * p.H)](
            query, key, value, grad_out, lam, lse1, lse2, delta1, delta2, p.mask, p.seq_arg, dquery,
            *strides,
            p.H, p.H_kv, p.N, p.L, p.qk_scale, p.scaling,
            CAUSAL=p.causal, MASK_KIND=p.mask_kind, VARLEN=p.varlen,
            BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=p.d, BLOCK_D=p.block_d, DOT_PREC=p.dot_precision,
            num_warps=num_warps, num_stages=num_stages,
        )
        # fmt: on
    dlam = -delta2.sum()  # dλ = -Σ dO ∘ (A2 V)
    return dquery, dkey, dvalue, dlam


class _TritonV1Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, lam, problem, path, save_o2, atomic_dq):
        out, o2, lse1, lse2 = _forward(problem, query, key, value, lam, path, save_o2)
        if save_o2:
            ctx.save_for_backward(query, key, value, lam, out, o2, lse1, lse2)
            ctx.problem, ctx.atomic_dq = problem, atomic_dq
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, lam, out, o2, lse1, lse2 = ctx.saved_tensors
        dq, dk, dv, dlam = _backward(ctx.problem, query, key, value, lam, out, o2, lse1, lse2, grad_out, ctx.atomic_dq)
        return dq, dk, dv, dlam.reshape(lam.shape), None, None, None, None


def select_path(n_queries: int, n_heads: int, n_kv_heads: int, packed: bool = False) -> str:
    """'decode' (split-K over the keys, all heads of a KV group per program) or 'prefill', as the op picks it."""
    rows = (n_heads // n_kv_heads) * n_queries
    if not packed and n_queries <= _DECODE_MAX_QUERIES and rows <= _DECODE_MAX_ROWS:
        return "decode"
    return "prefill"


def triton_v1_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    lam: torch.Tensor,
    *,
    scaling: float,
    causal: bool = True,
    attention_mask: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    path: Literal["auto", "prefill", "decode"] = "auto",
    atomic_dq: bool | None = None,
) -> torch.Tensor:
    """Diff Transformer V1 attention, fused: `A1 V - λ A2 V` before subln, as one autograd-capable op.

    CUDA tensors run the compiled Triton kernels; CPU tensors run the same kernels under Triton's interpreter (slow:
    for tests and debugging). Ask `diff_transformer.kernels.is_available(device)` first; the model uses it through
    `attn_implementation="diff_triton"`.

    Args:
        query: `(B, 2H, N, d)` = [q1 of heads 0..H-1 | q2 of heads 0..H-1] (component-major, as `DiffAttentionV1`
            builds it).
        key: `(B, 2H_kv, L, d)` = [k1 | k2] of the KV groups; H must be a multiple of H_kv (query head h uses group
            `h // (H / H_kv)`).
        value: `(B, 2H_kv, L, d)` = [first d-wide half of V_g | second half], i.e. what the KV cache stores.
        lam: λ, a one-element tensor (0-d fp32 in the model; differentiable) or a number.
        scaling: softmax scale (`d ** -0.5` in the model).
        causal: query i is position `L - N + i` (the queries are the last N of L keys: a cache or a chunked prefill)
            and sees keys `j <= L - N + i`. With an `attention_mask` both apply (the mask must encode causality
            itself when the cache is longer than the sequence, as transformers' masks do); `causal=True` lets the
            kernel skip the key tiles past the diagonal.
        attention_mask: None, or the mask transformers builds for sdpa (`masking_utils.sdpa_mask`): boolean
            (True = attend) or additive float, shape `(B or 1, 1 or H, N, >= L)` (extra key columns are ignored).
            A query row that attends nothing (left padding) gives 0 and zero gradients; so does a row whose additive
            mask is `finfo(float32).min` everywhere (it overflows to -inf on the kernel's log2 scale; eager would
            average V).
        cu_seqlens: packed variable-length batch (flash-attn style): `B == 1`, `N == L == cu_seqlens[-1]`, int32
            offsets `(S + 1,)` on the device; attention stays within each sequence (causal inside it when
            `causal=True`).
        max_seqlen: with `cu_seqlens`, at least the longest sequence; sizes the grid (computed when None, a
            device-to-host read).
        path: `"auto"` uses the decoding kernel for a few queries (see `select_path`); `"prefill"` or `"decode"`
            force one.
        atomic_dq: backward dQ by fp32 atomics instead of a separate recompute kernel; None uses `ATOMIC_DQ`.

    Returns:
        `(B, N, H, 2d)` in `query`'s dtype. Autograd gives gradients for query, key, value and lam, whichever path
        ran the forward.

    Raises:
        RuntimeError: triton is not installed.
        ValueError: shapes, dtypes or devices that do not fit together.

    Example:
        ```python
        from diff_transformer import kernels
        if kernels.is_available(query.device):
            out = kernels.triton_v1_attention(query, key, value, lam, scaling=d**-0.5)  # (B, N, H, 2d)
        ```
    """
    if not isinstance(lam, torch.Tensor):
        lam = torch.tensor(float(lam))
    if not triton_available():
        raise RuntimeError(
            "triton_v1_attention needs triton (pip install triton); check "
            "diff_transformer.kernels.is_available() before calling it"
        )
    _validate(query, key, value, lam, attention_mask, cu_seqlens, path)
    B, _, N, _ = query.shape
    L = key.shape[2]
    if attention_mask is not None:
        attention_mask = attention_mask[..., :L]
        if attention_mask.dtype not in (torch.bool, torch.float32, torch.float16, torch.bfloat16):
            attention_mask = attention_mask.to(torch.float32)
    if cu_seqlens is not None:
        longest = _check_cu_seqlens(cu_seqlens, N)
        cu_seqlens = cu_seqlens.to(dtype=torch.int32)
        if max_seqlen is None:
            max_seqlen = longest
        elif not longest <= max_seqlen:
            raise ValueError(
                f"triton_v1_attention: max_seqlen {max_seqlen} is below the longest packed sequence ({longest})"
            )
    # The kernels need unit column stride and int32 offsets inside one head's (rows, d) slice.
    query, key, value = (
        t if t.stride(-1) == 1 and t.stride(2) * t.shape[2] < 2**31 else t.contiguous() for t in (query, key, value)
    )
    lam32 = lam.reshape(1).to(device=query.device, dtype=torch.float32)  # autograd carries dλ back to lam's dtype
    if path == "auto":
        path = select_path(N, query.shape[1] // 2, key.shape[1] // 2, packed=cu_seqlens is not None)
    problem = _Problem(query, key, value, scaling, causal, attention_mask, cu_seqlens, max_seqlen)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value, lam32))
    atomic = ATOMIC_DQ if atomic_dq is None else bool(atomic_dq)
    if query.device.type == "cuda":
        with torch.cuda.device(query.device):
            return _TritonV1Attention.apply(query, key, value, lam32, problem, path, needs_grad, atomic)
    return _TritonV1Attention.apply(query, key, value, lam32, problem, path, needs_grad, atomic)


def _check_cu_seqlens(cu_seqlens: torch.Tensor, n: int) -> int:
    """The longest sequence, once `cu_seqlens` is known to be offsets the kernels may index with: 0, non-decreasing,
    ending at N. Anything else would read and write outside the packed rows (on a GPU: out-of-bounds accesses) or
    leave output rows unwritten. One device-to-host read, the same one computing max_seqlen costs."""
    offsets = cu_seqlens.tolist()
    if offsets[0] != 0 or offsets[-1] != n or any(b < a for a, b in zip(offsets, offsets[1:], strict=False)):
        shown = offsets if len(offsets) <= 8 else [*offsets[:4], "...", *offsets[-2:]]
        raise ValueError(
            f"triton_v1_attention: cu_seqlens {shown} must start at 0, never decrease and end at N={n} (the "
            "packed length): the offsets of each sequence's first token, then the total."
        )
    return max(b - a for a, b in zip(offsets, offsets[1:], strict=False))


def _validate(query, key, value, lam, attention_mask, cu_seqlens, path):
    def fail(message):
        raise ValueError(f"triton_v1_attention: {message}")

    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        fail(
            f"query, key and value must be 4-D (B, 2H, N, d), (B, 2H_kv, L, d), (B, 2H_kv, L, d); got "
            f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
        )
    B, H2, N, d = query.shape
    if key.shape != value.shape:
        fail(
            f"value must have key's shape (B, 2H_kv, L, d): its two d-wide halves as 2 H_kv heads; got key "
            f"{tuple(key.shape)}, value {tuple(value.shape)}"
        )
    if key.shape[0] != B or key.shape[3] != d:
        fail(f"key must be (B={B}, 2H_kv, L, d={d}); got {tuple(key.shape)}")
    if H2 % 2 or key.shape[1] % 2:
        fail(f"query and key need an even head count ([q1 | q2], [k1 | k2]); got {H2} and {key.shape[1]}")
    H, H_kv = H2 // 2, key.shape[1] // 2
    if H_kv == 0 or H % H_kv:
        fail(f"the H={H} differential heads must be a multiple of the H_kv={H_kv} KV groups")
    if key.shape[2] == 0 or N == 0:
        fail("query and key need at least one position")
    if query.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        fail(f"dtype must be float32, float16 or bfloat16; got {query.dtype}")
    if key.dtype != query.dtype or value.dtype != query.dtype:
        fail(f"query, key and value must share one dtype; got {query.dtype}, {key.dtype}, {value.dtype}")
    if key.device != query.device or value.device != query.device:
        fail(f"query, key and value must be on one device; got {query.device}, {key.device}, {value.device}")
    if query.device.type not in ("cuda", "cpu"):
        fail(f"runs on CUDA tensors (CPU tensors use the slow Triton interpreter); got {query.device.type}")
    if lam.numel() != 1:
        fail(f"lam must hold one value (λ); got shape {tuple(lam.shape)}")
    if d > 256:
        fail(f"head_dim {d} > 256 is not supported")
    if N * H * 2 * d >= 2**31 or key.shape[2] * d >= 2**31:
        fail(f"N·H·2d = {N * H * 2 * d} and L·d = {key.shape[2] * d} must stay below 2^31 (int32 offsets in a head)")
    if path not in ("auto", "prefill", "decode"):
        fail(f"path must be 'auto', 'prefill' or 'decode'; got {path!r}")
    if attention_mask is not None:
        if cu_seqlens is not None:
            fail("pass either attention_mask or cu_seqlens (packed sequences need no mask), not both")
        m = attention_mask
        if (
            m.dim() != 4
            or m.shape[0] not in (1, B)
            or m.shape[1] not in (1, H)
            or m.shape[2] != N
            or m.shape[3] < key.shape[2]
        ):
            fail(
                f"attention_mask must be (B or 1, 1 or H, N, >= L) = ({B}, 1, {N}, {key.shape[2]}); "
                f"got {tuple(m.shape)}"
            )
        if m.device != query.device:
            fail(f"attention_mask is on {m.device}, the inputs on {query.device}")
        if m.dtype != torch.bool and not m.is_floating_point():
            fail(
                f"attention_mask has dtype {m.dtype}: pass a bool mask (True = attend; mask.bool() for a 0/1 mask) or "
                "an additive float mask, as scaled_dot_product_attention requires"
            )
    if cu_seqlens is not None:
        if B != 1 or N != key.shape[2]:
            fail(f"cu_seqlens packs sequences into one batch row with N == L; got B={B}, N={N}, L={key.shape[2]}")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            fail(f"cu_seqlens must be 1-D (number of sequences + 1,); got shape {tuple(cu_seqlens.shape)}")
        if cu_seqlens.dtype not in (torch.int32, torch.int64):
            fail(f"cu_seqlens must be int32 or int64 offsets; got {cu_seqlens.dtype}")
        if cu_seqlens.device != query.device:
            fail(f"cu_seqlens is on {cu_seqlens.device}, the inputs on {query.device}: move it there")
        if path == "decode":
            fail("path='decode' does not take cu_seqlens; use 'auto' or 'prefill'")
    if path == "decode" and (H // H_kv) * N > 2 * _DECODE_MAX_ROWS:
        fail(
            f"path='decode' runs at most {2 * _DECODE_MAX_ROWS} query rows per KV group ((H / H_kv)·N = "
            f"{(H // H_kv) * N}); use 'auto' or 'prefill'"
        )
