"""The constrained o_proj fits that step0.py measured against the converter's plain one (docs/converting.md, "Step 0
on other domains"; issue 47), kept here because the converter does not use them: a ridge chosen per layer on
held-out calibration blocks (it shrinks o_proj towards 0: worse on every domain), and a ridge towards the source's
o_proj with one least-squares gain per head (`scaled_source_projection`; at its limit, the gains alone: worse still).

`constrained_fits(ridges, heldout, towards_source)` runs the converter with them: inside it, each layer's fit
(`diff_transformer.conversion.fit.LayerFit`) is `ConstrainedFit`, which takes the converter's λ candidates, features
and target and only changes how o_proj is solved and chosen. With one ridge (the converter's `RIDGE`), no held-out
blocks and no prior it computes what the converter computes, bit for bit (tests/experiments/test_v1_calibration.py).
"""

from __future__ import annotations

import contextlib

import torch

from diff_transformer.conversion import calibrate, fit
from diff_transformer.conversion.fit import RIDGE, least_squares_projection


def least_squares_towards(
    features: torch.Tensor, target: torch.Tensor, ridge: float, prior: torch.Tensor | None
) -> torch.Tensor:
    """argmin_W ‖features Wᵀ − target‖² + ρ‖W − prior‖², ρ = RIDGE × the mean squared feature, in float64 (the
    converter's `least_squares_projection` where PRIOR is None): a larger ridge keeps W near PRIOR where the
    calibration tokens cannot tell."""
    if prior is None:
        return least_squares_projection(features, target, ridge)
    features, target = features.double(), target.double()
    gram = features.T @ features
    rho = ridge * float(gram.diagonal().mean()) + 1e-12
    identity = torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device)
    right = features.T @ target + rho * prior.double().T
    return torch.linalg.solve(gram + rho * identity, right).T


def scaled_source_projection(
    features: torch.Tensor, target: torch.Tensor, source_o_proj: torch.Tensor, heads: int
) -> torch.Tensor:
    """The source's o_proj (D, H·w) with one least-squares gain per head: the projection with H free parameters
    that best maps the normalised heads onto TARGET (the normalisation divides each head by its size, which one gain
    per head undoes on average). Solved from the same Gram matrices as the full fit."""
    features, target, weight = features.double(), target.double(), source_o_proj.double()
    width = features.shape[1] // heads
    gram, cross = features.T @ features, features.T @ target  # (n, n), (n, D)
    # ⟨F_h W_hᵀ, F_g W_gᵀ⟩ = Σ (F_hᵀF_g ∘ W_hᵀW_g) and ⟨F_h W_hᵀ, T⟩ = Σ (F_hᵀT ∘ W_hᵀ), per pair of heads
    pairs = (gram * (weight.T @ weight)).reshape(heads, width, heads, width).sum(dim=(1, 3))  # (H, H)
    right = (cross * weight.T).reshape(heads, -1).sum(dim=1)  # (H,)
    scale = 1e-12 * float(pairs.diagonal().mean()) + 1e-30
    gains = torch.linalg.solve(pairs + scale * torch.eye(heads, dtype=pairs.dtype, device=pairs.device), right)
    return weight * gains.repeat_interleave(width)[None]


class ConstrainedFit(fit.LayerFit):
    """The converter's layer fit with the experiment's options, set on the class by `constrained_fits`: RIDGES tried
    per layer; the last SPLIT rows onwards (the held-out blocks) used to choose λ and the ridge when SPLIT is set,
    the rest fitted (then, with REFIT, the choice fitted again on every row); TOWARDS_SOURCE: the ridge shrinks
    o_proj towards `scaled_source_projection` instead of 0. CHOSEN_RIDGES collects each layer's ridge."""

    ridges = (RIDGE,)
    split = None
    refit = True
    towards_source = False
    chosen_ridges = []

    def best(self, candidates) -> tuple[float, float, torch.Tensor]:
        source_output, source_o_proj, heads, split = self.source_output, self.source_o_proj, self.heads, self.split
        fit_rows = slice(0, split) if split is not None else slice(None)
        check_rows = slice(split, None) if split is not None else slice(None)
        best = None
        for lam in candidates:
            features = self.features(lam)
            prior = None
            if self.towards_source:
                prior = scaled_source_projection(features[fit_rows], source_output[fit_rows], source_o_proj, heads)
            for rho in self.ridges:
                o_proj = least_squares_towards(features[fit_rows], source_output[fit_rows], rho, prior)
                error = features[check_rows].double() @ o_proj.T - source_output[check_rows]
                residual = float(error.square().sum() / source_output[check_rows].square().sum())
                if best is None or residual < best[0]:
                    best = (residual, lam, o_proj, rho, features)
        if split is not None and self.refit:  # the chosen λ and ridge, fitted again on every block
            prior = None
            if self.towards_source:
                prior = scaled_source_projection(best[4], source_output, source_o_proj, heads)
            best = (best[0], best[1], least_squares_towards(best[4], source_output, best[3], prior), best[3])
        type(self).chosen_ridges.append(best[3])
        return best[:3]


@contextlib.contextmanager
def constrained_fits(ridges=(RIDGE,), heldout: int = 0, towards_source: bool = False, refit: bool = True):
    """Conversions inside this block fit every layer with `ConstrainedFit`: RIDGES tried per layer, chosen on the
    last HELDOUT calibration blocks when HELDOUT > 0 (then, with REFIT, fitted again on all of them), shrinking
    towards the source's o_proj with per-head gains when TOWARDS_SOURCE. Yields the list of chosen ridges (one per
    layer, in order)."""
    chosen: list[float] = []
    options = dict(ridges=tuple(ridges), refit=refit, towards_source=towards_source, chosen_ridges=chosen)
    Fit = type("ConfiguredFit", (ConstrainedFit,), options)
    start = calibrate.calibrate_v1_start

    def with_split(source, config, geometry, tensor_map, plan, *args, **kwargs):
        # rows of the fit are (block, position) tokens in order: the last HELDOUT blocks are held out
        Fit.split = (plan.blocks.shape[0] - heldout) * plan.blocks.shape[1] if heldout else None
        return start(source, config, geometry, tensor_map, plan, *args, **kwargs)

    with _patched(fit, "LayerFit", Fit), _patched(calibrate, "calibrate_v1_start", with_split):
        yield chosen


@contextlib.contextmanager
def _patched(module, name: str, value):
    original = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, original)
