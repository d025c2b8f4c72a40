"""`diff-transformer train --parallelism fsdp --compile` under torchrun (2 ranks, gloo), V2, V1 and a Motif-shaped V1:
Trainer compiles the FSDP2-sharded model (aot_eager: dynamo and AOT autograd trace it as for inductor, then the traced
ops run) and it trains as one uncompiled process does on the same global batches, within the 1e-5 that
tests/distributed/test_sharded_train.py allows a sharded run (fp32; the gradient reduction sums in another order).
FSDP2's hooks are not traced (torch marks them so): the graph breaks at each sharded layer, for Llama as for Diff."""

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
from tests.helpers.tiny import MODEL_KINDS


pytestmark = pytest.mark.slow


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_a_compiled_sharded_run_trains_as_one_uncompiled_process(tmp_path, kind):
    model, text = tmp_path / "model", tmp_path / "train.txt"
    save_train_checkpoint(model, text, **MODEL_KINDS[kind])
    data = [str(model), "--data", str(text), *TRAIN_OPTIONS]
    assert cli.main(["train", *data, "--output", str(tmp_path / "single"), "--batch-size", "2"]) == 0
    env = {**launch_environment(), "TORCH_LOGS": "dynamo"}  # dynamo says what it traces: proof that it compiled
    result = torchrun_fsdp_train(data, tmp_path / "fsdp", "--compile-backend", "aot_eager", env=env)
    assert "torchdynamo start tracing forward" in result.stderr, result.stderr[-3000:]
    single, sharded = train_losses(tmp_path / "single"), train_losses(tmp_path / "fsdp")
    assert len(single) == len(sharded) == TRAIN_STEPS
    for a, b in zip(sharded, single):
        assert abs(a - b) <= 1e-5 * abs(b), (sharded, single)
