"""The one gate for text the package reads from a user (data and chat files, eval data, stdin, the command line):
what JSON or the OS decoder accepts but the tokenizer does not is refused in one line naming where it came from.

* A lone surrogate (U+D800-U+DFFF): JSON's `"\\ud800"`, or bytes that are not UTF-8 on stdin or in argv, which
  Python decodes with `surrogateescape`. The Rust tokenizer cannot take it (a TypeError deep inside).
* An integer literal over Python's 4,300 digits (`sys.get_int_max_str_digits`): `json.loads` raises ValueError.

`whole_number` reads a count typed as text the same way: ASCII digits only ("²" passes `str.isdigit`, then `int`
fails), within the digits `int` converts.
"""

from __future__ import annotations

import json
import sys

from .errors import UserError


class TextInputError(UserError):
    """A text input holds what no tokenizer takes; the message names the file and line (or the argument)."""


def check_text(text: str, where: str) -> str:
    """TEXT if it is valid Unicode text (no lone surrogate), else a `TextInputError` naming WHERE."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        code = ord(text[error.start])
        raise TextInputError(
            f"{where}: character {error.start} is a lone surrogate (U+{code:04X}), not text: an invalid \\u escape "
            "in JSON, or bytes that are not UTF-8; fix the text (e.g. iconv -f ... -t UTF-8)."
        ) from None
    return text


def parse_json_line(line: str, where: str):
    """One JSON value of a .jsonl line with every string in it checked by `check_text`; an invalid line, one nested
    too deeply or an integer literal over Python's digit limit is a `TextInputError` naming WHERE."""
    try:
        value = json.loads(line)
    except (json.JSONDecodeError, RecursionError) as error:
        raise TextInputError(f"{where}: not valid JSON ({getattr(error, 'msg', 'nested too deeply')})") from None
    except ValueError:  # int('9' * 5000): "Exceeds the limit (4300 digits) for integer string conversion"
        raise TextInputError(
            f"{where}: a number has more than {_max_digits()} digits: write it as a string or drop it"
        ) from None
    check_strings(value, where)
    return value


def whole_number(text: str) -> int | None:
    """TEXT (ASCII digits) as an int, else None: never the ValueError of `int` on "²" or on too many digits."""
    limit = _max_digits()  # 0: no limit set
    if not (text.isascii() and text.isdigit()) or (limit and len(text) > limit):
        return None
    return int(text)


def _max_digits() -> int:
    return getattr(sys, "get_int_max_str_digits", lambda: 4300)()  # Python < 3.10.7: no limit, no such error


def check_strings(value, where: str) -> None:
    """Every string (and key) of a parsed JSON value through `check_text`."""
    stack = [value]
    while stack:  # iterative: json.loads already bounded the depth
        item = stack.pop()
        if isinstance(item, str):
            check_text(item, where)
        elif isinstance(item, dict):
            for key, child in item.items():
                check_text(key, where)
                stack.append(child)
        elif isinstance(item, list):
            stack.extend(item)
