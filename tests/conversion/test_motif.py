"""Motif -> Diff V1 through `diff-transformer convert` and the Python API (docs/motif.md): tiny random checkpoints in
Motif's exact key layout (Motif-2.6B's stripe pairs, MHA and GQA; grouped differential attention as in
Motif-2-12.7B; tied and untied embeddings), each converted output checked against an independent reference forward
written from the semantics (tests/helpers/motif.py, float64, over the *source* weights)."""

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from diff_transformer import DiffForCausalLM, cli
from diff_transformer.conversion import ConversionError, convert_motif_to_diff, convert_to_diff, verify_conversion
from tests.helpers.motif import (
    LAYOUTS,
    motif_reference_greedy,
    motif_reference_logits,
    write_motif_checkpoint,
)


IDS = torch.tensor([[5, 17, 42, 8, 9, 30, 64, 3, 99, 7, 11, 4], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]])


def convert(capsys, *argv):
    """`diff-transformer convert ...` in-process: (exit code, stdout, stderr)."""
    capsys.readouterr()
    code = cli.main(["convert", *map(str, argv), "--quiet"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def reference(config, sd, ids):
    """The reference's logits (B, N, V) in float64."""
    sd64 = {name: tensor.double() for name, tensor in sd.items()}
    return torch.stack([motif_reference_logits(config, sd64, row) for row in ids])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_motif_converts_exactly_through_the_cli(tmp_path, capsys, layout):
    config, sd = write_motif_checkpoint(tmp_path / "motif", layout)
    code, out, err = convert(capsys, tmp_path / "motif", tmp_path / "diff", "--verify")
    assert code == 0, err
    reported = float(re.search(r"max \|Δlogit\| = (\S+),", out).group(1))
    assert reported <= 1e-5 and "greedy continuations match: True" in out, out
    assert "not function-preserving" not in out

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "diff", dtype=torch.float32).eval()
    assert type(model).__name__ == "DiffForCausalLM"
    groups = config.get("num_noise_heads")
    assert model.config.num_noise_heads == groups  # None: Motif-2.6B, the paper's V1 (one noise query per head)
    assert model.config.num_attention_heads == config["num_attention_heads"] - (
        groups or config["num_attention_heads"] // 2
    )
    assert model.config.num_key_value_heads == config["num_key_value_heads"] // 2
    assert model.config.hidden_act == "poly_norm" and model.config.lambda_init_depth_offset == -1
    assert model.config.subln_eps == config["attn_rms_norm_eps"]
    assert model.config.tie_word_embeddings == config["tie_word_embeddings"]
    expected = reference(config, sd, IDS)
    for implementation in ("eager", "sdpa"):
        model.set_attn_implementation(implementation)
        with torch.no_grad():
            logits = model(IDS).logits
        assert (logits.double() - expected).abs().max() <= 1e-5, implementation
        assert torch.equal(logits.argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize(
    "variant",
    [dict(head_dim=None), dict(use_bias=True), dict(model_type="Motif", num_hidden_layers=1)],
    ids=["no-head-dim", "biases", "one-layer"],
)
def test_config_variants_convert_exactly(tmp_path, variant):
    """Motif-2.6B's config may leave head_dim out (hidden_size / heads); `use_bias` biases q/k/v/o and the MLP."""
    config, sd = write_motif_checkpoint(tmp_path / "motif", "motif-2.6b-gqa", **variant)
    out = convert_to_diff(tmp_path / "motif", tmp_path / "diff", progress=False)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(IDS).logits
    assert (logits.double() - reference(config, sd, IDS)).abs().max() <= 1e-5


def test_the_check_tells_motifs_conventions_apart(tmp_path):
    """The 1e-5 agreement has teeth: the paper's λ_init schedule or subln at rms_norm_eps miss it."""
    config, sd = write_motif_checkpoint(tmp_path / "motif", "motif-gda")
    out = convert_to_diff(tmp_path / "motif", tmp_path / "diff", progress=False)
    expected = reference(config, sd, IDS)
    for wrong in (dict(lambda_init_depth_offset=0), dict(subln_eps=None)):
        model = DiffForCausalLM.from_pretrained(out, dtype=torch.float32, **wrong).eval()
        with torch.no_grad():
            assert (model(IDS).logits.double() - expected).abs().max() > 3e-5, wrong


@pytest.mark.parametrize("layout", ["motif-2.6b-gqa", "motif-gda"])
def test_greedy_generation_is_the_references_argmax_loop(tmp_path, layout):
    config, sd = write_motif_checkpoint(tmp_path / "motif", layout)
    out = convert_motif_to_diff(tmp_path / "motif", tmp_path / "diff", progress=False)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    sd64 = {name: tensor.double() for name, tensor in sd.items()}
    for row in IDS[:, :6]:
        expected = motif_reference_greedy(config, sd64, row, 8)
        for cache in ("dynamic", "static"):
            generated = model.generate(
                row[None], max_new_tokens=8, min_new_tokens=8, do_sample=False, cache_implementation=cache
            )[0]
            assert torch.equal(generated, expected), (cache, generated, expected)
    assert len(set(expected[6:].tolist())) > 2  # not degenerate


def test_every_weight_keeps_its_rows_and_columns(tmp_path):
    """Motif's stripe (and GDA group) layout is V1's: the converter permutes nothing; λ moves under diff_lambda."""
    _, sd = write_motif_checkpoint(tmp_path / "motif", "motif-gda")
    convert_to_diff(tmp_path / "motif", tmp_path / "diff", progress=False)
    out = load_file(tmp_path / "diff" / "model.safetensors")
    for name, tensor in sd.items():
        target = re.sub(r"self_attn\.(lambda_[qk][12])$", r"self_attn.diff_lambda.\1", name)
        assert torch.equal(out.pop(target), tensor), name
    assert not out


def test_bf16_conversion_loads_and_runs(tmp_path, capsys):
    config, sd = write_motif_checkpoint(tmp_path / "motif", "motif-gda-tied")
    code, out, err = convert(capsys, tmp_path / "motif", tmp_path / "diff", "--dtype", "bfloat16", "--verify")
    assert code == 0, err  # verified against the source cast to bfloat16 as OUT is
    assert "cast to bfloat16" in out, out
    stored = load_file(tmp_path / "diff" / "model.safetensors")
    assert stored["model.layers.0.mlp.act_fn.weight"].dtype == torch.bfloat16
    assert stored["model.layers.0.self_attn.diff_lambda.lambda_q1"].dtype == torch.float32  # they feed an exp
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "diff", dtype=torch.bfloat16).eval()
    with torch.no_grad():
        logits = model(IDS).logits
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()
    expected = reference(config, sd, IDS)
    assert (logits.double() - expected).abs().max() <= 0.1 * expected.abs().max()
    assert model.generate(IDS[:1, :6], max_new_tokens=4, do_sample=False).shape == (1, 10)


def test_card_names_the_source_and_its_licence(tmp_path):
    write_motif_checkpoint(tmp_path / "Motif-2.6B", "motif-2.6b-mha")
    out = convert_to_diff(tmp_path / "Motif-2.6B", tmp_path / "diff", progress=False)
    conversion = json.loads((out / "config.json").read_text())["conversion"]
    assert conversion["source"] == "Motif-2.6B" and conversion["source_model_type"] == "motif"
    assert conversion["function_preserving"] is True
    assert conversion["card_data"] == {
        "license": "other",
        "license_name": "motif-test-license",
        "language": ["en", "ko"],
    }
    card = (out / "README.md").read_text()
    assert "license: other" in card and "license_name: motif-test-license" in card
    assert "Converted from `Motif-2.6B`" in card and "Function-preserving at conversion: yes" in card
    assert "PolyNorm" in card and "0.8 − 0.6·exp(−0.3·(layer − 1))" in card
    assert (out / "generation_config.json").is_file()


def test_model_type_is_not_needed_to_recognise_motif(tmp_path):
    """Recognised by `architectures`; Motif's Hub configs carry their own model_type (and remote code)."""
    config, sd = write_motif_checkpoint(tmp_path / "motif", "motif-2.6b-gqa", model_type="Motif")
    out = convert_to_diff(tmp_path / "motif", tmp_path / "diff", progress=False)
    report = verify_conversion(tmp_path / "motif", out, max_new_tokens=4)
    assert report["passed"] and report["source_model_type"] == "motif" and report["expected_exact"]
    assert report["max_abs_logit_diff"] <= 1e-5


def write_raw(path, config, sd):
    (path / "config.json").write_text(json.dumps(config))
    save_file(sd, str(path / "model.safetensors"))


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (dict(kv_lora_rank=64), ("kv_lora_rank", "Motif-3", "only the dense Motif-2 line")),
        (dict(k_ratio=2), ("k_ratio=2", "stripe")),
        (dict(num_noise_heads=3), ("num_noise_heads=3", "groups of at least two")),
        (dict(num_key_value_heads=6), ("num_key_value_heads=6", "k_proj has 64 rows")),  # the config-vs-weights check
        # fewer heads than q_proj's rows: every family the converter reads has exactly heads x head_dim (same check)
        (dict(num_attention_heads=8, num_noise_heads=2), ("num_attention_heads=8", "q_proj has 160 rows")),
        (dict(attn_rms_norm_eps=None), ("attn_rms_norm_eps",)),
        (dict(use_sliding_window=True, sliding_window=16), ("sliding-window",)),
        (dict(hidden_act="silu"), ("hidden_act='silu'",)),
    ],
)
def test_what_cannot_be_computed_is_refused_in_one_line(tmp_path, refused, change, words):
    config, sd = write_motif_checkpoint(tmp_path / "motif", "motif-gda")
    (tmp_path / "motif" / "config.json").write_text(json.dumps({**config, **change}))
    refused(["convert", tmp_path / "motif", tmp_path / "diff"], *words)
    assert not (tmp_path / "diff").exists()


def test_unknown_tensors_and_other_options_are_refused(tmp_path, refused):
    config, sd = write_motif_checkpoint(tmp_path / "motif", "motif-2.6b-gqa")
    refused(["convert", tmp_path / "motif", tmp_path / "a", "--diff-version", "2"], "diff_version=1 only")
    refused(
        ["convert", tmp_path / "motif", tmp_path / "a", "--v1-init", "paper"], "Motif checkpoint, imported exactly"
    )
    extra = {**sd, "model.layers.0.self_attn.q_norm.weight": torch.ones(16)}
    write_raw(tmp_path / "motif", config, extra)
    refused(
        ["convert", tmp_path / "motif", tmp_path / "a"], "unexpected tensor model.layers.0.self_attn.q_norm.weight"
    )
    missing = {k: v for k, v in sd.items() if not k.endswith("act_fn.bias")}
    write_raw(tmp_path / "motif", config, missing)
    refused(["convert", tmp_path / "motif", tmp_path / "a"], "act_fn.bias", "missing")
    with pytest.raises(ConversionError, match="convert_motif_to_diff"):
        from diff_transformer.conversion import convert_llama_to_diff

        convert_llama_to_diff(tmp_path / "motif", tmp_path / "a", progress=False)


def test_a_converted_motif_model_trains(tmp_path):
    """The options are trainable parameters: one step moves PolyNorm, λ, the noise queries and subln."""
    write_motif_checkpoint(tmp_path / "motif", "motif-gda")
    out = convert_to_diff(tmp_path / "motif", tmp_path / "diff", progress=False)
    model = DiffForCausalLM.from_pretrained(out, dtype=torch.float32).train()
    model(IDS, labels=IDS).loss.backward()
    attention, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    noise_rows = attention.q_proj.weight.grad.view(2, 5, 16, -1)[:, -1]  # the last query of each group: noise
    for grad in (mlp.act_fn.weight.grad, mlp.act_fn.bias.grad, attention.diff_lambda.lambda_q2.grad, noise_rows):
        assert grad.abs().sum() > 0
