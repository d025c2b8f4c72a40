"""`diff-transformer train --parallelism fsdp --compile` under torchrun (2 ranks, gloo), V2, V1 and a Motif-shaped V1:
Trainer compiles the FSDP2-sharded model (aot_eager: dynamo and AOT autograd trace it as for inductor, then the traced
ops run) and it trains as one uncompiled process does on the same global batches, within the 1e-5 that
tests/distributed/test_sharded_train.py allows a sharded run (fp32; the gradient reduction sums in another order).
FSDP2's hooks are not traced (torch marks them so): the graph breaks at each sharded layer, for Llama as for Diff.
`--parallelism hsdp --compile` on two simulated nodes (2 replicas x 2 shards) likewise, for the Motif-shaped V1: the
same compiled layers as fsdp's, over a 2-D mesh. (`--parallelism tp` needs GPUs: accelerate refuses it on CPU.)"""

import pytest

from diff_transformer import cli
from tests.distributed.dist_common import (
    TRAIN_OPTIONS,
    TRAIN_STEPS,
    launch_environment,
    save_train_checkpoint,
    succeed,
    torchrun_fsdp_train,
    train_losses,
    two_nodes,
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


def test_a_compiled_hsdp_run_on_two_nodes_trains_as_one_uncompiled_process(tmp_path):
    model, text = tmp_path / "model", tmp_path / "train.txt"
    save_train_checkpoint(model, text, **MODEL_KINDS["motif-v1"])
    data = [str(model), "--data", str(text), *TRAIN_OPTIONS]
    assert cli.main(["train", *data, "--output", str(tmp_path / "single"), "--batch-size", "4"]) == 0  # 2 x 2 ranks
    sharded = [*data, "--batch-size", "1", "--parallelism", "hsdp", "--output", str(tmp_path / "hsdp")]
    env = {**launch_environment(), "TORCH_LOGS": "dynamo"}
    outputs = succeed(two_nodes([*sharded, "--compile", "--compile-backend", "aot_eager"], env))
    assert all("torchdynamo start tracing forward" in output for output in outputs), outputs[0][-3000:]
    single, hsdp = train_losses(tmp_path / "single"), train_losses(tmp_path / "hsdp")
    assert len(single) == len(hsdp) == TRAIN_STEPS
    for a, b in zip(hsdp, single):
        assert abs(a - b) <= 1e-5 * abs(b), (hsdp, single)
