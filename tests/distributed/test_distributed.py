"""Scale-out on existing engines, each run as 2 real processes (`torchrun --nproc_per_node 2 --standalone`, gloo on
CPU) and compared with an unsharded model in this process:

* DDP: transformers' Trainer (accelerate wraps the model in DistributedDataParallel);
* FSDP2: transformers' `DistributedConfig(fsdp_size=2)`, i.e. torch's `fully_shard` on every decoder layer + root,
  in a plain loop and handed to a plain Trainer (docs/training.md's recipe for users' scripts);
* tensor parallelism: transformers' `DistributedConfig(tp_plan="auto")` with our `base_model_tp_plan`;
* `diff-transformer train` (Trainer, so DDP) under torchrun.

Every rank records its world size: a launcher that silently starts one process (e.g. `accelerate launch --cpu
--num_processes 2`) fails these tests instead of passing them.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from diff_transformer import DiffForCausalLM, cli
from tests.distributed.dist_common import save_train_checkpoint, tiny_model, token_batches
from tests.distributed.dist_suite import TRAIN_ARGS
from tests.helpers.processes import launch
from tests.helpers.reference import reference_logits
from tests.helpers.rounding import assert_within_rounding


# One 2-process torchrun launch for the module (minutes on a loaded 2-core machine): the full run only.
pytestmark = pytest.mark.slow


def read_ranks(out, world_size=2):
    records = [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(world_size)]
    for rank, record in enumerate(records):
        assert (record["rank"], record["world_size"], record["env_world_size"]) == (rank, world_size, world_size)
    tensors = [load_file(Path(out) / f"rank{r}.safetensors") for r in range(world_size)]
    return records, tensors


def assert_ranks_identical(states):
    assert states[0].keys() == states[1].keys()
    for name in states[0]:
        assert torch.equal(states[0][name], states[1][name]), f"{name} differs between ranks"


def assert_close_states(actual, expected, atol):
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value.float(), atol=atol, rtol=0, msg=lambda m: f"{name}: {m}")


def reference_losses_and_state(model, batches, clip=None):
    """Plain single-process SGD on the global batches: the reference both engines must reproduce. (SGD, not Adam:
    Adam turns float noise in near-zero gradients into lr-sized updates, which no tolerance tells from bugs.)"""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for batch in batches:
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {name: t.detach().clone() for name, t in model.state_dict().items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One 2-process launch of tests/distributed/dist_suite.py: DDP, FSDP2, tensor parallelism, diff-transformer
    train."""
    root = tmp_path_factory.mktemp("distributed")
    tiny_model(1).save_pretrained(root / "models" / "fsdp")  # V1: fp32 λ vectors and per-head subln get sharded too
    tiny_model(2).save_pretrained(root / "models" / "fsdp_trainer")  # the model ddp_train.py builds
    tiny_model(1, seed=1).save_pretrained(root / "models" / "v1")
    tiny_model(2, seed=2).save_pretrained(root / "models" / "v2")
    # Qwen2's biases and Qwen3's q_norm/k_norm (one weight acting on every rank's heads: gradients summed by the plan)
    tiny_model(1, seed=3, use_qk_norm=True, attention_bias=True, attention_out_bias=False).save_pretrained(
        root / "models" / "qk"
    )
    tiny_model(1, num_key_value_heads=1).save_pretrained(root / "models" / "kv1")  # one KV group: cannot split in 2
    save_train_checkpoint(root / "models" / "train", root / "models" / "train.txt")
    launch("dist_suite", root / "out", root / "models", timeout=240)
    return root


def test_ddp_trainer_matches_single_process(runs):
    records, states = read_ranks(runs / "out" / "ddp")
    for record in records:
        assert record["trainer_world_size"] == 2 and record["model_wrapped"] == "DistributedDataParallel"
        assert record["backend"] == "gloo"
    assert_ranks_identical(states)

    # Same model, same data; global batch = 2 ranks x 2 per device, taken in order. Trainer clips at norm 1.
    steps, global_batch = 3, 4
    model = tiny_model(2).train()
    batches = token_batches(32)[: steps * global_batch].view(steps, global_batch, -1)
    initial = {name: t.clone() for name, t in model.state_dict().items()}
    losses, state = reference_losses_and_state(model, batches, clip=1.0)

    # The logged loss is the global batch's mean token loss: not summed or doubled over the ranks.
    assert records[0]["losses"] == pytest.approx(losses, abs=1e-5)
    assert_close_states(states[0], state, atol=1e-5)
    moved = max((states[0][name] - initial[name]).abs().max().item() for name in initial)
    assert moved > 1e-2  # training did change the weights


def test_fsdp2_matches_single_process(runs):
    records, states = read_ranks(runs / "out" / "fsdp")
    for record in records:
        assert record["backend"] == "gloo" and record["layer_is_fsdp_module"]
        # Each rank holds half of every weight between steps.
        assert (record["q_proj_param_type"], record["q_proj_local_rows"], record["q_proj_rows"]) == ("DTensor", 24, 48)
    assert_ranks_identical(states)

    steps, global_batch = 3, 4
    model = DiffForCausalLM.from_pretrained(runs / "models" / "fsdp").train()
    batches = token_batches(steps * global_batch).view(steps, global_batch, -1)
    losses, state = reference_losses_and_state(model, batches)
    assert records[0]["losses"] == pytest.approx(losses, abs=1e-5)
    assert_close_states(states[0], state, atol=1e-5)


def test_users_trainer_recipe_with_fsdp2_matches_single_process(runs):
    """docs/training.md's recipe (DistributedConfig at load, a plain Trainer, save_only_model=True): sharded, not
    wrapped again, and the single process's losses and weights on the same global batches (as DDP's test)."""
    records, states = read_ranks(runs / "out" / "fsdp_trainer")
    for record in records:
        assert record["backend"] == "gloo" and record["q_proj_local_rows"] == 24  # half of q_proj's 48 rows
        assert record["model_wrapped"] == "FSDPDiffForCausalLM"  # fully_shard's class: no DDP wrapper around it
    assert_ranks_identical(states)
    steps, global_batch = 3, 4
    model = tiny_model(2).train()
    batches = token_batches(32)[: steps * global_batch].view(steps, global_batch, -1)
    losses, state = reference_losses_and_state(model, batches, clip=1.0)
    assert records[0]["losses"] == pytest.approx(losses, abs=1e-5)
    assert_close_states(states[0], state, atol=1e-5)


def test_tensor_parallel_matches_unsharded_model(runs):
    records, tensors = read_ranks(runs / "out" / "tp")
    for record in records:
        assert record["backend"] == "gloo"
        error = record["results"]["kv1"]["error"]
        assert "num_key_value_heads=1" in error and "divisible by 2" in error

    ids = token_batches(2)[:, :8]
    for tag in ("v1", "v2", "qk"):
        model = DiffForCausalLM.from_pretrained(runs / "models" / tag)
        with torch.no_grad():
            logits = model(ids).logits
            generated = model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False)
        references = [reference_logits(model, row) for row in ids]  # float64, with fp32's rounding scale
        model.train()
        model(input_ids=ids, labels=ids).loss.backward()
        for record, sharded in zip(records, tensors):
            result = record["results"][tag]
            assert result["tp_size"] == 2
            assert (result["q_proj_local_rows"], result["q_proj_rows"]) == (24, 48)  # really sharded
            # each rank sums in its own order: sharded and unsharded logits within fp32's rounding of the formulas
            for row, (exact, sigma) in enumerate(references):
                assert_within_rounding(sharded[f"{tag}.logits"][row], exact, sigma, msg=f"{tag} sharded row {row}:")
                assert_within_rounding(logits[row], exact, sigma, msg=f"{tag} unsharded row {row}:")
            assert result["generated"] == generated.tolist()
            # Gradients too: V1's replicated λ vectors and subln only see a rank's own heads, so the plan must
            # sum their gradients over the ranks (without it they differ by ~1e-2).
            for name, param in model.named_parameters():
                torch.testing.assert_close(
                    sharded[f"{tag}.grad.{name}"], param.grad, atol=1e-5, rtol=0, msg=lambda m: f"{tag} {name}: {m}"
                )


def test_train_command_under_torchrun_matches_single_process(runs, tmp_path):
    records, _ = read_ranks(runs / "out" / "train_ranks")
    assert [record["status"] for record in records] == [0, 0]
    models = runs / "models"
    single = ["train", str(models / "train"), "--data", str(models / "train.txt"), "--output", str(tmp_path)]
    assert cli.main([*single, "--batch-size", "4", *TRAIN_ARGS]) == 0  # one process, twice the per-device batch

    ddp_log = json.loads((runs / "out" / "train" / "trainer_state.json").read_text())["log_history"]
    single_log = json.loads((tmp_path / "trainer_state.json").read_text())["log_history"]
    ddp_losses = [entry["loss"] for entry in ddp_log if "loss" in entry]
    single_losses = [entry["loss"] for entry in single_log if "loss" in entry]
    assert len(ddp_losses) == 3
    # Trainer's seeded sampler deals the same shuffled blocks to the two ranks as to the single process: the same
    # global batches, so the same losses step after step (averaged over the ranks, not summed) ...
    assert ddp_losses == pytest.approx(single_losses, abs=1e-5)
    assert ddp_log[-1]["epoch"] == pytest.approx(single_log[-1]["epoch"])  # ... and 4 blocks per step, not 2
    assert_close_states(
        load_file(runs / "out" / "train" / "model.safetensors"), load_file(tmp_path / "model.safetensors"), atol=2e-5
    )
