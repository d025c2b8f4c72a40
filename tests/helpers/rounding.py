"""How far fp32 rounding may move a result, derived from the computation instead of tuned on one machine's kernels.

A test that checks an fp32 result against formulas computes the formulas in float64 (exact to ~1e-16 here) and bounds
the fp32 error from the arithmetic: the magnitudes of the sums involved (a logit summing large terms of both signs
rounds further than its own size says) and how the network amplifies an early error (softmax over large scores, a norm
of a small vector). Both are read off the computation by Monte Carlo arithmetic (Parker 1997; Verificarlo): the float64
reference runs again a few times with every rounding that fp32 makes replaced by a random error of the same size, and
the spread of those runs is the scale of the fp32 error at every output. Which order a kernel sums in (AVX2, AVX-512,
blocked, sharded over ranks) changes the error's sign pattern, not this scale.

The rounding model (Higham, "Accuracy and Stability of Numerical Algorithms", 2.2 and 3.1), with unit roundoff u:
* an elementwise result y is y (1 + δ), |δ| ≤ u, or ≤ 2u for exp, sigmoid, rsqrt, cos and sin (vectorised libm:
  within one ulp);
* a sum or dot product of k terms t_j, accumulated left to right, is off by Σ_j t_j δ_j + Σ_i s_i δ'_i, s_i the
  partial sums: a random error of variance u²/3 (Σ t_j² + Σ s_i²), drawn as a Gaussian of that variance (tree and
  vectorised orders have smaller partial sums, so this is the conservative order).
Formulas call `fl(y)`, `fl_dot(a, b)` and `fl_sum(x, dim)` where fp32 would round; they are exact float64 outside
`rounding_scale`.

`rounding_scale(f)` returns f() and σ, the RMS over SAMPLES perturbed runs of their distance from f(), per element.
`assert_within_rounding` accepts |actual - f()| ≤ FACTOR σ_row, σ_row the RMS of σ over a row (one position's logits):
pooled over the row, 4 samples give a steady scale, where one element's σ from 4 samples may be near 0 by chance.
FACTOR = 16: the largest of ~2·10^4 Gaussian errors is ~4.5 of its own σ, and one element's σ reaches ~3 σ_row
(measured: 2.8 to 4.1 σ_row); 4.5 × 3 ≈ 13.5. The model's RMS error is 0.4 to 0.9 of σ on every matrix cell (the
rounding model sums left to right, the kernels mostly in blocks), its largest 0.13 to 0.52 of the bound under AVX-512,
AVX2 and plain kernels, MKL's too (docs/development.md, "Numeric tolerances").
"""

import contextlib

import torch


U32 = 2.0**-24  # fp32 unit roundoff: half the spacing of floats at 1
SAMPLES = 4
FACTOR = 16.0
_simulation = None  # (generator, unit roundoff) while rounding_scale perturbs


def fl(y, ulps=1):
    """y as fp32 arithmetic would leave it: y (1 + δ), |δ| ≤ ulps · u (exact outside `rounding_scale`)."""
    if _simulation is None:
        return y
    generator, unit = _simulation
    delta = torch.rand(y.shape, generator=generator, dtype=y.dtype) * 2 - 1
    return y * (1 + ulps * unit * delta)


def _accumulated(exact, terms, dim):
    """exact (the sum of `terms` over `dim`) plus the error of adding them left to right, products rounded first."""
    if _simulation is None:
        return exact
    generator, unit = _simulation
    variance = (terms.pow(2).sum(dim) + terms.cumsum(dim).pow(2).sum(dim)).to(exact.dtype) * unit**2 / 3
    return exact + variance.sqrt() * torch.randn(exact.shape, generator=generator, dtype=exact.dtype)


def fl_dot(a, b):
    """a @ b (a (..., n, k), b (k, m) or (..., k, m); or two vectors) with the rounding of k-term dot products."""
    exact = a @ b
    if _simulation is None:
        return exact
    if a.dim() == b.dim() == 1:  # two vectors
        return _accumulated(exact, a * b, dim=-1)
    # terms (..., n, k, m); a variance needs two digits, so they are formed in fp32, at half the cost
    return _accumulated(exact, a.float().unsqueeze(-1) * b.float().unsqueeze(-3), dim=-2)


def fl_sum(x, dim):
    """x summed over `dim` (kept) with the rounding of the accumulation."""
    return _accumulated(x.sum(dim), x, dim).unsqueeze(dim)


@contextlib.contextmanager
def _simulating(seed, unit):
    global _simulation
    _simulation = (torch.Generator().manual_seed(seed), unit)
    try:
        yield
    finally:
        _simulation = None


def rounding_scale(f, samples=SAMPLES, unit=U32):
    """(f(), σ): f's float64 value and the RMS, per element, of the error that rounding at `unit` puts on it.

    f returns a float64 tensor, computed with fl / fl_dot / fl_sum wherever the arithmetic under test rounds."""
    exact = f()
    runs = []
    for seed in range(samples):
        with _simulating(seed, unit):
            runs.append(f() - exact)
    return exact, torch.stack(runs).pow(2).mean(0).sqrt()


def bound(sigma, factor=FACTOR):
    """The tolerance per element: factor × the RMS of σ over the last dimension (a row of logits, of a map)."""
    return factor * sigma.pow(2).mean(-1, keepdim=True).sqrt().expand_as(sigma)


def error_ratio(actual, exact, sigma, factor=FACTOR):
    """max |actual - exact| / bound: at most 1 to pass (what tests report, and the measured figures quote)."""
    return ((actual.double() - exact).abs() / bound(sigma, factor)).max().item()


def assert_within_rounding(actual, exact, sigma, factor=FACTOR, runs=1, msg=""):
    """|actual - exact| ≤ runs × bound(σ): `actual` is fp32 arithmetic's value of the float64 `exact` (runs = 2 for the
    difference of two fp32 computations of it, each within one bound)."""
    ratio = error_ratio(actual, exact, sigma, factor * runs)
    worst = (actual.double() - exact).abs().max().item()
    assert ratio <= 1, (
        f"{msg} max |Δ| = {worst:.3g} is {ratio:.3g} × the fp32 rounding bound "
        f"({factor * runs:g} σ, σ up to {sigma.max().item():.3g})"
    )
