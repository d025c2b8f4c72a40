"""Outputs installed whole, and runs that may die at any moment (see the package docstring for the other layers):

* `Staging(out, overwrite=...)` writes into a hidden `.OUT.tmp-<token>` beside OUT, created with the umask's mode
  (as `save_pretrained` creates directories), and `install()` renames it into place once complete. Without
  `overwrite` that is one atomic rename, which replaces at most an empty directory: whatever appeared at OUT in the
  meantime (another run, say) is never deleted. With `overwrite` only the directory that was at OUT when the run
  started is replaced, and only if it has not changed since.
* A killed run leaves `.OUT.tmp-<token>` (ours: the next run into OUT removes it) and, when killed between the two
  renames of an overwrite, the user's previous OUT as `.OUT.old-<token>` (theirs: the next run renames it back).
  Every staging directory has a lock file `.OUT.tmp-<token>.lock` that its run holds (flock) while it lives, so the
  files of a live run are never touched. Both recoveries are reported (logging, to stderr by default). Neither is
  decided by the name: a staging directory is removed only when it holds the marker (`STAGING_MARK`, with its token)
  written into it at creation, and `.OUT.old-<token>` is renamed back only when the lock file of its token records
  that directory's identity (device, inode), written just before the rename that moved it. A directory of the
  user's that happens to be called `.OUT.tmp-notes` is never touched.
* `OutputLock(out)`: one run at a time into an output that is written in place (`train --output`): an flock on
  `OUT/.diff-transformer.lock`; a second run is refused while the first lives.
* An --overwrite installs the new output whole and removes of the replaced OUT only what a command of this package
  provably wrote (`ours`: its manifest or a training run's record proves it, unchanged; its bookkeeping files). Every
  other top-level entry is the user's (`users_entries`): moved into the new OUT and named in a note, or, where the
  new output has an entry of that name or a loader would read it beside the new model (`LOADER_READS`: a stale
  adapter_config.json, a shard), the run is refused naming it, before any work (`writes`) and again at the install.
"""

from __future__ import annotations

import errno
import fnmatch
import json
import logging
import os
import secrets
import shutil
import stat
import tempfile
from pathlib import Path

from ..errors import as_one_line
from .files import (
    _NOFOLLOW,
    MANIFEST,
    RUN_LOCK,
    RUN_RECORD,
    STAGING_MARK,
    OutputError,
    _read_small,
    refuse_links,
    write_new_file,
)
from .records import _manifest_entries, _manifest_proves, _proves, _run_record


try:
    import fcntl
except ImportError:  # Windows
    fcntl = None
    import msvcrt

logger = logging.getLogger(__name__)

_LOCK_LINE = "diff-transformer staging lock"  # a lock file's first line, with its token; an identity may follow


# --------------------------------------------------------------------------------------------------------------
# Locks: a run holds the lock of its token while it lives; the OS releases it when the process dies.


def _try_lock(fd: int) -> bool:
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        else:
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
        return True
    except OSError:
        return False


def _lock_if_dead(lock: Path) -> int | None:
    """An fd holding `lock` when no live process holds it (its run is dead), else None."""
    try:
        fd = os.open(lock, os.O_RDWR | _NOFOLLOW)  # a link planted at a lock's name is not our lock
    except OSError:
        return None
    if _try_lock(fd):
        return fd
    os.close(fd)
    return None


def _claim(parent: Path, name: str) -> tuple[str, int]:
    """A fresh token whose lock file `.NAME.tmp-<token>.lock` exists and is held. The file is locked under a temporary
    name before it is renamed into place, so no other run can ever see it unlocked while this one lives."""
    fd, temp = tempfile.mkstemp(prefix=f".{name}.lock-", dir=parent)
    try:
        os.write(fd, _lock_line("").encode() + b"\n")  # proof that a leftover of this name is ours
        if not _try_lock(fd):
            raise OSError(errno.EAGAIN, "cannot lock a new file", temp)
        while True:
            token = secrets.token_hex(4)
            stem = parent / f".{name}.tmp-{token}"
            if not any(p.exists() for p in (stem, Path(f"{stem}.lock"), parent / f".{name}.old-{token}")):
                _write_lock(fd, token)
                os.rename(temp, f"{stem}.lock")
                return token, fd
    except BaseException:
        os.close(fd)
        Path(temp).unlink(missing_ok=True)
        raise


def _lock_line(token: str) -> str:
    return f"{_LOCK_LINE} {token}".rstrip()


def _write_lock(fd: int, token: str, **identities: tuple[int, int]) -> None:
    """The lock file's content: our first line with the token, then the identities (device, inode) of the staging
    directory and (during an overwrite) of the directory moved to `.OUT.old-<token>`, so that a later run removes or
    renames back those directories and nothing else."""
    record = {key: list(value) for key, value in identities.items()}
    text = _lock_line(token) + "\n" + (json.dumps(record) + "\n" if record else "")
    os.ftruncate(fd, 0)
    os.pwrite(fd, text.encode(), 0)
    os.fsync(fd)


def _lock_record(lock: Path, token: str, key: str) -> tuple[int, int] | None:
    """The identity `key` ("staging", "moved") recorded in our lock file of `token`, or None."""
    lines = (_read_small(lock) or "").splitlines()
    if len(lines) < 2 or lines[0] != _lock_line(token):
        return None
    try:
        value = json.loads(lines[1])[key]
        return int(value[0]), int(value[1])
    except (ValueError, KeyError, TypeError, IndexError):
        return None


def _is_our_lock(lock: Path, token: str) -> bool:
    return (_read_small(lock) or "").splitlines()[:1] == [_lock_line(token)]


def _is_our_staging(stem: Path, token: str, lock: Path) -> bool:
    """`stem` holds the marker a run of ours wrote into it at creation, with this token, or (once the marker is gone,
    just before the install) our lock file of this token records its identity."""
    if stem.is_symlink() or not stem.is_dir():
        return False
    try:
        if json.loads(_read_small(stem / STAGING_MARK) or "null") == {"token": token}:
            return True
    except ValueError:
        pass
    identity = _identity(stem)
    return identity is not None and _lock_record(lock, token, "staging") == identity[:2]


def _size_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink()) / 1e6


def recover(out: Path) -> list[str]:
    """Clean up after dead runs that wrote to `out`: remove their `.OUT.tmp-*` directories (only ever ours) and rename
    a `.OUT.old-*` (the user's previous OUT, left by an overwrite killed between its two renames) back to OUT. Runs
    that still live are left alone. Returns (and logs) one note per action."""
    out = Path(out)
    parent, prefix = out.parent, f".{out.name}."
    if not parent.is_dir():
        return []
    tokens, leftovers = set(), []
    for entry in parent.iterdir():
        rest = entry.name[len(prefix) :] if entry.name.startswith(prefix) else ""
        if rest.startswith(("tmp-", "old-")):
            tokens.add(rest[4:].removesuffix(".lock"))
        elif rest.startswith("lock-"):
            leftovers.append(entry)  # a lock file not yet renamed by a run killed at that moment
    notes = []
    for token in sorted(tokens):
        stem, old = parent / f"{prefix}tmp-{token}", parent / f"{prefix}old-{token}"
        lock = Path(f"{stem}.lock")
        fd = _lock_if_dead(lock) if lock.exists() else None
        if lock.exists() and fd is None:
            continue  # a live run
        try:
            if _is_our_staging(stem, token, lock):
                size = _size_mb(stem)
                shutil.rmtree(stem)
                notes.append(
                    f"note: removed {stem.name} ({size:.1f} MB), the unfinished output of an interrupted run."
                )
            elif stem.is_dir() and not stem.is_symlink() and _is_our_lock(lock, token):
                try:  # killed between creating it and writing its marker: empty, or the user's
                    stem.rmdir()
                except OSError:
                    pass
            moved = _lock_record(lock, token, "moved") if fd is not None else None
            identity = _identity(old)
            if moved is not None and identity is not None and identity[:2] == moved and old.is_dir():
                if not os.path.lexists(out):
                    os.rename(old, out)
                    notes.append(
                        f"note: restored your previous {out} from {old.name}, where an interrupted --overwrite had "
                        "moved it."
                    )
                else:
                    notes.append(
                        f"note: {old} holds what an interrupted --overwrite moved out of {out.name}; {out.name} holds "
                        "something else now, so it was kept: move it back or delete it."
                    )
            if fd is not None and _is_our_lock(lock, token) and not (moved and os.path.lexists(old)):
                if not os.path.lexists(stem):
                    lock.unlink(missing_ok=True)
        finally:
            if fd is not None:
                os.close(fd)
    for entry in leftovers:
        fd = _lock_if_dead(entry)
        if fd is not None:
            if _is_our_lock(entry, ""):  # a lock file not yet renamed: ours only with our first line
                entry.unlink(missing_ok=True)
            os.close(fd)
    for note in notes:
        logger.warning(note)
    return notes


def _identity(path: Path):
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino, st.st_mtime_ns  # the mtime changes whenever an entry is added, removed or renamed


def _make_parents(directory: Path) -> Path | None:
    """mkdir -p, returning the top-most directory created (to remove on failure) or None."""
    created = None
    for parent in reversed([directory, *directory.parents]):
        if not parent.exists():
            created = created or parent
    directory.mkdir(parents=True, exist_ok=True)
    return created


def _remove_while_empty(directory: Path, created: Path) -> None:
    """Remove DIRECTORY and its parents up to CREATED (the top-most one a run created), stopping at the first that
    is not empty: what a refused or failed run created, and nothing else."""
    for folder in [directory, *directory.parents]:  # remove only what is still empty
        try:
            folder.rmdir()
        except OSError:
            break
        if folder == created:
            break


class Staging:
    """`with Staging(out, overwrite=...) as tmp:` write into `tmp`, then `staging.install()`. On any error before the
    install, `tmp` and the parent directories this created are removed and OUT is as it was.

    The constructor recovers what dead runs left beside OUT and refuses a non-empty OUT without `overwrite` (`flag`
    names the option in the message), a symbolic link or a file."""

    def __init__(
        self,
        out,
        *,
        overwrite: bool = False,
        name: str = "OUT",
        flag: str = "--overwrite",
        writes=(),
    ):
        self.out, self.name = Path(out).absolute(), name
        recover(self.out)
        if self.out.is_symlink():
            raise OutputError(
                f"{name} {self.out} is a symbolic link: pass the directory it points to, or another path."
            )
        if self.out.exists() and not self.out.is_dir():
            raise OutputError(f"{name} {self.out} exists and is not a directory: choose a directory path.")
        self.replace = None  # identity of the non-empty OUT this run was told to replace
        if self.out.is_dir() and any(self.out.iterdir()):
            if not overwrite:
                raise OutputError(f"{name} {self.out} is not empty: pass {flag} or choose another directory.")
            self.replace = _identity(self.out)
            # Before any work: the user's entries that the new output would replace (`writes`: patterns of the
            # names it may hold) or that a loader would read beside it; checked again at the install.
            patterns = (*LOADER_READS, *writes)
            candidates = [n for n in os.listdir(self.out) if _matches(n, patterns)]
            if candidates:
                mine = ours(self.out)
                refuse_users_entries(self.out, [n for n in candidates if n not in mine], name)
        self.path: Path | None = None
        self.carried: list[str] = []  # what the install kept of the replaced OUT: the user's (`users_entries`)
        self.installed = False
        self._fd = None
        self._created = None

    def __enter__(self) -> Path:
        parent = self.out.parent
        try:
            self._created = _make_parents(parent)
            token, self._fd = _claim(parent, self.out.name)
            self.token = token
            self.path = parent / f".{self.out.name}.tmp-{token}"
            os.mkdir(self.path, 0o777)  # the umask applies, as for save_pretrained's directories
            # What proves to a later run that this directory is ours (`recover`): a marker inside (removed just
            # before the install) and its identity in the lock file.
            write_new_file(self.path / STAGING_MARK, json.dumps({"token": token}))
            self._staging_id = _identity(self.path)[:2]
            _write_lock(self._fd, token, staging=self._staging_id)
        except OSError as exc:
            self._cleanup(failed=True)
            raise OutputError(
                f"cannot create a directory in {parent} ({exc.strerror or exc}): check the path and permissions."
            ) from exc
        return self.path

    def _appeared(self):
        return OutputError(
            f"{self.name} {self.out} was created or changed by something else while this run was writing it: nothing "
            f"was replaced; remove or rename it (or choose another {self.name}) and run again."
        )

    def seal(self) -> None:
        """Remove the staging marker: the directory now holds exactly what OUT will hold (e.g. for a manifest)."""
        (self.path / STAGING_MARK).unlink(missing_ok=True)

    def install(self) -> Path:
        """Rename the finished directory to OUT, replacing only what this run was told to replace."""
        out, tmp = self.out, self.path
        self.seal()
        current = _identity(out)
        if self.replace is None or current is None:
            try:
                os.rename(tmp, out)  # atomic; replaces at most an empty directory
            except OSError as exc:
                if exc.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
                    raise self._appeared() from None
                raise
        else:
            if current != self.replace:
                raise self._appeared()
            users = users_entries(out)  # proven at the last moment: what is not ours is kept, or refused here
            taken = set(os.listdir(tmp))
            refuse_users_entries(out, [n for n in users if n in taken or _matches(n, LOADER_READS)], self.name)
            old = out.parent / f".{out.name}.old-{self.token}"
            # What a later run may rename back, and only that.
            _write_lock(self._fd, self.token, staging=self._staging_id, moved=current[:2])
            os.rename(out, old)
            if _identity(old)[:2] != self.replace[:2]:  # swapped between the check and the rename
                os.rename(old, out)
                raise self._appeared()
            try:
                os.rename(tmp, out)
            except OSError:
                try:
                    os.rename(old, out)
                except OSError:
                    raise OutputError(
                        f"{out} was created by something else while this run replaced it: your previous {self.name} "
                        f"is safe in {old}; rename it back."
                    ) from None
                raise self._appeared() from None
            self.carried, left = _carry_users_entries(old, out, users)
            if left:
                logger.warning(
                    f"note: {old} holds {_shown(left)}, which appeared or changed in {out.name} while this run "
                    f"replaced it and which the new output also has: kept there; move or delete it yourself."
                )
            else:
                old.rmdir()
        self.installed = True
        return out

    def _cleanup(self, failed: bool) -> None:
        if self.path is not None and not self.installed:
            shutil.rmtree(self.path, ignore_errors=True)
        if self._fd is not None:
            Path(self.out.parent / f".{self.out.name}.tmp-{self.token}.lock").unlink(missing_ok=True)
            os.close(self._fd)
            self._fd = None
        if failed and self._created is not None:
            _remove_while_empty(self.out.parent, self._created)

    def __exit__(self, exc_type, exc, tb) -> bool:
        self._cleanup(failed=not self.installed)
        return False


# --------------------------------------------------------------------------------------------------------------
# An --overwrite removes of the replaced OUT only what a command of this package provably wrote; the rest is the
# user's: moved into the new OUT, or (where the new output would replace it or read it as part of the model) the
# command is refused, naming it. Never decided by a name.

# Names a loader of the new output reads besides the new output's own files (a stale adapter_config.json or shard
# index of the user's left beside the new output would make every command read it as part of the model): a user's
# entry of such a name is refused, never removed. A name decides only a refusal here, never a deletion.
LOADER_READS = (
    "config.json",
    "generation_config.json",
    "adapter_config.json",
    "base_model.json",
    "tokenizer*",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "*.safetensors",
    "*.index.json",
)


def _bookkeeping_of_ours(directory: Path, name: str) -> bool:
    """`name` is one of this package's bookkeeping files, as its content (not only its name) shows."""
    path = directory / name
    if name == MANIFEST:
        written_by = (_json_dict(path) or {}).get("written_by")
        return isinstance(written_by, str) and written_by.startswith("diff-transformer")
    if name == RUN_RECORD:
        return _json_dict(path) is not None
    if name == RUN_LOCK:
        return (_read_small(path) or "").startswith("diff-transformer run")
    if name == STAGING_MARK:
        return "token" in (_json_dict(path) or {})
    return False


def _json_dict(path: Path) -> dict | None:
    """The JSON object in the regular file `path` (never a FIFO, nor read through a link), else None."""
    try:
        value = json.loads(_read_small(path, limit=64 << 20) or "null")
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def ours(directory) -> set[str]:
    """The top-level entries of `directory` that a command of this package provably wrote and nobody changed since
    (its manifest, `write_manifest`, or a training run's record, `record_written`), and its bookkeeping files."""
    directory = Path(directory)
    manifest, record = _manifest_entries(directory), _run_record(directory)
    found = set()
    for name in os.listdir(directory):
        if (
            _bookkeeping_of_ours(directory, name)
            or _manifest_proves(directory, name, manifest)
            or (name in record and _proves(directory, name, record[name]))
        ):
            found.add(name)
    return found


def users_entries(old, new=None) -> list[str]:
    """The top-level entries of a replaced output `old` that are the user's: every entry that no command of this
    package provably wrote (`ours`). `new` is accepted for compatibility and ignored."""
    old = Path(old)
    mine = ours(old)
    return sorted(name for name in os.listdir(old) if name not in mine)


def _matches(name: str, patterns) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


def _shown(names: list[str], limit: int = 8) -> str:
    text = ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")
    return as_one_line(text)


def refuse_users_entries(out: Path, names: list[str], name: str = "OUT") -> None:
    """`OutputError` naming the user's entries `names` of OUT that the new output would replace or read."""
    if names:
        raise OutputError(
            f"{name} {out} holds {_shown(sorted(names))}, which no record of a diff-transformer command proves it "
            f"wrote (unchanged since), and which the new output would replace or read: --overwrite removes only what "
            f"an earlier run of this package provably wrote. Move them out of {name}, or choose another {name}; "
            "nothing was changed."
        )


def _carry_users_entries(old: Path, out: Path, users: list[str]) -> tuple[list[str], list[str]]:
    """Move the user's entries `users` of the replaced output `old` into the newly installed `out` (renames in one
    parent directory: nothing is copied, modification times kept), then delete what is left in `old` only where a
    command of this package provably wrote it; anything else (an entry that appeared or changed meanwhile) is moved
    too, or, where its name is taken in `out`, stays in `old`. Returns (moved, left in `old`)."""
    carried, left = [], []
    for name in users:
        if os.path.lexists(old / name) and not os.path.lexists(out / name):
            os.rename(old / name, out / name)
            carried.append(name)
    mine = ours(old)
    for name in sorted(os.listdir(old)):
        path = old / name
        if name in mine:
            if stat.S_ISDIR(os.lstat(path).st_mode):
                shutil.rmtree(path)
            else:
                path.unlink()
        elif not os.path.lexists(out / name):
            os.rename(path, out / name)
            carried.append(name)
        else:
            left.append(name)
    if carried:
        logger.warning(f"note: kept what no diff-transformer command wrote in {out}: {_shown(sorted(carried))}.")
    return sorted(carried), left


# --------------------------------------------------------------------------------------------------------------
# Outputs written in place (train): one run at a time.


class OutputLock:
    """`with OutputLock(out, name="--output"):` hold an exclusive lock on OUT (creating it and its parents)
    while a run writes into it; a second run into the same OUT gets an `OutputError` naming the first. The lock file is
    `OUT/RUN_LOCK`; the OS releases the lock if the run dies. On exit the lock file goes, and the directories this
    created are removed while still empty (a refused or failed start leaves nothing behind)."""

    def __init__(self, out, *, name: str = "OUT"):
        self.out, self.name = Path(out).absolute(), name
        self._fd, self._created = None, None

    def __enter__(self) -> Path:
        lock = self.out / RUN_LOCK
        try:
            self._created = _make_parents(self.out)
            while True:
                fd = os.open(lock, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o666)
                if not _try_lock(fd):
                    holder = (_read_small(lock) or "").strip() or "another process"
                    os.close(fd)
                    raise OutputError(
                        f"{self.name} {self.out} is being written by another run ({holder}): wait for it to finish, "
                        f"or choose another {self.name}."
                    )
                info = os.fstat(fd)
                if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:  # not truncated: another name's file too
                    os.close(fd)
                    refuse_links(self.out, name=self.name)  # names the link
                    raise OutputError(f"{self.name} {lock} is not a regular file: remove it and run again.")
                if os.path.samestat(info, os.stat(lock, follow_symlinks=False)):
                    break  # still the file at that path (the previous holder unlinks it before releasing)
                os.close(fd)
            os.ftruncate(fd, 0)
            os.write(fd, f"diff-transformer run, process {os.getpid()}\n".encode())
            self._fd = fd
        except OSError as exc:
            self._release()
            raise OutputError(
                f"cannot write {self.name} {self.out} ({exc.strerror or exc}): choose a directory you can write to."
            ) from None
        except BaseException:
            self._release()
            raise
        return self.out

    def _release(self) -> None:
        if self._fd is not None:
            (self.out / RUN_LOCK).unlink(missing_ok=True)
            os.close(self._fd)
            self._fd = None
        if self._created is not None:
            _remove_while_empty(self.out, self._created)

    def __exit__(self, exc_type, exc, tb) -> bool:
        self._release()
        return False
