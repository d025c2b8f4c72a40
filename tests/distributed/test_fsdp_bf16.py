"""`diff-transformer train --parallelism fsdp --bf16 on` under torchrun (2 ranks, gloo): FSDP2 with its
MixedPrecisionPolicy (bf16 weights in the forward and backward, fp32 master weights and gradient reduction), for V2,
V1 and a Motif-shaped V1 (grouped noise heads, PolyNorm), against one process training the same global batches.

Tolerance, as in tests/training/test_numerics.py: the unit is the bf16 error one process makes, measured in the same
test as the distance of its `--bf16 on` loss (B) from its fp32 loss (C). The sharded run (A) rounds the same values to
bf16 (its weights, where autocast rounds them at each matmul), so |A - C| is about |B - C| and
|A - B| <= |A - C| + |B - C|: 3 |B - C| allows |A - C| twice B's error, plus an fp32 floor. A loss is one mean over
64 tokens, whose rounding errors partly cancel, so one step's |B - C| can understate the scale (V1's first step: 3e-5,
where its later steps show 1.6e-4): the unit is the largest |B - C| of the run, for every step. Later steps compare
trajectories that AdamW (lr 1e-3) has moved by the rounding of the earlier gradients, which stays within it here.
Measured on the CPU (load 4): |A - B| at most 3.2e-4 against bounds of 5.5e-4 to 1.1e-3.
"""

import json
import os
import subprocess
import sys

import pytest

from diff_transformer import cli
from tests.distributed.dist_common import (
    TRAIN_OPTIONS,
    TRAIN_STEPS,
    launch_environment,
    save_train_checkpoint,
    torchrun_fsdp_train,
    train_losses,
)
from tests.helpers import REPOSITORY
from tests.helpers.tiny import MODEL_KINDS


pytestmark = pytest.mark.slow


def test_the_sharded_forward_computes_in_bf16_and_keeps_fp32_masters(tmp_path):
    """What the losses below cannot tell apart (a sharded run that dropped bf16 would be as close to one process's
    bf16 run as fp32 is): with train's DistributedConfig and --bf16 on, a layer's projection sees bf16 weights and
    inputs, while the sharded master weights and their gradients stay fp32; with --bf16 off, fp32 throughout."""
    from tests.helpers.tiny import tiny_model

    models = []
    for kind, config in MODEL_KINDS.items():
        version = config["diff_version"]
        overrides = {k: v for k, v in config.items() if k != "diff_version"}
        tiny_model(version, **overrides).save_pretrained(tmp_path / kind)
        models.append(f"{kind}={tmp_path / kind}")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += [str(REPOSITORY / "tests" / "distributed" / "fsdp_bf16_dtypes.py"), str(tmp_path / "out"), *models]
    env = {**launch_environment(), "PYTHONPATH": os.pathsep.join([str(REPOSITORY / "src"), str(REPOSITORY)])}
    result = subprocess.run(command, cwd=REPOSITORY, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    for rank in (0, 1):
        record = json.loads((tmp_path / "out" / f"rank{rank}.json").read_text())
        assert record["world_size"] == 2
        for kind in MODEL_KINDS:
            on, off = record["results"][f"{kind}.bf16=True"], record["results"][f"{kind}.bf16=False"]
            assert (on["weight"], on["input"]) == ("torch.bfloat16", "torch.bfloat16"), (kind, on)
            assert on["master"] == on["grads"] == ["torch.float32"], (kind, on)
            assert (off["weight"], off["input"]) == ("torch.float32", "torch.float32"), (kind, off)
            assert off["master"] == off["grads"] == ["torch.float32"], (kind, off)


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_fsdp_bf16_trains_as_one_process_does_within_bf16_rounding(tmp_path, kind):
    model, text = tmp_path / "model", tmp_path / "train.txt"
    save_train_checkpoint(model, text, **MODEL_KINDS[kind])
    data = [str(model), "--data", str(text), *TRAIN_OPTIONS]
    single = {}
    for bf16 in ("on", "off"):
        out = tmp_path / f"single-{bf16}"
        assert cli.main(["train", *data, "--output", str(out), "--batch-size", "2", "--bf16", bf16]) == 0
        single[bf16] = train_losses(out)
    sharded = tmp_path / "fsdp"
    torchrun_fsdp_train(data, sharded, "--bf16", "on")
    a, b, c = train_losses(sharded), single["on"], single["off"]
    assert len(a) == len(b) == len(c) == TRAIN_STEPS
    unit = max(abs(x - y) for x, y in zip(b, c))
    assert unit > 0, "--bf16 on computed in fp32"  # the unit must be bf16's error, not zero
    for step in range(TRAIN_STEPS):
        assert abs(a[step] - b[step]) <= 3 * unit + 1e-5 * abs(c[step]), (step, a, b, c)
