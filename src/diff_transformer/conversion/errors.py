"""The one exception the converter raises for every problem with its inputs or outputs, and its boundary: the
public entry points (`convert_*`, `verify_conversion`) re-raise any other `UserError` (a checkpoint that cannot be
read, an output that is not ours) as a `ConversionError` with the same line, so callers catch one class."""

import functools

from ..errors import UserError, one_line


class ConversionError(UserError):
    """A checkpoint cannot be converted. The message is one line: what is wrong, then how to fix it."""


def conversion_boundary(function):
    """FUNCTION, with every `UserError` from below (checkpoints, outputs) raised as a `ConversionError`."""

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except ConversionError:
            raise
        except UserError as exc:
            raise ConversionError(str(exc)) from exc

    return wrapper


__all__ = ["ConversionError", "conversion_boundary", "one_line"]
