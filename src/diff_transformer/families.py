"""The source families: every checkpoint family the converter reads, as data (docs/design.md, "Converting a Llama
checkpoint"). What differs between families is written here once; the converter (conversion/), the weight checks
(checkpoints/loading.py) and the model card (integrations/hub.py) read it from a `Family`, so adding a family that is
Llama's decoder up to `DiffConfig`'s flags is one entry below. This module imports nothing of the package, so every
part may import it.

Four families are "Llama-shaped": Llama's decoder (RMSNorm, rotate-half RoPE, GQA attention, gated SiLU MLP) up to
details that `DiffConfig` expresses, so the same tensor maps convert all of them and V2 stays exact:

| model_type | differs from Llama by                                        | in DiffConfig            |
|------------|--------------------------------------------------------------|--------------------------|
| llama      | -                                                            | -                        |
| mistral    | a sliding window (refused when shorter than the context)     | -                        |
| qwen2      | q/k/v biases, none on o_proj (hard-coded in Qwen2Attention)  | attention_out_bias=False |
| qwen3      | RMSNorm of every query/key head before RoPE; head_dim != D/H | use_qk_norm=True         |

Qwen2 and Qwen3 may also use a sliding window on their upper layers (`use_sliding_window`); that is refused too.
Two are differential already and import exactly into V1: transformers' DiffLlama and Motif (no transformers class;
recognised by `architectures: ["MotifForCausalLM"]`, read by conversion/motif.py).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Window:
    """How a family configures sliding-window attention, and the one-line fix when its window is refused."""

    per_layer: bool  # True: only layers listed as "sliding_attention" in `layer_types` slide (Qwen); False: all
    setting: str  # what the message names before `sliding_window=...`
    without: str  # "convert {without}, or ..."
    disable: str  # "... or set {disable} in a copy of SRC"


@dataclass(frozen=True, eq=False)
class Family:
    model_type: str  # config.json's model_type
    name: str  # in messages and cards
    prefix: str | None  # transformers class names: f"{prefix}Config", f"{prefix}ForCausalLM", ...; None: no class
    converter: str  # the public function that converts it (conversion/convert.py)
    llama_shaped: bool  # Llama's decoder up to DiffConfig's flags: Llama's tensor maps, V2 exact, V1 calibrated
    # Attention/MLP flags its modules hard-code (True / False) or read from the config (None): q/k/v biases, o_proj's
    # bias (None: as q/k/v's), the MLP's biases, a per-head RMSNorm of queries and keys.
    attention_bias: bool | None = None
    attention_out_bias: bool | None = None
    mlp_bias: bool | None = None
    qk_norm: bool = False
    window: Window | None = None  # how a sliding window is configured (refused when shorter than the context)
    tasks: bool = True  # its sequence/token classification and question-answering heads convert too
    # Differential already (λ vectors in every layer): imported exactly into V1 by `tensor_map` (conversion/layout.py),
    # nothing to initialise or calibrate; None: Llama's maps (V2 exact, V1 initialised).
    tensor_map: str | None = None
    lambda_std_field: str | None = None  # the config field holding its λ vectors' init std, kept in DiffConfig
    architecture: str | None = None  # recognised by `architectures` whatever its model_type (no transformers class)
    # The model card's "Conversion" section: how the converter mapped it, per diff_version (integrations/hub.py).
    card: tuple[tuple[int, str], ...] = ()

    @property
    def exact_v1(self) -> bool:
        """Imported exactly into V1 (DiffLlama, Motif): the only version it converts to."""
        return self.tensor_map is not None

    @property
    def default_version(self) -> int:
        return 1 if self.exact_v1 else 2

    @property
    def config_class(self) -> str:
        return f"{self.prefix}Config"

    def function_preserving(self, diff_version: int) -> bool:
        """Whether converting it into `diff_version` keeps its function (logits) exactly."""
        return self.exact_v1 or diff_version == 2

    def card_method(self, diff_version: int) -> str:
        return dict(self.card).get(diff_version, "")

    def describe(self) -> str:
        """How messages name it: its model_type, or what recognises it."""
        return f'{self.name} (architectures ["{self.architecture}"])' if self.architecture else repr(self.model_type)


_LLAMA_CARD = (
    (
        2,
        "Source head i became query heads (2i, 2i+1) with identical rows, the λ projection started at zero (λ = 0.5) "
        "and `o_proj` was doubled, so at step 0 the model computed exactly what the source computes. Continued "
        "pretraining lets the two queries of each pair diverge.",
    ),
    (
        1,
        "Source heads became differential heads (paired: each query kept with the key/value head it was trained "
        "with, every weight reused; expanded: see below), with fresh λ vectors: continue pretraining before use.",
    ),
)
_QWEN_WINDOW = Window(
    per_layer=True,
    setting="use_sliding_window=true, ",
    without='a checkpoint without it (Qwen2.5 and Qwen3 ship "use_sliding_window": false)',
    disable="it to false",
)

LLAMA = Family("llama", "Llama", "Llama", "convert_llama_to_diff", True, card=_LLAMA_CARD)
MISTRAL = Family(
    "mistral",
    "Mistral",
    "Mistral",
    "convert_llama_to_diff",
    True,
    attention_bias=False,  # MistralAttention / MistralMLP: no biases
    attention_out_bias=False,
    mlp_bias=False,
    window=Window(
        per_layer=False,
        setting="",
        without='a Mistral without a window (v0.2 and later have "sliding_window": null)',
        disable='"sliding_window": null',
    ),
    card=_LLAMA_CARD,
)
QWEN2 = Family(
    "qwen2",
    "Qwen2",
    "Qwen2",
    "convert_llama_to_diff",
    True,
    attention_bias=True,  # Qwen2Attention: bias=True on q/k/v, bias=False on o_proj
    attention_out_bias=False,
    mlp_bias=False,
    window=_QWEN_WINDOW,
    card=_LLAMA_CARD,
)
QWEN3 = Family(
    "qwen3",
    "Qwen3",
    "Qwen3",
    "convert_llama_to_diff",
    True,
    mlp_bias=False,  # Qwen3MLP has no biases
    qk_norm=True,
    window=_QWEN_WINDOW,
    card=_LLAMA_CARD,
)
DIFFLLAMA = Family(
    "diffllama",
    "DiffLlama",
    "DiffLlama",
    "convert_diffllama_to_diff",
    False,
    mlp_bias=False,  # DiffLlamaMLP: never
    tasks=False,
    tensor_map="DiffLlamaToV1",
    lambda_std_field="lambda_std_dev",
    card=(
        (
            1,
            "Imported from transformers' DiffLlama into the V1 (paper) layout with the head permutation that "
            "reproduces DiffLlama's logits.",
        ),
    ),
)
MOTIF = Family(
    "motif",
    "Motif",
    None,  # transformers has no class: conversion/motif.py reads its config as a LlamaConfig, biases included
    "convert_motif_to_diff",
    False,
    tasks=False,
    tensor_map="MotifToV1",
    architecture="MotifForCausalLM",
    card=(
        (
            1,
            "Imported exactly from Motif's differential attention (stripe pairs; grouped differential attention "
            "with `num_noise_heads`): Motif's head layout is the V1 layout, so every weight kept its rows and "
            'columns; PolyNorm (`hidden_act="poly_norm"`), the shared noise heads, Motif\'s λ_init schedule '
            "(`lambda_init_depth_offset=-1`) and its subln eps (`subln_eps`) are config options.",
        ),
    ),
)
MOTIF_ARCHITECTURE = MOTIF.architecture

# Every family the converter reads, by model_type.
FAMILIES = {f.model_type: f for f in (LLAMA, MISTRAL, QWEN2, QWEN3, DIFFLLAMA, MOTIF)}
# The Llama-shaped ones, converted by the same maps (`convert_llama_to_diff`).
LLAMA_SHAPED = {name: f for name, f in FAMILIES.items() if f.llama_shaped}


def family_of(model_type: str | None) -> Family | None:
    """The family of a `model_type` (what a converted config records as `conversion.source_model_type`)."""
    return FAMILIES.get(model_type) if isinstance(model_type, str) else None


def is_motif(config: dict) -> bool:
    """Whether a raw config.json describes a Motif model (by its architecture, or a `model_type` "motif")."""
    architectures = config.get("architectures") or []
    model_type = config.get("model_type")
    return MOTIF.architecture in architectures or (
        isinstance(model_type, str) and model_type.lower() == MOTIF.model_type
    )


def family_of_config(config: dict) -> Family | None:
    """The family of a raw config.json: Motif by its architecture (`is_motif`), else by `model_type`."""
    return MOTIF if is_motif(config) else family_of(config.get("model_type"))


__all__ = [
    "DIFFLLAMA",
    "FAMILIES",
    "LLAMA",
    "LLAMA_SHAPED",
    "MISTRAL",
    "MOTIF",
    "MOTIF_ARCHITECTURE",
    "QWEN2",
    "QWEN3",
    "Family",
    "Window",
    "family_of",
    "family_of_config",
    "is_motif",
]
