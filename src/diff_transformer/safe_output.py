"""Output directories that never cost the user data: `convert`, `demo` and `train` all choose and write them here.

* `check_target(out, name, sources)` refuses, whatever the flags, a path whose replacement would be a disaster: an
  empty path (an unset shell variable), the current directory or one of its ancestors, the home directory, the
  filesystem root, and any overlap with a source directory (which is never modified).
* `Staging(out, overwrite=...)` writes into a hidden `.OUT.tmp-<token>` beside OUT, created with the umask's mode
  (as `save_pretrained` creates directories), and `install()` renames it into place once complete. Without
  `overwrite` that is one atomic rename, which replaces at most an empty directory: whatever appeared at OUT in the
  meantime (another run, say) is never deleted. With `overwrite` only the directory that was at OUT when the run
  started is replaced, and only if it has not changed since.
* A killed run leaves `.OUT.tmp-<token>` (ours: the next run into OUT removes it) and, when killed between the two
  renames of an overwrite, the user's previous OUT as `.OUT.old-<token>` (theirs: the next run renames it back).
  Every staging directory has a lock file `.OUT.tmp-<token>.lock` that its run holds (flock) while it lives, so the
  files of a live run are never touched. Both recoveries are reported (logging, to stderr by default).
* `write_manifest` / `wrote_this`: a directory listing the hashes of the files it holds, so a command (the demo) can
  replace a directory only when it can prove that it wrote it and nobody changed it since.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import secrets
import shutil
import tempfile
from pathlib import Path

from .errors import UserError


try:
    import fcntl
except ImportError:  # Windows
    fcntl = None
    import msvcrt

logger = logging.getLogger(__name__)

MANIFEST = ".diff-transformer-output.json"


class OutputError(UserError):
    """An output path that cannot be written without losing data; one line naming the path and the fix."""


def check_target(out, *, name: str = "OUT", sources: dict | None = None, error: type[UserError] = OutputError) -> Path:
    """`out` as an absolute path, or `error` if replacing or writing it could destroy something: see the module doc.
    `sources` maps a name ("SRC", "MODEL") to a directory that OUT must neither be, lie inside, nor contain."""
    text = "" if out is None else os.fspath(out)
    if not text.strip():
        raise error(f"{name} is empty (an unset shell variable?): pass the directory to write.")
    path = Path(text).expanduser().absolute()
    real = path.resolve()
    cwd = Path.cwd().resolve()
    try:
        home = Path.home().resolve()
    except (RuntimeError, KeyError):  # no home directory known
        home = None
    if real.parent == real:
        raise error(f"{name} {text!r} is the filesystem root: pass a new directory for the output.")
    if real == home:
        raise error(f"{name} {text!r} is your home directory: pass a new directory for the output, e.g. ~/my-output.")
    if real == cwd or real in cwd.parents:
        where = "the current directory" if real == cwd else "a parent of the current directory"
        raise error(f"{name} {text!r} is {where}: pass a new directory for the output, e.g. ./my-output.")
    for source_name, source in (sources or {}).items():
        source = Path(source).resolve()
        if real == source or source in real.parents or real in source.parents:
            raise error(
                f"{name} {path} overlaps {source_name} {source}: choose an output directory outside {source_name} "
                f"that does not contain it ({source_name} is never modified)."
            )
    return path


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
        fd = os.open(lock, os.O_RDWR)
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
        if not _try_lock(fd):
            raise OSError(errno.EAGAIN, "cannot lock a new file", temp)
        while True:
            token = secrets.token_hex(4)
            stem = parent / f".{name}.tmp-{token}"
            if not any(p.exists() for p in (stem, Path(f"{stem}.lock"), parent / f".{name}.old-{token}")):
                os.rename(temp, f"{stem}.lock")
                return token, fd
    except BaseException:
        os.close(fd)
        Path(temp).unlink(missing_ok=True)
        raise


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
            if stem.is_dir() and not stem.is_symlink():
                size = _size_mb(stem)
                shutil.rmtree(stem)
                notes.append(
                    f"note: removed {stem.name} ({size:.1f} MB), the unfinished output of an interrupted run."
                )
            if old.is_dir() and not old.is_symlink():
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
            if not os.path.lexists(old):
                lock.unlink(missing_ok=True)
        finally:
            if fd is not None:
                os.close(fd)
    for entry in leftovers:
        fd = _lock_if_dead(entry)
        if fd is not None:
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
        error: type[UserError] = OutputError,
    ):
        self.out, self.name, self.error = Path(out).absolute(), name, error
        recover(self.out)
        if self.out.is_symlink():
            raise error(f"{name} {self.out} is a symbolic link: pass the directory it points to, or another path.")
        if self.out.exists() and not self.out.is_dir():
            raise error(f"{name} {self.out} exists and is not a directory: choose a directory path.")
        self.replace = None  # identity of the non-empty OUT this run was told to replace
        if self.out.is_dir() and any(self.out.iterdir()):
            if not overwrite:
                raise error(f"{name} {self.out} is not empty: pass {flag} or choose another directory.")
            self.replace = _identity(self.out)
        self.path: Path | None = None
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
        except OSError as exc:
            self._cleanup(failed=True)
            raise self.error(
                f"cannot create a directory in {parent} ({exc.strerror or exc}): check the path and permissions."
            ) from exc
        return self.path

    def _appeared(self):
        return self.error(
            f"{self.name} {self.out} was created or changed by something else while this run was writing it: nothing "
            f"was replaced; remove or rename it (or choose another {self.name}) and run again."
        )

    def install(self) -> Path:
        """Rename the finished directory to OUT, replacing only what this run was told to replace."""
        out, tmp = self.out, self.path
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
            old = out.parent / f".{out.name}.old-{self.token}"
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
                    raise self.error(
                        f"{out} was created by something else while this run replaced it: your previous {self.name} "
                        f"is safe in {old}; rename it back."
                    ) from None
                raise self._appeared() from None
            shutil.rmtree(old)  # the directory this run was told to replace, and nothing else
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
            for directory in [self.out.parent, *self.out.parent.parents]:  # remove only what is still empty
                try:
                    directory.rmdir()
                except OSError:
                    break
                if directory == self._created:
                    break

    def __exit__(self, exc_type, exc, tb) -> bool:
        self._cleanup(failed=not self.installed)
        return False


# --------------------------------------------------------------------------------------------------------------
# Manifests: proof that a directory holds exactly what a command wrote there.


def _file_hashes(directory: Path) -> dict[str, str] | None:
    """relative path -> sha256 of every file under `directory` (the manifest excluded); None if a link is found."""
    hashes = {}
    for root, dirs, files in os.walk(directory):
        for entry in dirs + files:
            if os.path.islink(os.path.join(root, entry)):
                return None
        for entry in files:
            path = Path(root) / entry
            relative = path.relative_to(directory).as_posix()
            if relative != MANIFEST:
                digest = hashlib.sha256()
                with open(path, "rb") as handle:
                    for block in iter(lambda: handle.read(1 << 20), b""):
                        digest.update(block)
                hashes[relative] = digest.hexdigest()
    return hashes


def write_manifest(directory, written_by: str) -> None:
    """Record in `directory` the hashes of every file it holds, as written by `written_by`."""
    directory = Path(directory)
    manifest = {"written_by": written_by, "files": _file_hashes(directory)}
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n", encoding="utf-8")


def wrote_this(directory, written_by: str) -> bool:
    """True when `directory` holds exactly the files `written_by` recorded there, unchanged."""
    directory = Path(directory)
    try:
        manifest = json.loads((directory / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not isinstance(manifest, dict) or manifest.get("written_by") != written_by:
        return False
    return manifest.get("files") == _file_hashes(directory)


__all__ = ["MANIFEST", "OutputError", "Staging", "check_target", "recover", "write_manifest", "wrote_this"]
