"""The one exception the converter raises for every problem with its inputs or outputs."""


class ConversionError(ValueError):
    """A checkpoint cannot be converted. The message is one line: what is wrong, then how to fix it."""


__all__ = ["ConversionError"]
