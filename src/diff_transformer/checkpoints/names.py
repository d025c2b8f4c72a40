"""Names as the command line takes them: an existing local directory, or a Hub model id. A name that does not exist
locally is a Hub id only when it reads as one (`org/name`) or is forced with `hf://`; otherwise it is a mistyped path
and is reported as such at once, instead of after the Hub client's retries."""

import re
from pathlib import Path

from . import CheckpointError


HUB_PREFIX = "hf://"
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[\w.\-]+)?$")


def hub_id(text: str, *, name: str = "MODEL") -> str:
    """`text`, which is not an existing path, as a Hub model id; `CheckpointError` when it reads as a mistyped path."""
    repo = text.removeprefix(HUB_PREFIX)
    if not _REPO_ID.match(repo) or ".." in repo:
        raise CheckpointError(
            f"{name} {text!r} is neither an existing directory nor a valid Hub model id: check the path, or pass an "
            "id like 'org/model'."
        )
    if text.startswith(HUB_PREFIX):
        return repo
    first = repo.split("/")[0]
    if "/" not in repo:
        raise CheckpointError(
            f"{name} {text!r} does not exist: check the path (for the Hub model {repo!r}, pass {HUB_PREFIX}{repo})."
        )
    if Path(first).is_dir():
        raise CheckpointError(
            f"{name} {text!r} does not exist (the directory {first} does): check the path (for the Hub model "
            f"{repo!r}, pass {HUB_PREFIX}{repo})."
        )
    return repo


def resolve_model(text, *, name: str = "MODEL") -> tuple[str, Path | None]:
    """(what to pass to `from_pretrained`, the local directory or None for a Hub id)."""
    text = str(text)
    if not text.strip():  # Path("") is the current directory: an unset shell variable would load whatever is here
        raise CheckpointError(f"{name} is empty (an unset shell variable?): pass a model directory or a Hub id.")
    path = Path(text).expanduser()
    if path.exists():
        if not path.is_dir():
            raise CheckpointError(
                f"{name} {text!r} is a file: pass the checkpoint directory (config.json + weights) or a Hub id."
            )
        return str(path), path
    return hub_id(text, name=name), None


__all__ = ["HUB_PREFIX", "hub_id", "resolve_model"]
