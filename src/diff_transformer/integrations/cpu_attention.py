"""Differential attention on CPU: the package's differential attention functions for `attn_implementation="sdpa"`
(transformers' default) and `"diff_map_first"`, registered with transformers' `AttentionInterface` under the keys
the model file asks for (`modeling_diff.differential_attention_function`: `"differential:sdpa:cpu"`, for CPU only,
and `"differential:diff_map_first"`).

A Diff layer calls such a function once, with both maps' queries and keys and its λ (`differential_lambda`):

* V1: query (B, 2H, N, d) = [q1 | q2], key (B, 2H_kv, L, d) = [k1 | k2], value (B, 2H_kv, L, d) = v's two halves,
  λ a () fp32 scalar -> (B, N, H, 2d);
* V2: query (B, 2H, N, d) (heads 2h, 2h+1 a pair), key and value (B, H_kv, L, d), λ (B, N, H) -> (B, N, H, d).

It returns `(output, None)`, or None where none of its strategies applies (another device, a paged cache, ...): the
layer then attends through the backend's plain calls, exactly as Hub custom code without this package does. So the
checkpoint's code holds the model only, and every speed-up below ships with the package (docs/design.md, "V1's
backend strategy"):

* `BLOCKED_DIFF_MAP` (both versions; V2 in train mode, or in eval mode under "diff_map_first"): sdpa on CPU in fp32,
  plain causal self-attention (no mask, no cached prefix): per block of queries, both maps' scores, softmax, the
  differential map A1 - λ A2, one product with V; `BlockedDifferentialAttention`'s backward recomputes each block.
  Under bf16 autocast (q, k fp32 after RoPE, V bf16) it casts V and λ up and computes in fp32 too.
* `DECODE_DIFF_MAP` (V1): one query per sequence without a mask: both maps' scores over the cache in one product,
  softmax, A1 - λ A2, one product with V's two halves as they sit in the cache.
* `PADDED_WIDE_VALUE` (V1): elsewhere on CPU (a mask, bf16, a cached prefix): one sdpa call per map with V 2d wide and
  q, k zero-padded to 2d, so PyTorch's fused CPU kernel (equal head sizes only) runs instead of the math kernel that
  materialises every (N, L) map. Zero columns leave q kᵀ unchanged; the scale is passed explicitly.
"""

import enum

import torch
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward


class CpuStrategy(enum.Enum):
    """How the CPU function computes `(A1 - λ A2) V` (module docstring)."""

    BLOCKED_DIFF_MAP = "per block of queries: both maps, A1 - λ A2, one product with V"
    DECODE_DIFF_MAP = "one query: both maps, A1 - λ A2, one product with V's halves"
    PADDED_WIDE_VALUE = "one sdpa call per map, V 2d wide, q and k zero-padded to 2d"


# Tuned on a 2-core CPU with benchmarks/profile_attention.py and bench_model.py (docs/performance.md has the figures).
BLOCKED_SCORE_BUDGET = 1 << 24  # scores one map's block may hold (fp32: 64 MiB); rows per block shrink to fit
BLOCKED_ROWS = 128  # V1's queries per block
V2_ROWS = 64  # V2's blocks hold its 2H/H_kv query heads per key/value head
V2_BLOCK_SCORES = 1 << 20  # V2 blocked while a key/value head's block holds this many scores, else the fused call
BLOCKED_MIN_ROWS = 16  # below this a block is too thin for GEMM


def blocked_rows(batch_heads: int, key_length: int, rows: int = BLOCKED_ROWS) -> int:
    """Queries per block of `blocked_differential_attention`: at most `rows`, and B·H differential heads over
    `key_length` keys, one map's block of scores within the budget."""
    return min(rows, BLOCKED_SCORE_BUDGET // max(1, batch_heads * key_length))


def on_cpu_in_fp32(query: torch.Tensor) -> bool:
    return query.device.type == "cpu" and query.dtype == torch.float32


def blocked_applies(query: torch.Tensor, attention_mask, key_length: int, causal: bool, rows: int) -> bool:
    """Whether `blocked_differential_attention` replaces the sdpa call: CPU in fp32, plain causal self-attention (no
    mask, no cached prefix: sdpa's `is_causal`) and, under the score budget, at least `BLOCKED_MIN_ROWS` rows per
    block. `query` (B, 2H, N, d); `rows` the version's rows per block."""
    N, heads = query.shape[2], query.shape[0] * query.shape[1] // 2  # B·H differential heads
    plain_causal = causal and attention_mask is None and key_length == N
    return on_cpu_in_fp32(query) and plain_causal and blocked_rows(heads, N, rows) >= BLOCKED_MIN_ROWS


def select_cpu_strategy(
    query: torch.Tensor,
    key: torch.Tensor,
    attention_mask: torch.Tensor | None,
    differential_lambda: torch.Tensor,
    causal: bool = True,
    training: bool = False,
    dropout: float = 0.0,
    map_first: bool = False,
) -> CpuStrategy | None:
    """The one place that decides how the CPU function attends, or None (the layer's plain calls). `query`
    (B, 2H, N, d), `key` (B, ·, L, d), λ () for V1 or (B, N, H) for V2; `training` the module's mode, `map_first`
    V2's eval-mode opt-in ("diff_map_first")."""
    if query.device.type != "cpu":
        return None
    N, L = query.shape[2], key.shape[2]
    if differential_lambda.dim() == 0:  # V1
        if N == 1 and attention_mask is None and on_cpu_in_fp32(query):
            return CpuStrategy.DECODE_DIFF_MAP
        if N == 1:  # the plain calls attend on the cache's halves as they sit (no 2d-wide copy per step)
            return None
        if blocked_applies(query, attention_mask, L, causal, BLOCKED_ROWS):
            return CpuStrategy.BLOCKED_DIFF_MAP
        return CpuStrategy.PADDED_WIDE_VALUE
    # V2: by default the fused call stays in eval mode: through it a converted V2 computes its Llama's logits to the
    # last bit (tests/evaluation/test_lm_eval.py), which the blocked products, summed in another order, do not.
    if (training and dropout) or not (training or map_first):
        return None
    if query.shape[1] // key.shape[1] * L * V2_ROWS > V2_BLOCK_SCORES:  # 2H/H_kv query heads per key/value head
        return None
    return CpuStrategy.BLOCKED_DIFF_MAP if blocked_applies(query, attention_mask, L, causal, V2_ROWS) else None


def cpu_differential_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    differential_lambda: torch.Tensor,
    dropout: float = 0.0,
    is_causal: bool | None = None,
    map_first: bool = False,
    **kwargs,
) -> tuple[torch.Tensor, None] | None:
    """The differential attention function of "sdpa" (module docstring for the shapes), or None."""
    causal = getattr(module, "is_causal", True) and is_causal is not False
    strategy = select_cpu_strategy(
        query, key, attention_mask, differential_lambda, causal, module.training, dropout, map_first
    )
    if strategy is None:
        return None
    lam = differential_lambda
    if lam.dim():  # V2: query heads (2h, 2h+1) over key/value head h // g, one key tensor for both maps
        B, H, N, H_kv, d = query.shape[0], query.shape[1] // 2, query.shape[2], key.shape[1], query.shape[3]
        grouped = query.view(B, H_kv, H // H_kv, 2, N, d).transpose(2, 3)  # (B, H_kv, 2, g, N, d): q_2h, q_2h+1
        keys = key.contiguous().unsqueeze(2).expand(B, H_kv, 2, N, d)  # (B, H_kv, 2, N, d): both maps, one tensor
        rows = blocked_rows(B * H, N, V2_ROWS)
        return blocked_differential_attention(grouped, keys, value.contiguous(), lam, scaling, rows), None
    B, H, N, d = query.shape[0], query.shape[1] // 2, query.shape[2], query.shape[3]
    H_kv, L = key.shape[1] // 2, key.shape[2]
    queries = query.view(B, 2, H, N, d)  # [q1 | q2] of every head
    keys = key.view(B, 2, H_kv, L, d)  # [k1 | k2] of every group
    values = value.view(B, 2, H_kv, L, d)  # [first | second] d-wide half of v_g
    if strategy is CpuStrategy.DECODE_DIFF_MAP:
        return decode_differential_attention(queries, keys, values, lam, scaling), None
    wide_value = torch.cat((values[:, 0], values[:, 1]), dim=-1)  # (B, H_kv, L, 2d)
    if strategy is CpuStrategy.BLOCKED_DIFF_MAP:
        grouped = queries.view(B, 2, H_kv, H // H_kv, N, d).transpose(1, 2)  # (B, H_kv, 2, g, N, d)
        rows = blocked_rows(B * H, N)
        return blocked_differential_attention(
            grouped, keys.transpose(1, 2).contiguous(), wide_value, lam, scaling, rows
        ), None
    outputs = []
    for c in (0, 1):  # PADDED_WIDE_VALUE
        query_c = nn.functional.pad(queries[:, c], (0, d))  # (B, H, N, 2d)
        key_c = nn.functional.pad(keys[:, c], (0, d))  # (B, H_kv, L, 2d)
        output_c, _ = sdpa_attention_forward(
            module, query_c, key_c, wide_value, attention_mask, dropout=0.0, scaling=scaling, is_causal=is_causal
        )  # (B, N, H, 2d)
        outputs.append(output_c)
    return outputs[0] - lam.to(outputs[0].dtype) * outputs[1], None  # (B, N, H, 2d)


def map_first_differential_attention(*args, **kwargs):
    """The differential attention function of "diff_map_first": "sdpa"'s, with V2's map formed first in eval mode
    too (prefill 2-11% faster on CPU; logits differ from the fused call's in the last bits, so a fresh conversion no
    longer reproduces its Llama's logits exactly)."""
    return cpu_differential_attention(*args, **kwargs, map_first=True)


def decode_differential_attention(queries, keys, values, lam, scaling: float) -> torch.Tensor:
    """(A1 - λ A2) V for one query per sequence over every cached key: queries (B, 2, H, 1, d), keys and values
    (B, 2, H_kv, L, d) (the cache as it sits: [k1 | k2], V's two halves), λ (); returns (B, 1, H, 2d)."""
    B, _, H, _, d = queries.shape
    H_kv = keys.shape[2]
    grouped = queries.view(B, 2, H_kv, H // H_kv, d)  # (B, 2, H_kv, g, d): head h reads key head h // g
    maps = torch.softmax(torch.matmul(grouped * scaling, keys.transpose(-1, -2)), dim=-1)  # (B, 2, H_kv, g, L)
    differential = torch.addcmul(maps[:, 0], maps[:, 1], lam.to(maps.dtype), value=-1)  # (B, H_kv, g, L)
    halves = torch.matmul(differential.unsqueeze(1), values)  # (B, 2, H_kv, g, d): the map times each V half
    return halves.permute(0, 2, 3, 1, 4).reshape(B, 1, H, 2 * d)  # (B, 1, H, 2d): [first | second] half


def _block_maps(grouped, keys, i0: int, i1: int, above_diagonal) -> tuple[torch.Tensor, torch.Tensor]:
    """A1 and A2 for query rows [i0, i1) over keys [0, i1), (B, H_kv, 2, g·n, i1), and the query blocks they came
    from, (B, H_kv, 2, g·n, d); grouped (B, H_kv, 2, g, N, d) holds the scaled queries, keys (B, H_kv, 2, N, d)."""
    B, H_kv, _, groups, _, d = grouped.shape
    n = i1 - i0
    blocks = grouped[..., i0:i1, :].reshape(B, H_kv, 2, groups * n, d)  # (B, H_kv, 2, g·n, d)
    if keys.stride(2) == 0:  # V2: both maps over one key tensor: one product with twice the rows
        scores = torch.matmul(blocks.reshape(B, H_kv, 2 * groups * n, d), keys[:, :, 0, :i1].transpose(-1, -2))
    else:
        scores = torch.matmul(blocks, keys[:, :, :, :i1].transpose(-1, -2))  # (B, H_kv, 2, g·n, i1)
    scores.view(B, H_kv, 2 * groups, n, i1)[..., i0:i1].add_(above_diagonal[:n, :n])
    scores = scores.view(B, H_kv, 2, groups * n, i1)
    return torch.softmax(scores, dim=-1, out=scores), blocks  # in place: one block of scores per map held, not two


def _block_lambda(lam: torch.Tensor, i0: int, i1: int) -> torch.Tensor:
    """λ for query rows [i0, i1): V1's () scalar as is, V2's per-row λ (B, H_kv, g, N, 1) as (B, H_kv, g·n, 1)."""
    if lam.dim() == 0:
        return lam
    return lam[:, :, :, i0:i1].reshape(lam.shape[0], lam.shape[1], -1, 1)  # (B, H_kv, g·n, 1)


class BlockedDifferentialAttention(torch.autograd.Function):
    """(A1 - λ A2) V block of query rows by block, forward and backward (`blocked_differential_attention`). Nothing
    of size (N, L) is kept: the backward recomputes each block's maps, as flash attention's does."""

    # Under autocast the layer hands over fp32 q, k (RoPE's fp32 cos/sin) with a bf16 V (and V2's λ); the function
    # computes in fp32, as outside autocast: its inputs are cast up (exactly) and both passes run with autocast off,
    # so the backward's products meet one dtype. Relies on torch.amp.custom_fwd/custom_bwd (PyTorch's recipe for a
    # custom Function under autocast); guarded by test_blocked_under_autocast_computes_in_fp32
    # (tests/model/test_cpu_attention.py) and the training option matrix (tests/training/test_numerics.py).
    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx, grouped, keys, wide_value, lam, rows: int):
        """grouped (B, H_kv, 2, g, N, d) scaled queries, keys (B, H_kv, 2, N, d), wide_value (B, H_kv, N, dv),
        lam () (V1) or (B, H_kv, g, N, 1) (V2: per query row) -> (B, H_kv, g, N, dv)."""
        B, H_kv, _, groups, N, _ = grouped.shape
        above_diagonal = torch.full((rows, rows), float("-inf"), device=grouped.device).triu_(1)  # (rows, rows)
        out = wide_value.new_empty(B, H_kv, groups, N, wide_value.shape[-1])  # (B, H_kv, g, N, dv)
        for i0 in range(0, N, rows):
            i1 = min(N, i0 + rows)
            first, second = _block_maps(grouped, keys, i0, i1, above_diagonal)[0].unbind(2)  # (B, H_kv, g·n, i1)
            differential = first.addcmul_(second, -_block_lambda(lam, i0, i1))  # A1 - λ A2
            out[:, :, :, i0:i1] = torch.matmul(differential, wide_value[:, :, :i1]).view(B, H_kv, groups, i1 - i0, -1)
        ctx.save_for_backward(grouped, keys, wide_value, lam)
        ctx.above_diagonal = above_diagonal
        return out

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        grouped, keys, wide_value, lam = ctx.saved_tensors
        B, H_kv, _, groups, N, d = grouped.shape
        above_diagonal = ctx.above_diagonal  # (rows, rows)
        rows = above_diagonal.shape[0]
        shared_keys = keys.stride(2) == 0  # V2: autograd sums grad_k over the expanded map dimension
        dense = torch.contiguous_format  # the in-place products below view (B, H_kv) as one batch dimension
        grad_q, grad_k = torch.zeros_like(grouped, memory_format=dense), torch.zeros_like(keys, memory_format=dense)
        grad_v, grad_lam = torch.zeros_like(wide_value, memory_format=dense), torch.zeros_like(lam)
        for i0 in range(0, N, rows):
            i1 = min(N, i0 + rows)
            n = i1 - i0
            maps, blocks = _block_maps(grouped, keys, i0, i1, above_diagonal)  # (B, H_kv, 2, g·n, i1 or d)
            first, second = maps.unbind(2)  # (B, H_kv, g·n, i1)
            lam_rows = _block_lambda(lam, i0, i1)  # () or (B, H_kv, g·n, 1)
            grad_block = grad_out[:, :, :, i0:i1].reshape(B, H_kv, groups * n, -1)  # (B, H_kv, g·n, dv)
            grad_map = torch.matmul(grad_block, wide_value[:, :, :i1].transpose(-1, -2))  # dO Vᵀ, (B, H_kv, g·n, i1)
            second_rowsum = (grad_map * second).sum(-1, keepdim=True)  # rowsum(dP ∘ A2) = -dλ per row
            if lam.dim() == 0:
                grad_lam -= second_rowsum.sum()
            else:
                grad_lam[:, :, :, i0:i1] = -second_rowsum.view(B, H_kv, groups, n, 1)
            differential = torch.addcmul(first, second, -lam_rows)  # A1 - λ A2
            # accumulated in place (beta = 1): (B·H_kv, i1, dv) += (A1 - λ A2)ᵀ dO
            grad_v[:, :, :i1].view(B * H_kv, i1, -1).baddbmm_(differential.flatten(0, 1).mT, grad_block.flatten(0, 1))
            # softmax's backward, dS = A ∘ (dA - rowsum(dA ∘ A)), in place: dA1 = dP, dA2 = -λ dP (λ constant per row)
            first.mul_(grad_map - (grad_map * first).sum(-1, keepdim=True))
            second.mul_(grad_map - second_rowsum).mul_(-lam_rows)
            if shared_keys:  # dQ = dS K, dK = dSᵀ Q, both maps in one product each
                grad_scores = maps.view(B, H_kv, 2 * groups * n, i1)
                grad_block_q = torch.matmul(grad_scores, keys[:, :, 0, :i1])  # (B, H_kv, 2g·n, d)
                grad_k[:, :, 0, :i1].view(B * H_kv, i1, d).baddbmm_(  # (B·H_kv, i1, d) += dSᵀ Q
                    grad_scores.flatten(0, 1).mT, blocks.reshape(B * H_kv, -1, d)
                )
            else:
                grad_block_q = torch.matmul(maps, keys[:, :, :, :i1])  # (B, H_kv, 2, g·n, d)
                grad_k[:, :, :, :i1].view(B * H_kv * 2, i1, d).baddbmm_(  # (B·H_kv·2, i1, d) += dSᵀ Q
                    maps.flatten(0, 2).mT, blocks.flatten(0, 2)
                )
            grad_q[..., i0:i1, :] = grad_block_q.view(B, H_kv, 2, groups, n, d)
        return grad_q, grad_k, grad_v, grad_lam, None


def blocked_differential_attention(
    grouped: torch.Tensor,
    keys: torch.Tensor,
    wide_value: torch.Tensor,
    lam: torch.Tensor,
    scaling: float,
    rows: int,
) -> torch.Tensor:
    """(A1 - λ A2) V for causal self-attention (N = L, no mask), block of queries by block (`blocked_applies`):
    V1's `BLOCKED_DIFF_MAP`, and V2 on the same terms.

    grouped (B, H_kv, 2, g, N, d): [q1 | q2] of the g differential heads reading each key/value head, keys
    (B, H_kv, 2, N, d): [k1 | k2] (V2: one key tensor expanded over both), wide_value (B, H_kv, N, dv) (V1: 2d wide,
    V2: d), lam () (V1) or (B, N, H) (V2: per token and head); returns (B, N, H, dv), head h = g·(its key/value
    head) + its index in the group. Rows [i0, i1) see keys [0, i1): the scores right of the diagonal are never
    formed."""
    B, H_kv, _, groups, N, d = grouped.shape
    if lam.dim():
        lam = lam.transpose(1, 2).reshape(B, H_kv, groups, N, 1)  # (B, H_kv, g, N, 1): one λ per query row
    out = BlockedDifferentialAttention.apply(grouped * scaling, keys, wide_value, lam, rows)  # (B, H_kv, g, N, dv)
    return out.view(B, H_kv * groups, N, -1).transpose(1, 2)  # (B, N, H, dv)
