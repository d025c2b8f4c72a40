"""Diff Transformer (differential attention) as a transformers model.

Two variants, selected by `config.diff_version` (docs/design.md has the exact math):

* V1 (Ye et al., ICLR 2025), `DiffAttentionV1`: head h computes `(softmax(q1 k1ᵀ) - λ softmax(q2 k2ᵀ)) v` with V of
  width 2d, then a per-head RMSNorm (`subln`) scaled by `1 - λ_init`; λ is one fp32 scalar per layer.
* V2 (Diff Transformer V2), `DiffAttentionV2`: 2H ordinary query heads share Llama's K/V; head h outputs
  `a_2h - sigmoid(W_λ x)_h a_2h+1`.

Both attend through the backends of `ALL_ATTENTION_FUNCTIONS` (eager, sdpa, flash, flex, paged), or through a
backend's differential attention function where one is registered (`differential_attention_function`). Module names
are Llama's, so Llama tooling (PEFT targets, TP plans, conversion scripts) applies unchanged. Only torch, transformers
and the sibling configuration are imported: this file is the checkpoints' Hub custom code, the model only.
"""

import copy
from collections import namedtuple
from collections.abc import Callable

import torch
from torch import nn
from transformers import initialization as init  # respects `_is_hf_initialized`: loaded weights are kept
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.integrations.eager_paged import eager_paged_attention_forward
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import (
    GenericForQuestionAnswering,
    GenericForSequenceClassification,
    GenericForTokenClassification,
    GradientCheckpointingLayer,
)
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel
from transformers.models.llama.modeling_llama import (
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    eager_attention_forward,
    repeat_kv,
    rotate_half,
)
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple
from transformers.utils.generic import is_flash_attention_requested, merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from .configuration_diff import POLY_NORM, DiffConfig


try:
    from transformers.modeling_utils import slice_logits_to_keep
except ImportError:  # transformers < 5.23 (vLLM's pins): the int / 1-D forms `generate` and Llama use

    def slice_logits_to_keep(hidden_states: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
        positions = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        return hidden_states[:, positions, :]


# ---- Layers ----


class DiffRMSNorm(LlamaRMSNorm):
    pass


class DiffScaledRMSNorm(DiffRMSNorm):
    """V1's subln: RMSNorm(x)·scale as one `F.rms_norm`, the scale in its weight (one fused CUDA kernel, not nine)."""

    def forward(self, hidden_states: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        weight = (self.weight * scale).to(hidden_states.dtype)  # autocast's fp32 weights: the activations' dtype
        return nn.functional.rms_norm(hidden_states, weight.shape, weight, self.variance_epsilon)


class DiffRotaryEmbedding(LlamaRotaryEmbedding):
    pass


class DiffPolyNorm(nn.Module):
    """Motif's PolyNorm activation (arXiv 2411.03884): w0 n(x³) + w1 n(x²) + w2 n(x) + b with n(u) = u / sqrt(mean(u²)
    + eps) over the last dimension (the whole intermediate width), computed in fp32. `hidden_act="poly_norm"`."""

    def __init__(self, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.full((3,), 1.0 / 3.0))  # (w0, w1, w2) for (x³, x², x)
        self.bias = nn.Parameter(torch.zeros(1))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32, weight, bias = x.float(), self.weight.float(), self.bias.float()
        cubic, square = x32.pow(3), x32.pow(2)
        out = weight[0] * self._norm(cubic) + weight[1] * self._norm(square) + weight[2] * self._norm(x32) + bias
        return out.to(x.dtype)

    def extra_repr(self) -> str:
        return f"eps={self.eps}"


# Mirrors transformers.models.llama.modeling_llama.LlamaMLP
# diff with Llama: `hidden_act="poly_norm"` (Motif's PolyNorm, a module with weights) besides transformers' ACT2FN
class DiffMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size
        self.intermediate_size = config.intermediate_size
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=config.mlp_bias)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=config.mlp_bias)
        self.act_fn = DiffPolyNorm() if config.hidden_act == POLY_NORM else ACT2FN[config.hidden_act]

    def forward(self, x):
        down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        return down_proj


def v1_lambda(lambda_q1, lambda_k1, lambda_q2, lambda_k2, lambda_init: float) -> torch.Tensor:
    """The paper's λ = exp(λq1·λk1) - exp(λq2·λk2) + λ_init, () fp32: the one place that computes it."""
    dot = lambda q, k: torch.dot(q.float(), k.float())  # noqa: E731
    return torch.exp(dot(lambda_q1, lambda_k1)) - torch.exp(dot(lambda_q2, lambda_k2)) + lambda_init


class DiffLambdaV1(nn.Module):
    """The paper's re-parameterised scalar: λ = exp(λq1·λk1) - exp(λq2·λk2) + λ_init, kept in fp32; with a floor m
    (`config.lambda_floor`), m + softplus₁₀₀(λ - m): λ stays above m, so the layer always subtracts."""

    def __init__(self, head_dim: int, lambda_init: float, lambda_floor: float | None = None):
        super().__init__()
        self.lambda_init, self.lambda_floor = lambda_init, lambda_floor
        self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2 = (
            nn.Parameter(torch.zeros(head_dim, dtype=torch.float32)) for _ in range(4)
        )

    def forward(self) -> torch.Tensor:
        lambda_full = v1_lambda(self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2, self.lambda_init)
        if self.lambda_floor is None:
            return lambda_full
        return self.lambda_floor + nn.functional.softplus(lambda_full - self.lambda_floor, beta=100.0)

    def extra_repr(self) -> str:
        floor = "" if self.lambda_floor is None else f", lambda_floor={self.lambda_floor:.4f}"
        return f"lambda_init={self.lambda_init:.4f}{floor}"


class DiffLambdaV2(nn.Module):
    """V2's per-token, per-head λ = sigmoid(W x)."""

    def __init__(self, hidden_size: int, num_heads: int):
        super().__init__()
        self.proj = nn.Linear(hidden_size, num_heads, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # The gate stays unquantized and, under fp16, in fp32 (`_keep_in_fp32_modules`): cast the input to its dtype.
        return torch.sigmoid(self.proj(hidden_states.to(self.proj.weight.dtype)))  # (B, N, H)


def _output_from_map(weights: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Eager: the output from the differential map (B, H, N, L) the layer returns, as Llama's eager attention from its
    weights, so `output_attentions` maps are on the gradient path."""
    value = repeat_kv(value, weights.shape[1] // value.shape[1])  # (B, H, L, dv)
    return torch.matmul(weights.to(value.dtype), value).transpose(1, 2)  # (B, N, H, dv)


# Mirrors transformers.models.llama.modeling_llama.LlamaAttention
# diff with Llama: 2H query heads of size d; K/V and o_proj widths set by the version; o_proj's own bias (Qwen2);
# q_norm/k_norm (Qwen3); the forward is each version's (DiffAttentionV1, DiffAttentionV2); not decorated with
# `use_kernelized_func` (the kernels hub's rotary)
class DiffAttention(nn.Module):
    """What both versions share: Llama's four projections (same names, so checkpoints, PEFT targets and TP plans
    carry over), the head geometry and the rotary scaling. `DiffAttentionV1` and `DiffAttentionV2` add the λ module
    and the forward; `DiffDecoderLayer` picks one by `config.diff_version`."""

    def __init__(self, config: DiffConfig, layer_idx: int, kv_width: int, output_width: int, query_width: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True

        hidden, bias = config.hidden_size, config.attention_bias
        out_bias = bias if config.attention_out_bias is None else config.attention_out_bias  # Qwen2: q/k/v only
        self.q_proj = nn.Linear(hidden, query_width, bias=bias)  # 2H query heads of size d (GDA: H + noise heads)
        self.k_proj = nn.Linear(hidden, kv_width, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_width, bias=bias)
        self.o_proj = nn.Linear(output_width, hidden, bias=out_bias)
        # Qwen3: RMSNorm over every d-wide query/key head before RoPE, one weight shared by all heads, so a source head
        # keeps its normalisation wherever the conversion puts it (V2: both heads of a pair; V1: q1/q2, k1/k2).
        self.q_norm = DiffRMSNorm(self.head_dim, eps=config.rms_norm_eps) if config.use_qk_norm else nn.Identity()
        self.k_norm = DiffRMSNorm(self.head_dim, eps=config.rms_norm_eps) if config.use_qk_norm else nn.Identity()


class DiffAttentionV2(DiffAttention):
    """V2: Llama attention with 2H query heads over Llama's K/V; head h outputs `a_2h - sigmoid(W_λ x)_h a_2h+1`.
    The forward is `LlamaAttention.forward` plus the differential step after the attention call."""

    def __init__(self, config: DiffConfig, layer_idx: int):
        H, H_kv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        super().__init__(config, layer_idx, kv_width=H_kv * d, output_width=H * d, query_width=2 * H * d)
        self.num_key_value_groups = 2 * H // H_kv  # 2H query heads share H_kv key/value heads
        self.diff_lambda = DiffLambdaV2(config.hidden_size, H)

    # Mirrors transformers.models.llama.modeling_llama.LlamaAttention.forward
    # diff with Llama: q_norm/k_norm; RoPE on q and k together; the differential step (a_2h - λ a_2h+1) after the call
    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(B, N, D) -> (B, N, D), and in eager mode the differential maps (B, H, N, L) (else None)."""
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)

        query_states = self.q_norm(self.q_proj(hidden_states).view(hidden_shape))  # (B, N, 2H, d)
        key_states = self.k_norm(self.k_proj(hidden_states).view(hidden_shape))  # (B, N, H_kv, d)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)  # (B, H_kv, N, d)

        cos, sin = position_embeddings  # RoPE on q and k at once: one cat, then Llama's five ops once, not twice each
        heads = torch.cat((query_states, key_states), dim=2)  # (B, N, 2H + H_kv, d)
        heads = heads * cos.unsqueeze(2) + rotate_half(heads) * sin.unsqueeze(2)  # Llama's arithmetic: its values
        query_states, key_states = heads.transpose(1, 2).split((query_states.shape[2], key_states.shape[2]), dim=1)

        if past_key_values is not None:
            key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)

        lam = self.diff_lambda(hidden_states)  # (B, N, H)
        differential = differential_attention_function(self.config._attn_implementation, hidden_states.device)
        if differential is not None:
            result = differential(
                self, query_states, key_states, value_states, attention_mask, scaling=self.scaling,
                dropout=0.0 if not self.training else self.attention_dropout, differential_lambda=lam, **kwargs,
            )  # fmt: skip
            if result is not None:  # (B, N, H, d): the differential output in one call
                return self.o_proj(result[0].reshape(*input_shape, -1)), result[1]

        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )

        attn_output, attn_weights = attention_interface(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            **kwargs,
        )  # (B, N, 2H, d)

        if attn_weights is not None:  # the differential maps A_2h - λ A_2h+1, (B, H, N, L)
            weights = attn_weights.view(input_shape[0], -1, 2, *attn_weights.shape[2:])  # (B, H, 2, N, L)
            attn_weights = weights[:, :, 0] - lam.transpose(1, 2).unsqueeze(-1).to(weights.dtype) * weights[:, :, 1]
        dropped = self.training and self.attention_dropout
        from_map = attention_capabilities(self.config._attn_implementation)[1].output_from_map
        if attn_weights is not None and from_map and not dropped:
            # Eager returns maps: compute the output from them (as Llama does), so they are on the gradient path.
            # With dropout, eager drops between its maps and its output, so the backend's output is kept.
            attn_output = _output_from_map(attn_weights, value_states)  # (B, N, H, d)
        else:
            pair = attn_output.view(*input_shape, -1, 2, self.head_dim)  # (B, N, H, 2, d): query heads (2h, 2h+1)
            attn_output = torch.addcmul(pair[..., 0, :], pair[..., 1, :], lam.unsqueeze(-1).to(pair.dtype), value=-1)

        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        attn_output = self.o_proj(attn_output)
        return attn_output, attn_weights


def v1_component_major(pairs: torch.Tensor) -> torch.Tensor:
    """V1's head layout, the one place that defines it (the forward and `diff_transformer.analysis` use it).

    q_proj's rows hold [q1 | q2] per differential head, k_proj's [k1 | k2] and v_proj's [first | second half] per
    key/value group (head-major, so tensor parallelism splits whole heads). Attention wants them component-major:
    (B, N, h, 2, d) -> (B, 2h, N, d) = [all x1 | all x2], so each map is a contiguous block of heads and a backend's
    ordinary GQA mapping pairs q_c of head h with k_c of its group."""
    B, N, h, _, d = pairs.shape
    return pairs.permute(0, 3, 2, 1, 4).reshape(B, 2 * h, N, d)  # (B, 2h, N, d)


def gda_pairs(groups: torch.Tensor) -> torch.Tensor:
    """Grouped differential attention's query layout (`config.num_noise_heads`), the one place that defines it: per
    noise group q_proj's rows hold r signal queries then the noise query (B, N, n, r + 1, d); signal head h = j·r + i
    gets its group's noise query as q2, so the (B, N, H, 2, d) pairs take V1's layout and every V1 path."""
    signal, noise = groups[..., :-1, :], groups[..., -1:, :]  # (B, N, n, r, d), (B, N, n, 1, d)
    return torch.stack((signal, noise.expand_as(signal)), dim=-2).flatten(2, 3)  # (B, N, H, 2, d)


def rotary_component_major(pairs: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on (B, N, h, 2, d) sub-heads, returned in `v1_component_major`'s layout (B, 2h, N, d): Llama's
    q·cos + rotate_half(q)·sin on a component-major view, summed in the order whose first operand is laid out
    component-major, so the sum is written there and the reorder costs no copy (the same values: addition commutes)."""
    B, N, h, _, d = pairs.shape
    heads = pairs.permute(0, 3, 2, 1, 4)  # (B, 2, h, N, d): a view
    cos, sin = cos[:, None, None], sin[:, None, None]  # (B, 1, 1, N, d)
    return (rotate_half(heads) * sin + heads * cos).reshape(B, 2 * h, N, d)  # (B, 2h, N, d)


def differential_attention_function(implementation: str, device: torch.device | None = None) -> Callable | None:
    """The function registered in `AttentionInterface` as `"differential:<implementation>:<device.type>"` (for one
    kind of device) or else `"differential:<implementation>"`, or None (the backend's plain calls).
    `f(module, query, key, value, attention_mask, scaling=, differential_lambda=λ, **kwargs)` returns
    `((A1 - λ A2) V, None)`, or None where it does not apply. V1: query (B, 2H, N, d) = [q1 | q2], key/value
    (B, 2H_kv, L, d), λ () -> (B, N, H, 2d); V2: key/value (B, H_kv, L, d), λ (B, N, H) -> (B, N, H, d)."""
    key = f"differential:{implementation}"
    return ALL_ATTENTION_FUNCTIONS.get(f"{key}:{device.type}" if device else key) or ALL_ATTENTION_FUNCTIONS.get(key)


# What an attention function can do beyond sdpa's calls (docs/design.md): its `differential_capabilities`, else
# transformers' own below, else flash kernels' by `is_flash_attention_requested`, else sdpa's. No name is tested here.
AttentionCapabilities = namedtuple("AttentionCapabilities", "split_calls returns_maps output_from_map after_paged")
TRANSFORMERS_FUNCTION_CAPABILITIES = {
    eager_attention_forward: AttentionCapabilities(False, True, True, None),
    eager_paged_attention_forward: AttentionCapabilities(False, True, False, eager_attention_forward),
}


def attention_capabilities(implementation: str) -> tuple[Callable, AttentionCapabilities]:
    """The function `AttentionInterface` holds for `implementation` (eager's if none) and what it can do."""
    function = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager_attention_forward)
    known = getattr(function, "differential_capabilities", None) or TRANSFORMERS_FUNCTION_CAPABILITIES.get(function)
    flash = is_flash_attention_requested(requested_attention_implementation=implementation)
    return function, known or AttentionCapabilities(flash, False, False, None)


def v1_attention_forward(
    module: nn.Module,
    attention_interface: Callable,
    capabilities: AttentionCapabilities,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    lam: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(A1 - λ A2) V (B, N, H, 2d) through a backend's plain calls, and the map A1 - λ A2 where it returns maps.
    query (B, 2H, N, d) = [q1 | q2], key (B, 2H_kv, L, d) = [k1 | k2], value (B, 2H_kv, L, d) = v's halves (uncached:
    v_proj's (B, L, H_kv, 2, d)), λ () fp32. One call for both maps with V 2d wide, or one per map and V half where
    the function needs `split_calls` (flash kernels), or decoding one token without maps (it reads the cache's halves
    in place). `output_from_map` (eager): the output from the map, as Llama's."""
    halves = value.transpose(1, 2) if value.dim() == 5 else value.unflatten(1, (2, -1)).permute(0, 2, 3, 1, 4)
    B, H_kv, L, _, d = halves.shape  # (B, H_kv, L, 2, d): a view; the paged cache packs all sequences in one row

    def attend(query, key, value):  # one standard call: (B, N, heads, width of value), map or None
        return attention_interface(
            module, query, key, value, attention_mask, dropout=0.0, scaling=module.scaling, **kwargs
        )

    if capabilities.split_calls or (
        query.shape[2] == 1 and not capabilities.returns_maps
    ):  # unbind, not indexing: its backward is one stack, each index's a zero-filled copy
        queries, keys = query.unflatten(1, (2, -1)).unbind(1), key.unflatten(1, (2, -1)).unbind(1)  # per map
        values = halves.unbind(3)  # (B, H_kv, L, d) per half
        outputs = [  # per map c: (B, N, H, 2d)
            torch.cat([attend(queries[c], keys[c], values[v])[0] for v in (0, 1)], dim=-1) for c in (0, 1)
        ]
        return torch.addcmul(outputs[0], outputs[1], lam, value=-1), None  # (B, N, H, 2d)

    # Both maps in one call, as V2 makes: 2H query heads [q1 | q2] over 2H_kv key heads [k1 | k2], each group's 2d-wide
    # v_g on both sides, so the backend's GQA mapping pairs q_c of head h with k_c and v_g of its group.
    wide = halves.unsqueeze(1).expand(B, 2, H_kv, L, 2, d)  # (B, 2, H_kv, L, 2, d): a view
    output, maps = attend(query, key, wide.reshape(B, 2 * H_kv, L, 2 * d))  # (B, N, 2H, 2d), (B, 2H, N, L)
    first, second = output.unflatten(2, (2, -1)).unbind(2)  # (B, N, H, 2d) each
    attn_weights = None
    if maps is not None:
        first_map, second_map = maps.unflatten(1, (2, -1)).unbind(1)  # (B, H, N, L) each
        attn_weights = first_map - lam.to(maps.dtype) * second_map  # (B, H, N, L)
        if capabilities.output_from_map:
            return _output_from_map(attn_weights, halves.flatten(-2)), attn_weights  # (B, N, H, 2d)
    return torch.addcmul(first, second, lam, value=-1), attn_weights  # (B, N, H, 2d): a () λ keeps its dtype


class DiffAttentionV1(DiffAttention):
    """V1 (the paper): head h computes `RMSNorm((A1 - λ A2) V) (1 - λ_init)`, A_c = softmax(q_c k_cᵀ / √d), V 2d wide.

    The forward is `LlamaAttention.forward` with V1's head layout (`v1_component_major`) and the differential step in
    place of the attention call: the backend's differential attention function where one is registered
    (`differential_attention_function`), else its plain calls (`v1_attention_forward`). V is cached as 2 H_kv heads
    of size d (its two halves), so every cache (dynamic, static, paged) holds what a Llama with 2 H_kv key/value heads
    of size d holds.
    """

    def __init__(self, config: DiffConfig, layer_idx: int):
        H, H_kv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        # GDA (`num_noise_heads`): per noise group, r = H / num_noise_heads signal queries then one noise query
        self.num_noise_heads = config.num_noise_heads
        query_heads = 2 * H if self.num_noise_heads is None else H + self.num_noise_heads
        super().__init__(config, layer_idx, kv_width=2 * H_kv * d, output_width=2 * H * d, query_width=query_heads * d)
        self.num_key_value_groups = H // H_kv  # each call attends H query heads over H_kv key heads
        self.lambda_init = config.lambda_init_for_layer(layer_idx)
        self.diff_lambda = DiffLambdaV1(d, self.lambda_init, config.lambda_floor)
        subln_eps = config.rms_norm_eps if config.subln_eps is None else config.subln_eps
        self.subln = DiffScaledRMSNorm(2 * d, eps=subln_eps)  # times 1 - λ_init in the forward

    # Mirrors transformers.models.llama.modeling_llama.LlamaAttention.forward
    # diff with Llama: V1's head layout (v1_component_major), a paged cache written once, v1_attention_forward, subln
    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(B, N, D) -> (B, N, D), and in eager mode the differential maps (B, H, N, L) (else None)."""
        B, N, _ = hidden_states.shape
        pair_shape = (B, N, -1, 2, self.head_dim)  # head counts from the tensors: a tensor-parallel shard's own

        if self.num_noise_heads is None:
            query = self.q_norm(self.q_proj(hidden_states).view(pair_shape))  # (B, N, H, 2, d)
        else:  # GDA: (B, N, n, r + 1, d), r signal queries and the noise query of each noise group
            group_shape = (B, N, -1, self.num_heads // self.num_noise_heads + 1, self.head_dim)
            query = gda_pairs(self.q_norm(self.q_proj(hidden_states).view(group_shape)))  # (B, N, H, 2, d)
        key = self.k_norm(self.k_proj(hidden_states).view(pair_shape))  # (B, N, H_kv, 2, d)
        value = self.v_proj(hidden_states).view(pair_shape)  # (B, N, H_kv, 2, d): v_g's two d-wide halves

        cos, sin = position_embeddings
        query = rotary_component_major(query, cos, sin)  # (B, 2H, N, d): [q1 | q2]
        key = rotary_component_major(key, cos, sin)  # (B, 2H_kv, N, d): [k1 | k2]

        implementation = self.config._attn_implementation
        attention_interface, capabilities = attention_capabilities(implementation)
        # Relies on: continuous batching passing its `PagedAttentionCache` as kwarg `cache` to the paged functions,
        # which update it on every call; V1 calls twice or more, so it writes once here. Guarded by
        # test_continuous_batching_matches_generate (tests/model/test_generation.py, tests/cli/test_serving.py).
        paged_cache = kwargs.pop("cache", None)
        differential = differential_attention_function(implementation, query.device) if paged_cache is None else None
        if paged_cache is not None or past_key_values is not None or differential is not None:
            value = v1_component_major(value)  # (B, 2H_kv, N, d): what caches hold and differential functions take
        if paged_cache is not None:
            key, value = paged_cache.update(key, value, self.layer_idx, kwargs)  # kwargs: updated in place
            attention_interface = capabilities.after_paged or attention_interface
        elif past_key_values is not None:
            key, value = past_key_values.update(key, value, self.layer_idx)
        lam = self.generation_lambda(past_key_values, N)  # () fp32
        args = (self, query, key, value, attention_mask)
        result = differential(*args, scaling=self.scaling, differential_lambda=lam, **kwargs) if differential else None
        if result is None:  # the backend's plain calls, else (B, N, H, 2d): the differential output in one call
            plain = (attention_interface, capabilities)
            result = v1_attention_forward(self, *plain, query, key, value, lam, attention_mask, **kwargs)
        attn_output, attn_weights = result  # (B, N, H, 2d), (B, H, N, L) or None

        attn_output = self.subln(attn_output, 1.0 - self.lambda_init)  # (B, N, H, 2d): RMSNorm·(1 - λ_init)
        attn_output = self.o_proj(attn_output.reshape(B, N, -1))
        return attn_output, attn_weights

    def generation_lambda(self, past_key_values: Cache | None, query_length: int) -> torch.Tensor:
        """λ, () fp32. Without gradients, a cache carries each layer's λ from the step that computed it (a prefill), so
        a decoding step (one query) skips λ's ops while λ's vectors are the same tensors at the same versions."""
        if past_key_values is None or torch.is_grad_enabled() or torch.compiler.is_compiling():
            return self.diff_lambda()
        vectors = tuple((p.data_ptr(), p._version) for p in self.diff_lambda.parameters())
        carried = vars(past_key_values).setdefault("_diff_lambda", {})  # layer -> (λ's vectors, λ)
        if query_length > 1 or carried.get(self.layer_idx, (None,))[0] != vectors:
            carried[self.layer_idx] = (vectors, self.diff_lambda())
        return carried[self.layer_idx][1]


DIFF_ATTENTION_CLASSES = {1: DiffAttentionV1, 2: DiffAttentionV2}


# Mirrors transformers.models.llama.modeling_llama.LlamaDecoderLayer
# diff with Llama: the attention class by `config.diff_version`
class DiffDecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: DiffConfig, layer_idx: int):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.self_attn = DIFF_ATTENTION_CLASSES[config.diff_version](config=config, layer_idx=layer_idx)
        self.mlp = DiffMLP(config)
        self.input_layernorm = DiffRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = DiffRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(
            hidden_states=hidden_states,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        hidden_states = residual + hidden_states

        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = residual + hidden_states
        return hidden_states


# ---- Integration hooks ----
# Every place where this model overrides or patches a transformers internal beyond the standard model-file API. Each
# hook names the internal it relies on and the test that fails if that internal changes under it. The mixins come first
# in the model classes' bases, so their methods wrap transformers' with `super()`.


class _PreTrainedModelHooks:
    """Hooks of every Diff model class (mixed into `DiffPreTrainedModel`)."""

    @classmethod
    def maybe_distribute_model(cls, model, distributed_config, mesh_manager):
        # Relies on: `PreTrainedModel.from_pretrained` calling `maybe_distribute_model` before it shards the weights
        # over the tensor-parallel mesh. An uneven colwise split would cut a differential head (or V1's k1/k2 pair) in
        # half and fail later with an opaque reshape error, so the sizes are checked here. Guarded by
        # tests/distributed/test_distributed.py::test_tensor_parallel_matches_unsharded_model.
        tp_size = getattr(distributed_config, "tp_size", None) or 1
        heads, kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
        noise_heads = model.config.num_noise_heads or heads  # GDA: each rank takes whole noise groups
        if tp_size > 1 and (heads % tp_size or kv_heads % tp_size or noise_heads % tp_size):
            raise ValueError(
                f"Tensor parallelism over {tp_size} ranks needs num_attention_heads={heads} and num_key_value_heads="
                f"{kv_heads}{'' if noise_heads == heads else f' and num_noise_heads={noise_heads}'} to be divisible "
                f"by {tp_size}: each rank computes whole differential heads, their key/value groups and noise "
                "queries. Use a tensor-parallel size that divides them."
            )
        return super().maybe_distribute_model(model, distributed_config, mesh_manager)


class _TaskHeadHooks:
    """Hooks of the task heads (mixed into `DiffForSequenceClassification` and its siblings)."""

    def __init__(self, config: DiffConfig):
        # Relies on: transformers' generic heads building their base model with `AutoModel.from_config(config)`, which
        # looks `type(config)` up in AutoModel's mapping. As Hub custom code that type is the class AutoConfig imported
        # (`transformers_modules.<hash>...DiffConfig`), unknown to AutoModel: mapped to DiffModel first. Guarded by
        # tests/model/test_heads.py::test_heads_load_as_remote_code_without_the_package.
        from transformers import AutoModel

        if type(config) not in AutoModel._model_mapping:
            AutoModel._model_mapping.register(type(config), DiffModel, exist_ok=True)
        super().__init__(config)


class _WithConfig:
    """`model` as seen through another config: every other attribute is the model's."""

    def __init__(self, model: nn.Module, config: DiffConfig):
        self._model, self.config = model, config

    def __getattr__(self, name):
        return getattr(self._model, name)


class _GenerationHooks:
    """Hooks of the generating model (mixed into `DiffForCausalLM`)."""

    def init_continuous_batching(self, *args, **kwargs):
        # Relies on: `GenerationMixin.init_continuous_batching` returning a `ContinuousBatchingManager` whose
        # `_create_batch_processor()` builds the `PagedAttentionCache` from `manager.model.config` (its
        # num_key_value_heads x head_dim size the pages). Guarded by tests/model/test_generation.py and
        # tests/cli/test_serving.py (test_continuous_batching_matches_generate in both).
        manager = super().init_continuous_batching(*args, **kwargs)
        if self.config.diff_version == 1 and not getattr(manager, "_sized_for_diff_v1", False):
            # A V1 layer stores what a Llama with 2 H_kv KV heads of size d (and 2H query heads) stores, so the cache
            # is built with that geometry: the manager sees a resized copy of the config for the call, so the model's
            # own config, read meanwhile by other threads (a server, a plain generate), never changes.
            create_batch_processor = manager._create_batch_processor
            sized = copy.copy(self.config)
            sized.num_key_value_heads = 2 * sized.num_key_value_heads
            sized.num_attention_heads = 2 * sized.num_attention_heads

            def create_batch_processor_v1():
                model = manager.model
                manager.model = _WithConfig(model, sized)
                try:
                    return create_batch_processor()
                finally:
                    manager.model = model

            manager._create_batch_processor = create_batch_processor_v1
            manager._sized_for_diff_v1 = True
        return manager


# ---- Models ----


# Mirrors transformers.models.llama.modeling_llama.LlamaPreTrainedModel
# diff with Llama: hooks; fp32 modules per version; V1's λ initialisation
class DiffPreTrainedModel(_PreTrainedModelHooks, PreTrainedModel):  # hooks: see "Integration hooks" above
    """Base class of every Diff model: weight initialisation (V1's λ vectors from N(0, `lambda_std`²)), the modules
    kept in fp32 per version (V1's λ vectors, strictly; V2's λ gate), and transformers' capabilities (sdpa, flash,
    flex, `torch.compile`, gradient checkpointing, `DiffDecoderLayer` as the unit of `device_map` and FSDP).
    """

    config: DiffConfig
    config_class = DiffConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["DiffDecoderLayer"]
    _skip_keys_device_placement = ["past_key_values"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _can_compile_fullgraph = True
    _supports_attention_backend = True
    # Set per version in `__init__`, so each names only modules that version has: (_keep_in_fp32_modules, _strict).
    # V1's λ vectors feed an exp(): they stay fp32 whatever dtype the rest of the model loads in (strict). V2's λ gate
    # is tiny (D x H) and decides how much of each head pair cancels: quantizers (bitsandbytes, ...) skip it, which
    # also keeps it trainable under QLoRA with `modules_to_save=["diff_lambda"]`, and fp16 loads keep it fp32.
    _keep_in_fp32_by_version = {
        1: ([], ["lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"]),
        2: (["diff_lambda.proj"], []),
    }
    _can_record_outputs = {"hidden_states": DiffDecoderLayer, "attentions": DiffAttention}

    def __init__(self, config: DiffConfig, *inputs, **kwargs):
        super().__init__(config, *inputs, **kwargs)
        self._keep_in_fp32_modules, self._keep_in_fp32_modules_strict = self._keep_in_fp32_by_version[
            config.diff_version
        ]

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)  # Linear, Embedding, RMSNorm (incl. subln -> 1), rotary buffers
        if isinstance(module, DiffLambdaV1):
            for param in (module.lambda_q1, module.lambda_k1, module.lambda_q2, module.lambda_k2):
                init.normal_(param, mean=0.0, std=self.config.lambda_std)
        elif isinstance(module, DiffPolyNorm):  # Motif's start: the three terms weighted equally, no offset
            init.constant_(module.weight, 1.0 / 3.0)
            init.zeros_(module.bias)


# Mirrors transformers.models.llama.modeling_llama.LlamaModel
class DiffModel(DiffPreTrainedModel):
    """The bare decoder: embeddings, `config.num_hidden_layers` `DiffDecoderLayer`s (Llama's, with differential
    attention: `DiffAttentionV1` or `DiffAttentionV2` by `config.diff_version`) and the final RMSNorm."""

    def __init__(self, config: DiffConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(
            [DiffDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.norm = DiffRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = DiffRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.post_init()

    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> BaseModelOutputWithPast:
        """Llama's decoder; `attentions` (eager only) are the differential maps (B, H, N, L)."""
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        if position_ids is None:
            past_seen_tokens = past_key_values.get_seq_length() if past_key_values is not None else 0
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens
            position_ids = position_ids.unsqueeze(0)

        causal_mask = create_causal_mask(
            config=self.config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            past_key_values=past_key_values,
            position_ids=position_ids,
        )
        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids=position_ids)
        for decoder_layer in self.layers[: self.config.num_hidden_layers]:
            hidden_states = decoder_layer(
                hidden_states,
                attention_mask=causal_mask,
                position_embeddings=position_embeddings,
                position_ids=position_ids,
                past_key_values=past_key_values,
                use_cache=use_cache,
                **kwargs,
            )
        hidden_states = self.norm(hidden_states)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, past_key_values=past_key_values)


# Mirrors transformers.models.llama.modeling_llama.LlamaForCausalLM
# diff with Llama: hooks; no `_fsdp_plan` yet (Llama's keeps lm_head's full weight under FSDP2)
class DiffForCausalLM(_GenerationHooks, DiffPreTrainedModel, GenerationMixin):  # hooks: see "Integration hooks"
    """`DiffModel` with a language-modelling head (tied to the embeddings when `config.tie_word_embeddings`), for
    training and `generate` (every decoding strategy and cache transformers has, continuous batching included)."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}

    def __init__(self, config: DiffConfig):
        super().__init__(config)
        self.model = DiffModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Unpack[TransformersKwargs],
    ) -> CausalLMOutputWithPast:
        """Llama's: logits (B, N, vocab) or the kept positions, the loss with `labels` (shifted inside)."""
        outputs: BaseModelOutputWithPast = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        hidden_states = outputs.last_hidden_state
        hidden_states = slice_logits_to_keep(hidden_states, logits_to_keep)
        logits = self.lm_head(hidden_states)

        loss = None
        if labels is not None:  # kwargs carry `num_items_in_batch` from Trainer for correct gradient accumulation
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)

        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )


# Mirrors transformers.models.llama.modeling_llama.LlamaForSequenceClassification
# diff with Llama: hooks
class DiffForSequenceClassification(_TaskHeadHooks, GenericForSequenceClassification, DiffPreTrainedModel):
    """`DiffModel` with a linear `score` head on the last token that is not `config.pad_token_id`; logits
    `(B, num_labels)`. transformers' generic head, as Llama's."""


# Mirrors transformers.models.llama.modeling_llama.LlamaForTokenClassification
# diff with Llama: hooks
class DiffForTokenClassification(_TaskHeadHooks, GenericForTokenClassification, DiffPreTrainedModel):
    """`DiffModel` with a linear `score` head on every token; logits `(B, N, num_labels)`. transformers' generic
    head, as Llama's."""


# Mirrors transformers.models.llama.modeling_llama.LlamaForQuestionAnswering
# diff with Llama: hooks; the base model is `model` (Llama keeps `transformer` for old checkpoints)
class DiffForQuestionAnswering(_TaskHeadHooks, GenericForQuestionAnswering, DiffPreTrainedModel):
    """`DiffModel` with a `qa_outputs` span head for extractive question answering; `start_logits` and
    `end_logits` `(B, N)`. transformers' generic head, as Llama's."""


__all__ = [
    "DiffPreTrainedModel",
    "DiffModel",
    "DiffForCausalLM",
    "DiffForSequenceClassification",
    "DiffForTokenClassification",
    "DiffForQuestionAnswering",
    "DiffAttention",
    "DiffAttentionV1",
    "DiffAttentionV2",
    "DiffDecoderLayer",
]
