"""Loading a model named on the command line (`from_pretrained`, reached through `checkpoints.open`), checked before
transformers tries it so that every problem is one line naming the input and the fix: a local Diff checkpoint is
compared with its config first, so a `diff_version` that disagrees with the weights (an edited config.json) is named
as such, not as transformers' size mismatch, and a config claiming more layers than the weights hold is refused before
anything is built.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from ..families import family_of, is_motif
from . import CheckpointError
from .configs import check_model_config, check_model_type, read_json, refuse_special_files
from .weights import PICKLE_REFUSAL, PICKLE_SUFFIXES, SAFETENSORS_INDEX, SAFETENSORS_SINGLE, find_shards, read_headers


def _weight_shapes(directory: Path) -> dict[str, tuple[int, ...]] | None:
    """Tensor name -> shape from the safetensors headers, or None when the checkpoint has no safetensors weights.
    Refuses a checkpoint whose only weights are pickles (`find_shards`' line): transformers would unpickle them, and
    torch's refusal of an unsafe one advises `weights_only=False`."""
    if not ((directory / SAFETENSORS_INDEX).is_file() or (directory / SAFETENSORS_SINGLE).is_file()):
        if any(p.is_file() and p.name.endswith(PICKLE_SUFFIXES) for p in directory.iterdir()):
            find_shards(directory)  # raises unless other model*.safetensors files hold the weights
        return None
    return {name: info.shape for name, info in read_headers(directory, find_shards(directory)).items()}


_LAYER_NAME = re.compile(r"^(.*?(?:^|\.)(?:layers|h|layer|blocks))\.(\d+)\.")
_EMBEDDING_NAMES = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight", "embed_in.weight")
# The fields a config sizes a model with, under the names transformers' families use (first one present wins).
_SIZE_FIELDS = {
    "layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "hidden": ("hidden_size", "n_embd", "d_model"),
    "vocab": ("vocab_size",),
    "heads": ("num_attention_heads", "n_head"),
    "kv_heads": ("num_key_value_heads",),
    "head_dim": ("head_dim",),
    "intermediate": ("intermediate_size", "n_inner", "ffn_dim"),
}
# How many more parameters a config may imply than the weights hold (quantized weights pack up to 8 values into one
# stored element; shared layers, e.g. ALBERT's, store one for many), plus a constant for tiny models.
IMPLIED_PARAMETERS_FACTOR = 64
IMPLIED_PARAMETERS_SLACK = 1 << 24


def _stored_layers(shapes: dict) -> int:
    """How many decoder layers the weights hold (`model.layers.<i>.` names)."""
    indices = {int(m.group(1)) for name in shapes if (m := re.match(r"model\.layers\.(\d+)\.", name))}
    return max(indices) + 1 if indices else 0


def _text_config(raw: dict) -> dict:
    """The part of a config.json that sizes the language model: its `text_config` for a multimodal one."""
    return raw["text_config"] if isinstance(raw.get("text_config"), dict) else raw


def _size_field(text: dict, size: str) -> str | None:
    """The field `text` gives `size` under (the first of `_SIZE_FIELDS[size]` present), or None."""
    return next((f for f in _SIZE_FIELDS[size] if text.get(f) is not None), None)


def _sizes(raw: dict, where: str) -> dict[str, int]:
    """The size fields of a config.json (its `text_config` for a multimodal one), each a whole number >= 1."""
    text = _text_config(raw)
    sizes = {}
    for size in _SIZE_FIELDS:
        field = _size_field(text, size)
        if field is None:
            continue
        value = text[field]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CheckpointError(f"{where}: config.json's {field}={value!r} must be a whole number >= 1: fix it.")
        sizes[size] = value
    return sizes


# Bounds on a config read before its weights can be (a Hub source, whose weights are downloaded only after its config
# passed): far above any released model (Llama 3.1 405B: 126 layers, hidden 16384, vocab 128256), low enough that
# planning a conversion layer by layer stays small. The exact check against the weights follows their download.
MAX_CONFIG_SIZES = {"layers": 4096, "hidden": 1 << 20, "vocab": 1 << 24, "heads": 1 << 14, "kv_heads": 1 << 14,
                    "head_dim": 1 << 14, "intermediate": 1 << 22}  # fmt: skip


def check_config_sizes_plausible(raw: dict, where: str) -> None:
    """Refuse a config.json whose size fields exceed `MAX_CONFIG_SIZES`, for sources whose weights are not at hand
    yet; `check_config_against_weights` compares it with the weights once they are."""
    for size, value in _sizes(raw, where).items():
        if value > MAX_CONFIG_SIZES[size]:
            field = _size_field(_text_config(raw), size)
            raise CheckpointError(
                f"{where}: config.json's {field}={value} is beyond any model this package converts (at most "
                f"{MAX_CONFIG_SIZES[size]}): fix config.json or check the model id."
            )


def check_config_against_weights(directory: Path, raw: dict, where: str, shapes: dict | None = None) -> None:
    """Refuse a config.json that asks for more model than the safetensors weights next to it hold, before anything is
    built from it (building costs time and memory in what the config claims: `num_hidden_layers: 100000` took minutes
    to build, 10^7 ran out of memory). Only the headers are read (names and shapes, no tensor data). Checked, each a
    one-line `CheckpointError` naming the field, the weights and the fix:

    * every size field (layers, hidden size, vocabulary, heads, head_dim, intermediate size) is a whole number >= 1;
    * the config's layer count is at most the layers the weights hold (`<prefix>.layers.<i>.` names);
    * vocab_size and hidden_size are the embedding's shape;
    * hidden_size is a multiple of num_attention_heads (when head_dim is not given), and the heads times head_dim
      are the rows of `self_attn.q_proj`/`k_proj` (exactly for the families the converter reads, at least for
      others; Diff's layout is `_mismatch`'s to check; a quantized checkpoint packs them in other shapes);
    * whatever the names, the parameters the config implies are at most `IMPLIED_PARAMETERS_FACTOR` times the stored
      ones (plus `IMPLIED_PARAMETERS_SLACK`).

    Used by every entry point: `check_diff_checkpoint` (`checkpoints.open`: generate, inspect, niah, train, merge,
    serve), and convert's source check. A directory without safetensors weights is left to the loader."""
    if shapes is None:
        shapes = _weight_shapes(directory)
    if shapes is None or not isinstance(raw, dict):
        return
    sizes = _sizes(raw, where)
    text = _text_config(raw)
    fix = "fix config.json or re-download the checkpoint"
    prefixes: dict[str, int] = {}
    for name in shapes:
        if m := _LAYER_NAME.match(name):
            prefixes[m.group(1)] = max(prefixes.get(m.group(1), 0), int(m.group(2)) + 1)
    layers = sizes.get("layers")
    if layers is not None and len(prefixes) == 1:
        (stored,) = prefixes.values()
        if layers > stored:
            field = next(f for f in _SIZE_FIELDS["layers"] if text.get(f) is not None)
            raise CheckpointError(
                f"{where}: config.json says {field}={layers}, but the weights hold {stored} layers: {fix}."
            )
    embedding = next(
        (s for n, s in shapes.items() if n.endswith(_EMBEDDING_NAMES) and len(s) == 2 and "vision" not in n), None
    )
    if embedding is not None:
        if "vocab" in sizes and sizes["vocab"] != embedding[0]:
            raise CheckpointError(
                f"{where}: config.json says vocab_size={sizes['vocab']}, but the embedding holds {embedding[0]} "
                f"tokens: {fix}."
            )
        projected = any(text.get(f) is not None for f in ("word_embed_proj_dim", "embedding_size"))
        if "hidden" in sizes and not projected and sizes["hidden"] != embedding[1]:
            raise CheckpointError(
                f"{where}: config.json says hidden_size={sizes['hidden']}, but the embedding is {embedding[1]} wide: "
                f"{fix}."
            )
    hidden, heads = sizes.get("hidden"), sizes.get("heads")
    head_dim = sizes.get("head_dim") or (hidden // heads if hidden and heads else None)
    if heads is not None and hidden is not None and "head_dim" not in sizes and hidden % heads:
        raise CheckpointError(
            f"{where}: config.json's hidden_size={hidden} is not a multiple of num_attention_heads={heads}: {fix}."
        )
    model_type = text.get("model_type", raw.get("model_type"))
    # A Diff checkpoint whose model_type was changed (to "llama", say): its doubled heads would otherwise be reported
    # as a head-count mismatch below. What shows it: Diff's own config field, or Diff's λ tensors in the weights.
    diff_weights = any(".self_attn.diff_lambda." in n for n in shapes)  # (DiffLlama's are self_attn.lambda_q1)
    if model_type != "diff" and (raw.get("diff_version") is not None or diff_weights):
        evidence = "its diff_version field" if raw.get("diff_version") is not None else "Diff's λ tensors"
        raise CheckpointError(
            f"{where}: config.json says model_type={model_type!r}, but this is a Diff Transformer checkpoint "
            f'({evidence}): set "model_type": "diff" in config.json.'
        )
    # The families the converter reads (`diff_transformer.families`): q_proj/k_proj rows exactly heads x head_dim
    exact = family_of(model_type) is not None or is_motif(raw)
    if model_type != "diff" and head_dim and not raw.get("quantization_config"):  # packed weights: other shapes
        for proj, count in (("q_proj", heads), ("k_proj", sizes.get("kv_heads", heads))):
            shape = next((s for n, s in shapes.items() if n.endswith(f".0.self_attn.{proj}.weight")), None)
            if shape is None or count is None or len(shape) != 2:
                continue
            # other families may add rows (a gate in q_proj); none has fewer than the heads need
            if shape[0] < count * head_dim or (exact and shape[0] != count * head_dim):
                field = "num_attention_heads" if proj == "q_proj" else "num_key_value_heads"
                raise CheckpointError(
                    f"{where}: config.json's {field}={count} x head_dim {head_dim} = {count * head_dim}, but "
                    f"{proj} has {shape[0]} rows: {fix}."
                )
    stored = sum(math.prod(shape) for shape in shapes.values())
    implied = _implied_parameters(sizes)
    if implied > IMPLIED_PARAMETERS_FACTOR * stored + IMPLIED_PARAMETERS_SLACK:
        raise CheckpointError(
            f"{where}: config.json implies about {implied:.3g} parameters, but the weights hold {stored:.3g} "
            f"(more than {IMPLIED_PARAMETERS_FACTOR}x fewer): {fix}."
        )


def _implied_parameters(sizes: dict[str, int]) -> int:
    """A lower estimate of the parameters a config describes: embedding, and per layer the attention projections and
    the MLP (fields it lacks count as nothing)."""
    hidden = sizes.get("hidden", 0)
    heads = sizes.get("heads", 0)
    head_dim = sizes.get("head_dim") or (hidden // heads if heads else 0)
    kv_heads = sizes.get("kv_heads", heads)
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    mlp = 2 * hidden * sizes.get("intermediate", 0)
    return sizes.get("vocab", 0) * hidden + sizes.get("layers", 0) * (attention + mlp)


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
    """For a local checkpoint, before anything is built from its config: the config asks for no more model than the
    safetensors weights hold (`check_config_against_weights`, any model type); for a Diff checkpoint also that its
    config.json parses and its weights are those the config describes, a `diff_version` that disagrees with the
    weights named with the fix. A directory without config.json is refused (`checkpoints.open` resolves an adapter to
    its base before this)."""
    config_file = directory / "config.json"
    refuse_special_files(directory)
    if not config_file.is_file():  # transformers would ask for its `model_type` key
        raise CheckpointError(
            f"no config.json in {directory}: {name} must be a transformers checkpoint directory (config.json + "
            "*.safetensors) or a Hub id; save the model with `save_pretrained` or download the full repository."
        )
    raw = read_json(config_file)
    check_model_type(raw, f"{name} {directory}")
    shapes = _weight_shapes(directory)
    if shapes is None:
        return
    check_config_against_weights(directory, raw, f"{name} {directory}", shapes)
    if not isinstance(raw, dict) or raw.get("model_type") != "diff":
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


def from_pretrained(location: str, shown: str, **kwargs):
    """`AutoModelForCausalLM.from_pretrained(LOCATION)` of a model already resolved and checked (`checkpoints.open`),
    every failure one `CheckpointError` line naming SHOWN."""
    from transformers import AutoModelForCausalLM

    from ..integrations.auto_classes import register_auto_classes

    register_auto_classes()

    # Safetensors only, wherever the weights come from (a Hub repo with only pytorch_model.bin is refused, not
    # unpickled): the local check (`_weight_shapes`) names the fix before this for a directory.
    kwargs.setdefault("use_safetensors", True)
    try:
        return AutoModelForCausalLM.from_pretrained(location, **kwargs)
    except Exception as exc:
        message = " ".join(str(exc).split())[:300] or type(exc).__name__
        # transformers' refusal ends "Please do not set `use_safetensors=True`", advice that does not apply here.
        # Relies on its OSError's wording (5.23: "... cannot be loaded with `safetensors`"); guarded by
        # tests/hub/test_hub.py::test_a_hub_repo_with_only_pickled_weights_is_refused_not_unpickled.
        if kwargs["use_safetensors"] and isinstance(exc, OSError) and "loaded with `safetensors`" in message:
            raise CheckpointError(f"{shown} has no safetensors weights, only pickles; {PICKLE_REFUSAL}") from None
        from safetensors import SafetensorError

        if isinstance(exc, (OSError, SafetensorError)):  # a file missing, unreadable or cut short
            raise CheckpointError(
                f"cannot load {shown} ({message}): check that it is a complete checkpoint, or re-download it."
            ) from None
        raise CheckpointError(f"cannot load {shown}: {message}") from None


__all__ = ["check_config_against_weights", "check_diff_checkpoint", "from_pretrained"]
