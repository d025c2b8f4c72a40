"""`train --parallelism`: a layout that does not fit the launch (world size, nodes, head counts, options a sharded run
does not take) is one `error:` line and exit status 2, before the model loads and with nothing written. The sharded
runs themselves are in tests/distributed/test_sharded_train.py (torchrun)."""

import re
import types

import pytest

from diff_transformer import cli
from diff_transformer.training import TrainingError
from diff_transformer.training.parallel import Layout, plan_layout
from tests.helpers.checkpoints import save_trainable_checkpoint
from tests.helpers.tiny import tiny_config
from tests.helpers.training import QUIET


def options(parallelism, tp_size=None, replicas=None, **rest):
    values = dict(parallelism=parallelism, tp_size=tp_size, replicas=replicas, lora=False, load_in_4bit=False)
    return types.SimpleNamespace(**{**values, "diff_only_steps": 0, **rest})


def launched(monkeypatch, world, local):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local))


def test_layouts_of_a_two_node_launch(monkeypatch):
    launched(monkeypatch, 8, 4)
    config = tiny_config(2)  # 4 heads, 2 KV groups
    assert plan_layout(options("ddp"), config) is None
    assert plan_layout(options("fsdp"), config) == Layout(1, 8, 1)
    assert plan_layout(options("hsdp"), config) == Layout(2, 4, 1)  # one replica per node
    assert plan_layout(options("hsdp", replicas=4), config) == Layout(4, 2, 1)


@pytest.mark.parametrize(
    "world, local, chosen, expected",
    [
        (4, 2, options("hsdp", replicas=3), "4 processes do not split into 3 replicas"),
        (2, 2, options("ddp", tp_size=2), "--tp-size belongs to a sharded --parallelism"),
        (2, 2, options("fsdp", replicas=2), "--replicas belongs to --parallelism hsdp"),
        (2, 2, options("fsdp", tp_size=2), "--tp-size belongs to --parallelism tp or tp+fsdp"),
        (2, 2, options("fsdp", lora=True), "--lora with --parallelism fsdp"),
        (2, 2, options("hsdp", diff_only_steps=3), "--diff-only-steps with --parallelism hsdp"),
        (2, 2, options("hsdp", replicas=0), "--replicas 0: pass a whole number >= 1"),
        (6, 6, options("tp+fsdp", tp_size=4), "--tp-size 4 does not divide the 6 processes"),
        (4, 4, options("tp+fsdp", tp_size=4), "num_key_value_heads=2 is not divisible by the tensor-parallel size 4"),
        (4, 4, options("tp", tp_size=2), "tp uses every rank"),
    ],
)
def test_layouts_that_do_not_divide_are_refused(monkeypatch, world, local, chosen, expected):
    launched(monkeypatch, world, local)
    with pytest.raises(TrainingError, match=expected.replace("+", r"\+")):
        plan_layout(chosen, tiny_config(2))


def test_refused_before_the_model_loads(monkeypatch, tmp_path, capsys):
    """Through the command: exit 2, one line, no --output left behind, and the weights never loaded."""
    from diff_transformer.training import train

    model = tmp_path / "model"
    save_trainable_checkpoint(model, 2)
    monkeypatch.setattr(train, "load_model", lambda *a, **k: pytest.fail("the model loaded before the refusal"))
    (tmp_path / "text.txt").write_text("Emma Woodhouse, handsome, clever, and rich. " * 40, encoding="utf-8")
    launched(monkeypatch, 4, 2)
    output = tmp_path / "run"
    argv = ["train", str(model), "--data", str(tmp_path / "text.txt"), "--output", str(output), *QUIET]
    capsys.readouterr()  # what saving the model printed
    status = cli.main([*argv, "--parallelism", "hsdp", "--replicas", "3"])
    err = capsys.readouterr().err.strip()
    assert status == 2 and err.count("\n") == 0 and "do not split into 3 replicas" in err, err
    assert not output.exists()


def test_a_sharded_checkpoint_is_resumed_by_a_sharded_run_only(tmp_path):
    from diff_transformer.training.resume import check_checkpoint_fits
    from tests.helpers.tiny import tiny_model

    sharded, whole = tmp_path / "checkpoint-2", tmp_path / "checkpoint-3"
    (sharded / "sharded").mkdir(parents=True)
    whole.mkdir()
    model = tiny_model(2)
    with pytest.raises(TrainingError, match="is a sharded .* resume it with a sharded --parallelism"):
        check_checkpoint_fits(sharded, model, lora=False, sharded=False)
    with pytest.raises(TrainingError, match=r"is a whole .* resume it with --parallelism ddp"):
        check_checkpoint_fits(whole, model, lora=False, sharded=True)


@pytest.mark.parametrize("choice", ["fsdp", "hsdp", "tp", "tp+fsdp"])
def test_a_sharded_parallelism_in_a_plain_process_asks_for_torchrun(monkeypatch, choice):
    """Without torchrun (no WORLD_SIZE) it would train one whole copy, sharded over nothing."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(TrainingError, match=f"--parallelism {re.escape(choice)} shards over the processes torchrun"):
        plan_layout(options(choice), tiny_config(2))
    launched(monkeypatch, 1, 1)  # torchrun with one process: its choice
    assert plan_layout(options("fsdp"), tiny_config(2)) == Layout(1, 1, 1)
