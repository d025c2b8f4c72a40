"""The calibrated start of a Llama -> Diff V1 conversion (conversion/calibrate.py, `--v1-init`)."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer, LlamaForCausalLM

from diff_transformer import DiffForCausalLM, cli
from diff_transformer.conversion import ConversionError, convert_llama_to_diff, convert_to_diff
from diff_transformer.conversion.calibrate import least_squares_gain, plan_calibration
from diff_transformer.conversion.layout import llama_to_v1_query_permutation
from tests.helpers import REPOSITORY
from tests.helpers.checkpoints import make_diffllama, make_llama, tree_digest


ASSETS = REPOSITORY / "src" / "diff_transformer" / "assets"
TINY_LLAMA = ASSETS / "tiny-llama"


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    """The shipped tiny Llama converted to V1 with the default (calibrated, built-in text), the calibrated start
    with λ = 0, and the paper start."""
    root = tmp_path_factory.mktemp("v1init")
    return {
        "calibrated": convert_llama_to_diff(TINY_LLAMA, root / "calibrated", diff_version=1, progress=False),
        "lambda0": convert_llama_to_diff(
            TINY_LLAMA, root / "lambda0", diff_version=1, v1_init="calibrated-lambda0", progress=False
        ),
        "paper": convert_llama_to_diff(TINY_LLAMA, root / "paper", diff_version=1, v1_init="paper", progress=False),
    }


def test_least_squares_gain_matches_a_hand_computed_example():
    normed = torch.tensor([[1.0, 2.0, 0.0], [3.0, -1.0, 0.0]])
    target = torch.tensor([[2.0, 1.0, 5.0], [4.0, 0.0, 7.0]])
    # channel 0: (1*2 + 3*4) / (1 + 9) = 1.4; channel 1: (2*1 - 1*0) / (4 + 1) = 0.4; channel 2: all zero -> 1
    assert torch.allclose(least_squares_gain(normed, target), torch.tensor([1.4, 0.4, 1.0]))
    # (1 - λ_init) = 0.5 multiplies the norm's output, so the gain doubles
    assert torch.allclose(least_squares_gain(normed, target, scale=0.5), torch.tensor([2.8, 0.8, 1.0]))


@pytest.mark.parametrize("v1_init", ["calibrated", "calibrated-lambda0"])
def test_calibrated_gains_of_layer_0_equal_least_squares_on_the_llamas_own_heads(tmp_path, v1_init):
    """Independent reference: transformers' Llama's attention maps and values of layer 0 (which sees the same
    embeddings in both models), paired as the converter pairs heads, and torch.linalg.lstsq per channel; for the
    default start, λ is the grid value whose least-squares gains leave the smallest residual."""
    src = make_llama(tmp_path / "llama", num_attention_heads=8, num_key_value_heads=4, hidden_size=64)
    out = convert_llama_to_diff(src, tmp_path / "diff", diff_version=1, v1_init=v1_init, progress=False)
    conversion = json.loads((out / "config.json").read_text())["conversion"]
    assert conversion["calibration_text"].startswith("random token ids")  # the test model has no usable tokenizer
    llama = LlamaForCausalLM.from_pretrained(src, attn_implementation="eager").eval()
    config = llama.config
    blocks = plan_calibration(src, config.vocab_size, config.max_position_embeddings).blocks
    assert list(blocks.shape) == conversion["calibration_tokens"]
    values = []
    attn = llama.model.layers[0].self_attn
    handle = attn.v_proj.register_forward_hook(lambda m, i, o: values.append(o))
    with torch.no_grad():
        maps = llama(blocks, output_attentions=True).attentions[0]  # (B, 8, L, L)
    handle.remove()
    d, B, L = 8, *blocks.shape
    v = values[0].view(B, L, 4, d).transpose(1, 2)  # (B, 4, L, d)
    perm = llama_to_v1_query_permutation(8, 4)
    kv = [j // 2 for j in range(8)]  # Llama head j reads kv head j // (8 / 4)

    def fit(lam):  # (relative residual, least-squares gains) of the V1 heads' output with this λ
        normed, target = [], []
        for h in range(4):
            a, b = perm[2 * h], perm[2 * h + 1]
            wide = torch.cat((v[:, kv[a]], v[:, kv[b]]), dim=-1)  # (B, L, 2d): [v1 | v2] of the V1 head
            y = (maps[:, a] - lam * maps[:, b]) @ wide  # (A1 − λ A2) [v1 | v2]
            t = torch.cat((maps[:, a] @ v[:, kv[a]], maps[:, b] @ v[:, kv[b]]), dim=-1)  # the Llama pair's output
            normed.append(y * torch.rsqrt(y.square().mean(-1, keepdim=True) + config.rms_norm_eps))
            target.append(t)
        normed, target = torch.cat(normed).reshape(-1, 2 * d).double(), torch.cat(target).reshape(-1, 2 * d).double()
        gain = torch.stack([torch.linalg.lstsq(normed[:, [j]], target[:, [j]]).solution[0, 0] for j in range(2 * d)])
        return float((gain * normed - target).square().sum() / target.square().sum()), gain

    grid = [round(-1 + 0.05 * i, 2) for i in range(31)] if v1_init == "calibrated" else [0.0]  # -1 .. 0.5
    residual, expected, lam = min(((*fit(lam), lam) for lam in grid), key=lambda fitted: fitted[0])
    got = load_file(out / "model.safetensors")["model.layers.0.self_attn.subln.weight"]
    assert torch.allclose(got.double(), expected, rtol=1e-4, atol=1e-6), (got, expected)
    assert not torch.allclose(got, torch.ones(2 * d))
    assert conversion["subln_relative_residual"][0] == pytest.approx(residual, abs=1e-4)
    model = DiffForCausalLM.from_pretrained(out)
    assert model.model.layers[0].self_attn.diff_lambda().item() == pytest.approx(lam, abs=1e-6)
    if v1_init == "calibrated":
        assert conversion["lambda_start"][0] == lam


@pytest.mark.parametrize("start", ["lambda0", "calibrated"])
def test_lambda_starts_where_the_conversion_says_and_moves_after_one_step(shipped, start):
    """calibrated-lambda0: λ exactly 0 (mirrored vectors); calibrated: each layer's fitted λ, set through λq2 alone."""
    config = json.loads((shipped[start] / "config.json").read_text())
    assert config["lambda_init"] == 0.0
    assert config["conversion"]["v1_init"] == {"lambda0": "calibrated-lambda0", "calibrated": "calibrated"}[start]
    starts = config["conversion"].get("lambda_start", [0.0] * config["num_hidden_layers"])
    assert start == "lambda0" or min(starts) < 0  # the fit adds the second map on the shipped Llama
    model = DiffForCausalLM.from_pretrained(shipped[start])
    for layer, expected in zip(model.model.layers, starts, strict=True):
        lam = layer.self_attn.diff_lambda
        assert torch.equal(lam.lambda_k2, lam.lambda_k1)
        assert torch.equal(lam.lambda_q2, lam.lambda_q1) == (expected == 0.0)
        assert lam.lambda_q1.abs().min() > 0 and lam.lambda_k1.abs().min() > 0  # not the gradient-free saddle
        if start == "lambda0":
            assert lam().item() == 0.0
        else:
            assert lam().item() == pytest.approx(expected, abs=1e-6)
        assert layer.self_attn.lambda_init == 0.0
    ids = torch.randint(3, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    model.train()
    model(ids, labels=ids).loss.backward()
    for layer in model.model.layers:
        assert layer.self_attn.diff_lambda.lambda_q1.grad.abs().sum() > 0
    optimizer.step()
    with torch.no_grad():
        assert all(layer.self_attn.diff_lambda().item() != s for layer, s in zip(model.model.layers, starts))


def _heldout_loss(path, blocks: int = 8) -> float:
    tokenizer = AutoTokenizer.from_pretrained(TINY_LLAMA)
    ids = tokenizer((ASSETS / "heldout.txt").read_text(encoding="utf-8")[:40000], return_tensors="pt").input_ids
    ids = ids[0, : blocks * 128].view(blocks, 128)
    model = (DiffForCausalLM if path != TINY_LLAMA else LlamaForCausalLM).from_pretrained(path).eval()
    with torch.no_grad():
        return model(ids, labels=ids).loss.item()


def test_conversion_without_calibration_data_uses_the_builtin_text_and_starts_closer(shipped):
    conversion = json.loads((shipped["calibrated"] / "config.json").read_text())["conversion"]
    assert conversion["calibration_text"].startswith("built-in") and "Persuasion" in conversion["calibration_text"]
    assert conversion["calibration_tokens"] == [16, 256]
    builtin = (ASSETS / "calibration.txt").read_text(encoding="utf-8")
    assert builtin[:2000] not in (ASSETS / "heldout.txt").read_text(encoding="utf-8")  # not the evaluation text
    card = (shipped["calibrated"] / "README.md").read_text()
    assert "calibrated" in card and "Persuasion" in card
    assert f"λ fitted on text ({', '.join(f'{v:g}' for v in conversion['lambda_start'])})" in card
    assert "λ = 0 exactly at step 0" in (shipped["lambda0"] / "README.md").read_text()
    starts = (TINY_LLAMA, shipped["calibrated"], shipped["lambda0"], shipped["paper"])
    source, calibrated, lambda0, paper = (_heldout_loss(p) for p in starts)
    # the target: held-out perplexity at step 0 within 1.6x the source's (the paper start: ~24x); fitting λ
    # starts closer than λ = 0 (measured on the held-out text: 1.25x against 1.50x)
    assert math.exp(calibrated - source) < math.exp(lambda0 - source) <= 1.6 < math.exp(paper - source)
    paper_config = json.loads((shipped["paper"] / "config.json").read_text())
    assert paper_config["lambda_init"] is None and paper_config["conversion"]["v1_init"] == "paper"


def test_calibration_data_file_is_used_and_bad_ones_are_refused(tmp_path, capsys):
    text = tmp_path / "mine.txt"
    text.write_text((ASSETS / "heldout.txt").read_text(encoding="utf-8")[:20000], encoding="utf-8")
    out = tmp_path / "diff"
    argv = ["convert", str(TINY_LLAMA), str(out), "--diff-version", "1", "--quiet", "--calibration-data", str(text)]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "V1 calibrated on --calibration-data mine.txt" in printed
    conversion = json.loads((out / "config.json").read_text())["conversion"]
    assert f"λ at step 0 fitted per layer: {conversion['lambda_start']}" in printed
    assert conversion["calibration_text"] == "--calibration-data mine.txt"  # the name, never the machine's path
    default = load_file(
        convert_llama_to_diff(TINY_LLAMA, tmp_path / "default", diff_version=1, progress=False) / "model.safetensors"
    )
    own = load_file(out / "model.safetensors")
    assert not torch.equal(
        own["model.layers.0.self_attn.subln.weight"], default["model.layers.0.self_attn.subln.weight"]
    )

    (tmp_path / "blob.txt").write_bytes(b"\x00\x01 binary" * 40)
    (tmp_path / "short.txt").write_text("Too short.", encoding="utf-8")
    (tmp_path / "latin1.txt").write_bytes("Caf\xe9 au lait.\n".encode("latin-1") * 40)
    for bad, words in (
        (tmp_path / "missing.txt", "is not a file"),
        (tmp_path / "blob.txt", "not text"),
        (tmp_path / "short.txt", "give at least 64 tokens"),
        (tmp_path / "latin1.txt", "not UTF-8"),
    ):
        target = tmp_path / "refused"
        argv = ["convert", str(TINY_LLAMA), str(target), "--diff-version", "1", "--calibration-data", str(bad)]
        assert cli.main([*argv, "--quiet"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "\n" not in err and words in err, err
        assert not target.exists()
    for argv, words in (
        (["--calibration-data", str(text)], "add --diff-version 1"),  # V2: nothing to calibrate
        (["--diff-version", "1", "--v1-init", "paper", "--calibration-data", str(text)], "not paper"),
    ):
        assert cli.main(["convert", str(TINY_LLAMA), str(tmp_path / "refused"), "--quiet", *argv]) == 2
        assert words in capsys.readouterr().err


def test_diffllama_import_has_no_v1_init_to_choose(tmp_path):
    src = make_diffllama(tmp_path / "dl")
    digest = tree_digest(src)
    with pytest.raises(ConversionError, match="imported exactly"):
        convert_to_diff(src, tmp_path / "out", calibration_data=ASSETS / "calibration.txt", progress=False)
    assert not (tmp_path / "out").exists() and tree_digest(src) == digest
