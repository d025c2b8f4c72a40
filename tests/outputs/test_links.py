"""Nothing is written through a link planted in an output (issue "Trust 4", item 1): a symbolic or hard link at any
name that `train`, `convert` or `merge` writes, whether the link points at a file or a directory outside OUT, leaves
its target byte for byte as it was. `train` writes in place (Trainer opens its files with plain `open()`), so a link
in its --output is refused in one line naming it; `convert` and `merge` write a new directory and rename it into
place, so a link in the OUT they replace is dropped with the old OUT (or kept as the user's), never written through.
The lists of names are checked against what a clean run of each command writes, so a name added later is covered."""

import os
from pathlib import Path

import pytest

from diff_transformer import cli
from diff_transformer.conversion import convert_llama_to_diff
from diff_transformer.outputs.files import write_new_file
from diff_transformer.outputs.records import record_entry
from diff_transformer.outputs.staging import OutputLock
from tests.helpers.training import train_argv, train_work


VICTIM = b"the user's file, outside OUT\n"

# What a training run writes under --output (`train` with --save-steps 1 and held-out data; the LoRA run adds the
# adapter's files; TensorBoard its runs/ directory), and the names of its bookkeeping (the lock, the run record and
# the temporary name the record was once written under).
TRAIN_TOP = [
    ".diff-transformer-run.json",
    ".diff-transformer-run.json.tmp",
    ".diff-transformer.lock",
    "README.md",
    "all_results.json",
    "chat_template.jinja",
    "config.json",
    "configuration_diff.py",
    "eval_results.json",
    "generation_config.json",
    "model.safetensors",
    "modeling_diff.py",
    "tokenizer.json",
    "tokenizer_config.json",
    "train_results.json",
    "trainer_state.json",
    "training_args.bin",
    "adapter_config.json",
    "adapter_model.safetensors",
    "base_model.json",
]
TRAIN_CHECKPOINT = [
    "README.md",
    "chat_template.jinja",
    "config.json",
    "configuration_diff.py",
    "generation_config.json",
    "model.safetensors",
    "modeling_diff.py",
    "optimizer.pt",
    "rng_state.pth",
    "scheduler.pt",
    "tokenizer.json",
    "tokenizer_config.json",
    "trainer_state.json",
    "training_args.bin",
    "adapter_config.json",
    "adapter_model.safetensors",
    "base_model.json",
]
TRAIN_FILES = TRAIN_TOP + [f"checkpoint-1/{name}" for name in TRAIN_CHECKPOINT]
TRAIN_DIRECTORIES = ["checkpoint-1", "runs"]

CONVERT_FILES = [
    ".diff-transformer-output.json",
    "LICENSE",
    "README.md",
    "chat_template.jinja",
    "config.json",
    "configuration_diff.py",
    "generation_config.json",
    "model.safetensors",
    "modeling_diff.py",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
]
MERGE_FILES = [
    ".diff-transformer-output.json",
    "README.md",
    "chat_template.jinja",
    "config.json",
    "configuration_diff.py",
    "generation_config.json",
    "model.safetensors",
    "modeling_diff.py",
    "tokenizer.json",
    "tokenizer_config.json",
]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """`tests.helpers.training.train_work`: a tiny Diff V2 checkpoint and its text, a tiny Llama, a LoRA run."""
    return train_work(tmp_path_factory.mktemp("links"))


def _written(directory: Path) -> set[str]:
    return {path.relative_to(directory).as_posix() for path in directory.rglob("*") if path.is_file()}


def _plant(out: Path, name: str, kind: str, victim: Path) -> Path:
    """A link of KIND at OUT/NAME to VICTIM (a file, or a directory holding one), its parents real directories."""
    link = out / name
    link.parent.mkdir(parents=True, exist_ok=True)
    if kind == "symlink":
        link.symlink_to(os.path.relpath(victim, link.parent))
    else:
        os.link(victim, link)
    return link


def _victim(tmp_path: Path, directory: bool) -> tuple[Path, Path]:
    """(what a link points at, the file whose bytes must not change)."""
    if directory:
        (tmp_path / "elsewhere").mkdir()
        (tmp_path / "elsewhere" / "trainer_state.json").write_bytes(VICTIM)
        return tmp_path / "elsewhere", tmp_path / "elsewhere" / "trainer_state.json"
    (tmp_path / "victim.txt").write_bytes(VICTIM)
    return tmp_path / "victim.txt", tmp_path / "victim.txt"


def _untouched(victim_root: Path, victim: Path) -> None:
    assert victim.read_bytes() == VICTIM
    if victim_root.is_dir():
        assert sorted(p.name for p in victim_root.iterdir()) == [victim.name]  # nothing written beside it either


TRAIN_LINKS = [(name, kind) for name in TRAIN_FILES for kind in ("symlink", "hardlink")]
TRAIN_LINKS += [(name, "symlink") for name in TRAIN_DIRECTORIES]  # a directory has no second hard link


@pytest.mark.parametrize(("name", "kind"), TRAIN_LINKS)
def test_train_refuses_a_link_at_any_name_it_writes(refused, work, tmp_path, capsys, name, kind):
    target, victim = _victim(tmp_path, directory=name in TRAIN_DIRECTORIES)
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("the user's")
    link = _plant(out, name, kind, target)
    what = "a symbolic link" if kind == "symlink" else "hard links"
    refused(train_argv(work, out, "--max-steps", "2", "--save-steps", "1", "--overwrite"), name, what, "Remove it")
    _untouched(target, victim)
    assert os.path.lexists(link) and (out / "notes.txt").read_text() == "the user's"  # refused, nothing removed


def test_train_refuses_an_output_that_is_a_link(refused, work, tmp_path, capsys):
    (tmp_path / "real").mkdir()
    (tmp_path / "out").symlink_to(tmp_path / "real")
    refused(train_argv(work, tmp_path / "out", "--max-steps", "1"), "is a symbolic link", "the directory it points to")
    assert list((tmp_path / "real").iterdir()) == []


def test_the_train_names_cover_what_a_run_writes(work, tmp_path):
    out = tmp_path / "run"
    argv = train_argv(work, out, "--max-steps", "2", "--save-steps", "1", "--eval-fraction", "0.2")
    argv[argv.index("--report-to") + 1] = "tensorboard"
    assert cli.main([str(a) for a in argv]) == 0
    written = _written(out) | _written(work / "lora")
    for path in written:
        top, _, rest = path.partition("/")
        if top.startswith("checkpoint-"):
            assert rest in TRAIN_CHECKPOINT, path
        else:
            assert path in TRAIN_TOP or top in TRAIN_DIRECTORIES, path
    assert {p.split("/")[0] for p in written} >= {"runs", "checkpoint-1", "checkpoint-2", "eval_results.json"}


def _convert(src: Path, out: Path, *, sharded: bool) -> None:
    """`convert SRC OUT --overwrite`, or its Python API with shards of 60 kB (the CLI has no shard option): the tiny
    Llama's 119 kB of weights make two shards and an index."""
    if sharded:
        convert_llama_to_diff(src, out, overwrite=True, progress=False, max_shard_size="60KB")
    else:
        assert cli.main([str(a) for a in ["convert", src, out, "--overwrite", "--quiet"]]) == 0


SHARDED = ["model.safetensors.index.json", "model-00001-of-00002.safetensors"]


@pytest.mark.parametrize("kind", ["symlink", "hardlink"])
@pytest.mark.parametrize("name", CONVERT_FILES + SHARDED)
def test_convert_overwrite_never_writes_through_a_link(work, tmp_path, name, kind, refused):
    """A link at a name the conversion writes (or a loader reads) is no output of ours (no record proves it):
    --overwrite refuses, naming it, and neither the link nor what it points at changes (issue 56)."""
    out = tmp_path / "out"
    out.mkdir()
    target, victim = _victim(tmp_path, directory=False)
    link = _plant(out, name, kind, target)
    refused(["convert", work / "llama", out, "--overwrite", "--quiet"], name, "--overwrite removes only what")
    _untouched(target, victim)
    assert link.is_symlink() if kind == "symlink" else os.stat(link).st_nlink == 2


def test_the_convert_names_cover_what_a_conversion_writes(work, tmp_path):
    for sharded in (False, True):
        out = tmp_path / f"out-{sharded}"
        _convert(work / "llama", out, sharded=sharded)
        shards = {f"model-{i:05d}-of-00002.safetensors" for i in (1, 2)}
        assert _written(out) == (
            set(CONVERT_FILES) - {"model.safetensors"} | set(SHARDED) | shards if sharded else set(CONVERT_FILES)
        )


@pytest.mark.parametrize("kind", ["symlink", "hardlink"])
@pytest.mark.parametrize("name", MERGE_FILES)
def test_merge_overwrite_never_writes_through_a_link(work, tmp_path, name, kind, refused):
    out = tmp_path / "out"
    out.mkdir()
    target, victim = _victim(tmp_path, directory=False)
    link = _plant(out, name, kind, target)
    refused(["merge", work / "lora", out, "--overwrite"], name, "--overwrite removes only what")
    _untouched(target, victim)
    assert link.is_symlink() if kind == "symlink" else os.stat(link).st_nlink == 2


def test_the_merge_names_cover_what_a_merge_writes(work, tmp_path):
    assert cli.main([str(a) for a in ["merge", work / "lora", tmp_path / "out"]]) == 0
    assert _written(tmp_path / "out") == set(MERGE_FILES)


def test_new_files_replace_a_link_at_their_name(tmp_path):
    target, victim = _victim(tmp_path, directory=False)
    out = tmp_path / "out"
    out.mkdir()
    _plant(out, "a.json", "symlink", target)
    _plant(out, "b.json", "hardlink", target)
    write_new_file(out / "a.json", "{}")
    write_new_file(out / "b.json", b"[]")
    _untouched(target, victim)
    assert (out / "a.json").read_text() == "{}" and not (out / "a.json").is_symlink()
    assert (out / "b.json").read_bytes() == b"[]" and sorted(p.name for p in out.iterdir()) == ["a.json", "b.json"]
    (out / "run").mkdir()
    (out / "run" / "x").write_text("x")
    _plant(out, "run/.diff-transformer-run.json", "symlink", target)  # the run record itself, and its old temp name
    _plant(out, "run/.diff-transformer-run.json.tmp", "symlink", target)
    record_entry(out / "run", "x")
    _untouched(target, victim)
    assert not (out / "run" / ".diff-transformer-run.json").is_symlink()


def test_the_run_lock_is_never_truncated_through_a_hard_link(tmp_path):
    from diff_transformer.outputs.files import OutputError

    target, victim = _victim(tmp_path, directory=False)
    out = tmp_path / "out"
    out.mkdir()
    _plant(out, ".diff-transformer.lock", "hardlink", target)
    with pytest.raises(OutputError, match="hard links"), OutputLock(out, name="--output"):
        pass
    _untouched(target, victim)
