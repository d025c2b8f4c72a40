"""The base class of every error that is the user's input, not a bug (the CLI prints its one line and exits 2), and
the one-line messages for optional dependencies (setup.cfg's extras): a command that needs one that is missing says
so, with the exact install command, before it loads anything."""

from __future__ import annotations

import importlib.util


class UserError(ValueError):
    """A bad input (argument, path, file). The message is one line: what is wrong, then how to fix it."""


def one_line(exc: BaseException) -> str:
    """An underlying exception's message squeezed onto one short line, to quote inside a UserError."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


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


__all__ = ["UserError", "install_command", "installed", "missing", "one_line", "require"]
