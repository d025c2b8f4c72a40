"""Differential attention (Diff Transformer V1 and V2) as a Hugging Face transformers model.

Importing the package registers `model_type="diff"` with the Auto classes, so `AutoConfig`, `AutoModel`,
`AutoModelForCausalLM` and the task heads' Auto classes (sequence and token classification, question answering) resolve
Diff checkpoints natively (no `trust_remote_code` needed).

One exception: while the `diff-transformer` command starts (the console script, `python -m diff_transformer`), the
package imports neither torch nor transformers, so `--version` and `--help` answer at once; the command registers
everything (`_load`) before it runs a subcommand, and the names below load on first use there too.
"""

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ._version import __version__  # noqa: F401  (one place: setup.cfg and --version read it too)


if TYPE_CHECKING:  # what `_load` binds, for type checkers and the API reference (mkdocstrings reads this statically)
    from .configuration_diff import DiffConfig
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


def _load() -> None:
    """Import the model classes, register them with transformers' Auto classes and install the integrations (what
    `import diff_transformer` does, except while the command starts)."""
    global _loaded
    if _loaded:
        return
    _loaded = True  # before the imports: a module that reads a name of ours while they run gets no second _load
    from transformers import (
        AutoConfig,
        AutoModel,
        AutoModelForCausalLM,
        AutoModelForQuestionAnswering,
        AutoModelForSequenceClassification,
        AutoModelForTokenClassification,
    )

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

    globals().update(
        DiffConfig=DiffConfig,
        DiffPreTrainedModel=DiffPreTrainedModel,
        DiffModel=DiffModel,
        DiffForCausalLM=DiffForCausalLM,
        DiffForSequenceClassification=DiffForSequenceClassification,
        DiffForTokenClassification=DiffForTokenClassification,
        DiffForQuestionAnswering=DiffForQuestionAnswering,
        DiffAttention=DiffAttention,
        DiffAttentionV1=DiffAttentionV1,
        DiffAttentionV2=DiffAttentionV2,
        DiffDecoderLayer=DiffDecoderLayer,
        DifferentialAttention=DifferentialAttention,
        differential_attention=differential_attention,
        register_peft_defaults=register_peft_defaults,
    )


def _command_starting() -> bool:
    """Whether this import is the `diff-transformer` command starting: its console script, or `python -m
    diff_transformer` / `python -m diff_transformer.cli` (while Python locates that module, argv[0] is "-m"; the
    original command line names the module). Any other program, `python -m` of another module included, gets the
    package as always."""
    argv0 = sys.argv[0] if sys.argv else ""
    if argv0 == "-m":
        original = list(getattr(sys, "orig_argv", []))
        module = original[original.index("-m") + 1] if "-m" in original[:-1] else ""
        return module in ("diff_transformer", "diff_transformer.cli")
    return Path(argv0).name in ("diff-transformer", "diff-transformer.exe", "diff-transformer-script.py")


def __getattr__(name: str):
    if name in __all__ and not _loaded:
        _load()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_loaded = False
if not _command_starting():
    _load()
