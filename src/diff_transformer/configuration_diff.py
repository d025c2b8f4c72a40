# Copyright 2026 The diff-transformer Authors. Licensed under the Apache License, Version 2.0 (the "License");
# http://www.apache.org/licenses/LICENSE-2.0. Distributed on an "AS IS" BASIS, WITHOUT WARRANTIES OF ANY KIND.
"""Configuration of the Diff Transformer (differential attention) model.

Self-contained on purpose: this file is copied next to the weights when a model is saved, so that
`AutoConfig.from_pretrained(..., trust_remote_code=True)` works where `diff_transformer` is not installed.
"""

import math

from huggingface_hub.dataclasses import strict
from transformers.activations import ACT2FN
from transformers.configuration_utils import PreTrainedConfig
from transformers.modeling_rope_utils import RopeParameters
from transformers.utils import logging


logger = logging.get_logger(__name__)
_MAP_FIRST_INFERENCE = "map_first_inference"

# `hidden_act` of Motif's PolyNorm activation (a module with weights, not an ACT2FN entry: modeling_diff.DiffPolyNorm).
POLY_NORM = "poly_norm"

AUTO_MAP = {"AutoConfig": "configuration_diff.DiffConfig", "AutoModel": "modeling_diff.DiffModel"} | {
    f"AutoModelFor{task}": f"modeling_diff.DiffFor{task}"
    for task in ("CausalLM", "SequenceClassification", "TokenClassification", "QuestionAnswering")
}

# Tensor-parallel rules for λ (not serialised: transformers drops `base_model_tp_plan` from config.json).
# V2: W_λ has one row per differential head, so it is split with its heads. V1: λ's four vectors and `subln` are
# replicated, but on each rank they only act on that rank's heads, so their gradients are summed over the ranks.
_TP_PLAN_BY_VERSION = {
    1: {f"layers.*.self_attn.{name}": "replicated_with_grad_allreduce" for name in ("diff_lambda", "subln")},
    2: {"layers.*.self_attn.diff_lambda.proj": "colwise"},
}
# `use_qk_norm`: one d-sized weight acts on every rank's local heads (as in Qwen3's plan).
_TP_PLAN_QK_NORM = {f"layers.*.self_attn.{name}": "replicated_with_grad_allreduce" for name in ("q_norm", "k_norm")}

FP32_TINY = 1.1754943508222875e-38  # torch.finfo(torch.float32).tiny, without importing torch here
# lambda_init_depth_offset's range (V1, depth schedule): V1 scales layer 0's output, in the model's dtype, by
# 1 - λ_init = 0.2 + 0.6 exp(-0.3 offset), finite in float16 (<= 65504) only for offset >= -38 (-39 gives 72,343); at
# most 10^6 (any offset past a few dozen gives λ_init = 0.8 already; a huge int would overflow the float arithmetic).
LAMBDA_OFFSET_RANGE = (-38, 10**6)
_EPS_WHY = "in float32, where it is added, a smaller eps is 0: NaN for an all-zero input of RMSNorm"

# The range of every number the model divides by, exponentiates or draws with, where it gives finite, meaningful
# results: name -> (low, high, "[)"-style bounds, why, fix), one message form "name=value must ... (why): fix.". Every
# rope_parameters field transformers' RoPE functions read is here too: transformers only warns for a few of them.
_RANGES = {
    "rms_norm_eps": (FP32_TINY, math.inf, "[)", _EPS_WHY, "use e.g. 1e-6 or 1e-5"),
    "subln_eps": (FP32_TINY, math.inf, "[)", _EPS_WHY, "use e.g. 1e-5, or None for rms_norm_eps"),
    "initializer_range": (0.0, 1.0, "[]", "the std of the initial weights", "use e.g. 0.02"),
    "attention_dropout": (0.0, 1.0, "[)", "a dropout probability; 1 drops every weight", "use 0.0 to disable it"),
    "lambda_init": (0.0, 1.0, "[)", "V1 scales the output by 1 - lambda_init", "use None for the paper's schedule"),
    "lambda_std": (0.0, math.inf, "[)", "the std of V1's initial λ vectors, which feed an exp()", "use e.g. 0.1"),
    "lambda_floor": (0.0, 1.0, "[)", "the least λ V1 may reach", "use e.g. 0.05, or None for the paper's λ"),
    "rope_parameters.rope_theta": (1.0, math.inf, "()", "frequencies are theta^(-2i/d)", "use e.g. 10000.0"),
    "rope_parameters.factor": (1.0, math.inf, "[)", "it stretches the context", "use e.g. 2.0"),
    "rope_parameters.original_max_position_embeddings": (1, math.inf, "[)", "a context length", "use e.g. 8192"),
    "rope_parameters.attention_factor": (0.0, math.inf, "()", "it scales the attention logits", "use e.g. 1.0"),
    "rope_parameters.beta_fast": (0.0, math.inf, "()", "YaRN's fast boundary, in rotations", "use e.g. 32"),
    "rope_parameters.beta_slow": (0.0, math.inf, "()", "YaRN's slow boundary, in rotations", "use e.g. 1"),
    "rope_parameters.mscale": (0.0, math.inf, "()", "it scales YaRN's attention temperature", "use e.g. 1.0"),
    "rope_parameters.mscale_all_dim": (0.0, math.inf, "[)", "it scales YaRN's attention temperature", "use e.g. 0.0"),
    "rope_parameters.low_freq_factor": (0.0, math.inf, "()", "Llama 3's boundary divides by it", "use e.g. 1.0"),
    "rope_parameters.high_freq_factor": (0.0, math.inf, "()", "Llama 3's boundary divides by it", "use e.g. 4.0"),
    "rope_parameters.partial_rotary_factor": (0.0, 1.0, "(]", "the share of dimensions that rotate", "use e.g. 1.0"),
}


def _check_range(name: str, value, low, high, bounds: str, why: str, fix: str) -> None:
    """A one-line ValueError naming the field, its value, its range, why and the fix, for a value outside it."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    above = number and (value >= low if bounds[0] == "[" else value > low)
    if above and (value <= high if bounds[1] == "]" else value < high):
        return
    shown = repr(value) if len(repr(value)) <= 12 else f"{repr(value)[:6]}... ({len(repr(value))} digits)"
    lo, hi = (f"{x:.3g}" if isinstance(x, float) else str(x) for x in (low, high))
    op = ">" if bounds[0] == "(" else ">="
    where = f"lie in {bounds[0]}{lo}, {hi}{bounds[1]}" if high < math.inf else f"be a finite number {op} {lo}"
    raise ValueError(f"{name}={shown} must {where} ({why}): {fix}.")


# Mirrors transformers.models.llama.configuration_llama.LlamaConfig
# diff with Llama: `num_attention_heads` counts differential heads and `head_dim` is a sub-head's (default
# hidden_size // 2H); no `pretraining_tp`; the Diff fields; its own validation (`validate_values`) and λ plans
@strict
class DiffConfig(PreTrainedConfig):
    r"""
    Configuration of a decoder-only Diff Transformer: `LlamaConfig`'s fields with their meaning, except that
    `num_attention_heads` counts *differential* heads (H) and `head_dim` is the size d of one query/key sub-head
    (default `hidden_size // 2H`: V1 then has the parameters of a Llama with 2H heads of size d, plus 6d per layer).

    Example:
        ```python
        config = DiffConfig(hidden_size=512, num_attention_heads=4, num_key_value_heads=2, diff_version=2)
        ```

    Attributes:
        diff_version (int): 1, the ICLR 2025 paper: `(softmax(Q1K1ᵀ) - λ softmax(Q2K2ᵀ)) V`, λ one scalar per layer,
            V 2d wide, a per-head RMSNorm (`subln`); 2 (default), Diff Transformer V2: 2H query heads paired as
            `a_2h - sigmoid(W_λ x)_h a_2h+1`, K/V and cache a Llama's. A config.json without the field is V1 (the
            default when such checkpoints were saved); saved configs always hold it.
        lambda_init (float | None): V1: a fixed λ_init; `None`, the paper's schedule `0.8 - 0.6 exp(-0.3 layer_idx)`.
        lambda_std (float): the std of V1's initial λ vectors `lambda_{q,k}{1,2}`; 0.1, the paper's.
        lambda_floor (float | None): V1: m in [0, 1) keeps λ above m, so the layer always subtracts (λ = m +
            softplus₁₀₀(λ_paper − m): λ_paper to within 3e-9 where λ_paper ≥ m + 0.2); `None`, the paper's λ.
        attention_out_bias (bool | None): `o_proj`'s bias; `None` follows `attention_bias` (Qwen2: q/k/v only).
        use_qk_norm (bool): Qwen3's `q_norm` / `k_norm` before RoPE: one d-wide RMSNorm weight for all (sub-)heads.
        num_noise_heads (int | None): V1: grouped differential attention (GDA, arXiv 2510.06949; Motif): the second
            maps of each group of r = H / num_noise_heads signal heads come from one shared noise query (q_proj holds
            per group the r signal queries, then the noise query). Divides H and is a multiple of
            `num_key_value_heads`; `None` (default): one noise query per head, the paper's V1.
        lambda_init_depth_offset (int): V1 with `lambda_init=None`: `0.8 - 0.6 exp(-0.3 (layer_idx + offset))`; 0
            (default) is the paper's code, Motif's models use -1.
        subln_eps (float | None): V1: `subln`'s eps; `None` (default) uses `rms_norm_eps` (Motif sets its own).
        conversion (dict | None): a converted checkpoint's provenance (source, base model, card data, V1's
            initialisation), written by the converter: metadata the model never reads; the package's model card does.
    """

    model_type = "diff"
    keys_to_ignore_at_inference = ["past_key_values"]
    # Llama's plan. q/k/v weights are head-major (rows of head h, then h+1), so a contiguous colwise split gives each
    # rank whole differential heads with their own q1/q2, k1/k2 and v pieces. __post_init__ adds each version's λ.
    base_model_tp_plan = {
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise",
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
    }
    base_model_pp_plan = {
        "embed_tokens": (["input_ids"], ["inputs_embeds"]),
        "layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
        "norm": (["hidden_states"], ["hidden_states"]),
    }

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 16
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    tie_word_embeddings: bool = False
    rope_parameters: RopeParameters | dict | None = None
    attention_bias: bool = False
    attention_dropout: int | float | None = 0.0
    mlp_bias: bool = False
    diff_version: int = 2
    lambda_init: float | None = None
    lambda_std: float = 0.1
    lambda_floor: float | None = None
    # Llama-family variants the converter maps exactly (Qwen2, Qwen3); the defaults are Llama's.
    attention_out_bias: bool | None = None
    use_qk_norm: bool = False
    # Motif's differential models (docs/motif.md): grouped differential attention, the λ_init depth offset and the
    # sub-layer norm's eps; `hidden_act="poly_norm"` selects Motif's PolyNorm. The defaults are the paper's V1.
    num_noise_heads: int | None = None
    lambda_init_depth_offset: int = 0
    subln_eps: float | None = None
    conversion: dict | None = None

    @classmethod
    def from_dict(cls, config_dict, **kwargs):
        # Checkpoints saved while V1 was the default may omit `diff_version` (transformers 4 left out defaults), and
        # `map_first_inference` was a field until it became the backend "diff_map_first": a config naming it loads.
        if any([config_dict.get(_MAP_FIRST_INFERENCE), kwargs.pop(_MAP_FIRST_INFERENCE, None)]):
            logger.warning(
                f"{_MAP_FIRST_INFERENCE}=True is no longer a config field and is ignored: V2's map-first CPU path is "
                "now the attention backend 'diff_map_first' (from_pretrained(..., attn_implementation="
                "'diff_map_first') with the diff_transformer package installed)."
            )
        config_dict = {"diff_version": 1, **{k: v for k, v in config_dict.items() if k != _MAP_FIRST_INFERENCE}}
        return super().from_dict(config_dict, **kwargs)

    def __post_init__(self, **kwargs):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.attention_dropout is None:  # the type allows None (as Llama's does); it means no dropout
            self.attention_dropout = 0.0
        # `@strict` runs every `validate_*` method after construction (and on `save_pretrained`), wrapping errors in a
        # two-line StrictDataclassClassValidationError; called here first, a bad value is one plain ValueError.
        self.validate_architecture()
        if self.head_dim is None:
            self.head_dim = self.hidden_size // (2 * self.num_attention_heads)
        self.validate_values()
        super().__post_init__(**kwargs)
        plan = {**type(self).base_model_tp_plan, **_TP_PLAN_BY_VERSION[self.diff_version]}
        plan |= _TP_PLAN_QK_NORM if self.use_qk_norm else {}
        # PolyNorm normalises over the whole intermediate width: the MLP stays whole.
        self.base_model_tp_plan = {k: v for k, v in plan.items() if self.hidden_act != POLY_NORM or ".mlp." not in k}
        # Saved models carry their code: every Auto class points at it (trust_remote_code=True without the package).
        self.auto_map = {**AUTO_MAP, **(getattr(self, "auto_map", None) or {})}

    def validate_architecture(self):
        """Part of `@strict`-powered validation (as in `LlamaConfig`): version and head geometry. `@strict` itself
        refuses a value of the wrong type (a float or bool for an int field) before this runs."""
        heads, kv, noise = self.num_attention_heads, self.num_key_value_heads, self.num_noise_heads
        version = self.diff_version
        sizes = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers")
        for name in (*sizes, "vocab_size", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be a positive integer: set it to a size > 0.")
        if version not in (1, 2):
            raise ValueError(
                f"diff_version={version!r} is not supported: use 1 (ICLR 2025 paper) or 2 (Diff Transformer V2)."
            )
        if heads % kv:
            raise ValueError(
                f"num_attention_heads={heads} is not divisible by num_key_value_heads={kv}: every differential head "
                "needs one key/value group. Pick a num_key_value_heads that divides num_attention_heads."
            )
        if self.head_dim is None and self.hidden_size < 2 * heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} cannot be split into 2 x num_attention_heads={heads} sub-heads: "
                "lower num_attention_heads or set head_dim explicitly."
            )
        if noise is None:
            return
        if version != 1:
            raise ValueError(
                f"num_noise_heads={noise} (grouped differential attention) needs diff_version=1: set diff_version=1 "
                "or num_noise_heads=None."
            )
        if noise <= 0 or heads % noise:
            raise ValueError(
                f"num_noise_heads={noise!r} must be a positive integer dividing num_attention_heads={heads} (each "
                "noise query serves num_attention_heads / num_noise_heads signal heads): pick a divisor, or None "
                "for one noise query per head."
            )
        if noise % kv:
            raise ValueError(
                f"num_noise_heads={noise} must be a multiple of num_key_value_heads={kv}: a noise query attends the "
                "one key/value group of the signal heads it serves. Raise num_noise_heads or lower "
                "num_key_value_heads."
            )

    def validate_values(self):
        """Part of `@strict`-powered validation: values that would otherwise give NaN logits or fail deep in torch."""
        head_dim, act, dropout, v1 = self.head_dim, self.hidden_act, self.attention_dropout, self.diff_version == 1
        if head_dim <= 0 or head_dim % 2:
            raise ValueError(
                f"head_dim={head_dim} must be a positive even number (rotary embeddings rotate pairs of dimensions): "
                "set head_dim explicitly or change hidden_size / num_attention_heads."
            )
        if act not in ACT2FN and act != POLY_NORM:
            raise ValueError(
                f"hidden_act={act!r} is not an activation transformers knows: use a key of "
                f"transformers.activations.ACT2FN, e.g. 'silu' (Llama's), 'gelu' or 'relu', or {POLY_NORM!r} "
                "(Motif's PolyNorm)."
            )
        rope = self.rope_parameters if isinstance(self.rope_parameters, dict) else {}
        values = {**{f"rope_parameters.{key}": value for key, value in rope.items()}, **vars(self)}
        for name, limits in _RANGES.items():
            if values.get(name) is not None:
                _check_range(name, values[name], *limits)
        for key in ("short_factor", "long_factor"):  # LongRoPE divides each frequency by one
            for value in rope.get(key) or []:
                _check_range(f"rope_parameters.{key}", value, 0.0, math.inf, "()", "a list of factors", "fix the list")
        low, high = rope.get("low_freq_factor", 0), rope.get("high_freq_factor", 1)
        if not high > low:
            raise ValueError(
                f"rope_parameters.high_freq_factor={high!r} must exceed low_freq_factor={low!r} (Llama 3's smoothing "
                "divides by their difference): use e.g. 4.0 and 1.0."
            )
        if dropout and v1:  # the V1 pair shares one softmax per map; independent dropout masks break the cancelling
            raise ValueError(
                f"attention_dropout={dropout} is not supported with diff_version=1: set it to 0.0 or use "
                "diff_version=2."
            )
        if v1 and self.lambda_init is None:  # the depth schedule: see LAMBDA_OFFSET_RANGE
            why = "below, layer 0's output scale 1 - λ_init overflows float16"
            offset, fix = self.lambda_init_depth_offset, "use 0 (the paper's) or -1 (Motif's)"
            _check_range("lambda_init_depth_offset", offset, *LAMBDA_OFFSET_RANGE, "[]", why, fix)

    def lambda_init_for_layer(self, layer_idx: int) -> float:
        """V1's λ_init of a (0-based) layer: the configured constant, or the paper's depth schedule (shifted by
        `lambda_init_depth_offset`: Motif's models use layer_idx - 1)."""
        if self.lambda_init is not None:
            return float(self.lambda_init)
        return 0.8 - 0.6 * math.exp(-0.3 * (layer_idx + self.lambda_init_depth_offset))


__all__ = ["DiffConfig"]
