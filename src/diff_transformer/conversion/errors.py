"""The one exception the converter raises for every problem with its inputs or outputs."""

from ..errors import UserError


class ConversionError(UserError):
    """A checkpoint cannot be converted. The message is one line: what is wrong, then how to fix it."""


def one_line(exc: BaseException) -> str:
    """An underlying exception's message squeezed onto one short line, to quote inside a ConversionError."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


__all__ = ["ConversionError", "one_line"]
