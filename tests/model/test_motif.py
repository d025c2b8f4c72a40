"""Motif's semantics as DiffConfig options (docs/motif.md): PolyNorm (`hidden_act="poly_norm"`), grouped differential
attention (`num_noise_heads`), λ_init's depth offset and subln's own eps. Each is checked against its formula or an
equivalent plain V1 model; the converted checkpoints themselves are tested in tests/conversion/test_motif.py."""

import math
import re
from types import SimpleNamespace

import pytest
import torch

from diff_transformer import DiffConfig, DiffForCausalLM
from diff_transformer.analysis import attention_maps
from diff_transformer.integrations.cpu_attention import CpuStrategy
from diff_transformer.integrations.vllm import fields
from diff_transformer.modeling_diff import DiffPolyNorm
from tests.helpers.reference import activation
from tests.helpers.rounding import assert_within_rounding, rounding_scale
from tests.helpers.tiny import tiny_model


GDA = dict(num_attention_heads=4, num_key_value_heads=2, num_noise_heads=2, head_dim=8)  # 2 groups of 2 signal heads


def gda_model(**overrides):
    return tiny_model(1, **{**GDA, "hidden_act": "poly_norm", **overrides})


def test_poly_norm_is_its_formula_and_starts_at_equal_weights():
    act = DiffPolyNorm()
    model = gda_model()
    fresh = DiffForCausalLM._from_config(model.config)
    start = fresh.model.layers[0].mlp.act_fn
    assert isinstance(start, DiffPolyNorm)
    assert torch.equal(start.weight.data, torch.full((3,), 1 / 3)) and torch.equal(start.bias.data, torch.zeros(1))
    with torch.no_grad():
        act.weight.copy_(torch.tensor([0.5, -0.25, 2.0]))
        act.bias.fill_(0.125)
    x = torch.randn(2, 5, 16)
    # w0 n(x³) + w1 n(x²) + w2 n(x) + b, n(u) = u / sqrt(mean(u²) + 1e-6): the reference's, in float64, with the
    # scale of fp32's rounding on it
    weights = {"act.weight": torch.tensor([0.5, -0.25, 2.0]).double(), "act.bias": torch.tensor([0.125]).double()}
    poly_norm = SimpleNamespace(hidden_act="poly_norm")
    expected, sigma = rounding_scale(lambda: activation(weights, "act", poly_norm, x.double()))
    assert_within_rounding(act(x), expected, sigma)
    assert act(x.bfloat16()).dtype == torch.bfloat16  # computed in fp32, returned in the input's dtype


def test_poly_norm_weights_are_state_and_trainable():
    model = gda_model().train()
    names = set(model.state_dict())
    assert {"model.layers.0.mlp.act_fn.weight", "model.layers.0.mlp.act_fn.bias"} <= names
    ids = torch.randint(3, model.config.vocab_size, (2, 9))
    model(ids, labels=ids).loss.backward()
    act = model.model.layers[0].mlp.act_fn
    assert act.weight.grad.abs().sum() > 0 and act.bias.grad.abs().sum() > 0


def test_num_noise_heads_equal_to_heads_is_plain_v1():
    """One noise query per head: the GDA layout [signal, noise] per group is V1's [q1 | q2] per head."""
    plain = tiny_model(1)
    config = DiffConfig(**{**plain.config.to_dict(), "num_noise_heads": 4})
    grouped = DiffForCausalLM._from_config(config, attn_implementation="eager")
    grouped.load_state_dict(plain.state_dict())
    ids = torch.randint(3, plain.config.vocab_size, (2, 11))
    with torch.no_grad():
        assert torch.equal(grouped.eval()(ids).logits, plain(ids).logits)


def expanded_twin(model):
    """A plain V1 model computing what the GDA `model` computes: each signal head gets a copy of its group's noise
    query as its own q2 (rows copied, every other weight as is)."""
    config = DiffConfig(**{**model.config.to_dict(), "num_noise_heads": None})
    twin = DiffForCausalLM._from_config(config, attn_implementation="eager")
    H, n, d = config.num_attention_heads, model.config.num_noise_heads, config.head_dim
    r = H // n
    state = model.state_dict()
    for name in [k for k in state if k.endswith("q_proj.weight") or k.endswith("q_proj.bias")]:
        groups = state[name].reshape(n, r + 1, d, *state[name].shape[1:])  # (n, r + 1, d, ...)
        signal, noise = groups[:, :r], groups[:, r:].expand(n, r, *groups.shape[2:])
        state[name] = torch.stack((signal, noise), dim=2).reshape(2 * H * d, *state[name].shape[1:])
    twin.load_state_dict(state)
    return twin.eval()


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["gqa2", "gqa4"])
def test_grouped_noise_heads_serve_their_group(kv_heads):
    """GDA equals V1 with each signal head's q2 a copy of its group's noise query (the semantics of sharing)."""
    model = gda_model(num_key_value_heads=kv_heads, attention_bias=True)
    assert model.model.layers[0].self_attn.q_proj.weight.shape == ((4 + 2) * 8, model.config.hidden_size)
    assert model.model.layers[0].self_attn.o_proj.weight.shape == (model.config.hidden_size, 2 * 4 * 8)
    twin = expanded_twin(model)
    ids = torch.randint(3, model.config.vocab_size, (2, 11))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, twin(ids).logits, rtol=0, atol=1e-6)


def test_grouped_model_backends_caches_and_generation_agree():
    model = gda_model()
    ids = torch.randint(3, model.config.vocab_size, (2, 10))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    with torch.no_grad():
        eager = model(ids, attention_mask=mask).logits
        model.set_attn_implementation("sdpa")
        sdpa = model(ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(sdpa[real], eager[real], rtol=1e-5, atol=1e-5)
    prompt = ids[:1]
    generated = model.generate(prompt, max_new_tokens=6, do_sample=False)
    steps = prompt
    for _ in range(6):  # the argmax loop without a cache
        with torch.no_grad():
            steps = torch.cat((steps, model(steps, use_cache=False).logits[:, -1:].argmax(-1)), dim=-1)
    assert torch.equal(generated, steps)
    static = model.generate(prompt, max_new_tokens=6, do_sample=False, cache_implementation="static")
    assert torch.equal(static, steps)


def test_grouped_model_runs_in_bf16():
    model = gda_model().to(torch.bfloat16)
    ids = torch.randint(3, model.config.vocab_size, (1, 8))
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()


def test_diff_triton_without_a_kernel_falls_back_for_grouped_attention(monkeypatch):
    """On CPU the fused kernel does not run: "diff_triton" attends as sdpa (its CPU strategies), same logits."""
    import diff_transformer.integrations.cpu_attention as cpu

    ran, select = [], cpu.select_cpu_strategy
    monkeypatch.setattr(cpu, "select_cpu_strategy", lambda *a, **k: ran.append(select(*a, **k)) or ran[-1])
    model = gda_model(attn_implementation="sdpa")
    twin = DiffForCausalLM._from_config(model.config, attn_implementation="diff_triton")
    twin.load_state_dict(model.state_dict())
    ids = torch.randint(3, model.config.vocab_size, (2, 9))
    with torch.no_grad():
        expected = model(ids).logits
        ran.clear()
        torch.testing.assert_close(twin.eval()(ids).logits, expected, rtol=0, atol=0)
    assert ran and set(ran) == {CpuStrategy.BLOCKED_DIFF_MAP}  # CPU prefill without gradients or mask


def test_fused_kernel_computes_grouped_attention(monkeypatch):
    """The kernel gets V1's inputs (each signal head's q2 is its group's noise query): through Triton's interpreter
    on CPU it computes what eager computes."""
    pytest.importorskip("triton", reason="the fused kernel needs triton (in the test extra)")
    from diff_transformer.integrations.attention import diff_triton_differential_attention

    monkeypatch.setattr(diff_triton_differential_attention, "runs_on", lambda device: True)
    model = gda_model()
    twin = DiffForCausalLM._from_config(model.config, attn_implementation="diff_triton")
    twin.load_state_dict(model.state_dict())
    ids = torch.randint(3, model.config.vocab_size, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(twin.eval()(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-5)


def test_lambda_init_depth_offset_and_subln_eps():
    model = tiny_model(1, num_hidden_layers=3, lambda_init_depth_offset=-1, subln_eps=1e-5)
    inits = [layer.self_attn.lambda_init for layer in model.model.layers]
    assert inits == [0.8 - 0.6 * math.exp(-0.3 * (i - 1)) for i in range(3)]  # Motif's: depth i - 1
    assert inits[0] < 0  # Motif's first layer starts slightly additive
    assert model.model.layers[0].self_attn.subln.variance_epsilon == 1e-5
    assert tiny_model(1).model.layers[0].self_attn.subln.variance_epsilon == tiny_model(1).config.rms_norm_eps
    plain = tiny_model(1, num_hidden_layers=3)
    assert [layer.self_attn.lambda_init for layer in plain.model.layers] == [
        0.8 - 0.6 * math.exp(-0.3 * i) for i in range(3)
    ]


def test_grouped_attention_maps_show_the_noise_groups():
    model = gda_model()
    ids = torch.randint(3, model.config.vocab_size, (1, 7))
    entries = attention_maps(model, ids)
    with torch.no_grad():
        eager = model(ids, output_attentions=True).attentions
    for entry, expected in zip(entries, eager):
        torch.testing.assert_close(entry.differential, expected.float(), rtol=1e-5, atol=1e-6)
        second = entry.second  # (B, H, N, L): signal heads (0, 1) share noise query 0, (2, 3) noise query 1
        assert torch.equal(second[:, 0], second[:, 1]) and torch.equal(second[:, 2], second[:, 3])
        assert not torch.equal(second[:, 1], second[:, 2])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(num_noise_heads=2, diff_version=2), "needs diff_version=1"),
        (dict(num_noise_heads=3), "must be a positive integer dividing num_attention_heads=4"),
        (dict(num_noise_heads=1), "must be a multiple of num_key_value_heads=2"),
        (dict(subln_eps=0.0), "subln_eps=0.0 must be a finite number >= 1.18e-38"),
        (dict(hidden_act="poly"), "or 'poly_norm'"),
    ],
)
def test_motif_options_are_checked_in_one_line(overrides, message):
    values = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=64, diff_version=1)
    with pytest.raises(ValueError, match=re.escape(message)):
        DiffConfig(**{**values, **overrides})


def test_vllm_places_the_motif_options():
    """vLLM computes them (tests/vllm/test_motif.py); other activations are still refused in one line."""
    config = DiffConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=64, num_noise_heads=2,
        diff_version=1, hidden_act="poly_norm", lambda_init_depth_offset=-1, subln_eps=1e-5,
    )  # fmt: skip
    fields.check_config(config)
    assert {"num_noise_heads", "lambda_init_depth_offset", "subln_eps"} <= set(fields.HONOURED)
    config = DiffConfig(hidden_size=64, num_attention_heads=4, vocab_size=64, hidden_act="gelu", diff_version=1)
    with pytest.raises(ValueError, match=r"^hidden_act='gelu' is not supported .* \(only silu, poly_norm\)"):
        fields.check_config(config)


def test_grouped_model_continuous_batching_matches_generate():
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model = gda_model(attn_implementation="sdpa", eos_token_id=None)
    prompts = [torch.randint(3, 97, (n,)).tolist() for n in (5, 11, 3)]
    expected = [
        model.generate(torch.tensor([p]), max_new_tokens=6, min_new_tokens=6, do_sample=False)[0, len(p) :].tolist()
        for p in prompts
    ]
    config = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=-1, pad_token_id=0)
    batching = ContinuousBatchingConfig(page_size=16, num_blocks=16, max_batch_tokens=64)
    results = model.generate_batch(
        prompts, generation_config=config, continuous_batching_config=batching, progress_bar=False
    )
    by_prompt = {tuple(r.prompt_ids): r.generated_tokens for r in results.values()}
    assert [by_prompt[tuple(p)] for p in prompts] == expected


def test_poly_norm_keeps_the_mlp_whole_under_tensor_parallelism():
    """PolyNorm's statistics span the whole intermediate width, so a colwise gate_proj would normalise each rank's
    slice alone: the MLP is left out of the tensor-parallel plan (replicated); attention is still split
    (tests/matrix: test_tensor_parallel_matches_the_unsharded_model[motif-*])."""
    plan = gda_model().config.base_model_tp_plan
    assert not any(".mlp." in key for key in plan) and plan["layers.*.self_attn.q_proj"] == "colwise"
    assert tiny_model(1).config.base_model_tp_plan["layers.*.mlp.gate_proj"] == "colwise"
