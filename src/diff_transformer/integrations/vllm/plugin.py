"""vLLM plugin: with `diff-transformer` installed, `vllm serve PATH` and `vllm.LLM(PATH)` load Diff checkpoints.

vLLM calls `register()` (entry point `vllm.general_plugins` in setup.cfg) in every process it starts: the front end,
the engine core and each worker. It must be cheap and safe to call repeatedly, so the model class is registered by
name and `model` (which imports vLLM's layers) is only imported when vLLM builds a model.
"""

ARCHITECTURE = "DiffForCausalLM"


def register() -> None:
    from transformers import AutoConfig
    from vllm import ModelRegistry

    from ...configuration_diff import DiffConfig

    # vLLM reads config.json with AutoConfig: model_type "diff" resolves without trust_remote_code.
    AutoConfig.register(DiffConfig.model_type, DiffConfig, exist_ok=True)
    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, "diff_transformer.integrations.vllm.model:DiffForCausalLM")
