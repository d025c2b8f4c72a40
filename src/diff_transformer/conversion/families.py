"""What the converter does with a source family (the families themselves, as data: `diff_transformer.families`): the
attention flags a family gives `Geometry` and `DiffConfig`, the sliding windows it refuses, its task heads.

A checkpoint is either the causal LM or one of the task heads (`score` / `qa_outputs`) of a family with `tasks`,
copied as they are.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..families import MOTIF, Family
from .errors import ConversionError
from .layout import Geometry


def attention_flags(family: Family, config) -> dict:
    """The attention/MLP flags of `Geometry` (and DiffConfig) that this family's modules hard-code or configure."""
    bias = bool(getattr(config, "attention_bias", False)) if family.attention_bias is None else family.attention_bias
    out_bias = bias if family.attention_out_bias is None else family.attention_out_bias
    mlp_bias = bool(getattr(config, "mlp_bias", False)) if family.mlp_bias is None else family.mlp_bias
    return dict(attention_bias=bias, attention_out_bias=out_bias, mlp_bias=mlp_bias, qk_norm=family.qk_norm)


def check_supported(family: Family, config, where: str) -> None:
    """Refuse what a Diff model cannot compute: a sliding window shorter than the context."""
    context = int(config.max_position_embeddings)
    window, rule = getattr(config, "sliding_window", None), family.window
    if rule is None or window is None or window >= context:
        return
    # Qwen's config drops the window unless use_sliding_window, then slides only from max_window_layers up.
    if rule.per_layer and "sliding_attention" not in (getattr(config, "layer_types", None) or []):
        return
    raise ConversionError(
        f"{where} uses sliding-window attention ({rule.setting}sliding_window={window} < max_position_embeddings="
        f"{context}), which Diff models do not implement: convert {rule.without}, or set {rule.disable} in a copy of "
        f"SRC to accept attention over the whole context (the same function up to {window} tokens)."
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


CAUSAL_LM = Task("ForCausalLM", "DiffForCausalLM")
TASKS = (
    CAUSAL_LM,
    Task("ForSequenceClassification", "DiffForSequenceClassification"),
    Task("ForTokenClassification", "DiffForTokenClassification"),
    Task("ForQuestionAnswering", "DiffForQuestionAnswering"),
)


def task_of(family: Family, architectures: list, where: str) -> Task:
    """The task of a checkpoint from its `architectures` (none listed: a causal LM); a family without `tasks`: causal
    LM only."""
    tasks = TASKS if family.tasks else (CAUSAL_LM,)
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
    flags = attention_flags(family, config)
    return dataclasses.replace(geometry, **flags, head=task.head(geometry, config), prefix=prefix)


__all__ = [
    "CAUSAL_LM",
    "TASKS",
    "Task",
    "attention_flags",
    "check_supported",
    "source_geometry",
    "task_of",
]
