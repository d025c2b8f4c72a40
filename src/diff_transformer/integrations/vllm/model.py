"""Diff Transformer V1 and V2 as vLLM models, built from vLLM's own layers (see `plugin` for registration).

Reads the checkpoints `DiffForCausalLM.save_pretrained` and the converter write, with the same tensor names. The
layout of q/k/v rows is head-major (see `modeling_diff.py`), so vLLM's `QKVParallelLinear` splits them over
tensor-parallel ranks into whole differential heads:

* V2: q_proj holds 2H query heads of size d (heads 2h and 2h+1 form differential head h), k/v_proj H_kv heads of
  size d: exactly a Llama with 2H heads. One attention call; head h outputs `a_2h - sigmoid(W_λ x)_h a_2h+1`.
* V1: q_proj holds, per differential head, [q1 | q2] (2d rows); k_proj per group [k1 | k2]; v_proj per group the
  2d-wide value [first half | second half]. The KV cache stores one head of size 2d per group for K ([k1 | k2]) and
  for V: the bytes of a Llama with 2 H_kv heads of size d. The two maps of head h become two query heads of size
  2d, [q1 | 0] and [0 | q2], so `q·k` is `q1·k1` or `q2·k2`, and ONE stock attention call (scale 1/√d) returns
  `A1 v` and `A2 v` with the whole 2d-wide v for both maps. Cost: half of each query is zeros, so QKᵀ does twice
  the multiply-adds of the d-wide product (AV is 2d wide for both maps whatever the design), and the backend must
  support head size 2d.
* V1 with grouped differential attention (`num_noise_heads` = n, Motif-2-12.7B): q_proj holds, per noise group, r
  signal queries then the noise query (d rows each); each signal head's q2 is its group's noise query, so after the
  projection the attention is V1's. q/k/v are projected as d-wide heads (H + n query heads, 2 H_kv key/value heads),
  so tensor parallelism splits whole noise groups and whole [k1 | k2] pairs.
* `hidden_act="poly_norm"` (Motif's PolyNorm): under tensor parallelism each rank holds a slice of the intermediate
  width, so the three mean squares it normalises by are summed over the ranks (one all-reduce of (T, 3) per layer).

Imports vLLM: only `plugin.register` touches this module, by name, so importing `diff_transformer` never does.
"""

from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.distributed import divide, get_tensor_model_parallel_world_size, tensor_model_parallel_all_reduce
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.models.utils import AutoWeightsLoader, WeightsMapper, maybe_prefix

from ...configuration_diff import DiffConfig
from ...modeling_diff import DiffLambdaV1  # the one λ formula: the transformers model's
from .fields import check_config


def _check_tensor_parallel(config: DiffConfig, tp_size: int) -> None:
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if heads % tp_size:
        raise ValueError(
            f"tensor_parallel_size={tp_size} does not divide num_attention_heads={heads}: a differential head "
            "(its query pair and λ) cannot be split over ranks. Pick a tensor_parallel_size that divides it."
        )
    if kv_heads % tp_size and tp_size % kv_heads:
        raise ValueError(
            f"tensor_parallel_size={tp_size} and num_key_value_heads={kv_heads}: one must divide the other so that "
            "key/value groups are split or replicated whole. Pick another tensor_parallel_size."
        )
    noise_heads = getattr(config, "num_noise_heads", None)
    if noise_heads is not None and (noise_heads % tp_size or kv_heads % tp_size):
        raise ValueError(
            f"tensor_parallel_size={tp_size} must divide num_noise_heads={noise_heads} and num_key_value_heads="
            f"{kv_heads}: each rank computes whole noise groups over whole key/value groups. Pick a "
            "tensor_parallel_size that divides both."
        )


class DiffPolyNormAndMul(nn.Module):
    """Motif's PolyNorm on the gate, times the up projection: (w0 n(g³) + w1 n(g²) + w2 n(g) + b) · u, n(v) =
    v / sqrt(mean(v²) + 1e-6) over the whole intermediate width, in fp32 as in the transformers model. The mean is
    over every rank's slice (all-reduced), so tensor parallelism computes what one device does."""

    def __init__(self, intermediate_size: int, eps: float = 1e-6):
        super().__init__()
        self.intermediate_size, self.eps = intermediate_size, eps
        self.weight = nn.Parameter(torch.full((3,), 1.0 / 3.0), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(1), requires_grad=False)
        self.tp_size = get_tensor_model_parallel_world_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)  # (T, I_local) each
        g = gate.float()
        powers = torch.stack((g * g * g, g * g, g))  # (3, T, I_local): x³, x², x
        squares = powers.pow(2).sum(-1, keepdim=True)  # (3, T, 1): this rank's part of Σ v²
        if self.tp_size > 1:
            squares = tensor_model_parallel_all_reduce(squares)
        normed = powers * torch.rsqrt(squares / self.intermediate_size + self.eps)
        out = (self.weight.float().view(3, 1, 1) * normed).sum(0) + self.bias.float()  # (T, I_local)
        return out.to(x.dtype) * up


class DiffMLP(nn.Module):
    def __init__(self, config: DiffConfig, quant_config, prefix: str):
        super().__init__()
        if config.hidden_act not in ("silu", "poly_norm"):
            raise ValueError(
                f"hidden_act={config.hidden_act!r} is not supported by the vLLM model: only 'silu', 'poly_norm'."
            )
        bias = config.mlp_bias
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [config.intermediate_size] * 2, bias=bias, quant_config=quant_config,
            prefix=f"{prefix}.gate_up_proj",
        )  # fmt: skip
        self.down_proj = RowParallelLinear(
            config.intermediate_size, config.hidden_size, bias=bias, quant_config=quant_config,
            prefix=f"{prefix}.down_proj",
        )  # fmt: skip
        poly_norm = config.hidden_act == "poly_norm"
        self.act_fn = DiffPolyNormAndMul(config.intermediate_size) if poly_norm else SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, _ = self.gate_up_proj(x)
        x, _ = self.down_proj(self.act_fn(x))
        return x


class DiffLambdaV2(nn.Module):
    """λ = sigmoid(W_λ x), one value per token and differential head; W_λ's rows are split with the heads (TP). Used
    where W_λ cannot join q/k/v's GEMM (`QKVLambdaParallelLinear`): the model in another dtype than fp32, or
    quantized."""

    def __init__(self, hidden_size: int, num_heads: int, prefix: str):
        super().__init__()
        # Kept in fp32 and never quantized, as in the transformers model (`_keep_in_fp32_modules`).
        self.proj = ColumnParallelLinear(
            hidden_size, num_heads, bias=False, params_dtype=torch.float32, prefix=f"{prefix}.proj"
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        gate, _ = self.proj(hidden_states.float())
        return torch.sigmoid(gate)  # (T, H_local) fp32


class QKVLambdaParallelLinear(QKVParallelLinear):
    """V2's q/k/v projection with W_λ's H rows appended: ONE GEMM writes [q | k | v | gate] per rank, as vLLM's Llama
    writes [q | k | v]. As a GEMM of its own, W_λ (H outputs) cost each layer one more GEMM call (on CPU a oneDNN
    call, one more OpenMP parallel region; on GPU one more launch), the one extra op of V2's layer that is not
    elementwise (benchmarks/census_vllm.py). Rank r holds the λ rows of its own differential heads,
    [r H/tp, (r+1) H/tp), as `ColumnParallelLinear` would split them; under `attention_bias` the λ rows' bias is 0
    (W_λ has none). Only for unquantized fp32 models: W_λ stays fp32 in any dtype and is never quantized (the
    transformers model's `_keep_in_fp32_modules`), so in bf16 or quantized it stays a `DiffLambdaV2` of its own.
    The checkpoint's `diff_lambda.proj.weight` loads as the shard "lambda" (`DiffModel`'s mapper)."""

    def __init__(self, hidden_size: int, head_size: int, query_heads: int, kv_heads: int, bias: bool, prefix: str):
        # QKVParallelLinear's own bookkeeping of heads (which also sizes its weight): set as its __init__ does, then
        # the weight built with the λ rows, as vLLM's MinimaxM3QKVParallelLinearWithIndexer does for its extra rows.
        self.hidden_size, self.head_size, self.v_head_size = hidden_size, head_size, head_size
        self.total_num_heads, self.total_num_kv_heads = query_heads, kv_heads
        tp_size = get_tensor_model_parallel_world_size()
        self.num_heads = divide(query_heads, tp_size)
        if tp_size >= kv_heads:
            self.num_kv_heads, self.num_kv_head_replicas = 1, divide(tp_size, kv_heads)
        else:
            self.num_kv_heads, self.num_kv_head_replicas = divide(kv_heads, tp_size), 1
        self.num_lambda = self.num_heads // 2  # one λ per differential head (a pair of query heads)
        q, kv = self.num_heads * head_size, self.num_kv_heads * head_size
        self.lambda_offset = q + 2 * kv  # in this rank's rows
        self.output_sizes = [q * tp_size, kv * tp_size, kv * tp_size, self.num_lambda * tp_size]
        ColumnParallelLinear.__init__(
            self, input_size=hidden_size, output_size=sum(self.output_sizes), bias=bias, gather_output=False,
            params_dtype=torch.float32, prefix=prefix,
        )  # fmt: skip
        if bias:  # W_λ has no bias: its rows stay 0 (the loader writes q/k/v's over theirs)
            self.bias.data.zero_()

    def validate_shard_id(self, shard_id) -> bool:
        return shard_id == "lambda" or super().validate_shard_id(shard_id)

    def weight_loader_v2(self, param, loaded_weight: torch.Tensor, loaded_shard_id: str | None = None):
        if loaded_shard_id != "lambda":
            return super().weight_loader_v2(param, loaded_weight, loaded_shard_id)
        # num_heads=1: rank r takes rows [r H/tp, (r+1) H/tp) of W_λ, as q takes its heads
        param.load_qkv_weight(
            loaded_weight=loaded_weight, num_heads=1, shard_id="lambda", shard_offset=self.lambda_offset,
            shard_size=self.num_lambda,
        )  # fmt: skip


class DiffAttention(nn.Module):
    """What both versions share: the fused q/k/v projection, `o_proj`, Qwen3's q/k norms, RoPE on every d-wide
    sub-head, and one stock `Attention` call. `head_size` is the width of one projection head (its rows are contiguous
    in the checkpoint, so tensor parallelism splits whole heads), attended and fed to `o_proj` at that width;
    `query_heads` how many such heads q_proj holds. `qkv_heads` (GDA): q/k/v projected as (head size, query heads,
    key/value heads) other than that, e.g. d-wide heads whose counts tensor parallelism splits into whole groups."""

    def __init__(
        self,
        config: DiffConfig,
        head_size: int,
        query_heads: int,
        cache_config,
        quant_config,
        prefix: str,
        qkv_heads: tuple[int, int, int] | None = None,
        lambda_rows: bool = False,
    ):
        super().__init__()
        tp_size = get_tensor_model_parallel_world_size()
        _check_tensor_parallel(config, tp_size)
        H, H_kv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.head_dim = d
        self.num_heads = H // tp_size  # differential heads on this rank
        self.num_kv_heads = max(1, H_kv // tp_size)
        out_bias = config.attention_bias if config.attention_out_bias is None else config.attention_out_bias

        qkv_size, qkv_query_heads, qkv_kv_heads = qkv_heads or (head_size, query_heads, H_kv)
        if lambda_rows:  # V2, fp32, unquantized: W_λ's rows in the same GEMM
            self.qkv_proj = QKVLambdaParallelLinear(
                config.hidden_size, qkv_size, qkv_query_heads, qkv_kv_heads, config.attention_bias,
                prefix=f"{prefix}.qkv_proj",
            )  # fmt: skip
        else:
            self.qkv_proj = QKVParallelLinear(
                config.hidden_size, qkv_size, qkv_query_heads, qkv_kv_heads, bias=config.attention_bias,
                quant_config=quant_config, prefix=f"{prefix}.qkv_proj",
            )  # fmt: skip
        # both versions: 2 d-wide query sub-heads per differential head; GDA: r signal queries and 1 noise per group
        self.q_size = qkv_query_heads // tp_size * qkv_size
        self.kv_size = self.num_kv_heads * head_size
        self.qkv_split = [self.q_size, self.kv_size, self.kv_size]
        if lambda_rows:
            self.qkv_split.append(self.qkv_proj.num_lambda)  # V2's gate: one λ per differential head
        self.o_proj = RowParallelLinear(
            H * head_size, config.hidden_size, bias=out_bias, quant_config=quant_config, prefix=f"{prefix}.o_proj"
        )
        # Qwen3: one d-sized RMSNorm over every query/key sub-head before RoPE (V1: q1, q2, k1, k2 alike).
        self.q_norm = RMSNorm(d, eps=config.rms_norm_eps) if config.use_qk_norm else None
        self.k_norm = RMSNorm(d, eps=config.rms_norm_eps) if config.use_qk_norm else None
        # Every sub-head (q1, q2, k1, k2, V2's heads) is rotated on its own d dimensions, as in the transformers model.
        self.rotary_emb = get_rope(
            d, max_position=config.max_position_embeddings, is_neox_style=True,
            rope_parameters=getattr(config, "rope_parameters", None),
        )  # fmt: skip
        self.attn = Attention(
            2 * self.num_heads, head_size, d**-0.5, num_kv_heads=self.num_kv_heads, cache_config=cache_config,
            quant_config=quant_config, prefix=f"{prefix}.attn",
        )  # fmt: skip

    def _sub_head_norm(self, norm: RMSNorm | None, x: torch.Tensor) -> torch.Tensor:
        if norm is None:
            return x
        return norm(x.reshape(-1, self.head_dim)).view(x.shape)  # every d-wide sub-head on its own

    def project(self, positions: torch.Tensor, hidden_states: torch.Tensor):
        """q (T, 2H*d), k and v (T, H_kv*head_size), normed and rotated; with `lambda_rows` also λ's gate (T, H)."""
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v, *gate = qkv.split(self.qkv_split, dim=-1)
        q, k = self._sub_head_norm(self.q_norm, q), self._sub_head_norm(self.k_norm, k)
        q, k = self.rotary_emb(positions, q, k)
        return q, k, v, *gate


class DiffAttentionV2(DiffAttention):
    """V2: a Llama attention with 2H query heads of size d (heads 2h, 2h+1 form differential head h) over H_kv
    key/value heads; head h outputs `a_2h - sigmoid(W_λ x)_h a_2h+1`. Unquantized fp32: W_λ's rows are in qkv_proj
    (`QKVLambdaParallelLinear`), so the layer dispatches Llama's ops plus a sigmoid and an addcmul; otherwise W_λ is a
    fp32 projection of its own (`DiffLambdaV2`)."""

    def __init__(self, config: DiffConfig, layer_idx: int, cache_config, quant_config, prefix: str):
        H, d = config.num_attention_heads, config.head_dim
        fused = quant_config is None and torch.get_default_dtype() == torch.float32  # the model's dtype while built
        super().__init__(config, d, 2 * H, cache_config, quant_config, prefix, lambda_rows=fused)
        self.diff_lambda = None if fused else DiffLambdaV2(config.hidden_size, H, prefix=f"{prefix}.diff_lambda")

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        T, d, H = hidden_states.shape[0], self.head_dim, self.num_heads
        q, k, v, *gate = self.project(positions, hidden_states)
        if gate:
            lam = torch.sigmoid(gate[0])  # (T, H)
        else:
            lam = self.diff_lambda(hidden_states).to(hidden_states.dtype)  # (T, H)
        out = self.attn(q, k, v).view(T, H, 2, d)  # (T, H, 2, d): query heads (2h, 2h+1)
        out = torch.addcmul(out[:, :, 0], lam.unsqueeze(-1), out[:, :, 1], value=-1)  # (T, H, d): a_2h - λ a_2h+1
        out, _ = self.o_proj(out.reshape(T, H * d))
        return out


class DiffAttentionV1(DiffAttention):
    """V1: per differential head [q1 | q2] (2d rows of q_proj), per group [k1 | k2] and a 2d-wide value. The KV cache
    stores one head of size 2d per group for K and V; the two maps of head h become two query heads of size 2d,
    [q1 | 0] and [0 | q2], so ONE stock attention call (scale 1/√d) returns `A1 v` and `A2 v`."""

    def __init__(self, config: DiffConfig, layer_idx: int, cache_config, quant_config, prefix: str):
        H, H_kv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.num_noise_heads = getattr(config, "num_noise_heads", None)
        # GDA: d-wide q/k/v heads (H + n queries; [k1 | k2] and the two value halves as 2 H_kv heads)
        qkv = None if self.num_noise_heads is None else (d, H + self.num_noise_heads, 2 * H_kv)
        super().__init__(config, 2 * d, H, cache_config, quant_config, prefix, qkv_heads=qkv)
        self.lambda_init = config.lambda_init_for_layer(layer_idx)
        lambda_floor = getattr(config, "lambda_floor", None)
        self.diff_lambda = DiffLambdaV1(d, self.lambda_init, lambda_floor).requires_grad_(False)
        # λ depends on the weights only: computed once they are loaded (`DiffModel.load_weights`), not every step
        # (up to 11 ops a layer, a third of what the layer dispatched beyond Llama's in a decode step).
        self.register_buffer("lambda_value", torch.zeros((), dtype=torch.float32), persistent=False)
        subln_eps = getattr(config, "subln_eps", None)
        self.subln = RMSNorm(2 * d, eps=config.rms_norm_eps if subln_eps is None else subln_eps)
        self.group_size = None if self.num_noise_heads is None else H // self.num_noise_heads + 1

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        T, d, H = hidden_states.shape[0], self.head_dim, self.num_heads
        q, k, v = self.project(positions, hidden_states)
        if self.num_noise_heads is None:
            q = q.view(T, H, 2, d)  # (T, H, 2, d): [q1 | q2] of every head
        else:  # GDA: (T, n, r + 1, d) -> each signal head's (q1, q2) = (its query, its group's noise query)
            groups = q.view(T, -1, self.group_size, d)
            signal, noise = groups[:, :, :-1], groups[:, :, -1:].expand_as(groups[:, :, :-1])
            q = torch.stack((signal, noise), dim=3).reshape(T, H, 2, d)  # (T, H, 2, d)
        zeros = torch.zeros_like(q[:, :, 0])
        q = torch.stack(
            (torch.cat((q[:, :, 0], zeros), dim=-1), torch.cat((zeros, q[:, :, 1]), dim=-1)), dim=2
        )  # (T, H, 2, 2d): [q1 | 0], [0 | q2] against keys [k1 | k2]
        out = self.attn(q.reshape(T, H * 2 * 2 * d), k, v).view(T, H, 2, 2 * d)  # (T, H, 2, 2d): A1 v, A2 v
        lam = self.lambda_value.to(out.dtype)
        out = torch.addcmul(out[:, :, 0], out[:, :, 1], lam, value=-1)  # (T, H, 2d): A1 v - λ A2 v
        out = self.subln(out.reshape(T * H, 2 * d)) * (1.0 - self.lambda_init)  # (T*H, 2d)
        out, _ = self.o_proj(out.reshape(T, H * 2 * d))
        return out


ATTENTION_CLASSES = {1: DiffAttentionV1, 2: DiffAttentionV2}


class DiffDecoderLayer(nn.Module):
    def __init__(self, config: DiffConfig, layer_idx: int, cache_config, quant_config, prefix: str):
        super().__init__()
        self.self_attn = ATTENTION_CLASSES[config.diff_version](
            config, layer_idx, cache_config, quant_config, prefix=f"{prefix}.self_attn"
        )
        self.mlp = DiffMLP(config, quant_config, prefix=f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)  # fused add + norm
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


@support_torch_compile
class DiffModel(nn.Module):
    # Llama's per-projection tensors load into vLLM's fused qkv_proj / gate_up_proj as shards.
    hf_to_vllm_mapper = WeightsMapper(
        orig_to_new_stacked={
            ".q_proj": (".qkv_proj", "q"),
            ".k_proj": (".qkv_proj", "k"),
            ".v_proj": (".qkv_proj", "v"),
            ".gate_proj": (".gate_up_proj", 0),
            ".up_proj": (".gate_up_proj", 1),
        }
    )

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        check_config(config)
        if vllm_config.parallel_config.pipeline_parallel_size > 1:
            raise ValueError(
                "pipeline_parallel_size > 1 is not supported by diff-transformer's vLLM model: use tensor parallelism."
            )
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DiffDecoderLayer(
                config, i, vllm_config.cache_config, vllm_config.quant_config, prefix=f"{prefix}.layers.{i}"
            )
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if isinstance(self.layers[0].self_attn.qkv_proj, QKVLambdaParallelLinear):  # V2, fp32, unquantized
            self.hf_to_vllm_mapper = self.hf_to_vllm_mapper | WeightsMapper(
                orig_to_new_stacked={".diff_lambda.proj": (".qkv_proj", "lambda")}
            )

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(
        self, input_ids: torch.Tensor | None, positions: torch.Tensor, inputs_embeds: torch.Tensor | None = None
    ) -> torch.Tensor:
        hidden_states = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = AutoWeightsLoader(self).load_weights(weights, mapper=self.hf_to_vllm_mapper)
        with torch.no_grad():
            for layer in self.layers:
                attention = layer.self_attn
                if isinstance(attention, DiffAttentionV1):  # λ from the vectors just loaded
                    attention.lambda_value.copy_(attention.diff_lambda())
        return loaded


class DiffForCausalLM(nn.Module):
    """vLLM's `DiffForCausalLM` (architecture name of `diff_transformer.DiffForCausalLM` checkpoints)."""

    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        self.model = DiffModel(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        self.lm_head = ParallelLMHead(
            config.vocab_size, config.hidden_size, quant_config=vllm_config.quant_config,
            prefix=maybe_prefix(prefix, "lm_head"),
        )  # fmt: skip
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors=None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # vLLM's model runners pass `intermediate_tensors` by keyword to every model; they are only set under pipeline
        # parallelism, which `DiffModel` refuses when it is built (no `SupportsPP`), so here they are always None.
        return self.model(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        # Tied embeddings: lm_head.weight is embed_tokens.weight, and the loader writes a shared tensor only once.
        return AutoWeightsLoader(self).load_weights(weights)
