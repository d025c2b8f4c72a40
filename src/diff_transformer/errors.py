"""The base class of every error that is the user's input, not a bug: the CLI prints its one line and exits 2."""


class UserError(ValueError):
    """A bad input (argument, path, file). The message is one line: what is wrong, then how to fix it."""


__all__ = ["UserError"]
