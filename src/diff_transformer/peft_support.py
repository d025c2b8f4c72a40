"""PEFT defaults for `model_type="diff"`.

Diff's module names are Llama's (`q_proj`, `k_proj`, `v_proj`, `o_proj`, `gate_proj`, `up_proj`, `down_proj`,
`input_layernorm`, ...), so every default PEFT has for "llama" is right for "diff" too: `LoraConfig(task_type=
"CAUSAL_LM")` without `target_modules` adapts q_proj and v_proj, IA3 adapts k_proj/v_proj/down_proj, and so on.

Registration is lazy: importing peft takes ~0.15 s on top of diff_transformer's import, and several seconds when
bitsandbytes is installed (peft imports it), so neither this package nor `modeling_diff.py` imports peft. Instead
`import diff_transformer` registers if peft is already imported, and so does every Diff model constructed while it
is (in the package and as Hub custom code alike), which covers any script that imports peft before loading the
model. If a model was built before peft was first imported, call `register_peft_defaults()` (or pass
`target_modules`).

The λ parameters are not adapted by default. To train them (recommended after converting a Llama: V2's λ projection
starts at zero), pass `modules_to_save=["diff_lambda"]`: they are then trained in full and saved with the adapter.
"""

import importlib.util
import sys

from .modeling_diff import add_diff_to_peft_default_targets


def register_peft_defaults() -> bool:
    """Register "diff" next to "llama" in PEFT's default-target tables (importing peft). False if peft is missing."""
    if importlib.util.find_spec("peft") is None:
        return False
    add_diff_to_peft_default_targets()
    return True


def register_if_peft_imported() -> None:
    if sys.modules.get("peft") is not None:  # None: an import of peft was blocked
        add_diff_to_peft_default_targets()
