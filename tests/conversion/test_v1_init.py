"""The calibrated start of a Llama -> Diff V1 conversion (conversion/calibrate.py and fit.py, `--v1-init`)."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer, LlamaForCausalLM

from diff_transformer import DiffForCausalLM, cli
from diff_transformer.conversion import ConversionError, convert_llama_to_diff, convert_to_diff
from diff_transformer.conversion.calibrate import plan_calibration
from diff_transformer.conversion.fit import least_squares_projection
from diff_transformer.conversion.layout import llama_to_v1_query_permutation
from diff_transformer.evaluation import heldout_perplexity
from tests.helpers import REPOSITORY
from tests.helpers.checkpoints import make_diffllama, make_llama, tree_digest


ASSETS = REPOSITORY / "src" / "diff_transformer" / "assets"
TINY_LLAMA = ASSETS / "tiny-llama"


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    """The shipped tiny Llama converted to V1 with the default (calibrated, differential, built-in text), the
    additive calibrated start, the calibrated start with λ = 0, the paper start and the expanded layout."""
    root = tmp_path_factory.mktemp("v1init")

    def convert(name, **options):
        return convert_llama_to_diff(TINY_LLAMA, root / name, diff_version=1, progress=False, **options)

    return {
        "calibrated": convert("calibrated"),
        "additive": convert("additive", v1_init="calibrated-additive"),
        "lambda0": convert("lambda0", v1_init="calibrated-lambda0"),
        "paper": convert("paper", v1_init="paper"),
        "expanded": convert("expanded", v1_layout="expanded"),
    }


def test_least_squares_projection_matches_a_hand_computed_example_and_lstsq():
    # one feature, one output: w = Σ x t / (Σ x² + ρ), ρ = 1e-4 · mean Σ x² = 1e-4 · 10
    features, target = torch.tensor([[1.0], [3.0]]), torch.tensor([[2.0], [4.0]])
    assert least_squares_projection(features, target).item() == pytest.approx(14 / (10 + 1e-3), rel=1e-12)
    generator = torch.Generator().manual_seed(0)
    features, weight = torch.randn(200, 6, generator=generator), torch.randn(3, 6, generator=generator)
    target = features @ weight.T + 0.01 * torch.randn(200, 3, generator=generator)
    expected = torch.linalg.lstsq(features.double(), target.double()).solution.T
    assert torch.allclose(least_squares_projection(features, target, ridge=0.0), expected, atol=1e-9)


GRIDS = {
    "calibrated": [round(0.1 + 0.05 * i, 2) for i in range(9)],  # differential: 0.1 .. 0.5
    "calibrated-additive": [round(-1 + 0.05 * i, 2) for i in range(31)],  # -1 .. 0.5
    "calibrated-lambda0": [0.0],
}


@pytest.mark.parametrize("v1_init", list(GRIDS))
def test_calibrated_o_proj_of_layer_0_is_least_squares_on_the_llamas_own_heads(tmp_path, v1_init):
    """Independent reference: transformers' Llama's attention maps and values of layer 0 (which sees the same
    embeddings in both models), paired as the converter pairs heads, normalised as V1's sub-layer norm does, and
    the ridge least-squares projection onto the Llama's own attention output solved with torch.linalg.lstsq on the
    augmented system; λ is the grid value whose fit leaves the smallest residual."""
    src = make_llama(tmp_path / "llama", num_attention_heads=8, num_key_value_heads=4, hidden_size=64)
    out = convert_llama_to_diff(src, tmp_path / "diff", diff_version=1, v1_init=v1_init, progress=False)
    conversion = json.loads((out / "config.json").read_text())["conversion"]
    assert conversion["calibration_text"].startswith("text sampled from SRC itself")  # the default: no text needed
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
    heads = [maps[:, j] @ v[:, kv[j]] for j in range(8)]  # (B, L, d): each Llama head's output
    llama_output = (torch.cat(heads, dim=-1) @ attn.o_proj.weight.T).reshape(-1, 64).double()  # (tokens, D)

    def fit(lam):  # (relative residual, o_proj) of V1's normalised heads with this λ
        features = []
        for h in range(4):
            a, b = perm[2 * h], perm[2 * h + 1]
            wide = torch.cat((v[:, kv[a]], v[:, kv[b]]), dim=-1)  # (B, L, 2d): [v1 | v2] of the V1 head
            y = (maps[:, a] - lam * maps[:, b]) @ wide  # (A1 − λ A2) [v1 | v2]
            features.append(y * torch.rsqrt(y.square().mean(-1, keepdim=True) + config.rms_norm_eps))
        x = torch.cat(features, dim=-1).reshape(-1, 4 * 2 * d).double()  # λ_init = 0: no output factor
        rho = 1e-4 * float(x.square().sum(0).mean())
        augmented = torch.cat((x, rho**0.5 * torch.eye(x.shape[1], dtype=x.dtype)))
        padded = torch.cat((llama_output, torch.zeros(x.shape[1], 64, dtype=x.dtype)))
        weight = torch.linalg.lstsq(augmented, padded).solution.T  # (D, 4·2d)
        return float((x @ weight.T - llama_output).square().sum() / llama_output.square().sum()), weight

    residual, expected, lam = min(((*fit(lam), lam) for lam in GRIDS[v1_init]), key=lambda fitted: fitted[0])
    weights = load_file(out / "model.safetensors")
    assert torch.allclose(weights["model.layers.0.self_attn.o_proj.weight"].double(), expected, atol=1e-4)
    assert torch.equal(weights["model.layers.0.self_attn.subln.weight"], torch.ones(2 * d))
    assert conversion["subln_relative_residual"][0] == pytest.approx(residual, abs=1e-4)
    model = DiffForCausalLM.from_pretrained(out)
    assert model.model.layers[0].self_attn.diff_lambda().item() == pytest.approx(lam, abs=1e-6)
    if v1_init != "calibrated-lambda0":
        assert conversion["lambda_start"][0] == lam


@pytest.mark.parametrize("start", ["lambda0", "calibrated", "additive"])
def test_lambda_starts_where_the_conversion_says_and_moves_after_one_step(shipped, start):
    """calibrated-lambda0: λ exactly 0 (mirrored vectors); calibrated: each layer's fitted λ > 0, set through λq2
    alone, above the floor; calibrated-additive: the fit adds the second map on the shipped Llama (λ < 0)."""
    config = json.loads((shipped[start] / "config.json").read_text())
    assert config["lambda_init"] == 0.0
    v1_init = {"lambda0": "calibrated-lambda0", "calibrated": "calibrated", "additive": "calibrated-additive"}[start]
    assert config["conversion"]["v1_init"] == v1_init and config["conversion"]["v1_layout"] == "paired"
    assert config["lambda_floor"] == (0.05 if start == "calibrated" else None)
    starts = config["conversion"].get("lambda_start", [0.0] * config["num_hidden_layers"])
    if start == "calibrated":
        assert min(starts) >= 0.1
    if start == "additive":
        assert max(starts) < 0
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


def test_the_default_stays_differential_when_training_pushes_lambda_down(shipped):
    """The floor (lambda_floor 0.05) holds whatever the gradient asks: descending on +λ for many steps drives the
    paper's λ far below 0, the layer's λ stays above 0.05 (and an unfloored copy does go negative)."""
    model = DiffForCausalLM.from_pretrained(shipped["calibrated"])
    unfloored = DiffForCausalLM.from_pretrained(shipped["calibrated"], lambda_floor=None)
    for candidate in (model, unfloored):
        lambdas = [layer.self_attn.diff_lambda for layer in candidate.model.layers]
        optimizer = torch.optim.SGD([p for m in lambdas for p in m.parameters()], lr=0.5)
        for _ in range(50):
            optimizer.zero_grad()
            sum(m() for m in lambdas).backward()
            optimizer.step()
    with torch.no_grad():
        assert all(0.05 < layer.self_attn.diff_lambda().item() < 0.06 for layer in model.model.layers)
        assert all(layer.self_attn.diff_lambda().item() < 0 for layer in unfloored.model.layers)


def _heldout_loss(path, blocks: int = 8) -> float:
    tokenizer = AutoTokenizer.from_pretrained(TINY_LLAMA)
    ids = tokenizer((ASSETS / "heldout.txt").read_text(encoding="utf-8")[:40000], return_tensors="pt").input_ids
    ids = ids[0, : blocks * 128].view(blocks, 128)
    model = (DiffForCausalLM if path != TINY_LLAMA else LlamaForCausalLM).from_pretrained(path).eval()
    with torch.no_grad():
        return model(ids, labels=ids).loss.item()


def test_conversion_without_calibration_data_samples_the_source_and_starts_closer(shipped):
    conversion = json.loads((shipped["calibrated"] / "config.json").read_text())["conversion"]
    assert conversion["calibration_text"] == "text sampled from SRC itself (temperature 1, from the bos token), seed 0"
    assert conversion["calibration_tokens"] == [16, 256]
    card = (shipped["calibrated"] / "README.md").read_text()
    assert "calibrated" in card and "sampled from SRC itself" in card and "differential" in card
    step0 = conversion["step0_heldout"]
    assert f"({step0['ratio']:.2f}×)" in card
    assert f"fitted on text in [0.1, 0.5] ({', '.join(f'{v:g}' for v in conversion['lambda_start'])})" in card
    assert "λ < 0 ADDS the second attention map" in (shipped["additive"] / "README.md").read_text()
    assert "λ = 0 exactly at step 0" in (shipped["lambda0"] / "README.md").read_text()
    starts = (TINY_LLAMA, *(shipped[name] for name in ("calibrated", "additive", "lambda0", "paper", "expanded")))
    source, calibrated, additive, lambda0, paper, expanded = (_heldout_loss(p) for p in starts)
    ratio = dict(
        zip(
            ("calibrated", "additive", "lambda0", "paper", "expanded"),
            (math.exp(x - source) for x in (calibrated, additive, lambda0, paper, expanded)),
            strict=True,
        )
    )
    # the targets: the differential default within 1.5x the source's held-out perplexity at step 0
    # (measured: 1.34x paired, 1.10x expanded; the additive start 1.10x, λ = 0 1.39x, the paper start ~30x)
    assert ratio["additive"] < ratio["calibrated"] <= 1.5 < ratio["paper"], ratio
    assert ratio["expanded"] <= 1.2, ratio
    paper_config = json.loads((shipped["paper"] / "config.json").read_text())
    assert paper_config["lambda_init"] is None and paper_config["conversion"]["v1_init"] == "paper"


@pytest.mark.parametrize("name", ["calibrated", "expanded"])
def test_recorded_step0_perplexity_is_what_the_two_models_compute_on_the_heldout_blocks(shipped, name):
    """Independent reference: transformers' Llama (the source) and the converted checkpoint, loaded whole, scored on
    the held-out sampled blocks, which are reproducible from the seed and were not among the fitted ones."""
    conversion = json.loads((shipped[name] / "config.json").read_text())["conversion"]
    config = json.loads((TINY_LLAMA / "config.json").read_text())
    plan = plan_calibration(TINY_LLAMA, config["vocab_size"], config["max_position_embeddings"])
    again = plan_calibration(TINY_LLAMA, config["vocab_size"], config["max_position_embeddings"])
    other = plan_calibration(TINY_LLAMA, config["vocab_size"], config["max_position_embeddings"], seed=1)
    assert torch.equal(plan.blocks, again.blocks) and not torch.equal(plan.blocks, other.blocks)  # seeded
    assert plan.heldout_blocks.shape == (4, 256)
    assert not any(torch.equal(row, fitted) for row in plan.heldout_blocks for fitted in plan.blocks)
    with torch.no_grad():
        source = LlamaForCausalLM.from_pretrained(TINY_LLAMA).eval()(plan.heldout_blocks, labels=plan.heldout_blocks)
        converted = DiffForCausalLM.from_pretrained(shipped[name]).eval()(
            plan.heldout_blocks, labels=plan.heldout_blocks
        )
    step0 = conversion["step0_heldout"]
    assert step0["tokens"] == 4 * 255
    # fp32 losses of ~4.3 summed over 1,020 tokens in another order: ~1e-6 relative; the record rounds to 4 decimals
    assert step0["source_perplexity"] == pytest.approx(math.exp(source.loss.item()), rel=1e-4)
    assert step0["converted_perplexity"] == pytest.approx(math.exp(converted.loss.item()), rel=1e-4)
    assert step0["ratio"] == pytest.approx(math.exp(converted.loss.item() - source.loss.item()), rel=1e-4)


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
    assert "o_proj refitted per layer by least squares (sub-layer norm weight kept at 1)" in printed
    step0 = conversion["step0_heldout"]  # the text's last fifth, never fitted on; printed without --verify
    held = f"{step0['tokens']:,} held-out tokens ({step0['blocks']} blocks × {step0['block_tokens']})"
    assert f"({step0['ratio']:.2f}x) on {held} of the calibration text (--calibration-data mine.txt)" in printed
    assert conversion["calibration_text"] == "--calibration-data mine.txt"  # the name, never the machine's path
    default = load_file(
        convert_llama_to_diff(TINY_LLAMA, tmp_path / "default", diff_version=1, progress=False) / "model.safetensors"
    )
    own = load_file(out / "model.safetensors")
    assert not torch.equal(
        own["model.layers.0.self_attn.o_proj.weight"], default["model.layers.0.self_attn.o_proj.weight"]
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


@pytest.mark.slow
def test_smollm2_converts_to_a_differential_v1_close_to_its_source(tmp_path, capsys):
    """The real checkpoint (SmolLM2-135M-Instruct: 9 heads over 3, which cannot pair): `convert --diff-version 1`
    picks the expanded layout and says so in one line; every layer starts with λ > 0 (the paper's λ_init) above the
    floor. Step-0 perplexity against the source's on two domains, the default start being fitted on text sampled
    from the source (issue 47): held-out Austen within 1.6x (measured 1.47-1.56x over seeds 0-2; 1.37x when the
    start was fitted on Austen itself) and the Python Language Reference within 2.1x (1.84-1.99x; 2.54x when fitted
    on Austen, so the old default fails here). The issue's aim, 1.5x on every domain, is not met yet."""
    from tests.helpers.smollm2 import smollm2

    source = smollm2()
    out = tmp_path / "smollm2-v1"
    assert cli.main(["convert", str(source), str(out), "--diff-version", "1", "--quiet"]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("V1 layout:")]
    assert len(notes) == 1 and "expanded" in notes[0] and "cannot be paired" in notes[0]
    config = json.loads((out / "config.json").read_text())
    assert config["conversion"]["v1_layout"] == "expanded" and config["lambda_floor"] == 0.05
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (9, 3, 64)
    model = DiffForCausalLM.from_pretrained(out).eval()
    lambdas = [layer.self_attn.diff_lambda().item() for layer in model.model.layers]
    assert lambdas == pytest.approx([0.8 - 0.6 * math.exp(-0.3 * i) for i in range(30)], abs=1e-6)
    from pydoc_data.topics import topics

    tokenizer = AutoTokenizer.from_pretrained(source)
    texts = {
        "austen": ((ASSETS / "heldout.txt").read_text(encoding="utf-8"), 1.6),
        "python reference": ("\n\n".join(topics[name] for name in sorted(topics)), 2.1),
    }
    # scored as the demo and --verify score it
    converted = {name: heldout_perplexity(model, tokenizer, t, max_tokens=2040) for name, (t, _) in texts.items()}
    del model
    llama = LlamaForCausalLM.from_pretrained(source).eval()
    for name, (text, bound) in texts.items():
        original = heldout_perplexity(llama, tokenizer, text, max_tokens=2040)
        assert converted[name] / original <= bound, (name, converted[name], original)


def _conversion(path) -> dict:
    return json.loads((path / "config.json").read_text())["conversion"]


def _subln_divisor_spread(path) -> float:
    """Mean over layers and heads of the coefficient of variation, over held-out tokens, of subln's divisor rms(y)
    (y: a head's 2d-wide pre-norm output)."""
    model = DiffForCausalLM.from_pretrained(path).eval()
    spreads = []

    def record(module, args):
        rms = args[0].float().pow(2).mean(-1).sqrt()  # (B, N, H)
        spreads.append((rms.std(dim=(0, 1)) / rms.mean(dim=(0, 1))).mean().item())

    for layer in model.model.layers:
        layer.self_attn.subln.register_forward_pre_hook(record)
    tokenizer = AutoTokenizer.from_pretrained(TINY_LLAMA)
    ids = tokenizer((ASSETS / "heldout.txt").read_text(encoding="utf-8")[:20000], return_tensors="pt").input_ids
    with torch.no_grad():
        model(ids[:, :512])
    return sum(spreads) / len(spreads)


def test_expanded_start_reads_a_steady_second_value_half(shipped, tmp_path, monkeypatch):
    """The calibrated expanded start: channel 0 of each value group's second half reads the layer input along one
    direction at STEADY_VALUE times the first half's norm (the other channels stay small noise), so subln's divisor
    barely varies from token to token on text no fit saw, where the same conversion without it (steady_value 0)
    divides each token by its own head norm."""
    from diff_transformer.conversion import calibrate

    expanded = shipped["expanded"]
    conversion = json.loads((expanded / "config.json").read_text())["conversion"]
    assert "steadiest direction, 10x the first half's norm" in conversion["subln"]
    assert conversion["steady_value"] == 10 and "steady_value" not in _conversion(shipped["calibrated"])  # paired
    source, converted = load_file(TINY_LLAMA / "model.safetensors"), load_file(expanded / "model.safetensors")
    config = json.loads((expanded / "config.json").read_text())
    groups, d, hidden = config["num_key_value_heads"], config["head_dim"], config["hidden_size"]
    for layer in range(config["num_hidden_layers"]):
        v = converted[f"model.layers.{layer}.self_attn.v_proj.weight"].view(groups, 2, d, hidden)
        llama_v = source[f"model.layers.{layer}.self_attn.v_proj.weight"].view(groups, d, hidden)
        assert torch.equal(v[:, 0], llama_v)  # the first half is the source's value head
        steady, noise = v[:, 1, 0], v[:, 1, 1:]
        directions = steady / steady.norm(dim=-1, keepdim=True)
        torch.testing.assert_close(directions, directions[:1].expand_as(directions))  # one direction per layer
        assert steady.norm(dim=-1).min() > 10 * noise.norm(dim=-1).max()
    monkeypatch.setattr(calibrate, "STEADY_VALUE", 0.0)
    plain = convert_llama_to_diff(TINY_LLAMA, tmp_path / "plain", diff_version=1, v1_layout="expanded", progress=False)
    steady_spread, plain_spread = _subln_divisor_spread(expanded), _subln_divisor_spread(plain)
    assert steady_spread < 0.25 * plain_spread, (steady_spread, plain_spread)
