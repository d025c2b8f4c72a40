"""Hub model ids as the command line takes them: a name that does not exist locally is a Hub id only when it reads as
one (`org/name`) or is forced with `hf://`. Used by `loading` (models to load) and `conversion.source` (SRC)."""

import re
from pathlib import Path

from .errors import UserError


HUB_PREFIX = "hf://"
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[\w.\-]+)?$")


def hub_id(text: str, *, name: str = "MODEL", error: type[UserError] = UserError) -> str:
    """`text`, which is not an existing path, as a Hub model id; `error` when it reads as a mistyped local path."""
    repo = text.removeprefix(HUB_PREFIX)
    if not _REPO_ID.match(repo) or ".." in repo:
        raise error(
            f"{name} {text!r} is neither an existing directory nor a valid Hub model id: check the path, or pass an "
            "id like 'org/model'."
        )
    if text.startswith(HUB_PREFIX):
        return repo
    first = repo.split("/")[0]
    if "/" not in repo:
        raise error(
            f"{name} {text!r} does not exist: check the path (for the Hub model {repo!r}, pass {HUB_PREFIX}{repo})."
        )
    if Path(first).is_dir():
        raise error(
            f"{name} {text!r} does not exist (the directory {first} does): check the path (for the Hub model "
            f"{repo!r}, pass {HUB_PREFIX}{repo})."
        )
    return repo
