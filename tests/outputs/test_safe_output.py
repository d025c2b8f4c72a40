"""Nothing the user owns is lost (issue "Trust", items 2 and 5): refused output paths, the atomic install, recovery
after killed runs, the demo's proof of authorship, permissions, symbolic links, and bf16 verification. The commands
run in-process through `cli.main` on tiny checkpoints; every refusal is one `error:` line and exit status 2."""

import fcntl
import json
import logging
import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from diff_transformer import cli
from diff_transformer.conversion import ConversionError, convert_llama_to_diff, verify_conversion
from diff_transformer.conversion import convert as convert_module
from diff_transformer.outputs.records import write_manifest, wrote_this
from tests.helpers.checkpoints import make_llama, tree_digest


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_llama(tmp_path_factory.mktemp("src") / "llama")


def sentinel_tree(root: Path) -> dict:
    """A directory of the user's: files that must survive every refused command."""
    (root / "notes").mkdir(parents=True, exist_ok=True)
    (root / "precious.txt").write_text("the user's data\n")
    (root / "notes" / "todo.md").write_text("- keep me\n")
    return tree_digest(root)


def hidden_entries(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


# ---------------------------------------------------------------------------------------------------------------
# Output paths that are refused whatever the flags


def test_convert_refuses_empty_out_cwd_its_ancestors_home_and_root(refused, llama, tmp_path, monkeypatch, capsys):
    cwd = tmp_path / "work" / "project"
    cwd.mkdir(parents=True)
    (tmp_path / "home").mkdir()
    digest = sentinel_tree(tmp_path)  # the cwd and the home directory lie inside
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    refused(["convert", llama, "", "--overwrite", "--quiet"], "OUT is empty")
    refused(["convert", llama, ".", "--overwrite", "--quiet"], "'.'", "current directory")
    refused(["convert", llama, "..", "--overwrite", "--quiet"], "'..'", "parent of the current directory")
    refused(["convert", llama, tmp_path, "--overwrite", "--quiet"], "parent of the current directory")
    refused(["convert", llama, "~", "--overwrite", "--quiet"], "'~'", "home directory")
    refused(["convert", llama, "/", "--overwrite", "--quiet"], "'/'", "filesystem root")
    assert tree_digest(tmp_path) == digest
    assert cli.main(["convert", str(llama), "fresh", "--quiet"]) == 0  # a new directory below the cwd is fine
    assert (cwd / "fresh" / "config.json").is_file()


def test_train_refuses_the_model_directory_as_output(refused, tmp_path, capsys):
    from tests.helpers.tiny import tiny_model

    model = tmp_path / "model"
    tiny_model(2).save_pretrained(model)
    (tmp_path / "text.txt").write_text("It is a truth universally acknowledged. " * 40)
    digest = tree_digest(model)
    common = ["--data", tmp_path / "text.txt", "--quiet", "--report-to", "none", "--max-steps", "1"]
    refused(["train", model, "--output", model, *common], "--output", "is MODEL: choose another --output")
    refused(["train", model, "--output", model / "run", *common], "overlaps MODEL")
    # a copy of a model is not a training run either: the final save would overwrite it
    copy = tmp_path / "copy"
    tiny_model(1).save_pretrained(copy)
    copy_digest = tree_digest(copy)
    refused(["train", model, "--output", copy, *common], str(copy), "--overwrite")
    assert tree_digest(model) == digest and tree_digest(copy) == copy_digest


# ---------------------------------------------------------------------------------------------------------------
# The demo replaces only what it can prove it wrote


def test_demo_does_not_replace_a_training_run(refused, tmp_path, capsys):
    run = tmp_path / "run"
    (run / "checkpoint-5").mkdir(parents=True)
    (run / "config.json").write_text(
        json.dumps({"model_type": "diff", "diff_version": 2})
    )  # what the old check trusted
    (run / "checkpoint-5" / "model.safetensors").write_bytes(b"trained weights")
    digest = sentinel_tree(run)
    refused(["demo", "--output", run], str(run), "--overwrite")
    refused(["demo", "--scratch", "--output", run], str(run), "--overwrite")
    assert tree_digest(run) == digest


def test_manifest_proves_authorship_only_while_unchanged(tmp_path):
    out = tmp_path / "out"
    (out / "sub").mkdir(parents=True)
    (out / "a.json").write_text("{}")
    (out / "sub" / "b.bin").write_bytes(b"\x00\x01")
    assert not wrote_this(out, "demo")  # no manifest
    write_manifest(out, "demo")
    assert wrote_this(out, "demo") and not wrote_this(out, "another tool")
    (out / "sub" / "b.bin").write_bytes(b"\x00\x02")
    assert not wrote_this(out, "demo")  # changed
    write_manifest(out, "demo")
    (out / "notes.txt").write_text("added by the user")
    assert not wrote_this(out, "demo")  # added
    (out / "notes.txt").unlink()
    assert wrote_this(out, "demo")
    (out / "link").symlink_to(tmp_path)
    assert not wrote_this(out, "demo")


def test_scratch_demo_replaces_its_own_output_only(refused, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    assert cli.main(["demo", "--scratch"]) == 0
    assert list((tmp_path / "tmp").iterdir()) == []  # the temporary directory is gone
    out = tmp_path / "scratch"
    assert cli.main(["demo", "--scratch", "--output", str(out)]) == 0
    assert (out / "diff-v2" / "model.safetensors").is_file()
    assert cli.main(["demo", "--scratch", "--output", str(out)]) == 0  # its own, unchanged output: replaced
    (out / "diff-v1" / "notes.txt").write_text("my notes")
    capsys.readouterr()
    refused(["demo", "--scratch", "--output", out], str(out), "--overwrite")
    assert (out / "diff-v1" / "notes.txt").read_text() == "my notes"
    # diff-v1 holds the user's notes now: no record proves it the demo's, and the new output writes that name
    refused(["demo", "--scratch", "--output", out, "--overwrite"], str(out), "diff-v1")
    (out / "diff-v1" / "notes.txt").unlink()  # the demo's own output again, as recorded: replaced with the flag
    assert cli.main(["demo", "--scratch", "--output", str(out), "--overwrite"]) == 0
    assert wrote_this(out, "diff-transformer demo --scratch")
    assert hidden_entries(tmp_path) == []


# ---------------------------------------------------------------------------------------------------------------
# The install: an atomic rename that replaces only what this run was told to replace


def _during_write(monkeypatch, action):
    """Run `action()` while the conversion writes its temporary directory (as another process would)."""
    write = convert_module._write

    def wrapped(*args, **kwargs):
        write(*args, **kwargs)
        action()

    monkeypatch.setattr(convert_module, "_write", wrapped)


@pytest.mark.parametrize("overwrite", [False, True])
def test_directory_appearing_during_conversion_is_kept(llama, tmp_path, monkeypatch, overwrite):
    out = tmp_path / "diff"
    _during_write(monkeypatch, lambda: sentinel_tree(out))
    with pytest.raises(ConversionError, match="created or changed by something else while this run was writing"):
        convert_llama_to_diff(llama, out, overwrite=overwrite, progress=False)
    assert sorted(p.name for p in out.iterdir()) == ["notes", "precious.txt"]
    assert hidden_entries(tmp_path) == []


def test_overwrite_replaces_only_the_directory_it_was_told_to(llama, tmp_path, monkeypatch):
    out = tmp_path / "diff"
    sentinel_tree(out)
    _during_write(monkeypatch, lambda: (out / "added-meanwhile.txt").write_text("new work"))
    with pytest.raises(ConversionError, match="created or changed by something else"):
        convert_llama_to_diff(llama, out, overwrite=True, progress=False)
    assert (out / "added-meanwhile.txt").read_text() == "new work" and (out / "precious.txt").is_file()
    assert hidden_entries(tmp_path) == []


def test_second_conversion_into_the_same_out(llama, tmp_path, monkeypatch):
    """Two conversions into one OUT: the one finishing first installs; the other refuses and deletes nothing."""
    out = tmp_path / "diff"
    write = convert_module._write
    calls = []

    def wrapped(*args, **kwargs):
        write(*args, **kwargs)
        if not calls:
            calls.append(1)
            convert_llama_to_diff(llama, out, diff_version=1, progress=False)  # the "other" run, finishing first

    monkeypatch.setattr(convert_module, "_write", wrapped)
    with pytest.raises(ConversionError, match="created or changed by something else"):
        convert_llama_to_diff(llama, out, progress=False)
    assert json.loads((out / "config.json").read_text())["diff_version"] == 1
    assert hidden_entries(tmp_path) == []


# ---------------------------------------------------------------------------------------------------------------
# Killed runs: the next run recovers the user's model and removes what was only ours


KILL_BETWEEN_RENAMES = """
import os, signal, sys
from diff_transformer.conversion import convert_llama_to_diff
from diff_transformer.outputs import staging

rename = os.rename
def rename_then_die(src, dst):
    if ".old-" in os.fspath(dst):  # OUT moved aside: die before the new one takes its place
        rename(src, dst)
        os.kill(os.getpid(), signal.SIGKILL)
    rename(src, dst)
staging.os.rename = rename_then_die
convert_llama_to_diff(sys.argv[1], sys.argv[2], overwrite=True, progress=False)
"""


def test_killed_overwrite_is_recovered_by_the_next_run(llama, tmp_path, caplog):
    out = tmp_path / "diff"
    digest = sentinel_tree(out)
    result = subprocess.run([sys.executable, "-c", KILL_BETWEEN_RENAMES, str(llama), str(out)], timeout=300)
    assert result.returncode == -9
    assert not out.exists()  # the user's model is only in .diff.old-*, the finished conversion in .diff.tmp-*
    names = hidden_entries(tmp_path)
    assert [n.split("-")[0] for n in names] == [".diff.old", ".diff.tmp", ".diff.tmp"], names  # + the lock file

    with caplog.at_level(logging.WARNING, logger="diff_transformer"):
        with pytest.raises(ConversionError, match="is not empty: pass overwrite=True"):
            convert_llama_to_diff(llama, out, progress=False)
    assert tree_digest(out) == digest and hidden_entries(tmp_path) == []
    notes = " ".join(caplog.messages)
    assert f"restored your previous {out}" in notes and "unfinished output of an interrupted run" in notes


KILL_WHILE_WRITING = """
import os, signal, sys
from diff_transformer.conversion import convert_llama_to_diff
from diff_transformer.conversion import writer

def add_then_die(self, *args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)
writer.ShardWriter.add = add_then_die
convert_llama_to_diff(sys.argv[1], sys.argv[2], progress=False)
"""


def test_leftovers_of_dead_runs_are_removed_and_live_runs_left_alone(llama, tmp_path, capsys):
    out = tmp_path / "diff"
    result = subprocess.run([sys.executable, "-c", KILL_WHILE_WRITING, str(llama), str(out)], timeout=300)
    assert result.returncode == -9
    (dead,) = [p for p in tmp_path.iterdir() if p.name.startswith(".diff.tmp-") and p.is_dir()]
    live = tmp_path / ".diff.tmp-11ve0000"
    live.mkdir()
    (live / "model.safetensors").write_bytes(b"being written")
    lock = open(tmp_path / ".diff.tmp-11ve0000.lock", "w")
    fcntl.flock(lock, fcntl.LOCK_EX)  # a run that is still alive
    old = tmp_path / ".diff.old-0dead111"
    sentinel_tree(old)
    (out / "x").mkdir(parents=True)
    try:
        assert cli.main(["convert", str(llama), str(out), "--overwrite", "--quiet"]) == 0
    finally:
        lock.close()
    err = capsys.readouterr().err
    assert err.count("note: removed") == 1 and dead.name in err, err
    assert hidden_entries(tmp_path) == [".diff.old-0dead111", ".diff.tmp-11ve0000", ".diff.tmp-11ve0000.lock"]
    assert (live / "model.safetensors").read_bytes() == b"being written" and (old / "precious.txt").is_file()


def test_directories_named_like_leftovers_are_the_users(llama, tmp_path, capsys):
    """Issue 21: `mkdir .model.tmp-notes; convert SRC model` removed the user's directory, and a `.model.old-*` of
    theirs was renamed into OUT, by name alone. Only what a run of ours marked at creation is recovered now."""
    out = tmp_path / "model"
    names = (".model.tmp-notes", ".model.old-notes", ".model.old-0dead")
    mine = {name: sentinel_tree(tmp_path / name) for name in names}
    (tmp_path / ".model.tmp-0dead.lock").write_text("")  # nobody holds it, but nothing proves it is ours
    (tmp_path / ".model.lock-mine").write_text("my own file\n")
    assert cli.main(["convert", str(llama), str(out), "--quiet"]) == 0
    assert "note:" not in capsys.readouterr().err
    assert {name: tree_digest(tmp_path / name) for name in mine} == mine
    assert (tmp_path / ".model.lock-mine").read_text() == "my own file\n"
    assert (tmp_path / ".model.tmp-0dead.lock").exists() and (out / "config.json").is_file()


# ---------------------------------------------------------------------------------------------------------------
# Item 5: permissions, links out of SRC, bf16 verification


def test_converted_directory_follows_the_umask(llama, tmp_path):
    previous = os.umask(0o022)
    try:
        out = convert_llama_to_diff(llama, tmp_path / "diff", progress=False)
    finally:
        os.umask(previous)
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    assert stat.S_IMODE((out / "model.safetensors").stat().st_mode) == 0o644


def test_side_file_links_out_of_src_are_not_followed(tmp_path, caplog):
    src = make_llama(tmp_path / "llama")
    (tmp_path / "secrets").mkdir()
    (tmp_path / "secrets" / "token").write_text("hf_SECRET")
    (src / "tokenizer.model").symlink_to(tmp_path / "secrets" / "token")  # an allowed name, linking outside SRC
    (src / "extra").mkdir()
    (src / "extra" / "merges.txt").write_text("a b\n")
    (src / "merges.txt").symlink_to(src / "extra" / "merges.txt")  # a link inside SRC is fine
    with caplog.at_level(logging.WARNING, logger="diff_transformer"):
        out = convert_llama_to_diff(src, tmp_path / "diff", progress=False)
    assert not (out / "tokenizer.model").exists()
    assert (out / "merges.txt").read_text() == "a b\n" and not (out / "merges.txt").is_symlink()
    assert "not copying tokenizer.model" in " ".join(caplog.messages)


def test_bf16_conversion_verifies(llama, tmp_path, capsys):
    out = tmp_path / "diff"
    assert cli.main(["convert", str(llama), str(out), "--dtype", "bfloat16", "--verify", "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "against the source with its weights cast to bfloat16 as in OUT" in printed
    report = verify_conversion(llama, out, max_new_tokens=2)
    assert report["passed"] and report["max_abs_logit_diff"] <= 1e-4
    # the cast reference still catches a wrong conversion: one changed weight fails it
    from safetensors.torch import load_file, save_file

    state = load_file(out / "model.safetensors")
    state["model.layers.0.mlp.down_proj.weight"][0, 0] += 0.5
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    assert not verify_conversion(llama, out, max_new_tokens=0)["passed"]


def test_a_run_record_proves_only_what_is_unchanged(tmp_path):
    """record_written / remove_recorded (train --overwrite): what appeared or changed since the snapshot is recorded;
    removal takes a file only while its hash matches and a directory only while it holds exactly what was recorded."""
    from diff_transformer.outputs.files import RUN_RECORD
    from diff_transformer.outputs.records import record_written, remove_recorded, top_level_state

    out = tmp_path / "out"
    out.mkdir()
    (out / "users.txt").write_text("there before")
    before = top_level_state(out)
    for name in ("model.bin", "edited.txt"):
        (out / name).write_text(name)
    for name in ("logs", "logs-touched"):
        (out / name).mkdir()
        (out / name / "events").write_text("e")
    record_written(out, before)
    assert set(json.loads((out / RUN_RECORD).read_text())) == {"model.bin", "edited.txt", "logs", "logs-touched"}
    (out / "edited.txt").write_text("changed by the user")
    (out / "logs-touched" / "mine.txt").write_text("mine")
    assert sorted(remove_recorded(out)) == ["logs", "model.bin"]
    assert sorted(p.name for p in out.iterdir()) == ["edited.txt", "logs-touched", "users.txt"]
    assert (out / "logs-touched" / "mine.txt").is_file()
