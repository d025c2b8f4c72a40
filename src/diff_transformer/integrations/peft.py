"""PEFT defaults for `model_type="diff"`.

Diff's module names are Llama's (`q_proj`, `k_proj`, `v_proj`, `o_proj`, `gate_proj`, `up_proj`, `down_proj`,
`input_layernorm`, ...), so every default PEFT has for "llama" is right for "diff" too: `LoraConfig(task_type=
"CAUSAL_LM")` without `target_modules` adapts q_proj and v_proj, IA3 adapts k_proj/v_proj/down_proj, and so on.

Registration is lazy: importing peft takes ~0.15 s on top of diff_transformer's import, and several seconds when
bitsandbytes is installed (peft imports it), so this package never imports peft by itself. Instead
`import diff_transformer` registers if peft is already imported, and so does every Diff model constructed while it
is, which covers any script that imports peft before loading the model. If a model was built before peft was first
imported, call `register_peft_defaults()` (or pass `target_modules`).

This lives in the package, not in the checkpoint's custom code: a model loaded as Hub custom code without the
package has no PEFT defaults, like any custom-code model (pass `target_modules=["q_proj", "v_proj"]`).

The λ parameters are not adapted by default. To train them (recommended after converting a Llama: V2's λ projection
starts at zero), pass `modules_to_save=["diff_lambda"]`: they are then trained in full and saved with the adapter.
"""

import functools
import importlib.util
import sys

from ..modeling_diff import DiffPreTrainedModel


def add_diff_to_peft_default_targets() -> None:
    """Give "diff" every PEFT default table entry that "llama" has (LoRA and its relatives, IA3, LN tuning, ...).

    Relies on: PEFT has no registration API; its tuners look `model_type` up in the module-level dicts
    `peft.utils.constants.TRANSFORMERS_MODELS_TO_*` when `target_modules` is None, so adding a key is all it takes.
    Guarded by tests/training/test_peft.py::test_defaults_registered_on_construction_and_on_request. Needs peft
    installed.
    """
    from peft.utils import constants

    for name, mapping in vars(constants).items():
        if name.startswith("TRANSFORMERS_MODELS_TO_") and isinstance(mapping, dict) and "llama" in mapping:
            mapping.setdefault("diff", mapping["llama"])


def register_peft_defaults() -> bool:
    """Register "diff" next to "llama" in PEFT's default-target tables (importing peft). False if peft is missing."""
    if importlib.util.find_spec("peft") is None:
        return False
    add_diff_to_peft_default_targets()
    return True


def register_if_peft_imported() -> None:
    if sys.modules.get("peft") is not None:  # None: an import of peft was blocked
        add_diff_to_peft_default_targets()


def install_peft_hooks(model_class: type = DiffPreTrainedModel) -> None:
    """Register now if peft is imported, and on every construction of a `model_class` model (so a model built after
    `import peft` gets the defaults whatever was imported first)."""
    register_if_peft_imported()
    if getattr(model_class.__init__, "_registers_peft_defaults", False):
        return
    construct = model_class.__init__

    @functools.wraps(construct)
    def __init__(self, *args, **kwargs):
        construct(self, *args, **kwargs)
        register_if_peft_imported()

    __init__._registers_peft_defaults = True
    model_class.__init__ = __init__
