"""experiments/v1_calibration: the constrained fits that step0.py measured (fits.py, moved out of the converter) solve
what they claim, leave the converter's own fit untouched when set to its values, and still run the converter; step0.py
runs end to end."""

import importlib.util
import json
import sys

import pytest
import torch

from diff_transformer.conversion import calibrate, convert_llama_to_diff, fit
from diff_transformer.conversion.fit import RIDGE
from tests.helpers import REPOSITORY
from tests.helpers.checkpoints import tree_digest


EXPERIMENT = REPOSITORY / "experiments" / "v1_calibration"
TINY_LLAMA = REPOSITORY / "src" / "diff_transformer" / "assets" / "tiny-llama"
LAYER_FIT = fit.LayerFit
SMALL = dict(diff_version=1, calibration_blocks=4, calibration_block_size=32, progress=False)


@pytest.fixture(scope="module")
def step0():
    spec = importlib.util.spec_from_file_location("v1_calibration_step0", EXPERIMENT / "step0.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # puts the experiment's folder on sys.path, as running it does
    return module


@pytest.fixture(scope="module")
def fits(step0):
    return sys.modules["fits"]


def test_ridge_towards_a_prior_and_one_gain_per_head_match_lstsq(fits):
    """The two constrained fits (issue 47): ridge towards a prior W0 is least squares on the system augmented with
    √ρ(W − W0) = 0; one gain per head is least squares over the H per-head outputs F_h W_hᵀ."""
    generator = torch.Generator().manual_seed(0)
    features, prior = (
        torch.randn(300, 6, generator=generator).double(),
        torch.randn(4, 6, generator=generator).double(),
    )
    target = features @ torch.randn(4, 6, generator=generator).double().T
    rho = 0.5 * float(features.square().sum(0).mean())  # ridge 0.5 × the mean squared feature
    augmented = torch.cat((features, rho**0.5 * torch.eye(6, dtype=features.dtype)))
    padded = torch.cat((target, rho**0.5 * prior.T))
    expected = torch.linalg.lstsq(augmented, padded).solution.T
    assert torch.allclose(fits.least_squares_towards(features, target, 0.5, prior), expected, atol=1e-9)
    assert torch.allclose(fits.least_squares_towards(features, target, 1e12, prior), prior, atol=1e-9)
    heads, source = 3, torch.randn(4, 6, generator=generator).double()  # 3 heads of width 2
    target = sum(g * features[:, 2 * h : 2 * h + 2] @ source[:, 2 * h : 2 * h + 2].T for h, g in enumerate((2, -1, 3)))
    target = target + 0.1 * torch.randn(300, 4, generator=generator).double()
    per_head = torch.stack(
        [(features[:, 2 * h : 2 * h + 2] @ source[:, 2 * h : 2 * h + 2].T).reshape(-1) for h in range(3)], 1
    )
    gains = torch.linalg.lstsq(per_head, target.reshape(-1, 1)).solution[:, 0]  # (3,)
    assert torch.allclose(
        fits.scaled_source_projection(features, target, source, heads), source * gains.repeat_interleave(2), atol=1e-9
    )


def test_constrained_fits_at_the_converters_values_are_the_converter_and_others_change_the_start(
    fits, tmp_path, one_torch_thread
):
    """One ridge (RIDGE), no held-out blocks, no prior: the same bytes as the converter's own fit (the experiment's
    baseline rows are the converter's start). Two ridges chosen on a held-out block: one chosen per layer, from the
    two. Shrinking towards the source's o_proj: another start. Outside the block the converter's own fit is back."""
    plain = convert_llama_to_diff(TINY_LLAMA, tmp_path / "plain" / "out", **SMALL)
    with fits.constrained_fits() as chosen:
        same = convert_llama_to_diff(TINY_LLAMA, tmp_path / "same" / "out", **SMALL)
    assert tree_digest(same) == tree_digest(plain)
    layers = json.loads((plain / "config.json").read_text())["num_hidden_layers"]
    assert chosen == [RIDGE] * layers
    with fits.constrained_fits(ridges=(RIDGE, 0.1), heldout=1) as chosen:
        convert_llama_to_diff(TINY_LLAMA, tmp_path / "held" / "out", **SMALL)
    assert len(chosen) == layers and set(chosen) <= {RIDGE, 0.1}
    with fits.constrained_fits(heldout=1, towards_source=True):
        shrunk = convert_llama_to_diff(TINY_LLAMA, tmp_path / "shrunk" / "out", **SMALL)
    assert tree_digest(shrunk)["model.safetensors"] != tree_digest(plain)["model.safetensors"]
    assert fit.LayerFit is LAYER_FIT and calibrate.calibrate_v1_start is fit.calibrate_v1_start


@pytest.mark.slow  # end to end (a conversion, three domains scored): 13 s, in the whole suite, not the quick loop
def test_step0_records_a_constrained_configuration(step0, tmp_path, monkeypatch, one_torch_thread):
    """step0.py on the tiny Llama: the source's scores once, then one row per configuration with its chosen ridges
    and a ratio per domain; a configuration already recorded is skipped."""
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))  # the sampled-block cache and the scratch conversion
    results = tmp_path / "step0.jsonl"
    argv = ["--source", str(TINY_LLAMA), "--blocks", "2", "--heldout", "1", "--ridges", "1e-4,0.1"]
    step0.main([*argv, "--results", str(results)])
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    assert [row["config"].get("source_scores") for row in rows] == [True, None]
    row = rows[1]
    assert row["config"]["ridges"] == [1e-4, 0.1] and row["config"]["heldout"] == 1
    assert len(row["chosen_ridges"]) == 4 and set(row["chosen_ridges"]) <= {1e-4, 0.1}
    assert set(row["ratio"]) == {"austen", "pydoc", "code"} and all(r > 0 for r in row["ratio"].values())
    step0.main([*argv, "--results", str(results)])
    assert len(results.read_text().splitlines()) == 2
