"""Every field read from a metadata file is checked for its type and range, and no NaN passes silently (issue
"Trust 4", item 4): a wrong-typed field of an adapter's adapter_config.json or base_model.json, of a Motif
config.json, or a wrong serve --device / --dtype is one `error:` line (exit 2), never an "unexpected ... (a bug)" line;
config values that make the forward non-finite (subln_eps 1e-300, a depth offset whose 1 - λ_init overflows float16)
are refused at load; generate refuses NaN logits, and merge refuses to write NaN or inf weights unless
--allow-non-finite says so."""

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file

from diff_transformer import DiffConfig, cli
from diff_transformer.configuration_diff import FP32_TINY, LAMBDA_OFFSET_RANGE
from tests.helpers.checkpoints import HELDOUT, save_trainable_checkpoint
from tests.helpers.motif import write_motif_checkpoint
from tests.helpers.tiny import tiny_model
from tests.helpers.training import QUIET


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A tiny V1 and V2 model (token ids), a tiny Motif checkpoint, and a one-step LoRA run on a trainable V2 model."""
    root = tmp_path_factory.mktemp("fields")
    tiny_model(1).save_pretrained(root / "v1")
    tiny_model(2).save_pretrained(root / "v2")
    write_motif_checkpoint(root / "motif")
    save_trainable_checkpoint(root / "base", 2)
    (root / "text.txt").write_text(HELDOUT[:2500], encoding="utf-8")
    argv = ["train", root / "base", "--data", root / "text.txt", "--output", root / "lora", *QUIET]
    assert cli.main([str(a) for a in [*argv, "--max-steps", "1", "--lora", "--lora-r", "4"]]) == 0
    return root


def _edited(work, tmp_path, source: str, file: str, changes):
    """A copy of WORK/SOURCE whose FILE has CHANGES (a dict of fields; anything else replaces the whole content)."""
    path = tmp_path / source
    shutil.copytree(work / source, path)
    content = json.loads((path / file).read_text())
    (path / file).write_text(json.dumps({**content, **changes} if isinstance(changes, dict) else changes))
    return path


# ---- a Diff config.json: values that make the forward non-finite are refused at load ----


def test_the_depth_offset_bound_is_where_the_output_scale_leaves_float16():
    """1 - λ_init of layer 0 is 0.2 + 0.6 exp(-0.3 offset): finite in float16 at the lowest allowed offset, inf one
    below (computed here from the paper's formula, not the config's code)."""
    low = LAMBDA_OFFSET_RANGE[0]

    def scale(offset):
        return torch.tensor(0.2 + 0.6 * math.exp(-0.3 * offset), dtype=torch.float16)

    assert torch.isfinite(scale(low)) and torch.isinf(scale(low - 1))
    DiffConfig(diff_version=1, lambda_init_depth_offset=low)
    with pytest.raises(ValueError, match="lambda_init_depth_offset=-39 must lie in"):
        DiffConfig(diff_version=1, lambda_init_depth_offset=low - 1)
    DiffConfig(diff_version=1, lambda_init_depth_offset=-1000, lambda_init=0.5)  # a fixed λ_init: no schedule


def test_subln_eps_must_survive_float32():
    assert torch.tensor(FP32_TINY, dtype=torch.float32) > 0 and torch.tensor(1e-300, dtype=torch.float32) == 0
    DiffConfig(diff_version=1, subln_eps=FP32_TINY)
    for eps in (1e-300, 0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="subln_eps="):
            DiffConfig(diff_version=1, subln_eps=eps)


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"subln_eps": 1e-300}, ["subln_eps=1e-300 must be a finite number >= 1.18e-38"]),
        ({"lambda_init_depth_offset": -1000}, ["lambda_init_depth_offset=-1000 must lie in [-38"]),
        ({"lambda_init_depth_offset": 10**400}, ["lambda_init_depth_offset=100000... (401 digits) must lie in"]),
        ({"subln_eps": "x"}, ["subln_eps"]),
    ],
)
def test_generate_refuses_a_config_that_makes_nan_logits(refused, work, tmp_path, capsys, changes, words):
    model = _edited(work, tmp_path, "v1", "config.json", changes)
    refused(["generate", model, "5 6 7", "--max-new-tokens", "2"], *words)


def test_generate_refuses_non_finite_logits(refused, work, tmp_path, capsys):
    model = tiny_model(2)
    with torch.no_grad():
        model.model.norm.weight[3] = math.inf  # a valid config, weights that overflow
    model.save_pretrained(tmp_path / "model")
    refused(["generate", tmp_path / "model", "5 6 7", "--max-new-tokens", "2"], "non-finite logits", "token 1")


# ---- an adapter: lora_alpha that overflows, wrong-typed fields of adapter_config.json and base_model.json ----


def test_merge_never_writes_non_finite_weights_unless_told(refused, work, tmp_path, capsys):
    adapter = _edited(work, tmp_path, "lora", "adapter_config.json", {"lora_alpha": 1e308})  # alpha / r overflows B·A
    refused(["merge", adapter, tmp_path / "out"], "NaN or inf", "--allow-non-finite", "nothing was written")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lora"]
    refused(["generate", adapter, "hello", "--max-new-tokens", "2"], "non-finite logits")
    assert cli.main([str(a) for a in ["merge", adapter, tmp_path / "out", "--allow-non-finite"]]) == 0
    weights = load_file(tmp_path / "out" / "model.safetensors")
    assert any(not torch.isfinite(w).all() for w in weights.values())  # what the flag asked for
    assert cli.main([str(a) for a in ["merge", work / "lora", tmp_path / "clean"]]) == 0
    assert all(torch.isfinite(w).all() for w in load_file(tmp_path / "clean" / "model.safetensors").values())


@pytest.mark.parametrize(
    "file, changes, words",
    [
        ("adapter_config.json", {"r": "8"}, ['r is "8", not a whole number']),
        ("adapter_config.json", {"r": 0}, ["r is 0, not >= 1"]),
        ("adapter_config.json", {"lora_alpha": "16"}, ['lora_alpha is "16", not a finite number']),
        ("adapter_config.json", {"lora_dropout": 2}, ["lora_dropout is 2, not in [0, 1]"]),
        ("adapter_config.json", {"target_modules": 5}, ["target_modules is 5, not a string or a list of strings"]),
        ("adapter_config.json", {"modules_to_save": "diff_lambda"}, ["modules_to_save", "a list of strings"]),
        ("adapter_config.json", {"use_rslora": "no"}, ['use_rslora is "no", not true or false']),
        ("base_model.json", {"relative": 5}, ["base_model.json: relative is 5, not a string"]),
        ("base_model.json", {"absolute": []}, ["absolute is [], not a string"]),
        ("base_model.json", {"hub_id": {"a": 1}}, ["hub_id"]),
        ("base_model.json", {"fingerprint": "x"}, ['fingerprint is "x", not a JSON object']),
        ("base_model.json", {"fingerprint": {"tensors": "1", "parameters": 1, "sha256": "x"}}, ["fingerprint: tens"]),
        ("base_model.json", [1], ["base_model.json: holds a JSON list, not an object"]),
    ],
)
def test_wrong_typed_adapter_fields_are_one_line(refused, work, tmp_path, capsys, file, changes, words):
    adapter = _edited(work, tmp_path, "lora", file, changes)
    refused(["generate", adapter, "hello", "--max-new-tokens", "1"], *words)
    refused(["merge", adapter, tmp_path / "out"], *words)
    assert not (tmp_path / "out").exists()


# ---- Motif's config.json fields (the converter) ----


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("attn_rms_norm_eps", "x", ['attn_rms_norm_eps is "x", not a finite number']),
        ("attn_rms_norm_eps", 1e-300, ["attn_rms_norm_eps is 1e-300, not >= 1.17549e-38"]),
        ("num_nextn_predict_layers", "2", ['num_nextn_predict_layers is "2", not a whole number']),
        ("num_nextn_predict_layers", [1], ["num_nextn_predict_layers is [1]"]),
        ("sliding_window", "x", ['sliding_window is "x", not a whole number']),
        ("sliding_window", [4], ["sliding_window is [4]"]),
        ("use_sliding_window", "x", ['use_sliding_window is "x", not true or false']),
        ("num_noise_heads", "2", ['num_noise_heads is "2"']),
        ("qkv_bias", "x", ['qkv_bias is "x", not true or false']),  # bool("x") was True: a misleading refusal
    ],
)
def test_wrong_typed_motif_fields_are_one_line(refused, work, tmp_path, capsys, field, value, words):
    source = _edited(work, tmp_path, "motif", "config.json", {field: value})
    refused(["convert", source, tmp_path / "out", "--diff-version", "1", "--quiet"], "config.json of", *words)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("value", [5, "LlamaForCausalLM", [1], {"a": 1}])
def test_a_wrong_typed_architectures_is_one_line(refused, work, tmp_path, capsys, value):
    """`architectures` picks the model class and tells Motif apart: a non-list was an exit-1 TypeError in convert."""
    source = _edited(work, tmp_path, "motif", "config.json", {"architectures": value})
    refused(["convert", source, tmp_path / "out", "--quiet"], "architectures", "is not a list of class names")
    model = _edited(work, tmp_path / "v2", "v2", "config.json", {"architectures": value})
    refused(["generate", model, "5 6 7", "--max-new-tokens", "1"], "architectures", "is not a list of class names")


# ---- generation_config.json: types transformers leaves unchecked, settings that need what the model lacks ----


@pytest.mark.parametrize(
    "generation, words",
    [
        ({"eos_token_id": "8"}, ['eos_token_id is "8", not a whole number or a list of them']),
        ({"bos_token_id": 2**64}, ["bos_token_id is 18446744073709551616, not in [0, 9223372036854775807]"]),
        ({"use_cache": "x"}, ['use_cache is "x", not true or false']),  # truthy: silently misread before
        ({"do_sample": "x"}, ['do_sample is "x", not true or false']),
        ({"num_beams": 2**64}, ["num_beams=18446744073709551616 must be >= 1 and <= 64"]),
        ({"prefill_chunk_size": "8"}, ['prefill_chunk_size is "8"']),
        ({"max_time": "8"}, ['max_time is "8", not a finite number']),
        ({"guidance_scale": "x"}, ['guidance_scale is "x"']),
        ({"exponential_decay_length_penalty": 8}, ["exponential_decay_length_penalty is 8, not a [start index"]),
        ({"exponential_decay_length_penalty": [1, 1.5]}, ["exponential_decay_length_penalty", "no eos_token_id"]),
        ({"sequence_bias": {"a": 1}}, ["sequence_bias", "not a list of [token-id list, bias] pairs"]),
        ({"stop_strings": ["a"]}, ["sets stop_strings, which needs a tokenizer"]),
        ({"token_healing": True}, ["sets token_healing, which needs a tokenizer"]),
    ],
)
def test_generation_config_types_are_one_line(refused, work, tmp_path, capsys, generation, words):
    model = tmp_path / "model"
    shutil.copytree(work / "v2", model)
    (model / "generation_config.json").write_text(json.dumps(generation))
    refused(["generate", model, "5 6 7", "--max-new-tokens", "2"], *words)


@pytest.mark.parametrize("generation", [{"repetition_penalty": 2}, {"return_dict_in_generate": True}])
def test_generation_settings_transformers_would_trip_on_are_honoured(work, tmp_path, capsys, generation):
    """A whole-number repetition_penalty (transformers' processor takes floats only) and return_dict_in_generate
    (generate then returns an object, not the ids) generate as the same settings written otherwise would."""
    outputs = []
    for index, written in enumerate(
        [generation, {k: float(v) if k != "return_dict_in_generate" else False for k, v in generation.items()}]
    ):
        model = tmp_path / f"model{index}"
        shutil.copytree(work / "v2", model)
        (model / "generation_config.json").write_text(json.dumps(written))
        capsys.readouterr()
        assert cli.main(["generate", str(model), "5 6 7", "--max-new-tokens", "4"]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] and len(outputs[0].split()) == 4


# ---- serve --device / --dtype, checked before the server starts ----


@pytest.mark.parametrize(
    "options, words",
    [
        (["--device", "xyz"], ["--device 'xyz' is not a device"]),
        (["--device="], ["--device '' is not a device"]),
        (["--device", "cuda:x"], ["is not a device"]),
        (["--dtype", "float8"], ["--dtype 'float8' is not a dtype", "float32"]),
        (["--dtype", "--port", "0"], ["--dtype needs a value"]),
    ],
)
def test_serve_device_and_dtype_are_checked_before_it_starts(refused, work, tmp_path, capsys, options, words):
    pytest.importorskip("fastapi")
    from tests.helpers import REPOSITORY

    refused(["serve", REPOSITORY / "src" / "diff_transformer" / "assets" / "tiny-llama", *options], *words)
