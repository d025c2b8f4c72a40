"""Provenance of a converted checkpoint, stored in its config as `DiffConfig.conversion`.

The card itself is written by `integrations.hub.diff_model_card`, the one generator shared with `save_pretrained` and
`push_to_hub`: keeping the provenance in the config (not only in the README) means a converted model that is
re-saved or pushed later still names its base model.
"""

from __future__ import annotations

import re

from .source import SourceCheckpoint


_CACHE_SNAPSHOT = re.compile(r"models--(?P<org>[^/]+?)--(?P<name>[^/]+)/snapshots/[^/]+/?$")
# Card fields that must follow the weights (a derivative keeps its source's licence).
_COPIED_METADATA = ("license", "license_name", "license_link", "language")


def hub_id_of(source: SourceCheckpoint) -> str | None:
    """The Hub id of SRC: given as such, or recovered from an HF cache snapshot path."""
    if source.repo_id:
        return source.repo_id
    match = _CACHE_SNAPSHOT.search(source.path.as_posix())
    if match:
        return f"{match.group('org')}/{match.group('name')}"
    return None


def source_card_metadata(source: SourceCheckpoint) -> dict:
    readme = source.path / "README.md"
    if not readme.is_file():
        return {}
    try:
        from huggingface_hub.repocard import metadata_load

        metadata = metadata_load(readme) or {}
    except Exception:  # a malformed card must not stop a conversion
        return {}
    return {key: metadata[key] for key in _COPIED_METADATA if metadata.get(key)}


def conversion_provenance(source: SourceCheckpoint, source_kind: str, diff_version: int) -> dict:
    """The `conversion` entry of the converted config. `base_model` only when SRC has a Hub id: the Hub rejects
    anything else there, and a local path would leak the converting machine's file system into config.json."""
    from .. import __version__

    base_model = hub_id_of(source)
    provenance = {
        "source": base_model or source.path.name,
        "source_model_type": source_kind,
        "function_preserving": source_kind == "diffllama" or diff_version == 2,
        "converter": f"diff-transformer {__version__}",
        "card_data": source_card_metadata(source),
    }
    if base_model:
        provenance["base_model"] = base_model
    return provenance


__all__ = ["conversion_provenance", "hub_id_of", "source_card_metadata"]
