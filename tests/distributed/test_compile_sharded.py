"""`diff-transformer train --parallelism fsdp --compile` under torchrun (2 ranks, gloo), V2, V1 and a Motif-shaped V1:
Trainer compiles the FSDP2-sharded model (aot_eager: dynamo and AOT autograd trace it as for inductor, then the traced
ops run) and it trains as one uncompiled process does on the same global batches, within the 1e-5 that
tests/distributed/test_sharded_train.py allows a sharded run (fp32; the gradient reduction sums in another order).
FSDP2's hooks are not traced (torch marks them so): the graph breaks at each sharded layer, for Llama as for Diff."""

import subprocess
import sys

import pytest

from diff_transformer import cli
from tests.distributed.dist_common import launch_environment, save_train_checkpoint, train_losses
from tests.helpers import REPOSITORY


pytestmark = pytest.mark.slow

COMMON = [
    "--quiet", "--report-to", "none", "--block-size", "32", "--eval-fraction", "0", "--max-steps", "3",
    "--logging-steps", "1", "--lr", "1e-3", "--seed", "3", "--save-steps", "100",
]  # fmt: skip
MODELS = {
    "v2": dict(diff_version=2),
    "v1": dict(diff_version=1),
    "motif-v1": dict(diff_version=1, num_noise_heads=2, head_dim=8, hidden_act="poly_norm"),
}


@pytest.mark.parametrize("kind", MODELS)
def test_a_compiled_sharded_run_trains_as_one_uncompiled_process(tmp_path, kind):
    model, text = tmp_path / "model", tmp_path / "train.txt"
    save_train_checkpoint(model, text, **MODELS[kind])
    data = [str(model), "--data", str(text), *COMMON]
    assert cli.main(["train", *data, "--output", str(tmp_path / "single"), "--batch-size", "2"]) == 0
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += ["-m", "diff_transformer.cli", "train", *data, "--output", str(tmp_path / "fsdp"), "--batch-size", "1"]
    command += ["--parallelism", "fsdp", "--compile-backend", "aot_eager"]
    env = {**launch_environment(), "TORCH_LOGS": "dynamo"}  # dynamo says what it traces: proof that it compiled
    result = subprocess.run(command, cwd=REPOSITORY, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    assert "torchdynamo start tracing forward" in result.stderr, result.stderr[-3000:]
    single, sharded = train_losses(tmp_path / "single"), train_losses(tmp_path / "fsdp")
    assert len(single) == len(sharded) == 3
    for a, b in zip(sharded, single):
        assert abs(a - b) <= 1e-5 * abs(b), (sharded, single)
