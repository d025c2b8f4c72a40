"""Differential attention (Diff Transformer V1 and V2) as a Hugging Face transformers model.

Importing the package registers `model_type="diff"` with the Auto classes, so `AutoConfig`, `AutoModel`,
`AutoModelForCausalLM` and the task heads' Auto classes (sequence and token classification, question answering) resolve
Diff checkpoints natively (no `trust_remote_code` needed).

One exception: while the `diff-transformer` command starts (the console script, `python -m diff_transformer`), the
package imports neither torch nor transformers, so `--version` and `--help` answer at once; the command registers
everything (`_load`) before it runs a subcommand, and the names below load on first use there too.
"""

import importlib
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ._version import __version__  # noqa: F401  (one place: setup.cfg and --version read it too)


# The public names, by the module that defines them: `__all__`, `_load`'s imports and the names bound here.
PUBLIC_NAMES = {
    ".configuration_diff": ("DiffConfig",),
    ".modeling_diff": (
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
    ),
    ".layers": ("DifferentialAttention", "differential_attention"),
    ".integrations.peft": ("register_peft_defaults",),
}

__all__ = [name for names in PUBLIC_NAMES.values() for name in names]

if TYPE_CHECKING:  # `PUBLIC_NAMES` spelled out for type checkers and mkdocstrings, which read imports statically
    # (`X as X`: a re-export); tests/model/test_package.py holds this block to the table.
    from .configuration_diff import DiffConfig as DiffConfig
    from .integrations.peft import register_peft_defaults as register_peft_defaults
    from .layers import DifferentialAttention as DifferentialAttention
    from .layers import differential_attention as differential_attention
    from .modeling_diff import DiffAttention as DiffAttention
    from .modeling_diff import DiffAttentionV1 as DiffAttentionV1
    from .modeling_diff import DiffAttentionV2 as DiffAttentionV2
    from .modeling_diff import DiffDecoderLayer as DiffDecoderLayer
    from .modeling_diff import DiffForCausalLM as DiffForCausalLM
    from .modeling_diff import DiffForQuestionAnswering as DiffForQuestionAnswering
    from .modeling_diff import DiffForSequenceClassification as DiffForSequenceClassification
    from .modeling_diff import DiffForTokenClassification as DiffForTokenClassification
    from .modeling_diff import DiffModel as DiffModel
    from .modeling_diff import DiffPreTrainedModel as DiffPreTrainedModel


def _load() -> None:
    """Import the model classes, register them with transformers' Auto classes and install the integrations (what
    `import diff_transformer` does, except while the command starts)."""
    global _loaded
    if _loaded:
        return
    _loaded = True  # before the imports: a module that reads a name of ours while they run gets no second _load
    from .integrations import install as _install_integrations
    from .integrations.auto_classes import register_auto_classes

    public = {
        name: getattr(importlib.import_module(module, __name__), name)
        for module, names in PUBLIC_NAMES.items()
        for name in names
    }
    register_auto_classes()  # `integrations.auto_classes`: the table of Auto classes, shared with checkpoints/

    # What the package adds to the model classes and to transformers (see `integrations`): the "diff_triton" attention
    # backend (V1's fused kernel), the model card on save/push, PEFT's default target modules for "diff" (peft is not
    # imported here: it is slow; Diff models constructed after it is imported register too).
    _install_integrations()

    globals().update(public)


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
