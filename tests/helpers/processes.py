"""Run a script in a fresh interpreter, by default one where `import diff_transformer` fails as on a machine
without the package: what a user who only has transformers (and the Hub) sees."""

import json
import os
import subprocess
import sys

from . import REPOSITORY


# Prepended to a script: any attempt to import diff_transformer raises, exactly as if it were not installed.
BLOCK_DIFF_TRANSFORMER = """
import importlib.abc, sys

class BlockDiffTransformer(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "diff_transformer" or name.startswith("diff_transformer."):
            raise ImportError("diff_transformer is not installed here")
        return None

sys.meta_path.insert(0, BlockDiffTransformer())
"""


def run_json(script, *args, env, block_diff_transformer=True, timeout=300, cwd=None):
    """Run SCRIPT (source text) with ARGS in the directory CWD (default: this one); return the JSON value it prints on
    its last stdout line.

    The child's environment is this one without HF_*/TRANSFORMERS_* variables (so no cache, token or offline flag
    leaks in), plus ENV.
    """
    child_env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    child_env.update(env)
    source = (BLOCK_DIFF_TRANSFORMER if block_diff_transformer else "") + script
    result = subprocess.run(
        [sys.executable, "-c", source, *map(str, args)],
        capture_output=True,
        text=True,
        env=child_env,
        stdin=subprocess.DEVNULL,  # never wait on transformers' interactive trust_remote_code prompt
        timeout=timeout,
        cwd=cwd,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def launch(script, *args, nproc=2, timeout=120):
    """Run a script of tests/distributed (a module name: `ddp_train`) under torchrun with NPROC processes (a free port
    via --standalone), from the repository root so that it imports `tests.*` as a package."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env = {k: v for k, v in env.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_"))}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    result = subprocess.run(
        [*torchrun, "-m", f"tests.distributed.{script}", *map(str, args)],
        cwd=REPOSITORY,
        capture_output=True,
        text=True,
        env=env,
        stdin=subprocess.DEVNULL,
        timeout=timeout,
    )
    assert result.returncode == 0, f"{script} failed:\n{result.stdout[-2000:]}\n{result.stderr[-6000:]}"
