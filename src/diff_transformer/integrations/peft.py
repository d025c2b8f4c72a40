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

`diff-transformer train --lora` names the base in adapter_config.json by its absolute directory, so that PEFT loads
it from anywhere on this machine; on the Hub that path names nothing (and tells the world about the trainer's disk).
So `push_to_hub` of a PEFT model whose base is a Diff model refuses, before anything is created or uploaded, an
adapter whose base is a local directory, and says how to name the base by its Hub id (`guard_adapter_push`).

The λ parameters are not adapted by default. To train them (recommended after converting a Llama: V2's λ projection
starts at zero), pass `modules_to_save=["diff_lambda"]`: they are then trained in full and saved with the adapter.
"""

import functools
import importlib.util
import os
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


def local_base(name) -> bool:
    """Whether an adapter's `base_model_name_or_path` names a local directory (what the Hub cannot resolve): an
    absolute path, or one that exists here (transformers tries a local directory before the Hub)."""
    return isinstance(name, str) and (os.path.isabs(os.path.expanduser(name)) or os.path.isdir(name))


def _refuse_local_bases(model) -> None:
    for adapter, config in model.peft_config.items():
        base = config.base_model_name_or_path
        if local_base(base):
            raise ValueError(
                f"adapter {adapter!r} names its base model by the local directory {base}, which means nothing on the "
                "Hub: push the base first (base.push_to_hub('you/base')), then set "
                f"model.peft_config[{adapter!r}].base_model_name_or_path = 'you/base' and push the adapter again."
            )


def guard_adapter_push() -> None:
    """Make `PeftModel.push_to_hub` refuse, before it creates the repo, an adapter on a Diff model whose
    adapter_config.json would name a local directory as its base (what `train --lora` records for a local base).

    Relies on: `PeftModel.push_to_hub` being transformers' `PushToHubMixin.push_to_hub`, which writes
    adapter_config.json from `peft_config` (`PeftModel.save_pretrained`) and uploads it as it is. Guarded by
    tests/hub/test_hub.py::test_push_of_an_adapter_on_a_local_base_is_refused_before_anything_is_created. Models on
    other bases push as PEFT pushes them. Needs peft installed.
    """
    PeftModel = getattr(sys.modules.get("peft") or importlib.import_module("peft"), "PeftModel", None)
    if PeftModel is None:  # peft is still being imported (it imports nothing of ours): the next trigger guards
        return
    push = PeftModel.push_to_hub
    if getattr(push, "_refuses_local_bases", False):
        return

    @functools.wraps(push)
    def push_to_hub(self, *args, **kwargs):
        if isinstance(self.get_base_model(), DiffPreTrainedModel):
            _refuse_local_bases(self)
        return push(self, *args, **kwargs)

    push_to_hub._refuses_local_bases = True
    PeftModel.push_to_hub = push_to_hub


def v1_prefix_heads(config) -> int | None:
    """The key/value heads a V1 layer's cache holds (2 H_kv of size d: docs/design.md, "Cache layouts"), or None
    for a config whose cache holds `num_key_value_heads`, as PEFT assumes."""
    if getattr(config, "model_type", None) != "diff" or getattr(config, "diff_version", None) != 1:
        return None
    return 2 * config.num_key_value_heads


def size_prefixes_for_v1_caches() -> None:
    """Make PEFT's prefix tuning size a V1 model's virtual keys and values as V1's cache holds them: 2 H_kv heads of
    size d per layer, where PEFT reads H_kv heads from the config and the first forward fails in the cache's
    concatenation. V2 and every other model are sized as PEFT sizes them.

    Relies on: `PeftModel.add_adapter` sizing a prompt-learning adapter through
    `peft.peft_model._prepare_prompt_learning_config(peft_config, model_config)`, which for prefix tuning of a GQA
    model sets `num_attention_heads = num_key_value_heads` and `token_dim = head_dim × num_key_value_heads`; the
    prompt encoder and the cache it builds take these sizes. Guarded by tests/training/test_peft.py::
    test_prefix_tuning_v1_equals_an_explicit_cache. Needs peft installed.
    """
    peft_model = importlib.import_module("peft.peft_model")
    prepare = getattr(peft_model, "_prepare_prompt_learning_config", None)
    if prepare is None or getattr(prepare, "_sizes_v1_prefixes", False):  # None: peft is still being imported
        return

    @functools.wraps(prepare)
    def _prepare_prompt_learning_config(peft_config, model_config):
        peft_config = prepare(peft_config, model_config)
        heads = v1_prefix_heads(model_config)
        if heads and peft_config.peft_type == "PREFIX_TUNING":
            peft_config.num_attention_heads, peft_config.token_dim = heads, heads * model_config.head_dim
        return peft_config

    _prepare_prompt_learning_config._sizes_v1_prefixes = True
    peft_model._prepare_prompt_learning_config = _prepare_prompt_learning_config


def register_peft_defaults() -> bool:
    """Register "diff" next to "llama" in PEFT's default-target tables, guard adapter pushes (`guard_adapter_push`)
    and size V1's prefixes (`size_prefixes_for_v1_caches`), importing peft. False if peft is missing."""
    if importlib.util.find_spec("peft") is None:
        return False
    add_diff_to_peft_default_targets()
    guard_adapter_push()
    size_prefixes_for_v1_caches()
    return True


def register_if_peft_imported() -> None:
    if sys.modules.get("peft") is not None:  # None: an import of peft was blocked
        add_diff_to_peft_default_targets()
        guard_adapter_push()
        if "peft.peft_model" in sys.modules:  # else peft is still being imported: the next trigger sizes prefixes
            size_prefixes_for_v1_caches()


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


__all__ = ["register_peft_defaults"]
