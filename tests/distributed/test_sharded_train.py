"""`diff-transformer train --parallelism hsdp/fsdp` under torchrun, as a user launches it on two nodes, simulated on
this machine: two torchrun agents (`--nnodes 2 --node-rank 0/1 --nproc-per-node 2`, c10d rendezvous on 127.0.0.1,
gloo), four ranks in all. Compared with one process training on the same global batches:

* HSDP (2 replicas x 2 shards): the same loss at every step, the same final weights, an ordinary checkpoint at the end;
* one rank SIGKILLed after a sharded (DCP) checkpoint, the run resumed from it on the two nodes: the same losses and
  final weights as the run that was not interrupted;
* the same 4-rank checkpoint resumed on 2 processes with --parallelism fsdp and --gradient-checkpointing (DCP
  reshards the weights and Adam states onto the new mesh): the uninterrupted run's losses within fp32 rounding.

Every rank holds its own shard only: the checkpoints hold one safetensors shard file per rank, each smaller than the
model. Sized for 2 loaded cores (the tiny model, 32-token blocks, 6 steps): about 3 minutes in all.
"""

import json
import os
import shutil
import signal
import time
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from diff_transformer import cli
from diff_transformer.training.resume import _complete, trainer_checkpoints
from tests.distributed.dist_common import finish, save_train_checkpoint, succeed, torchrun, train_losses, two_nodes


pytestmark = pytest.mark.slow

STEPS, SAVE = 6, 2  # within the first epoch (26 blocks): the ranks' share of a last, short batch differs
COMMON = [
    "--quiet", "--report-to", "none", "--block-size", "32", "--eval-fraction", "0", "--max-steps", str(STEPS),
    "--logging-steps", "1", "--lr", "1e-3", "--save-steps", str(SAVE), "--seed", "3",
]  # fmt: skip
# Adam, not SGD: DCP must carry its moment estimates and step count across the restart. With lr 1e-3 and 6 steps
# the float noise Adam can magnify stays far below the bound (the sharded and single-process sums differ ~1e-7).
LOSS_BOUND = 1e-5
WEIGHT_BOUND = 2e-5


def assert_close_weights(actual: Path, expected: Path, atol: float):
    a, b = load_file(actual / "model.safetensors"), load_file(expected / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=0, msg=lambda m: f"{name}: {m}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded")
    model, text = root / "model", root / "train.txt"
    save_train_checkpoint(model, text)
    data = [str(model), "--data", str(text), *COMMON]

    # One process, 4 blocks a step: the global batch of 2 nodes x 2 ranks x 1 block.
    assert cli.main(["train", *data, "--output", str(root / "single"), "--batch-size", "4"]) == 0

    sharded = [*data, "--batch-size", "1", "--parallelism", "hsdp"]
    previous = os.umask(0o022)  # inherited by the ranks: the modes of what they write are checked against it
    try:
        nodes = two_nodes([*sharded, "--output", str(root / "hsdp"), "--save-total-limit", "2"])
    finally:
        os.umask(previous)
    succeed(nodes)

    # The same run, one rank of node 1 SIGKILLed once the first sharded checkpoint is complete.
    killed = root / "killed"
    nodes = two_nodes([*sharded, "--output", str(killed)])
    deadline, victim = time.monotonic() + 200, None
    while time.monotonic() < deadline and victim is None and nodes[1].poll() is None:
        if any(_complete(c) for c in trainer_checkpoints(killed)):
            workers = psutil.Process(nodes[1].pid).children()
            if workers:
                victim = workers[0].pid
                os.kill(victim, signal.SIGKILL)
        time.sleep(0.02)
    ended = finish(nodes)
    assert victim is not None, "no checkpoint appeared, or the run ended before one rank could be killed"
    assert any(status != 0 for status, _ in ended) and not (killed / "model.safetensors").exists()
    resume_from = max((c for c in trainer_checkpoints(killed) if _complete(c)), key=lambda c: int(c.name[11:]))
    succeed(two_nodes([*sharded, "--output", str(killed), "--resume", str(resume_from)]))

    # That 4-rank checkpoint resumed on 2 processes (another mesh), with gradient checkpointing.
    resharded = root / "resharded"
    shutil.copytree(resume_from, resharded / resume_from.name)  # copied, not linked: --output refuses links
    launch = ["--standalone", "--nproc-per-node", "2"]
    args = [*data, "--batch-size", "2", "--parallelism", "fsdp", "--gradient-checkpointing", "--resume"]
    succeed([torchrun(launch, [*args, "--output", str(resharded)])])
    return root, int(resume_from.name.rpartition("-")[2])


def test_two_nodes_hsdp_equal_one_process(runs):
    root, _ = runs
    single, hsdp = train_losses(root / "single"), train_losses(root / "hsdp")
    assert len(hsdp) == STEPS
    assert hsdp == pytest.approx(single, abs=LOSS_BOUND)
    assert single[-1] < single[0]  # it trained
    assert_close_weights(root / "hsdp", root / "single", WEIGHT_BOUND)

    # --save-total-limit 2 rotated the run's own sharded checkpoints (recorded with their shards' hashes).
    assert [path.name for path in trainer_checkpoints(root / "hsdp")] == ["checkpoint-4", "checkpoint-6"]
    # Sharded checkpoints: one safetensors shard per rank, none holding the whole model.
    checkpoint = root / "hsdp" / "checkpoint-4"
    shards = [path.stat().st_size for path in sorted((checkpoint / "sharded").glob("*.safetensors"))]
    # weights + Adam's two moments, each written once (the two replicas hold the same shards): a quarter per rank
    whole = 3 * (root / "single" / "model.safetensors").stat().st_size
    assert len(shards) == 4 and sum(shards) == pytest.approx(whole, rel=0.02)
    assert all(size < 0.26 * whole for size in shards)
    assert not list(checkpoint.glob("*.safetensors")) and (checkpoint / "trainer_state.json").is_file()

    # The final save is an ordinary checkpoint of the package's own classes.
    config = json.loads((root / "hsdp" / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_diff.DiffForCausalLM"
    assert (root / "hsdp" / "modeling_diff.py").is_file() and not list((root / "hsdp").glob("_fsdp*.py"))
    # Of a file the user creates, as convert's: not safetensors' owner-only 0600 (gathered export, DCP shards).
    modes = {str(path): oct(path.stat().st_mode & 0o777) for path in (root / "hsdp").rglob("*") if path.is_file()}
    assert str(root / "hsdp" / "model.safetensors") in modes and any("/sharded/" in path for path in modes)
    assert {path: mode for path, mode in modes.items() if mode != "0o644"} == {}
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(root / "hsdp")
    ids = torch.tensor([[1, 5, 9, 13]])
    assert model.generate(ids, max_new_tokens=3, do_sample=False).shape == (1, 7)


def test_killed_rank_resumes_to_the_same_weights(runs):
    root, step = runs
    assert 0 < step < STEPS
    assert train_losses(root / "killed") == train_losses(root / "hsdp")  # same world size, same order of sums: exact
    assert_close_weights(root / "killed", root / "hsdp", atol=0)


def test_resume_on_another_world_size_reshards(runs):
    root, step = runs
    resumed = train_losses(root / "resharded")
    assert len(resumed) == STEPS  # the history up to the checkpoint, then the steps run on 2 processes
    assert resumed == pytest.approx(train_losses(root / "hsdp"), abs=LOSS_BOUND)
    assert_close_weights(root / "resharded", root / "hsdp", WEIGHT_BOUND)
