"""Where a command may write an output, and how (see the package docstring for the other layers):

* `check_target(out, name, sources)` refuses, whatever the flags, a path whose replacement would be a disaster: an
  empty path (an unset shell variable), the current directory or one of its ancestors, the home directory, the
  filesystem root, and any overlap with a source directory (which is never modified).
* Nothing is ever written through a link: every file of ours is created new (`O_CREAT | O_EXCL`, which refuses an
  existing name, a symbolic link included) and, where it replaces one, renamed over the name (`write_new_file`), which
  replaces a link instead of following it. An output written in place (`train --output`, where Trainer writes with
  plain `open()`) is first checked for links (`refuse_links`): the package never creates a symbolic link or a second
  hard link there, so any it finds is not its own and is refused before anything is written, naming the link.
"""

from __future__ import annotations

import os
import secrets
import stat
import tempfile
from pathlib import Path

from ..errors import UserError, one_line


_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)

# The bookkeeping entries of this package in an output (`records` writes the first two, `staging` the others).
MANIFEST = ".diff-transformer-output.json"
RUN_RECORD = ".diff-transformer-run.json"  # what a training run wrote at the top of its --output (train)
STAGING_MARK = ".diff-transformer-staging"  # inside a staging directory while it is ours: {"token": ...}
RUN_LOCK = ".diff-transformer.lock"


class OutputError(UserError):
    """An output path that cannot be written without losing data; one line naming the path and the fix."""


def check_target(out, *, name: str = "OUT", sources: dict | None = None) -> Path:
    """`out` as an absolute path, or `OutputError` if replacing or writing it could destroy something (module doc).
    `sources` maps a name ("SRC", "MODEL") to a directory that OUT must neither be, lie inside, nor contain."""
    text = "" if out is None else os.fspath(out)
    if not text.strip():
        raise OutputError(f"{name} is empty (an unset shell variable?): pass the directory to write.")
    path = Path(text).expanduser().absolute()
    try:
        os.fsencode(path).decode("utf-8")
    except UnicodeDecodeError:
        # safetensors (Rust) takes only UTF-8 paths, and the model card names the directory in UTF-8 text.
        raise OutputError(
            f"{name} {ascii(text)} is not valid UTF-8 (bytes of another encoding in the path), which the weights "
            "and the model card cannot be written under: choose a path of UTF-8 characters."
        ) from None
    real = path.resolve()
    cwd = Path.cwd().resolve()
    try:
        home = Path.home().resolve()
    except (RuntimeError, KeyError):  # no home directory known
        home = None
    if real.parent == real:
        raise OutputError(f"{name} {text!r} is the filesystem root: pass a new directory for the output.")
    if real == home:
        raise OutputError(
            f"{name} {text!r} is your home directory: pass a new directory for the output, e.g. ~/my-output."
        )
    if real == cwd or real in cwd.parents:
        where = "the current directory" if real == cwd else "a parent of the current directory"
        raise OutputError(f"{name} {text!r} is {where}: pass a new directory for the output, e.g. ./my-output.")
    for source_name, source in (sources or {}).items():
        source = Path(source).resolve()
        if real == source:
            raise OutputError(
                f"{name} {path} is {source_name}: choose another {name} ({source_name} is never modified)."
            )
        if source in real.parents or real in source.parents:
            raise OutputError(
                f"{name} {path} overlaps {source_name} {source}: choose an output directory outside {source_name} "
                f"that does not contain it ({source_name} is never modified)."
            )
    return path


# --------------------------------------------------------------------------------------------------------------
# Never through a link: files created new, then renamed over their name; outputs written in place checked for links.


def write_new_file(path, data: str | bytes) -> None:
    """Write DATA (text: UTF-8) to PATH without writing through whatever is at PATH: into a new file beside it,
    created with `O_EXCL` (which refuses an existing name, a symbolic link included) and the umask's mode, then renamed
    over PATH. A symbolic or hard link at PATH is replaced, its target never touched; a reader sees the old file or
    the new one, never half of it."""
    path = Path(path)
    data = data.encode("utf-8") if isinstance(data, str) else data
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | getattr(os, "O_BINARY", 0)
    while True:
        temp = path.parent / f".{path.name}.{secrets.token_hex(4)}.tmp"
        try:
            fd = os.open(temp, flags, 0o666)
            break
        except FileExistsError:
            continue  # that random name is taken (by anything, a link included): draw another
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


def umask_mode() -> int:
    """The mode the user's umask gives a new file (0o666 & ~umask)."""
    umask = os.umask(0)  # no getter: read by setting, then restored
    os.umask(umask)
    return 0o666 & ~umask


def follow_umask(paths) -> None:
    """Give PATHS the mode of a file the user creates (`umask_mode`): safetensors writes each file into a private
    (0600) temporary file renamed into place, so weights saved by save_pretrained (PEFT's too) are owner-only."""
    mode = umask_mode()
    for path in paths:
        if not os.path.islink(path):  # never change a link's target
            os.chmod(path, mode)


def find_link(directory) -> tuple[Path, str] | None:
    """The first entry under DIRECTORY (walked without following links) that a file written at its name could reach
    something outside DIRECTORY through, with what it is: a symbolic link, or a regular file with more than one hard
    link (its other names are elsewhere). None when there is none (or DIRECTORY is missing)."""
    pending = [Path(directory)]
    while pending:
        folder = pending.pop()
        try:
            children = sorted(os.scandir(folder), key=lambda e: e.name)
        except (FileNotFoundError, NotADirectoryError):
            continue
        for child in children:
            info = child.stat(follow_symlinks=False)
            path = Path(child.path)
            if stat.S_ISLNK(info.st_mode):
                try:
                    target = os.readlink(path)
                except OSError:
                    target = "?"
                return path, f"a symbolic link to {target}"
            if stat.S_ISDIR(info.st_mode):
                pending.append(path)
            elif stat.S_ISREG(info.st_mode) and info.st_nlink > 1:
                return path, f"a file with {info.st_nlink} hard links (the same file under another name elsewhere)"
    return None


def refuse_links(directory, *, name: str = "OUT") -> None:
    """`OutputError` when DIRECTORY (an output written in place, as `train --output`) holds a symbolic link or a hard
    link (`find_link`). No command of this package creates one there, so it is not the run's own: refused (rather
    than removed, which could lose the user's work) before a file is written through it to a file outside DIRECTORY."""
    from ..errors import as_one_line

    found = find_link(directory)
    if found is None:
        return
    path, what = found
    raise OutputError(
        as_one_line(
            f"{name} {directory} holds {path.relative_to(directory)}, {what}, which no diff-transformer command "
            f"creates: the run's files could be written through it to a file outside {name}. Remove it (or move it "
            f"out of {name}), or choose another {name}."
        )
    )


def _read_small(path: Path, limit: int = 4096) -> str | None:
    """The text of a small regular file (never a FIFO or a device: opened non-blocking, checked), else None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return os.read(fd, limit).decode("utf-8", "replace")
    finally:
        os.close(fd)


# --------------------------------------------------------------------------------------------------------------
# Single files a command writes (inspect's figures and JSON): checked before any work, written all or none.


def check_output_file(path: str, option: str, overwrite: bool, suffixes=None) -> Path:
    """A file the command will write: its directory exists, it is not there already (or --overwrite), its suffix
    fits."""
    out = Path(path)
    if suffixes is not None and out.suffix.lower().lstrip(".") not in suffixes:
        choices = ", ".join(f".{suffix}" for suffix in sorted(suffixes))
        raise UserError(f"{option} {path} needs a file suffix it can be written as: one of {choices}.")
    if not out.parent.is_dir():
        raise UserError(f"{option} {path}: directory {out.parent} does not exist; create it first.")
    if out.is_dir():
        raise UserError(f"{option} {path} is a directory: give a file name.")
    if out.exists() and not overwrite:
        raise UserError(f"{option} {path} already exists: pass --overwrite to replace it, or choose another name.")
    _probe_writable(out, option)
    return out


def _probe_writable(out: Path, option: str) -> None:
    """Create and remove a file beside OUT: a read-only or full directory is refused before any work is done."""

    try:
        fd, probe = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise UserError(
            f"{option} {out}: cannot write in {out.parent} ({exc.strerror or exc}): choose a writable directory."
        ) from None


class OutputFiles:
    """The files of one run, each written to a temporary file beside it (`add`) and renamed into place together
    (`install`) once every one is complete: a failure leaves none of them, and nothing half-written."""

    def __init__(self):
        self.pending: list[tuple[str, Path]] = []

    def add(self, out: Path, write) -> None:
        try:
            fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=out.suffix)
        except OSError as exc:
            self.discard()
            raise UserError(
                f"cannot write {out} ({exc.strerror or exc}): check the directory and free space."
            ) from None
        os.close(fd)
        self.pending.append((tmp, out))
        try:
            write(tmp)
        except OSError as exc:
            self.discard()
            raise UserError(
                f"writing {out} failed ({exc.strerror or exc}): check free space and permissions."
            ) from None
        except (RuntimeError, ValueError) as exc:  # matplotlib: a format it cannot write here, text it cannot draw
            self.discard()
            raise UserError(f"writing {out} failed ({one_line(exc)}): choose another format, e.g. .png.") from None
        except BaseException:
            self.discard()
            raise

    def install(self) -> None:
        mode = umask_mode()
        try:
            for tmp, out in self.pending:
                os.chmod(tmp, mode)  # mkstemp makes it private: the permissions of a file the user creates
                os.replace(tmp, out)
        except OSError as exc:
            self.discard()
            raise UserError(
                f"writing {out} failed ({exc.strerror or exc}): check free space and permissions."
            ) from None
        self.pending = []

    def discard(self) -> None:
        for tmp, _ in self.pending:
            Path(tmp).unlink(missing_ok=True)
        self.pending = []


def refuse_inside_source(paths, local: Path | None, shown: str) -> None:
    """No output file of PATHS ((option, path) pairs) may be written inside the source directory LOCAL (SHOWN, e.g.
    "MODEL org/name": its config.json, say): sources are never modified."""
    if local is None:
        return
    root = local.resolve()
    for option, path in paths:
        if path is not None and (path.resolve() == root or root in path.resolve().parents):
            raise UserError(f"{option} {path} lies inside {shown}, which is never modified: write it somewhere else.")
