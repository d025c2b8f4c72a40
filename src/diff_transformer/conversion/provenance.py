"""Provenance of a converted checkpoint, stored in its config as `DiffConfig.conversion`.

The card itself is written by `integrations.hub.diff_model_card`, the one generator shared with `save_pretrained` and
`push_to_hub`: keeping the provenance in the config (not only in the README) means a converted model that is
re-saved or pushed later still names its base model.
"""

from __future__ import annotations

import logging
import os
import re
import stat
from pathlib import Path

from ..families import Family
from ..integrations.hub import CARD_DATA_KEYS, card_data_problem
from .source import SourceCheckpoint


_CACHE_SNAPSHOT = re.compile(r"models--(?P<org>[^/]+?)--(?P<name>[^/]+)/snapshots/[^/]+/?$")
# A card's YAML front matter is read within these bounds: a few hundred bytes of aliases can otherwise expand into
# gigabytes (each alias level multiplies), and whatever is copied lands in config.json.
_FRONT_MATTER_BYTES = 64 * 1024
_YAML_DEPTH = 16
logger = logging.getLogger(__name__)


def hub_id_of(source: SourceCheckpoint) -> str | None:
    """The Hub id of SRC: given as such, or recovered from an HF cache snapshot path."""
    if source.repo_id:
        return source.repo_id
    match = _CACHE_SNAPSHOT.search(source.path.as_posix())
    if match:
        return f"{match.group('org')}/{match.group('name')}"
    return None


def source_card_metadata(source: SourceCheckpoint) -> dict:
    """The source card's licence and language (`CARD_DATA_KEYS`), from a bounded front matter without YAML aliases;
    anything else, or anything too large or malformed, is left out with a note (a card never stops a conversion)."""
    readme = source.path / "README.md"
    metadata = _front_matter(readme)
    if metadata is None:
        return {}
    copied = {}
    for key in CARD_DATA_KEYS:
        if metadata.get(key) in (None, "", []):
            continue
        problem = card_data_problem({key: metadata[key]})
        if problem is None:
            copied[key] = metadata[key]
        else:
            logger.warning(f"note: {key} of SRC's README.md is not copied into the card: {problem}.")
    return copied


def _front_matter(readme: Path) -> dict | None:
    """The YAML front matter of `readme` as a dict, or None (no card, not a regular file, too large, aliases, too
    deep, malformed). Never opens a FIFO or a device, never reads more than the bound."""
    import yaml

    try:
        fd = os.open(readme, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        head = handle.read(_FRONT_MATTER_BYTES + 8).decode("utf-8", "replace")
    lines = head.split("\n")
    if not lines or lines[0].strip() != "---":
        return None
    try:
        end = next(i for i, line in enumerate(lines[1:], 1) if line.strip() == "---")
    except StopIteration:
        logger.warning(f"note: the front matter of SRC's README.md is over {_FRONT_MATTER_BYTES} bytes: not read.")
        return None
    text = "\n".join(lines[1:end])
    try:
        depth = 0
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None):
                logger.warning("note: the front matter of SRC's README.md uses YAML anchors/aliases: not read.")
                return None
            if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
                depth += 1
                if depth > _YAML_DEPTH:
                    logger.warning("note: the front matter of SRC's README.md is nested too deeply: not read.")
                    return None
            elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
                depth -= 1
        metadata = yaml.safe_load(text)
    except yaml.YAMLError:
        return None
    return metadata if isinstance(metadata, dict) else None


def conversion_provenance(source: SourceCheckpoint, family: Family, diff_version: int) -> dict:
    """The `conversion` entry of the converted config. `base_model` only when SRC has a Hub id: the Hub rejects
    anything else there, and a local path would leak the converting machine's file system into config.json."""
    from .._version import __version__

    base_model = hub_id_of(source)
    provenance = {
        "source": base_model or source.path.name,
        "source_model_type": family.model_type,
        "function_preserving": family.function_preserving(diff_version),
        "converter": f"diff-transformer {__version__}",
        "card_data": source_card_metadata(source),
    }
    if base_model:
        provenance["base_model"] = base_model
    return provenance


__all__ = ["conversion_provenance", "hub_id_of", "source_card_metadata"]
