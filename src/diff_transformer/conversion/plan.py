"""From SRC's config.json and tensor headers to what a conversion writes: the Diff config and the tensor map
(`plan_conversion`), SRC's config and every tensor's name, shape and dtype checked first, before anything is built
or written; `planned_config` gives the same config from a config.json alone (`diff-transformer plan`)."""

from __future__ import annotations

from pathlib import Path

import torch

from ..checkpoints.configs import check_generation_config, check_model_config
from ..checkpoints.loading import check_config_against_weights, check_config_sizes_plausible
from ..configuration_diff import AUTO_MAP
from ..families import FAMILIES, MOTIF, Family, family_of_config
from .dtypes import cast_dtype, from_safetensors_code
from .errors import ConversionError, one_line
from .families import CAUSAL_LM, check_supported, source_geometry, task_of
from .layout import IGNORED_SOURCE_TENSORS, Geometry, choose_v1_layout, make_tensor_map, pairable
from .motif import motif_config
from .options import CALIBRATED_INITS, ConvertOptions, checked_options
from .source import SourceCheckpoint, check_float_dtypes, read_weights_headers


# Llama / DiffLlama config fields that DiffConfig shares with the same meaning (the head geometry is set separately).
_COPIED_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "hidden_act",
    "max_position_embeddings",
    "initializer_range",
    "rms_norm_eps",
    "use_cache",
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
    "tie_word_embeddings",
    "rope_parameters",
    "attention_bias",
    "attention_dropout",
    "mlp_bias",
)
# The least λ of the default (differential) V1 start, kept throughout training (`DiffConfig.lambda_floor`).
DIFFERENTIAL_LAMBDA_FLOOR = 0.05


def plan_conversion(source: SourceCheckpoint, expected: Family, options: ConvertOptions):
    """Validate SRC (config, then every tensor header) and return the Diff config and the tensor map."""
    where = source.repo_id or str(source.path)
    # A config that claims more model than the weights hold, refused before anything is built from it (a Hub source:
    # once its weights are downloaded, below).
    if source.repo_id is None:
        check_config_against_weights(source.path, source.config, where)
    else:  # the weights come after the config passed: bound what the config alone can make us plan
        check_config_sizes_plausible(source.config, where)
    config, tensor_map = _mapped_config(source, expected, options, where)
    check_model_config(config, where, build=False)  # before a Hub download
    # OUT gets SRC's generation_config.json: one that generate() cannot use (num_beams -3) is refused here.
    check_generation_config(str(source.path), where)
    read_weights_headers(source)
    if source.repo_id is not None:
        shapes = {name: info.shape for name, info in source.tensors.items()}
        check_config_against_weights(source.path, source.config, where, shapes)
    _validate_tensors(source, tensor_map.geometry, family_of_config(source.config))
    # The weights hold the layers the config claims: now building it (on the meta device) costs what the model is.
    check_model_config(config, where)
    config.dtype = options.dtype or _declared_dtype(source) or _stored_dtype(source, tensor_map.geometry)
    return config, tensor_map


def _mapped_config(source: SourceCheckpoint, expected: Family, options: ConvertOptions, where: str):
    """The Diff config and tensor map of SRC's config.json converted as OPTIONS ask (no weights read)."""
    v1_init = options.v1_init
    source_config, family, task = _source_config(source, expected)
    geometry = source_geometry(family, task, source_config)
    calibrated = v1_init in CALIBRATED_INITS
    layout = choose_v1_layout(geometry, options.v1_layout) if v1_init is not None else None
    tensor_map = make_tensor_map(
        family,
        options.diff_version,
        geometry,
        lambda_std=options.lambda_std,
        seed=options.seed,
        mirrored_lambda=calibrated,
        v1_layout=layout or "paired",
    )
    if v1_init == "paper":
        tensor_map.provenance = {"v1_init": "paper", "v1_layout": layout}
    if layout == "expanded" and v1_init == "calibrated-additive":
        pair = " (or --v1-layout paired)" if pairable(geometry) else ""  # never suggest a layout SRC cannot take
        raise ConversionError(
            "--v1-init calibrated-additive fits λ < 0 on paired heads; the expanded layout starts with A2 = A1, where "
            f"λ has no effect, so it has no additive start: use --v1-init calibrated{pair}."
        )
    # λ_init: the paper's schedule, except where λ starts fitted or at 0 (λ_init 0, mirrored vectors)
    lambda_init = 0.0 if calibrated and (layout == "paired" or v1_init == "calibrated-lambda0") else None
    floor = DIFFERENTIAL_LAMBDA_FLOOR if v1_init == "calibrated" else None
    # Built before any weights are downloaded or read, so that an unsupported config is refused early.
    config = _diff_config(source_config, family, task, geometry, options, where, lambda_init, layout, floor)
    return config, tensor_map


def planned_config(source_config: dict, diff_version: int | None = None, where: str = "config.json"):
    """The Diff config `convert` writes for a source whose config.json is SOURCE_CONFIG, with the converter's
    defaults (`diff-transformer plan`): nothing else is read."""
    source = SourceCheckpoint(Path(where), None, dict(source_config), [])
    family = family_of_config(source.config)
    if family is None:
        raise model_type_error(source, expected=None)
    version = family.default_version if diff_version is None else diff_version
    options = checked_options(ConvertOptions(version), family)
    check_config_sizes_plausible(source.config, where)
    return _mapped_config(source, family, options, where)[0]


def _declared_dtype(source: SourceCheckpoint) -> torch.dtype | None:
    declared = source.config.get("dtype") or source.config.get("torch_dtype")
    return cast_dtype(str(declared)) if declared else None


def _stored_dtype(source: SourceCheckpoint, geometry: Geometry) -> torch.dtype:
    """What the shards store (checked to be float): what the config records when SRC's config does not say."""
    return from_safetensors_code(source.tensors[geometry.prefix + "embed_tokens.weight"].dtype)


def _accepted(converter: str) -> str:
    """The families `converter` reads, as messages name them."""
    return ", ".join(family.describe() for family in FAMILIES.values() if family.converter == converter)


def model_type_error(source: SourceCheckpoint, expected: Family | None) -> ConversionError:
    """SRC is not of a family the converter reads, or (`expected`) not of one that `expected`'s converter reads."""
    family = family_of_config(source.config)
    model_type = family.model_type if family is not None else source.model_type
    where = source.repo_id or str(source.path)
    if model_type == "diff":
        return ConversionError(
            f"{where} is already a Diff checkpoint (model_type 'diff'): load it directly, no conversion is needed."
        )
    if expected is not None and family is not None:
        return ConversionError(
            f"{where} has model_type {model_type!r}, "
            f"but this converter expects {expected.model_type!r}: use {family.converter}."
        )
    if expected is not None:
        accepted = _accepted(expected.converter)
    else:
        groups = [_accepted(converter) for converter in dict.fromkeys(f.converter for f in FAMILIES.values())]
        accepted = ", ".join(groups[:-1]) + " or " + groups[-1]
    return ConversionError(
        f"{where} has model_type {model_type!r}; only {accepted} checkpoints convert: pick a checkpoint of one of "
        "these families (config.json's model_type says which)."
    )


def _source_config(source: SourceCheckpoint, expected: Family):
    """SRC's parsed config, family and task. SRC may be of any family that `expected`'s converter reads (LLAMA: every
    Llama-shaped family)."""
    where = source.repo_id or str(source.path)
    family = family_of_config(source.config)
    if family is None or family.converter != expected.converter:
        raise model_type_error(source, expected=expected)
    if source.config.get("quantization_config"):
        method = (
            source.config["quantization_config"].get("quant_method", "?")
            if isinstance(source.config["quantization_config"], dict)
            else "?"
        )
        raise ConversionError(
            f"{where} is a quantized checkpoint ({method}): convert the unquantized (float) weights instead."
        )
    if family is MOTIF:  # no transformers class: read as a LlamaConfig, Motif's fields checked (motif.py)
        return motif_config(source.config, where), family, CAUSAL_LM
    task = task_of(family, source.config.get("architectures") or [], where)
    import transformers

    config_class = getattr(transformers, family.config_class)
    try:
        config = config_class.from_dict(dict(source.config))
    except Exception as exc:
        raise ConversionError(
            f"config.json of {where} is not a valid {config_class.__name__} ({one_line(exc)}): fix or re-download it."
        ) from exc
    check_supported(family, config, where)
    return config, family, task


def _diff_config(
    source_config,
    family: Family,
    task,
    geometry: Geometry,
    options: ConvertOptions,
    where: str,
    lambda_init: float | None = None,
    v1_layout: str | None = None,
    lambda_floor: float | None = None,
):
    """The Diff config of SRC converted as `options` ask (`v1_layout` the layout chosen, `lambda_init` and
    `lambda_floor` the V1 start's)."""
    from ..configuration_diff import DiffConfig

    diff_version, lambda_std = options.diff_version, options.lambda_std

    fields = {name: getattr(source_config, name) for name in _COPIED_FIELDS if hasattr(source_config, name)}
    # What the family hard-codes or configures (`attention_flags`); o_proj's bias is written only where it differs
    # from q/k/v's (Qwen2), so Llama conversions keep the config they always had.
    out_bias = None if geometry.out_bias == geometry.attention_bias else geometry.out_bias
    fields.update(attention_bias=geometry.attention_bias, attention_out_bias=out_bias, mlp_bias=geometry.mlp_bias)
    fields.update(use_qk_norm=geometry.qk_norm)
    if task is not CAUSAL_LM:  # the head's labels
        fields.update(id2label=source_config.id2label, label2id=source_config.label2id)
        fields.update(problem_type=getattr(source_config, "problem_type", None))
    if family.lambda_std_field:  # differential already: its λ vectors' init std
        lambda_std = getattr(source_config, family.lambda_std_field, None)
        lambda_std = 0.1 if lambda_std is None else float(lambda_std)
    if family is MOTIF:  # H = the signal heads; GDA's noise heads, λ_init at depth i - 1, subln's own eps
        motif = source_config.motif
        heads, kv_heads = geometry.num_heads - geometry.motif_groups, geometry.num_kv_heads // 2
        fields.update(num_noise_heads=None if motif.num_noise_heads is None else motif.groups)
        fields.update(lambda_init_depth_offset=-1, subln_eps=motif.attn_rms_norm_eps, hidden_act="poly_norm")
    elif diff_version == 2 or v1_layout == "expanded":
        heads, kv_heads = geometry.num_heads, geometry.num_kv_heads
    else:
        heads, kv_heads = geometry.num_heads // 2, geometry.num_kv_heads // 2
    try:
        config = DiffConfig(
            **fields,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=geometry.head_dim,
            diff_version=diff_version,
            lambda_init=lambda_init,  # None: the paper's depth schedule (also DiffLlama's); 0.0: calibrated V1
            lambda_std=float(lambda_std),
            lambda_floor=lambda_floor,
        )
    except Exception as exc:
        hint = " or use diff_version=2" if diff_version == 1 and family.llama_shaped else ""
        raise ConversionError(
            f"{where} cannot be expressed as a Diff V{diff_version} config ({one_line(exc)}): fix config.json{hint}."
        ) from exc
    config.architectures = [task.diff_class]
    config.auto_map = dict(AUTO_MAP)
    return config


def _validate_tensors(source: SourceCheckpoint, geometry: Geometry, family: Family) -> None:
    where = source.repo_id or str(source.path)
    expected, optional = geometry.expected_source_tensors(family)
    for name, info in source.tensors.items():
        if geometry.canonical(name) in expected:
            if info.shape != expected[geometry.canonical(name)]:
                raise ConversionError(
                    f"tensor {name} in {info.shard.name} has shape {list(info.shape)}, but config.json implies "
                    f"{list(expected[geometry.canonical(name)])}: config.json does not describe these weights; fix "
                    "it or re-download the checkpoint."
                )
        elif not IGNORED_SOURCE_TENSORS.match(name):
            raise ConversionError(
                f"unexpected tensor {name} in {info.shard.name} of {where}: not part of a {source.model_type} model "
                "with this config (unsupported feature or wrong model); convert a plain checkpoint."
            )
    present = {geometry.canonical(name) for name in source.tensors}
    missing = [name for name in expected if name not in present and name not in optional]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ConversionError(
            f"tensor {missing[0]}{more} is missing from {where}: the checkpoint is incomplete; re-download it."
        )
    check_float_dtypes(source)


__all__ = ["DIFFERENTIAL_LAMBDA_FLOOR", "model_type_error", "plan_conversion", "planned_config"]
