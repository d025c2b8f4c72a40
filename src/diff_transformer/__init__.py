"""Differential attention (Diff Transformer V1 and V2) as a Hugging Face transformers model.

Importing the package registers `model_type="diff"` with the Auto classes, so `AutoConfig`, `AutoModel`,
`AutoModelForCausalLM` and the task heads' Auto classes (sequence and token classification, question answering) resolve
Diff checkpoints natively (no `trust_remote_code` needed).
"""

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

from ._version import __version__  # noqa: F401  (one place: setup.cfg and --version read it too)
from .configuration_diff import DiffConfig
from .integrations import install as _install_integrations
from .integrations.peft import register_peft_defaults
from .layers import DifferentialAttention, differential_attention
from .modeling_diff import (
    DiffAttention,
    DiffAttentionV1,
    DiffAttentionV2,
    DiffDecoderLayer,
    DiffForCausalLM,
    DiffForQuestionAnswering,
    DiffForSequenceClassification,
    DiffForTokenClassification,
    DiffModel,
    DiffPreTrainedModel,
)


AutoConfig.register(DiffConfig.model_type, DiffConfig, exist_ok=True)
AutoModel.register(DiffConfig, DiffModel, exist_ok=True)
AutoModelForCausalLM.register(DiffConfig, DiffForCausalLM, exist_ok=True)
AutoModelForSequenceClassification.register(DiffConfig, DiffForSequenceClassification, exist_ok=True)
AutoModelForTokenClassification.register(DiffConfig, DiffForTokenClassification, exist_ok=True)
AutoModelForQuestionAnswering.register(DiffConfig, DiffForQuestionAnswering, exist_ok=True)

# `save_pretrained` copies these classes' source files next to the weights and writes `auto_map`, so saved models
# also load with `trust_remote_code=True` where this package is not installed.
DiffConfig.register_for_auto_class("AutoConfig")
DiffModel.register_for_auto_class("AutoModel")
DiffForCausalLM.register_for_auto_class("AutoModelForCausalLM")
DiffForSequenceClassification.register_for_auto_class("AutoModelForSequenceClassification")
DiffForTokenClassification.register_for_auto_class("AutoModelForTokenClassification")
DiffForQuestionAnswering.register_for_auto_class("AutoModelForQuestionAnswering")

# What the package adds to the model classes and to transformers (see `integrations`): the "diff_triton" attention
# backend (V1's fused kernel), the model card on save/push, PEFT's default target modules for "diff" (peft is not
# imported here: it is slow; Diff models constructed after it is imported register too).
_install_integrations()

__all__ = [
    "DiffConfig",
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
    "DifferentialAttention",
    "differential_attention",
    "register_peft_defaults",
]
