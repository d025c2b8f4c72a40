"""The base class of every error that is the user's input, not a bug (the CLI prints its one line and exits 2), and
the one-line messages for optional dependencies (setup.cfg's extras): a command that needs one that is missing says
so, with the exact install command, before it loads anything."""

from __future__ import annotations

import importlib.util


class UserError(ValueError):
    """A bad input (argument, path, file). The message is one line: what is wrong, then how to fix it."""


# What str.splitlines() breaks a line at: a refusal holding one (a file name can) would be several lines.
_LINE_BREAKS = "\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029"


def as_one_line(text: str) -> str:
    """`text` with every line break escaped (`\\n`, `\\x85`...), so a message printed as one line stays one line."""
    return "".join(c.encode("unicode_escape").decode() if c in _LINE_BREAKS else c for c in text)


def one_line(exc: BaseException) -> str:
    """An underlying exception's message squeezed onto one short line, to quote inside a UserError."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def library_failure(exc: BaseException, output=None) -> str | None:
    """One line for a failure that comes from the machine or a file rather than from this package (a full disk, an
    unreadable or corrupt file), naming the file where the exception knows it (else OUTPUT, the command's output
    path, for a failed write) and the fix; None for anything else."""
    import errno
    import json

    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        where = f" writing {exc.filename}" if exc.filename else ""
        return f"no space left on the device{where}: free some space or choose an output on another disk."
    if isinstance(exc, (PermissionError, IsADirectoryError, NotADirectoryError, FileNotFoundError)) and exc.filename:
        return f"{exc.strerror or one_line(exc)}: {exc.filename}: check the path and its permissions."
    if type(exc).__name__ == "SafetensorError":  # safetensors' Rust error, without importing safetensors here
        written = _safetensors_write_failure(str(exc), output)
        if written is not None:
            return written
        return f"a safetensors file is corrupt, truncated or unwritable ({one_line(exc)}): restore or re-download it."
    if isinstance(exc, json.JSONDecodeError):
        return f"a JSON file is not valid JSON ({one_line(exc)}): fix or restore it."
    if isinstance(exc, UnicodeDecodeError):
        return f"a text file is not UTF-8 ({one_line(exc)}): convert it to UTF-8."
    if isinstance(exc, UnicodeEncodeError) and "surrogate" in str(exc.reason):
        # a path of bytes that are not UTF-8 (Python carries them as surrogates) written into a UTF-8 file
        return "a path is not valid UTF-8 (bytes of another encoding in a file name): rename it with UTF-8 characters."
    if isinstance(exc, MemoryError):
        return "out of memory: use a smaller model, batch or length, or a machine with more memory."
    return None


def _safetensors_write_failure(message: str, output=None) -> str | None:
    """One line for a SafetensorError raised while *writing* (`save_file`, `save_pretrained`): the output's disk, not
    a corrupt input. Relies on safetensors' Rust error text, "Error while serializing: I/O error: <strerror> (os error
    N)" and, in some versions, ' at path "<path>"' (0.8 names no path for a failed write: then OUTPUT). Guarded by
    tests/outputs/test_write_errors.py, which provokes real failures."""
    import errno
    import os
    import re
    import shutil

    if not message.startswith("Error while serializing"):
        return None
    code = re.search(r"\(os error (\d+)\)", message)
    path = re.search(r'at path "(.*)"', message)
    where = os.path.dirname(path.group(1)) if path else (os.fspath(output) if output else None)
    if code and int(code.group(1)) in (errno.ENOSPC, errno.EDQUOT):
        free = ""
        if where:
            existing = os.path.abspath(where)
            while not os.path.isdir(existing) and os.path.dirname(existing) != existing:
                existing = os.path.dirname(existing)  # the output directory itself is gone (its staging removed)
            try:
                free = f" ({shutil.disk_usage(existing).free / 2**20:,.1f} MiB free there)"
            except OSError:
                pass
        place = f" in {where}" if where else ""
        return (
            f"no space left on the device writing a safetensors file{place}{free}: free some space or choose an "
            "output on another disk."
        )
    detail = " ".join(message.split(": ", 1)[-1].split())[:300]
    place = f" in {where}" if where else ""
    return f"writing a safetensors file{place} failed ({detail}): check the output path, its permissions and its disk."


SEED_LIMIT = 2**32  # what every random generator a seed reaches takes (numpy's range; torch's is wider)


def check_seed(seed, name: str = "seed", error=None) -> int:
    """SEED as an int in [0, 2**32), else one line (`error`, default `UserError`): a seed past 2**64 overflows inside
    torch, a negative one is refused by numpy, a float or bool would be silently truncated."""
    import operator

    error = error or UserError
    try:
        value = None if isinstance(seed, (bool, float)) else operator.index(seed)
    except TypeError:
        value = None
    if value is None or not 0 <= value < SEED_LIMIT:
        shown = repr(seed) if len(repr(seed)) <= 40 else repr(seed)[:37] + "..."
        raise error(f"{name} {shown} must be a whole number in [0, 2**32): pass a seed from 0 to {SEED_LIMIT - 1}.")
    return value


def install_command(extra: str) -> str:
    """How to get EXTRA: from a source checkout (the package is not on a public index yet), and from an index."""
    source, index = f'pip install -e ".[{extra}]"', f'pip install "diff-transformer[{extra}]"'
    return f"{source} in a source checkout, or {index} from an index"


def installed(package: str) -> bool:
    """Whether `import PACKAGE` can find the package (without importing it: peft alone costs seconds)."""
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # a parent package that fails to import, or a broken half-imported module
        return False


def missing(packages, extra: str, purpose: str) -> str | None:
    """The one-line message naming what PURPOSE lacks and how to install it, or None when everything is there."""
    absent = [package for package in packages if not installed(package)]
    if not absent:
        return None
    names = absent[0] if len(absent) == 1 else f"{', '.join(absent[:-1])} and {absent[-1]}"
    verb = "is" if len(absent) == 1 else "are"
    return f"{purpose} needs {names}, which {verb} not installed: {install_command(extra)}."


def require(packages, extra: str, purpose: str) -> None:
    """`UserError` (one line, exit status 2 on the command line) when a package of PACKAGES is not installed."""
    message = missing(packages, extra, purpose)
    if message is not None:
        raise UserError(message)


__all__ = ["SEED_LIMIT", "UserError", "check_seed", "install_command", "installed", "missing", "one_line", "require"]
