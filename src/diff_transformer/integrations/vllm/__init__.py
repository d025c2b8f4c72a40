"""vLLM: `plugin.register` (the `vllm.general_plugins` entry point) and `model` (the vLLM model classes)."""
