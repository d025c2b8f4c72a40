# Copyright 2026 The diff-transformer Authors.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
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


AUTO_MAP = {
    "AutoConfig": "configuration_diff.DiffConfig",
    "AutoModel": "modeling_diff.DiffModel",
    "AutoModelForCausalLM": "modeling_diff.DiffForCausalLM",
    "AutoModelForSequenceClassification": "modeling_diff.DiffForSequenceClassification",
    "AutoModelForTokenClassification": "modeling_diff.DiffForTokenClassification",
    "AutoModelForQuestionAnswering": "modeling_diff.DiffForQuestionAnswering",
}

# Tensor-parallel rules for λ (not serialised: transformers drops `base_model_tp_plan` from config.json).
# V2: W_λ has one row per differential head, so it is split with its heads. V1: λ's four vectors and `subln` are
# replicated, but on each rank they only act on that rank's heads, so their gradients are summed over the ranks.
_TP_PLAN_BY_VERSION = {
    1: {
        "layers.*.self_attn.diff_lambda": "replicated_with_grad_allreduce",
        "layers.*.self_attn.subln": "replicated_with_grad_allreduce",
    },
    2: {"layers.*.self_attn.diff_lambda.proj": "colwise"},
}
# `use_qk_norm`: one d-sized weight acts on every rank's local heads (as in Qwen3's plan).
_TP_PLAN_QK_NORM = {
    "layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
    "layers.*.self_attn.k_norm": "replicated_with_grad_allreduce",
}


FP32_TINY = 1.1754943508222875e-38  # torch.finfo(torch.float32).tiny, without importing torch here
# lambda_init_depth_offset's range (V1, depth schedule): the least offset for which 1 - λ_init of layer 0 stays below
# float16's largest number, 0.2 + 0.6 exp(-0.3 offset) <= 65504 (validate_motif_options); at most 10^6 above (any
# offset past a few dozen gives λ_init = 0.8 already, and a huge int would overflow the float arithmetic).
LAMBDA_OFFSET_RANGE = (-38, 10**6)


# Every rope_parameters field that transformers' RoPE functions read (modeling_rope_utils), with the range where it
# gives finite, meaningful frequencies: (low, low included, high, high included, why, example). transformers only
# warns for a few of them (a factor < 1) and not at all for the rest; one table checks them all, the same way.
_ROPE_RANGES = {
    "rope_theta": (
        1.0,
        False,
        math.inf,
        False,
        "frequencies are theta^(-2i/d): 1 or less repeats or inverts them",
        "10000.0",
    ),
    "factor": (
        1.0,
        True,
        math.inf,
        False,
        "it stretches the context: below 1 it shrinks it, 0 divides by zero",
        "2.0",
    ),
    "original_max_position_embeddings": (1, True, math.inf, False, "a context length in positions", "8192"),
    "attention_factor": (0.0, False, math.inf, False, "it scales the attention logits", "1.0"),
    "beta_fast": (0.0, False, math.inf, False, "YaRN's fast boundary, in rotations", "32"),
    "beta_slow": (0.0, False, math.inf, False, "YaRN's slow boundary, in rotations", "1"),
    "mscale": (0.0, False, math.inf, False, "it scales YaRN's attention temperature", "1.0"),
    "mscale_all_dim": (0.0, True, math.inf, False, "it scales YaRN's attention temperature", "0.0"),
    "low_freq_factor": (0.0, False, math.inf, False, "Llama 3's wavelength boundary divides by it", "1.0"),
    "high_freq_factor": (0.0, False, math.inf, False, "Llama 3's wavelength boundary divides by it", "4.0"),
    "partial_rotary_factor": (0.0, False, 1.0, True, "the share of each head's dimensions that rotate", "1.0"),
}
_ROPE_LISTS = ("short_factor", "long_factor")  # LongRoPE's per-frequency factors: each in (0, inf)


def _check_rope_parameters(rope_parameters) -> None:
    """A ValueError naming the first rope_parameters field outside its range (`_ROPE_RANGES`), or a non-number."""
    if not isinstance(rope_parameters, dict):
        return
    for key, (low, low_in, high, high_in, why, example) in _ROPE_RANGES.items():
        value = rope_parameters.get(key)
        if value is None:
            continue
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        inside = number and (low <= value if low_in else low < value) and (value <= high if high_in else value < high)
        if not inside:
            upper = "" if high == math.inf else f" and {'<=' if high_in else '<'} {high:g}"
            raise ValueError(
                f"rope_parameters.{key}={value!r} must be a finite number {'>=' if low_in else '>'} {low:g}{upper} "
                f"({why}): use e.g. {example}."
            )
    for key in _ROPE_LISTS:
        values = rope_parameters.get(key)
        if values is None:
            continue
        if not isinstance(values, (list, tuple)) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < math.inf for v in values
        ):
            raise ValueError(
                f"rope_parameters.{key} must be a list of finite numbers > 0 (LongRoPE divides each frequency by "
                "one): fix the list."
            )
    high, low = rope_parameters.get("high_freq_factor"), rope_parameters.get("low_freq_factor")
    if high is not None and low is not None and not high > low:
        raise ValueError(
            f"rope_parameters.high_freq_factor={high!r} must exceed low_freq_factor={low!r} (Llama 3's smoothing "
            "divides by their difference): use e.g. 4.0 and 1.0."
        )


# Mirrors transformers.models.llama.configuration_llama.LlamaConfig
# diff with Llama: `num_attention_heads` counts differential heads and `head_dim` is a sub-head's (default
# hidden_size // 2H); no `pretraining_tp`; the Diff fields; its own validation (`validate_values`) and λ plans
@strict
class DiffConfig(PreTrainedConfig):
    r"""
    Configuration of a decoder-only Diff Transformer. Every field of `LlamaConfig` keeps its meaning, except that
    `num_attention_heads` counts *differential* heads (H) and `head_dim` is the size d of one query/key sub-head.
    The fields below are the ones Diff models add or read differently; they are keyword arguments of the constructor.

    Example:
        ```python
        config = DiffConfig(hidden_size=512, num_attention_heads=4, num_key_value_heads=2, diff_version=2)
        ```

    Attributes:
        diff_version (int):
            1: the ICLR 2025 paper, `(softmax(Q1K1ᵀ) - λ softmax(Q2K2ᵀ)) V` with a per-layer scalar λ, V of width 2d
            and a per-head RMSNorm (`subln`). 2: Diff Transformer V2, 2H standard query heads paired as
            `a_2h - sigmoid(W_λ x)_h a_2h+1`, K/V and cache exactly a Llama's. Defaults to 2. A config dict or
            config.json *without* the field (`from_dict`, `from_pretrained`) is V1: 1 was the default when such
            checkpoints were saved. Saved configs always hold the field.
        head_dim (int | None):
            Query/key sub-head size d. Defaults to `hidden_size // (2 * num_attention_heads)`, so that V1 has the
            parameter count of a Llama with `2 * num_attention_heads` heads of size d (plus 6d per layer).
        lambda_init (float | None):
            V1 only. `None` uses the paper's depth schedule `0.8 - 0.6 exp(-0.3 layer_idx)`; a float fixes it.
        lambda_std (float):
            Standard deviation of the initial V1 re-parameterisation vectors `lambda_{q,k}{1,2}`. Defaults to 0.1.
        lambda_floor (float | None):
            V1 only. `None` (default): the paper's λ, unbounded below. A float m in [0, 1) keeps λ above m throughout
            training, so the layer always subtracts its second map: λ = m + softplus₁₀₀(λ_paper − m), which equals
            λ_paper (to within 3e-9) wherever λ_paper ≥ m + 0.2 and approaches m smoothly below it.
        attention_out_bias (bool | None):
            Whether `o_proj` has a bias. `None` (default) follows `attention_bias`; Qwen2 has q/k/v biases and none on
            `o_proj` (`attention_bias=True, attention_out_bias=False`).
        num_noise_heads (int | None):
            V1 only. Grouped differential attention (GDA, arXiv 2510.06949; Motif-2-12.7B): `num_attention_heads`
            still counts the differential (signal) heads H, each with its own q1, but their second maps come from
            `num_noise_heads` shared noise queries: noise query j serves the H / num_noise_heads signal heads
            `j·r .. j·r + r − 1` (r = H / num_noise_heads). q_proj holds, per noise group, the r signal queries then
            the noise query ((H + num_noise_heads)·d rows); k_proj, v_proj and o_proj (2H·d inputs) are V1's. Must
            divide H and be a multiple of `num_key_value_heads` (a noise query attends one key/value group, the one
            its signal heads use). `None` (default): one noise query per head, the paper's V1 (the same model as
            `num_noise_heads=num_attention_heads`).
        lambda_init_depth_offset (int):
            V1 only, with `lambda_init=None`: the depth schedule reads `0.8 - 0.6 exp(-0.3 (layer_idx + offset))`.
            0 (default): the paper's code (0-based layer index). Motif's models use -1.
        subln_eps (float | None):
            V1 only: the eps of the per-head RMSNorm `subln`. `None` (default) uses `rms_norm_eps`; Motif's models
            set their own (`attn_rms_norm_eps`).
        use_qk_norm (bool):
            Qwen3's `q_norm` / `k_norm`: an RMSNorm over each d-wide query and key (sub-)head before RoPE, one weight
            of size d shared by all heads (V1: by q1, q2, k1 and k2 alike). Defaults to False.
        conversion (dict | None):
            Provenance of a checkpoint converted from another architecture, written by the converter: `source`,
            `base_model` (Hub id, when known), `source_model_type`, `function_preserving`, `converter` and
            `card_data` (licence/language of the source's card); a Llama -> V1 conversion adds `v1_init` ("calibrated":
            λ_init = 0 with mirrored λ vectors and fitted `subln` gains, with `calibration_text`, `calibration_tokens`
            and `subln_relative_residual`; or "paper"). Metadata only: the model never reads it. The
            diff_transformer package builds the model card from it (and checks `card_data` then), so a converted
            model re-saved or pushed later still names its base model. `None` for models built as Diff models.
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
        # Checkpoints saved while V1 was the default may omit `diff_version` (transformers 4 left out fields equal to
        # the class default): they stay V1. `to_dict` always writes the field, so no new checkpoint relies on this.
        if "diff_version" not in config_dict:
            config_dict = {**config_dict, "diff_version": 1}
        # `map_first_inference` was a config field until it became the backend "diff_map_first": a config.json (or a
        # from_pretrained keyword) that names it still loads, and the one that asked for it is told how to ask now.
        asked = [config_dict.get(_MAP_FIRST_INFERENCE), kwargs.pop(_MAP_FIRST_INFERENCE, None)]
        config_dict = {key: value for key, value in config_dict.items() if key != _MAP_FIRST_INFERENCE}
        if any(asked):
            logger.warning(
                f"{_MAP_FIRST_INFERENCE}=True is no longer a config field and is ignored: V2's map-first CPU path is "
                "now the attention backend 'diff_map_first' (from_pretrained(..., attn_implementation="
                "'diff_map_first') with the diff_transformer package installed)."
            )
        return super().from_dict(config_dict, **kwargs)

    def __post_init__(self, **kwargs):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.attention_dropout is None:  # the type allows None (as Llama's does); it means no dropout
            self.attention_dropout = 0.0
        # `@strict` runs every `validate_*` method after construction (and on `validate()` / `save_pretrained`),
        # wrapping errors in a two-line StrictDataclassClassValidationError. They are called here first, before
        # anything is derived from the values, so a bad value is one plain ValueError naming the field and the fix.
        self.validate_architecture()
        if self.head_dim is None:
            self.head_dim = self.hidden_size // (2 * self.num_attention_heads)
        self.validate_values()
        super().__post_init__(**kwargs)
        self.base_model_tp_plan = {**type(self).base_model_tp_plan, **_TP_PLAN_BY_VERSION[self.diff_version]}
        if self.use_qk_norm:
            self.base_model_tp_plan.update(_TP_PLAN_QK_NORM)
        if self.hidden_act == POLY_NORM:  # PolyNorm normalises over the whole intermediate width: the MLP stays whole
            for name in ("gate_proj", "up_proj", "down_proj"):
                self.base_model_tp_plan.pop(f"layers.*.mlp.{name}")
        # Saved models carry their code (configuration_diff.py, modeling_diff.py): point every Auto class at it, so
        # a checkpoint loads with trust_remote_code=True where diff_transformer is not installed.
        self.auto_map = {**AUTO_MAP, **(getattr(self, "auto_map", None) or {})}

    def validate_architecture(self):
        """Part of `@strict`-powered validation (as in `LlamaConfig`): version and head geometry."""
        if self.diff_version not in (1, 2):
            raise ValueError(
                f"diff_version={self.diff_version!r} is not supported: "
                "use 1 (ICLR 2025 paper) or 2 (Diff Transformer V2)."
            )
        sizes = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers")
        for name in (*sizes, "vocab_size", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be a positive integer: set it to a size > 0.")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not divisible by num_key_value_heads="
                f"{self.num_key_value_heads}: every differential head needs one key/value group. Pick a "
                "num_key_value_heads that divides num_attention_heads."
            )
        if self.head_dim is None and self.hidden_size < 2 * self.num_attention_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} cannot be split into 2 x num_attention_heads="
                f"{self.num_attention_heads} sub-heads: lower num_attention_heads or set head_dim explicitly."
            )

    def validate_values(self):
        """Part of `@strict`-powered validation: values that would otherwise give NaN logits or fail deep in torch."""
        if self.head_dim <= 0 or self.head_dim % 2 != 0:
            raise ValueError(
                f"head_dim={self.head_dim} must be a positive even number (rotary embeddings rotate pairs of "
                "dimensions): set head_dim explicitly or change hidden_size / num_attention_heads."
            )
        if self.hidden_act not in ACT2FN and self.hidden_act != POLY_NORM:
            raise ValueError(
                f"hidden_act={self.hidden_act!r} is not an activation transformers knows: use a key of "
                f"transformers.activations.ACT2FN, e.g. 'silu' (Llama's), 'gelu' or 'relu', or {POLY_NORM!r} "
                "(Motif's PolyNorm)."
            )
        # `not x > 0` (rather than `x <= 0`) also catches NaN, for which every comparison is False. RMSNorm adds eps
        # in fp32, where anything below its smallest normal number (1.2e-38) is lost or denormal: 1e-300 is 0 there.
        if not FP32_TINY <= self.rms_norm_eps < math.inf:
            raise ValueError(
                f"rms_norm_eps={self.rms_norm_eps} must be a finite number >= {FP32_TINY:.3g} (RMSNorm divides by "
                "sqrt(mean(x²) + eps) in float32: an eps that is 0 there gives NaN for an all-zero hidden state): "
                "use e.g. 1e-6 or 1e-5."
            )
        _check_rope_parameters(self.rope_parameters)
        if not 0.0 <= self.initializer_range <= 1.0:
            raise ValueError(
                f"initializer_range={self.initializer_range} must lie in [0, 1] (the std of the initial weights): "
                "use e.g. 0.02."
            )
        if not 0.0 <= self.attention_dropout < 1.0:
            raise ValueError(
                f"attention_dropout={self.attention_dropout} must lie in [0, 1) (a dropout probability; 1 drops "
                "every attention weight): use 0.0 to disable it."
            )
        if self.attention_dropout and self.diff_version == 1:
            # The V1 pair shares one softmax per map; independent dropout masks would break the noise cancellation.
            raise ValueError(
                f"attention_dropout={self.attention_dropout} is not supported with diff_version=1: set it to 0.0 "
                "or use diff_version=2."
            )
        if self.lambda_init is not None and not 0.0 <= self.lambda_init < 1.0:
            raise ValueError(
                f"lambda_init={self.lambda_init} must lie in [0, 1) (V1 scales the output by 1 - lambda_init); "
                "use None for the paper's depth schedule."
            )
        if not 0.0 <= self.lambda_std < math.inf:
            raise ValueError(
                f"lambda_std={self.lambda_std} must be a finite number >= 0 (the std of V1's initial λ vectors, "
                "which feed an exp()): use e.g. 0.1, the paper's value."
            )
        floor = self.lambda_floor
        number = isinstance(floor, (int, float)) and not isinstance(floor, bool)
        if floor is not None and not (number and 0 <= floor < 1):
            raise ValueError(
                f"lambda_floor={self.lambda_floor} must lie in [0, 1) (the least λ V1 may reach): use e.g. 0.05, or "
                "None for the paper's unbounded λ."
            )
        self.validate_motif_options()

    def validate_motif_options(self):
        """Part of `@strict`-powered validation: grouped differential attention, λ_init's depth offset, subln's eps."""
        noise = self.num_noise_heads
        if noise is not None:
            heads, kv_heads = self.num_attention_heads, self.num_key_value_heads
            if self.diff_version != 1:
                raise ValueError(
                    f"num_noise_heads={noise} (grouped differential attention) needs diff_version=1: set "
                    "diff_version=1 or num_noise_heads=None."
                )
            if isinstance(noise, bool) or not isinstance(noise, int) or noise <= 0 or heads % noise:
                raise ValueError(
                    f"num_noise_heads={noise!r} must be a positive integer dividing num_attention_heads={heads} "
                    "(each noise query serves num_attention_heads / num_noise_heads signal heads): pick a divisor, "
                    "or None for one noise query per head."
                )
            if noise % kv_heads:
                raise ValueError(
                    f"num_noise_heads={noise} must be a multiple of num_key_value_heads={kv_heads}: a noise query "
                    "attends the one key/value group of the signal heads it serves. Raise num_noise_heads or lower "
                    "num_key_value_heads."
                )
        offset = self.lambda_init_depth_offset
        if isinstance(offset, bool) or not isinstance(offset, int):
            raise ValueError(
                f"lambda_init_depth_offset={offset!r} must be an integer (added to the layer index in λ_init's depth "
                "schedule): use 0 (the paper's) or -1 (Motif's)."
            )
        # V1 scales each layer's output by 1 - λ_init = 0.2 + 0.6 exp(-0.3 (layer_idx + offset)), largest at layer 0,
        # in the model's dtype: finite in float16, the narrowest (65504), only for offset >= -38 (-39 gives 72,343).
        if (
            self.diff_version == 1
            and self.lambda_init is None
            and not LAMBDA_OFFSET_RANGE[0] <= offset <= LAMBDA_OFFSET_RANGE[1]
        ):
            digits = str(offset)
            shown = digits if len(digits) <= 12 else f"{digits[:6]}... ({len(digits)} digits)"
            raise ValueError(
                f"lambda_init_depth_offset={shown} must lie in [{LAMBDA_OFFSET_RANGE[0]}, {LAMBDA_OFFSET_RANGE[1]}] "
                "(below, layer 0's output scale 1 - λ_init overflows float16): use 0 (the paper's) or -1 (Motif's)."
            )
        # As rms_norm_eps: subln adds eps in float32, where anything below its smallest normal number is lost.
        eps = self.subln_eps
        if eps is not None and not (isinstance(eps, (int, float)) and FP32_TINY <= eps < math.inf):
            raise ValueError(
                f"subln_eps={eps} must be a finite number >= {FP32_TINY:.3g} (a smaller eps is 0 in float32: NaN for "
                "an all-zero head): use e.g. 1e-5, or None for rms_norm_eps."
            )

    def lambda_init_for_layer(self, layer_idx: int) -> float:
        """V1's λ_init of a (0-based) layer: the configured constant, or the paper's depth schedule (shifted by
        `lambda_init_depth_offset`: Motif's models use layer_idx - 1)."""
        if self.lambda_init is not None:
            return float(self.lambda_init)
        return 0.8 - 0.6 * math.exp(-0.3 * (layer_idx + self.lambda_init_depth_offset))


__all__ = ["DiffConfig"]
