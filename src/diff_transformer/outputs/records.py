"""Proofs that a directory holds what a command of this package wrote there, which let a later command replace or
delete it (and nothing else):

* `write_manifest` / `wrote_this`: a directory listing every entry it holds (the hashes of its regular files, its
  subdirectories), so a command (the demo) can replace a directory only when it can prove that it wrote it and nobody
  changed it since. Anything else (a link, a FIFO, a socket, a device) is never opened and disproves authorship.
* A training run's record (`RUN_RECORD` at the top of its --output, `record_written` / `record_entry`): the hashes of
  every entry the run wrote, so that `remove_recorded` deletes only those still unchanged, and checkpoint rotation
  only the checkpoints the run saved (`proven`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
from pathlib import Path

from .files import MANIFEST, RUN_LOCK, RUN_RECORD, _read_small, write_new_file


# --------------------------------------------------------------------------------------------------------------
# Manifests: proof that a directory holds exactly what a command wrote there.


def _file_hashes(directory: Path) -> dict[str, str] | None:
    """relative path -> sha256 of every regular file under `directory` (the manifest excluded) and "directory" for
    every subdirectory; None if anything else is found (a link, a FIFO, a socket, a device: never opened)."""
    entries = {}
    pending = [Path(directory)]
    while pending:
        folder = pending.pop()
        try:
            children = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError:
            return None
        for child in children:
            path = Path(child.path)
            relative = path.relative_to(directory).as_posix()
            mode = child.stat(follow_symlinks=False).st_mode
            if stat.S_ISDIR(mode):
                entries[relative] = "directory"
                pending.append(path)
            elif not stat.S_ISREG(mode):
                return None
            elif relative != MANIFEST:
                digest = _sha256(path)
                if digest is None:
                    return None
                entries[relative] = digest
    return entries


def _sha256(path: Path) -> str | None:
    """The hash of a regular file, opened without following a link or blocking (it could have been swapped for a
    FIFO since it was listed), else None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        digest = hashlib.sha256()
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(directory, written_by: str, exclude=()) -> None:
    """Record in `directory` every entry it holds (file hashes, subdirectories), as written by `written_by`, less the
    top-level entries `exclude` (not written by it: what an --overwrite kept of the user's, `Staging.carried`)."""
    directory = Path(directory)
    entries = _file_hashes(directory)
    if entries is not None and exclude:
        entries = {k: v for k, v in entries.items() if k.split("/", 1)[0] not in set(exclude)}
    manifest = {"written_by": written_by, "entries": entries}
    write_new_file(directory / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True) + "\n")


def wrote_this(directory, written_by: str) -> bool:
    """True when `directory` holds exactly the entries `written_by` recorded there, unchanged."""
    directory = Path(directory)
    try:
        manifest = json.loads(_read_small(directory / MANIFEST, limit=64 << 20) or "null")  # never a FIFO
    except (OSError, ValueError, RecursionError):
        return False
    if not isinstance(manifest, dict) or manifest.get("written_by") != written_by:
        return False
    return manifest.get("entries") == _file_hashes(directory)


def _manifest_entries(directory: Path) -> dict:
    """The entries a diff-transformer command's manifest in `directory` records, or {} (none, or not ours)."""
    try:
        manifest = json.loads(_read_small(directory / MANIFEST, limit=64 << 20) or "null")
    except (OSError, ValueError, RecursionError):
        return {}
    if not isinstance(manifest, dict) or not str(manifest.get("written_by", "")).startswith("diff-transformer"):
        return {}
    entries = manifest.get("entries")
    return entries if isinstance(entries, dict) else {}


def _manifest_proves(directory: Path, name: str, entries: dict) -> bool:
    """The manifest's `entries` prove that a command wrote the top-level entry `name`, unchanged since."""
    path = directory / name
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return False
    if stat.S_ISREG(mode):
        return entries.get(name) == _sha256(path)
    if stat.S_ISDIR(mode) and entries.get(name) == "directory":
        prefix = name + "/"
        inside = {key[len(prefix) :]: value for key, value in entries.items() if key.startswith(prefix)}
        return _file_hashes(path) == inside
    return False


# --------------------------------------------------------------------------------------------------------------
# Run records: what a training run wrote into its --output, entry by entry.


def top_level_state(directory) -> dict[str, tuple[int, int]]:
    """name -> (size, mtime_ns) of each entry at the top of `directory` (what a run is about to change)."""
    state = {}
    for entry in os.scandir(directory) if os.path.isdir(directory) else []:
        info = entry.stat(follow_symlinks=False)
        state[entry.name] = (info.st_size, info.st_mtime_ns)
    return state


def record_written(directory, before: dict[str, tuple[int, int]], *, skip=()) -> None:
    """Record the top-level entries of `directory` that appeared or changed since `before`: regular files with their
    hash, directories with the hashes of everything inside (`_file_hashes`) (RUN_RECORD; added to what an earlier
    record of the same directory still proves)."""
    directory = Path(directory)
    entries = _run_record(directory)
    now = top_level_state(directory)
    for name, state in now.items():
        if name in skip or name in (RUN_RECORD, RUN_LOCK) or before.get(name) == state:
            continue
        path = directory / name
        mode = os.lstat(path).st_mode
        if stat.S_ISDIR(mode) and (inside := _file_hashes(path)) is not None:
            entries[name] = inside
        elif stat.S_ISREG(mode) and (digest := _sha256(path)) is not None:
            entries[name] = digest
    _write_record(directory, entries)


def _run_record(directory: Path) -> dict:
    try:
        record = json.loads(_read_small(directory / RUN_RECORD, limit=1 << 20) or "{}")
    except (OSError, ValueError, RecursionError):
        return {}
    if not isinstance(record, dict):
        return {}
    return {k: v for k, v in record.items() if isinstance(k, str) and isinstance(v, (str, dict))}


def _proves(directory: Path, name: str, digest) -> bool:
    """Whether the record's `digest` of `name` (a file's hash, or a directory's `_file_hashes`) still matches."""
    path = directory / name
    if "/" in name or name in (".", "..") or not os.path.lexists(path):
        return False
    mode = os.lstat(path).st_mode
    if isinstance(digest, dict) and stat.S_ISDIR(mode):
        return _file_hashes(path) == digest
    return isinstance(digest, str) and stat.S_ISREG(mode) and _sha256(path) == digest


def record_entry(directory, name: str) -> None:
    """Add the top-level entry `name` of `directory` (e.g. a checkpoint a run just saved) to its RUN_RECORD, with the
    hashes of everything inside: the proof that lets a later step of the run (checkpoint rotation) or a later run
    delete it, as long as nobody changes it."""
    directory = Path(directory)
    path = directory / name
    entries = _run_record(directory)
    mode = os.lstat(path).st_mode
    if stat.S_ISDIR(mode) and (inside := _file_hashes(path)) is not None:
        entries[name] = inside
    elif stat.S_ISREG(mode) and (digest := _sha256(path)) is not None:
        entries[name] = digest
    else:
        entries.pop(name, None)
    _write_record(directory, entries)


def forget_entry(directory, name: str) -> None:
    """Drop `name` from the RUN_RECORD of `directory` (deleted, or no longer the run's)."""
    directory = Path(directory)
    entries = _run_record(directory)
    if entries.pop(name, None) is not None:
        _write_record(directory, entries)


def record_flag(directory, flag: str) -> None:
    """Note FLAG in the RUN_RECORD of `directory`: a fact about the run, not an entry (its key starts with "/", which
    no file name does, so nothing ever tries to prove or delete it)."""
    directory = Path(directory)
    entries = _run_record(directory)
    if entries.get("/" + flag) != "yes":
        entries["/" + flag] = "yes"
        _write_record(directory, entries)


def has_flag(directory, flag: str) -> bool:
    return _run_record(Path(directory)).get("/" + flag) == "yes"


def recorded(directory) -> list[str]:
    """The names RUN_RECORD lists (whether or not they are still as recorded: see `proven`)."""
    return sorted(_run_record(Path(directory)))


def proven(directory, name: str) -> bool:
    """Whether RUN_RECORD proves that a run wrote the entry `name` of `directory` and nobody changed it since."""
    directory = Path(directory)
    digest = _run_record(directory).get(name)
    return digest is not None and _proves(directory, name, digest)


def _write_record(directory: Path, entries: dict) -> None:
    # Never half-written (it is what proves the run's files), and never written through a link at its name.
    write_new_file(directory / RUN_RECORD, json.dumps(entries, indent=1, sort_keys=True) + "\n")


def remove_recorded(directory) -> list[str]:
    """Delete what RUN_RECORD proves an earlier run wrote and nobody changed since (a file whose hash still matches,
    a directory holding exactly what was recorded inside it), then the record; everything else stays (the user's).
    Returns what was deleted."""
    directory = Path(directory)
    removed = []
    for name, digest in sorted(_run_record(directory).items()):
        if not _proves(directory, name, digest):
            continue
        path = directory / name
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            path.unlink()
        removed.append(name)
    (directory / RUN_RECORD).unlink(missing_ok=True)
    return removed
