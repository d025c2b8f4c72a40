"""Issue 56 item 4: `--overwrite` removes only what an earlier run of this package provably wrote (its manifest or a
training run's record, unchanged since). Every command that takes --overwrite and writes a directory (convert,
merge, train, niah, demo, demo --scratch): the user's entries planted in OUT (an unrelated .bin, a subdirectory, a
symbolic link, a notes file) survive an --overwrite untouched (content and modification time) and are named in a
note; a user's entry that the new output would replace or read (a README.md, a stray shard) makes the command refuse
with exit code 2, naming it, with OUT unchanged; the previous run's own files are replaced. Commands run in-process
on tiny checkpoints."""

import os
from pathlib import Path

import pytest

from diff_transformer import cli
from tests.helpers.training import train_argv, train_work


TINY = Path(cli.__file__).resolve().parent.parent / "assets" / "tiny-llama"
PAST = 1_000_000_000  # a modification time (2001) that no run of the test sets by accident


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """`tests.helpers.training.train_work`: a tiny Diff V2 checkpoint and its text, a tiny Llama, a LoRA run."""
    return train_work(tmp_path_factory.mktemp("ownership"))


COMMANDS = {
    "convert": lambda w, out: ["convert", w / "llama", out, "--quiet"],
    "merge": lambda w, out: ["merge", w / "lora", out],
    "train": lambda w, out: train_argv(w, out, "--max-steps", "1", "--eval-fraction", "0"),
    "niah": lambda w, out: ["niah", TINY, "--out", out, "--lengths", "150", "--depths", "0", "--needles", "1"],
    "demo --scratch": lambda w, out: ["demo", "--scratch", "--output", out],
    "demo": lambda w, out: ["demo", "--output", out],
}
SLOW = {"demo", "demo --scratch", "train"}  # a demo (conversion, verification, generation), a training run: 10-80 s


def _run(argv) -> int:
    return cli.main([str(a) for a in argv])


def _state(path: Path) -> dict:
    """relative path -> (kind, content or link target, mtime_ns) of everything under PATH, links not followed."""
    state = {}
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            entry = Path(root) / name
            info = os.lstat(entry)
            if entry.is_symlink():
                what = ("link", os.readlink(entry))
            elif entry.is_dir():
                what = ("dir", None)
            else:
                what = ("file", entry.read_bytes())
            state[entry.relative_to(path).as_posix()] = (*what, info.st_mtime_ns)
    return state


def _identities(path: Path) -> dict:
    return {p.name: (os.lstat(p).st_ino, os.lstat(p).st_mtime_ns) for p in path.iterdir()}


def _plant_users_entries(out: Path, link: bool) -> list[str]:
    """What a user keeps in OUT that the new output neither writes nor reads, dated in the past."""
    (out / "finetune-backup.bin").write_bytes(b"\x00weights of mine\xff")
    (out / "notes.txt").write_text("my notes")
    (out / "experiments").mkdir()
    (out / "experiments" / "log.txt").write_text("mine")
    names = ["experiments", "finetune-backup.bin", "notes.txt"]
    if link:
        (out / "latest").symlink_to("../elsewhere/model")  # dangling: never followed
        names.append("latest")
    for path in [out / "experiments" / "log.txt", *(out / name for name in names)]:
        os.utime(path, ns=(PAST, PAST), follow_symlinks=False)
    return names


@pytest.mark.parametrize("command", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW else c for c in COMMANDS])
def test_overwrite_keeps_the_users_entries_and_replaces_its_own(command, work, tmp_path, capsys, refused):
    argv = COMMANDS[command]
    out = tmp_path / "out"
    assert _run(argv(work, out)) == 0
    first = _identities(out)
    # train writes in place, where a link could lead a write outside OUT: refused (test_links), not kept
    users = _plant_users_entries(out, link=command != "train")
    users_state = {k: v for k, v in _state(out).items() if k.split("/")[0] in users}

    # A file of the run's that the user changed (theirs now: the new output writes that name; README.md, say), a
    # user's stray shard (a loader would read it beside the new model)
    written = next(name for name in ("README.md", "niah.json", "diff-v1/config.json") if (out / name).exists())
    for name in (written, "old-model-00002-of-00002.safetensors"):
        original = (out / name).read_bytes() if (out / name).exists() else None
        (out / name).write_bytes(b"mine: " + name.encode())
        os.utime(out / name, ns=(PAST, PAST))
        before = _state(out)
        top = name.split("/")[0]
        refused([*argv(work, out), "--overwrite"], str(out), top, "--overwrite removes only what", notes=True)
        assert _state(out) == before  # nothing changed, nothing removed
        assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]  # nothing left beside
        if original is None:
            (out / name).unlink()
        else:
            (out / name).write_bytes(original)  # the run's own file again: proven, replaceable
    os.utime(out, ns=(PAST, PAST))  # (the directory itself may change: entries are added and removed)

    capsys.readouterr()
    assert _run([*argv(work, out), "--overwrite"]) == 0
    err = capsys.readouterr().err
    after = _state(out)
    assert {k: v for k, v in after.items() if k.split("/")[0] in users} == users_state  # untouched
    if command != "train":  # written in place, they never moved: nothing to say
        assert "kept what no diff-transformer command wrote" in err and all(name in err for name in users)
    now = _identities(out)
    for name, identity in first.items():  # the previous run's own files: removed and written anew
        assert now.get(name) != identity, name
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]


@pytest.mark.parametrize("command", ["convert", "merge", "train", "niah", "demo --scratch"])
def test_overwrite_never_takes_an_empty_path_the_current_directory_or_the_source(
    command, work, tmp_path, refused, monkeypatch
):
    argv = COMMANDS[command]
    monkeypatch.chdir(tmp_path)
    refused([*argv(work, ""), "--overwrite"], "is empty")
    refused([*argv(work, "."), "--overwrite"], "current directory")
    source = {"convert": work / "llama", "merge": work / "lora", "train": work / "v2", "niah": TINY}.get(command)
    if source is not None:
        before = _state(source)
        refused([*argv(work, source), "--overwrite"], str(source))
        assert _state(source) == before


def test_a_convert_output_from_before_manifests_is_refused_naming_its_files(work, tmp_path, refused):
    """An output that no record proves (a conversion by an older version, a copy of a model): nothing is removed on a
    name's say-so; the refusal names what would be replaced."""
    import shutil

    out = tmp_path / "old"
    shutil.copytree(work / "llama", out)
    before = _state(out)
    refused(["convert", work / "llama", out, "--overwrite", "--quiet"], "config.json", "model.safetensors")
    assert _state(out) == before
