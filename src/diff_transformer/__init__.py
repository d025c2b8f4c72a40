"""Differential attention (Diff Transformer V1 and V2) as a Hugging Face transformers model.

Importing the package registers `model_type="diff"` with the Auto classes, so `AutoConfig`, `AutoModel`,
`AutoModelForCausalLM` and the task heads' Auto classes (sequence and token classification, question answering) resolve
Diff checkpoints natively (no `trust_remote_code` needed).

One exception: while the `diff-transformer` command starts (the console script, `python -m diff_transformer`), the
package imports neither torch nor transformers, so `--version` and `--help` answer at once; the command registers
everything (`_load`) before it runs a subcommand, and the public names load on first use there too.
"""

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ._version import __version__  # noqa: F401  (one place: setup.cfg and --version read it too)


# The modules whose `__all__` lists the package's public names, in order: each module's `__all__` is the one list of
# its names (the model files' own, shipped with checkpoints), and `_load` binds them here.
PUBLIC_MODULES = (".configuration_diff", ".integrations.peft", ".layers", ".modeling_diff")

if TYPE_CHECKING:  # `PUBLIC_MODULES` for type checkers and mkdocstrings, which read a star import through `__all__`
    # (tests/model/test_package.py holds this block to the tuple)
    from .configuration_diff import *  # noqa: F403
    from .integrations.peft import *  # noqa: F403
    from .layers import *  # noqa: F403
    from .modeling_diff import *  # noqa: F403


def _load() -> None:
    """Import the model classes, register them with transformers' Auto classes and install the integrations (what
    `import diff_transformer` does, except while the command starts)."""
    global _loaded
    if _loaded:
        return
    _loaded = True  # before the imports: a module that reads a name of ours while they run gets no second _load
    from .integrations import install as _install_integrations
    from .integrations.auto_classes import register_auto_classes

    modules = [importlib.import_module(module, __name__) for module in PUBLIC_MODULES]
    public = {name: getattr(module, name) for module in modules for name in module.__all__}
    register_auto_classes()  # `integrations.auto_classes`: the table of Auto classes, shared with checkpoints/

    # What the package adds to the model classes and to transformers (see `integrations`): the "diff_triton" attention
    # backend (V1's fused kernel), the model card on save/push, PEFT's default target modules for "diff" (peft is not
    # imported here: it is slow; Diff models constructed after it is imported register too).
    _install_integrations()

    globals().update(public, __all__=list(public))


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
    # While the command starts, a public name (or `__all__`) loads the package; a submodule's name does not (`from
    # diff_transformer import cli` asks for the attribute before it imports the submodule).
    public = name == "__all__" or not (name.startswith("_") or importlib.util.find_spec(f"{__name__}.{name}"))
    if public and not _loaded:
        _load()
        if name in globals():
            return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_loaded = False
if not _command_starting():
    _load()
