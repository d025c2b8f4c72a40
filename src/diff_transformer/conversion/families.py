"""The checkpoint families the converter reads, and what each needs from `DiffConfig` (docs/design.md, "Converting a
Llama checkpoint").

Each family below is Llama's decoder (RMSNorm, rotate-half RoPE, GQA attention, gated SiLU MLP) up to details that
`DiffConfig` expresses, so the same tensor maps convert all of them and V2 stays exact:

| model_type | differs from Llama by                                        | in DiffConfig            |
|------------|--------------------------------------------------------------|--------------------------|
| llama      | -                                                            | -                        |
| mistral    | a sliding window (refused when shorter than the context)     | -                        |
| qwen2      | q/k/v biases, none on o_proj (hard-coded in Qwen2Attention)  | attention_out_bias=False |
| qwen3      | RMSNorm of every query/key head before RoPE; head_dim != D/H | use_qk_norm=True         |

Qwen2 and Qwen3 may also use a sliding window on their upper layers (`use_sliding_window`); that is refused too.
A checkpoint is either the causal LM or one of the task heads (`score` / `qa_outputs`), copied as they are.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .errors import ConversionError
from .layout import Geometry


@dataclass(frozen=True)
class Family:
    model_type: str
    prefix: str  # transformers class names: f"{prefix}Config", f"{prefix}ForCausalLM", ...

    @property
    def config_class(self) -> str:
        return f"{self.prefix}Config"

    def attention(self, config) -> dict:
        """The attention/MLP flags of `Geometry` (and DiffConfig) that this family's modules hard-code or configure."""
        if self.model_type == "qwen2":  # Qwen2Attention: bias=True on q/k/v, bias=False on o_proj
            return dict(attention_bias=True, attention_out_bias=False, mlp_bias=False, qk_norm=False)
        if self.model_type == "mistral":  # MistralAttention / MistralMLP: no biases
            return dict(attention_bias=False, attention_out_bias=False, mlp_bias=False, qk_norm=False)
        bias = bool(getattr(config, "attention_bias", False))
        if self.model_type == "qwen3":  # Qwen3MLP has no biases
            return dict(attention_bias=bias, attention_out_bias=bias, mlp_bias=False, qk_norm=True)
        mlp_bias = bool(getattr(config, "mlp_bias", False)) and self.model_type == "llama"  # DiffLlama: never
        return dict(attention_bias=bias, attention_out_bias=bias, mlp_bias=mlp_bias, qk_norm=False)

    def check_supported(self, config, where: str) -> None:
        """Refuse what a Diff model cannot compute: a sliding window shorter than the context."""
        context = int(config.max_position_embeddings)
        window = getattr(config, "sliding_window", None)
        if self.model_type in ("qwen2", "qwen3"):
            # Qwen's config drops the window unless use_sliding_window, then slides only from max_window_layers up.
            sliding = "sliding_attention" in (getattr(config, "layer_types", None) or [])
            if sliding and window is not None and window < context:
                raise ConversionError(
                    f"{where} uses sliding-window attention (use_sliding_window=true, sliding_window={window} < "
                    f"max_position_embeddings={context}), which Diff models do not implement: convert a checkpoint "
                    'without it (Qwen2.5 and Qwen3 ship "use_sliding_window": false), or set it to false in a copy of '
                    f"SRC to accept attention over the whole context (the same function up to {window} tokens)."
                )
        elif self.model_type == "mistral" and window is not None and window < context:
            raise ConversionError(
                f"{where} uses sliding-window attention (sliding_window={window} < max_position_embeddings="
                f"{context}), which Diff models do not implement: convert a Mistral without a window (v0.2 and "
                'later have "sliding_window": null), or set "sliding_window": null in a copy of SRC to accept '
                f"attention over the whole context (the same function up to {window} tokens)."
            )


@dataclass(frozen=True)
class Task:
    suffix: str  # "ForCausalLM" in "LlamaForCausalLM"
    diff_class: str

    def head(self, geometry: Geometry, config) -> tuple[tuple[str, tuple[int, ...]], ...] | None:
        """The tensors on top of the decoder (name, shape); None: the causal LM's lm_head (maybe tied)."""
        D, labels = geometry.hidden_size, int(getattr(config, "num_labels", 2))
        if self.suffix == "ForSequenceClassification":
            return (("score.weight", (labels, D)),)
        if self.suffix == "ForTokenClassification":
            return (("score.weight", (labels, D)), ("score.bias", (labels,)))
        if self.suffix == "ForQuestionAnswering":
            return (("qa_outputs.weight", (2, D)), ("qa_outputs.bias", (2,)))
        return None


# The Llama-shaped families, all converted by the same maps (`convert_llama_to_diff`).
FAMILIES = {
    f.model_type: f
    for f in (
        Family("llama", "Llama"),
        Family("mistral", "Mistral"),
        Family("qwen2", "Qwen2"),
        Family("qwen3", "Qwen3"),
    )
}
DIFFLLAMA = Family("diffllama", "DiffLlama")
# Motif (conversion/motif.py): recognised by `architectures: ["MotifForCausalLM"]`; transformers has no class for it
# (its config is read as a LlamaConfig by `motif.motif_config`), causal LM only.
MOTIF = Family("motif", "Motif")
CAUSAL_LM = Task("ForCausalLM", "DiffForCausalLM")
TASKS = (
    CAUSAL_LM,
    Task("ForSequenceClassification", "DiffForSequenceClassification"),
    Task("ForTokenClassification", "DiffForTokenClassification"),
    Task("ForQuestionAnswering", "DiffForQuestionAnswering"),
)


def family_of(model_type: str | None) -> Family | None:
    return DIFFLLAMA if model_type == "diffllama" else FAMILIES.get(model_type)


def family_of_config(config: dict) -> Family | None:
    """The family of a raw config.json: Motif by its architecture (`motif.is_motif`), else by `model_type`."""
    from .motif import is_motif

    return MOTIF if is_motif(config) else family_of(config.get("model_type"))


def task_of(family: Family, architectures: list, where: str) -> Task:
    """The task of a checkpoint from its `architectures` (none listed: a causal LM). DiffLlama: causal LM only."""
    tasks = TASKS if family is not DIFFLLAMA else (CAUSAL_LM,)
    if not architectures:
        return CAUSAL_LM
    for task in tasks:
        if family.prefix + task.suffix in architectures:
            return task
    accepted = ", ".join(family.prefix + task.suffix for task in tasks)
    raise ConversionError(
        f"{where} holds a {', '.join(map(str, architectures))} checkpoint; only {accepted} "
        f"{'converts' if len(tasks) == 1 else 'convert'}: pick such a checkpoint (a causal LM has its lm_head)."
    )


def source_geometry(family: Family, task: Task, config) -> Geometry:
    """The source's shapes and the family's attention details, the head and where the source stores its decoder."""
    import transformers

    geometry = Geometry.from_config(config)
    if family is MOTIF:  # `motif.motif_config` read the biases and the head groups
        motif = config.motif
        return dataclasses.replace(
            geometry,
            attention_bias=motif.qkv_bias,
            attention_out_bias=motif.out_bias,
            mlp_bias=motif.mlp_bias,
            motif_groups=motif.groups,
        )
    source_class = getattr(transformers, family.prefix + task.suffix)
    prefix = getattr(source_class, "base_model_prefix", "model") + "."  # Llama's and Qwen's QA heads: "transformer"
    return dataclasses.replace(geometry, **family.attention(config), head=task.head(geometry, config), prefix=prefix)


__all__ = [
    "CAUSAL_LM",
    "DIFFLLAMA",
    "FAMILIES",
    "MOTIF",
    "TASKS",
    "Family",
    "Task",
    "family_of",
    "family_of_config",
    "source_geometry",
    "task_of",
]
