"""Issue "Trust 3": what a request can make us compute is bounded. A config.json that claims more model than the
safetensors weights next to it hold (10^5 or 10^7 layers, a huge hidden size or vocabulary, heads that do not fit) is
refused in one line by every entry point before anything is built from it (`check_config_against_weights`)."""

import json
import shutil
import time
from pathlib import Path

import pytest

import diff_transformer
from diff_transformer.checkpoints import CheckpointError


TINY_LLAMA = Path(diff_transformer.__file__).parent / "assets" / "tiny-llama"
# field -> (hostile value, words of the refusal)
HOSTILE = {
    "layers_1e5": (
        "num_hidden_layers",
        100_000,
        "config.json says num_hidden_layers=100000, but the weights hold 4 layers",
    ),
    "layers_1e7": (
        "num_hidden_layers",
        10_000_000,
        "config.json says num_hidden_layers=10000000, but the weights hold 4 layers",
    ),
    "hidden": ("hidden_size", 1_000_000, "hidden_size=1000000, but the embedding is 192 wide"),
    "vocab": ("vocab_size", 1_000_000_000, "vocab_size=1000000000, but the embedding holds 2048 tokens"),
    "heads": ("num_attention_heads", 5, "num_attention_heads=5 x head_dim 32 = 160, but q_proj has 192 rows"),
    "intermediate": ("intermediate_size", 10**9, "config.json implies about"),
}
# Generous for a loaded 2-core machine: the refusals take well under a second; what they replace took minutes.
SECONDS = 10


def hostile_copy(root: Path, case: str) -> Path:
    field, value, _ = HOSTILE[case]
    path = root / f"hostile-{case}"
    shutil.copytree(TINY_LLAMA, path)
    config = json.loads((path / "config.json").read_text())
    config[field] = value
    (path / "config.json").write_text(json.dumps(config))
    return path


def adapter_on(base: Path, path: Path) -> Path:
    """A PEFT adapter directory (config only) whose base is BASE: merge's way to a base model."""
    path.mkdir()
    (path / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "task_type": "CAUSAL_LM",
                "base_model_name_or_path": str(base),
                "r": 2,
                "lora_alpha": 4,
                "target_modules": ["q_proj"],
            }
        )
    )
    return path


ENTRY_POINTS = {
    "convert": lambda model, tmp: ["convert", model, tmp / "out"],
    "generate": lambda model, tmp: ["generate", model, "Hello"],
    "generate-chat": lambda model, tmp: ["generate", model, "Hello", "--chat"],
    "inspect": lambda model, tmp: ["inspect", model, "Hello", "--json", tmp / "maps.json"],
    "train": lambda model, tmp: ["train", model, "--data", tmp / "data.jsonl", "--output", tmp / "run", "--any-model"],
    "merge": lambda model, tmp: ["merge", adapter_on(model, tmp / "adapter"), tmp / "merged"],
    "niah": lambda model, tmp: ["niah", model, "--out", tmp / "niah", "--lengths", "64"],
}


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_every_entry_point_refuses_a_config_larger_than_its_weights(entry, refused, tmp_path):
    (tmp_path / "data.jsonl").write_text('{"text": "Hello there."}\n')
    model = hostile_copy(tmp_path, "layers_1e5")
    start = time.monotonic()
    refused(ENTRY_POINTS[entry](model, tmp_path), HOSTILE["layers_1e5"][2], str(model))
    assert time.monotonic() - start < SECONDS


@pytest.mark.parametrize("case", HOSTILE)
def test_each_hostile_field_is_refused_before_the_model_is_built(case, refused, tmp_path):
    model = hostile_copy(tmp_path, case)
    start = time.monotonic()
    refused(["generate", model, "Hello"], HOSTILE[case][2])
    refused(["convert", model, tmp_path / "out"], HOSTILE[case][2])
    assert time.monotonic() - start < 2 * SECONDS


def test_the_package_s_loader_refuses_it_too(tmp_path):
    from diff_transformer.checkpoints.loading import load_causal_lm

    model = hostile_copy(tmp_path, "layers_1e7")
    start = time.monotonic()
    with pytest.raises(
        CheckpointError, match="config.json says num_hidden_layers=10000000, but the weights hold 4 layers"
    ):
        load_causal_lm(str(model))
    assert time.monotonic() - start < SECONDS


def test_honest_checkpoints_pass(tmp_path):
    """The check refuses nothing real: the shipped Llama, its Diff conversions, a DiffLlama and a sharded Llama."""
    from diff_transformer.checkpoints.configs import read_json
    from diff_transformer.checkpoints.loading import check_config_against_weights
    from diff_transformer.conversion import convert_to_diff
    from tests.helpers.checkpoints import make_diffllama, make_llama

    paths = [
        TINY_LLAMA,
        convert_to_diff(TINY_LLAMA, tmp_path / "v1", diff_version=1, progress=False),
        convert_to_diff(TINY_LLAMA, tmp_path / "v2", diff_version=2, progress=False),
        make_diffllama(tmp_path / "diffllama"),
        make_llama(tmp_path / "sharded", max_shard_size="20KB"),
    ]
    for path in paths:
        check_config_against_weights(Path(path), read_json(Path(path) / "config.json"), str(path))
