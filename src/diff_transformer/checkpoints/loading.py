"""Loading a model named on the command line (`load_causal_lm`), checked before transformers tries it so that every
problem is one line naming the input and the fix: a local Diff checkpoint is compared with its config first, so a
`diff_version` that disagrees with the weights (an edited config.json) is named as such, not as transformers' size
mismatch, and a config claiming more layers than the weights hold is refused before anything is built.
"""

from __future__ import annotations

import re
from pathlib import Path

from . import CheckpointError
from .configs import check_model_config, check_model_type, read_json, refuse_special_files
from .names import resolve_model
from .weights import SAFETENSORS_INDEX, SAFETENSORS_SINGLE, find_shards, read_headers


def _weight_shapes(directory: Path) -> dict[str, tuple[int, ...]] | None:
    """Tensor name -> shape from the safetensors headers, or None when the checkpoint has no safetensors weights."""
    if not ((directory / SAFETENSORS_INDEX).is_file() or (directory / SAFETENSORS_SINGLE).is_file()):
        return None
    return {name: info.shape for name, info in read_headers(directory, find_shards(directory)).items()}


def _stored_layers(shapes: dict) -> int:
    """How many decoder layers the weights hold (`model.layers.<i>.` names)."""
    indices = {int(m.group(1)) for name in shapes if (m := re.match(r"model\.layers\.(\d+)\.", name))}
    return max(indices) + 1 if indices else 0


def _mismatch(config, shapes: dict) -> str | None:
    """The first way the weights disagree with `DiffForCausalLM(config)`, or None."""
    import torch

    from ..modeling_diff import DiffForCausalLM

    with torch.device("meta"):
        expected = {n: tuple(t.shape) for n, t in DiffForCausalLM(config).state_dict().items()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    for key, shape in expected.items():
        if key not in shapes:
            return f"tensor {key} is missing"
        if tuple(shapes[key]) != shape:
            return f"tensor {key} has shape {list(shapes[key])}, but config.json implies {list(shape)}"
    return None


def check_diff_checkpoint(directory: Path, *, name: str = "MODEL") -> None:
    """For a local Diff checkpoint: its config.json parses and its weights are those the config describes; a
    `diff_version` that disagrees with the weights is named with the fix."""
    config_file = directory / "config.json"
    refuse_special_files(directory)
    if not config_file.is_file():
        return  # e.g. a PEFT adapter directory: transformers reports what is missing
    raw = read_json(config_file)
    check_model_type(raw, f"{name} {directory}")
    if not isinstance(raw, dict) or raw.get("model_type") != "diff":
        return
    shapes = _weight_shapes(directory)
    if shapes is None:
        return
    from ..configuration_diff import DiffConfig

    try:
        config = DiffConfig.from_pretrained(directory)
    except Exception as exc:
        raise CheckpointError(
            f"{config_file} is not a valid Diff config ({' '.join(str(exc).split())[:200]}): fix it."
        ) from None
    check_model_config(config, f"{name} {directory}", build=False)
    from ..integrations.hub import config_card_data_problem

    problem = config_card_data_problem(config)
    if problem:  # the card, built from it at every save, would refuse it after a run: refused before loading
        raise CheckpointError(
            f"{name} {directory}: config.json's conversion: {problem}: fix or remove conversion.card_data."
        )
    layers = _stored_layers(shapes)
    if layers != config.num_hidden_layers:  # before anything is built: a config can claim any number of layers
        raise CheckpointError(
            f"{name} {directory}: config.json says num_hidden_layers={config.num_hidden_layers}, but the weights hold "
            f"{layers} layers: fix config.json or re-download the checkpoint."
        )
    check_model_config(config, f"{name} {directory}")
    problem = _mismatch(config, shapes)
    if problem is None:
        return
    version = config.diff_version
    other = 2 if version == 1 else 1
    try:
        fits_other = _mismatch(DiffConfig.from_dict({**config.to_dict(), "diff_version": other}), shapes) is None
    except Exception:
        fits_other = False
    if fits_other:
        raise CheckpointError(
            f"{name} {directory}: config.json says diff_version={version}, but the weights are those of a "
            f'diff_version={other} model: set "diff_version": {other} in config.json.'
        )
    raise CheckpointError(
        f"{name} {directory}: {problem}: config.json does not describe these weights; fix it or re-download the "
        "checkpoint."
    )


def load_causal_lm(text, *, name: str = "MODEL", **kwargs):
    """`AutoModelForCausalLM.from_pretrained` of a command-line MODEL, every failure one `CheckpointError` line."""
    from transformers import AutoModelForCausalLM

    import diff_transformer  # noqa: F401  (registers the Auto classes)

    location, local = resolve_model(text, name=name)
    if local is not None:
        check_diff_checkpoint(local, name=name)
    try:
        return AutoModelForCausalLM.from_pretrained(location, **kwargs)
    except Exception as exc:
        message = " ".join(str(exc).split())[:300] or type(exc).__name__
        raise CheckpointError(
            f"cannot load {name} {text!r} ({message}): check that it is a complete checkpoint, or re-download it."
        ) from None


__all__ = ["check_diff_checkpoint", "load_causal_lm"]
