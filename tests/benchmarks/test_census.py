"""benchmarks/census.py, the per-layer census of the ops each model dispatches on a GPU's code path: no model's count
creeps above the committed benchmarks/results/census.json (counts are deterministic, not timings), Llama's equals
the count derived by hand from its code (so a change in how ops are counted is noticed), and sdpa is dispatched as
CUDA would.

When a change lowers a count, regenerate the committed figures: `python benchmarks/census.py --write` then
`python benchmarks/results_page.py`. Op counts do not depend on widths or lengths, so the tiny geometry here (head
size 64 and the GQA layout of the recorded one) checks the recorded 0.85B figures.
"""

import json

import pytest
import torch

from tests.helpers import REPOSITORY, load_script


census = load_script(REPOSITORY / "benchmarks" / "census.py")

# Llama's decoder layer, one decode or prefill step, from modeling_llama.py: 2 RMSNorms in bf16 of 8 ops each
# (cast to fp32, pow, mean, add eps, rsqrt, mul, cast back, mul weight), 7 matmuls (q, k, v, o, gate, up, down),
# RoPE on q and k (5 each: mul cos, neg and cat of rotate_half, mul sin, add), 2 cache cats (k, v), 1 attention
# call (flash), 2 residual adds, silu and the gate's mul: 16 + 7 + 10 + 2 + 1 + 2 + 2 = 40.
LLAMA_FORWARD = 40
# Training (no cache, as a training step runs): that forward without the 2 cache cats (38) and its backward as
# autograd dispatches it (71: 14 matmuls, the norms', RoPE's, silu's and the attention's backward, gradient sums).
LLAMA = {"decode": LLAMA_FORWARD, "prefill": LLAMA_FORWARD, "train": 38 + 71}


@pytest.fixture(scope="module")
def tiny():
    return census.census(census.TINY)


@pytest.fixture(scope="module")
def committed():
    return json.loads(census.RESULTS.read_text())


def test_llama_counts_are_the_ones_derived_from_its_code(tiny):
    """If this fails, the counting changed (or transformers' Llama did): check the new count by hand, update LLAMA
    and regenerate census.json."""
    assert {phase: tiny["llama/sdpa"][phase]["ops"] for phase in census.PHASES} == LLAMA
    assert tiny["llama/sdpa"]["decode"]["per_op"]["mm"] == 7
    assert tiny["llama/sdpa"]["decode"]["per_op"]["_scaled_dot_product_flash_attention"] == 1


@pytest.mark.parametrize("config", census.CONFIGS)
def test_no_count_creeps_above_the_committed_one(tiny, committed, config):
    """Per layer and phase, ops now <= the recorded ops (lower is fine; then `census.py --write` records it)."""
    recorded = committed["results"][config]
    assert "error" not in tiny[config], f"{config} is no longer countable: {tiny[config].get('error')}"
    for phase in census.PHASES:
        now, then = tiny[config][phase]["ops"], recorded[phase]["ops"]
        assert now <= then, f"{config} {phase}: {now} ops per layer, {then} recorded ({tiny[config][phase]['per_op']})"


def test_the_recorded_llama_is_the_one_counted_now(committed):
    """The committed table and this test count the same way (Llama's figures are the ratios' denominators)."""
    assert {phase: committed["results"]["llama/sdpa"][phase]["ops"] for phase in census.PHASES} == LLAMA


def test_floor_extras_are_the_least_differential_work():
    """V2: the λ projection, its sigmoid and one addcmul; V1: one fused RMSNorm, as CUDA runs `F.rms_norm` (one
    kernel forward, one backward)."""
    extra = census.floor_extra(census.TINY)
    assert extra["v2"]["decode"] == extra["v2"]["prefill"] == 3
    assert extra["v1"]["decode"] == extra["v1"]["prefill"] == 1
    assert extra["v2"]["train"] > 3 and extra["v1"]["train"] == 2  # forward and backward


def meta(*shape):
    return torch.empty(*shape, device="meta", dtype=torch.bfloat16)


def dispatched(fn) -> dict:
    counter = census.Census()
    with counter:
        fn()
    return dict(counter.ops)


def test_sdpa_is_dispatched_as_on_cuda():
    """Flash with one head size (GQA allowed), memory-efficient for a wider V without GQA, as torch's CUDA choice;
    the math decomposition where neither applies (several ops)."""
    q, k, v = meta(1, 8, 16, 64), meta(1, 2, 16, 64), meta(1, 2, 16, 64)
    flash = dispatched(lambda: census.cuda_sdpa(q, k, v, is_causal=True, enable_gqa=True))
    assert flash == {"_scaled_dot_product_flash_attention": 1}
    wide = meta(1, 8, 16, 128)
    efficient = dispatched(lambda: census.cuda_sdpa(q, meta(1, 8, 16, 64), wide, is_causal=True))
    assert efficient == {"_scaled_dot_product_efficient_attention": 1}
    math = dispatched(lambda: census.cuda_sdpa(q, k, meta(1, 2, 16, 128), is_causal=True, enable_gqa=True))
    assert sum(math.values()) > 1 and not any("scaled_dot_product" in name for name in math)


@pytest.mark.filterwarnings("ignore:Mismatch dtype")  # torch says why the composite runs
def test_rms_norm_is_dispatched_as_on_cuda():
    """`F.rms_norm` is torch's one fused kernel on CUDA (and one for its backward) where the weight has the input's
    dtype, its composite otherwise; the values are the composite's."""
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    weight = torch.rand(64, dtype=torch.bfloat16)
    with census.CudaDispatchMode():
        fused = torch.nn.functional.rms_norm(x, (64,), weight, 1e-6)
    assert torch.equal(fused, torch.nn.functional.rms_norm(x, (64,), weight, 1e-6))
    x, weight = meta(2, 3, 64).requires_grad_(), meta(64).requires_grad_()

    def step():
        with census.CudaDispatchMode():
            torch.nn.functional.rms_norm(x, (64,), weight, 1e-6).backward(meta(2, 3, 64))

    assert dispatched(step) == {"_fused_rms_norm": 1, "_fused_rms_norm_backward": 1}
    assert x.grad.shape == x.shape and weight.grad.shape == weight.shape
    mixed = dispatched(lambda: census.cuda_rms_norm(meta(2, 3, 64), (64,), torch.empty(64, device="meta"), 1e-6))
    assert sum(mixed.values()) > 1 and "_fused_rms_norm" not in mixed
