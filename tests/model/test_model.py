import math
import re

import pytest
import torch
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from diff_transformer import DiffConfig, DiffForCausalLM, DiffModel
from tests.helpers.reference import reference_forward, reference_logits
from tests.helpers.rounding import assert_within_rounding, rounding_scale
from tests.helpers.tiny import tiny_config, tiny_model


GQA_CASES = [  # (H, H_kv, hidden, explicit head_dim)
    (4, 4, 48, None),
    (6, 2, 48, None),  # H / H_kv = 3
    (8, 2, 64, None),  # H / H_kv = 4
    (3, 1, 48, 10),  # explicit head_dim != hidden / (2H)
]


def gqa_model(diff_version, heads, kv_heads, hidden, head_dim, **overrides):
    """A tiny model of one GQA_CASES layout, with attention biases."""
    return tiny_model(
        diff_version,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        hidden_size=hidden,
        head_dim=head_dim,
        attention_bias=True,
        **overrides,
    )


@pytest.mark.parametrize("heads,kv_heads,hidden,head_dim", GQA_CASES)
def test_matches_reference(diff_version, heads, kv_heads, hidden, head_dim):
    assert_matches_reference(gqa_model(diff_version, heads, kv_heads, hidden, head_dim), torch.randint(3, 97, (2, 13)))


def assert_matches_reference(model, ids):
    with torch.no_grad():
        assert_logits_match_reference(model, ids, model(ids).logits)


def assert_logits_match_reference(model, ids, *logits, mask=None, positions=slice(None)):
    """Each fp32 `logits` (B, len(positions), V) is within fp32's rounding of the float64 reference over `ids` (B, N)
    at `positions` (the real tokens' where `mask` marks padding): two computations compared this way differ by at most
    two bounds, whatever order each sums in."""
    for row in range(ids.shape[0]):
        exact, sigma = reference_logits(model, ids[row], None if mask is None else mask[row])
        real = positions if mask is None else mask[row].bool()
        for i, got in enumerate(logits):
            got_row = got[row] if mask is None else got[row][real]
            assert_within_rounding(got_row, exact[real], sigma[real], msg=f"logits {i}, row {row}:")


@pytest.mark.parametrize("heads,kv_heads,hidden,head_dim", GQA_CASES)
@pytest.mark.parametrize("grouped_noise", [False, True], ids=["v1", "grouped-noise"])
def test_blocked_cpu_prefill_matches_reference(heads, kv_heads, hidden, head_dim, grouped_noise, monkeypatch):
    """V1's blocked CPU attention (sdpa, fp32, no mask): blocks of 4 queries over 13 tokens, so full,
    partial and diagonal blocks all count; every GQA grouping and grouped noise heads, against the reference."""
    import diff_transformer.modeling_diff as modeling
    from diff_transformer.modeling_diff import V1Strategy

    monkeypatch.setattr(modeling, "BLOCKED_ROWS", 4)
    monkeypatch.setattr(modeling, "BLOCKED_MIN_ROWS", 1)
    ran, select = [], modeling.select_v1_strategy
    monkeypatch.setattr(modeling, "select_v1_strategy", lambda *a, **k: ran.append(select(*a, **k)) or ran[-1])
    noise_heads = kv_heads if grouped_noise else None  # one noise query per key/value group
    model = gqa_model(1, heads, kv_heads, hidden, head_dim, attn_implementation="sdpa", num_noise_heads=noise_heads)
    assert_matches_reference(model, torch.randint(3, 97, (2, 13)))
    assert ran and set(ran) == {V1Strategy.BLOCKED_DIFF_MAP}


@pytest.mark.parametrize("heads,kv_heads,hidden,head_dim", GQA_CASES)
@pytest.mark.parametrize("grouped_noise", [False, True], ids=["v1", "grouped-noise"])
def test_v1_cpu_decode_matches_the_full_forward(heads, kv_heads, hidden, head_dim, grouped_noise, monkeypatch):
    """V1 decoding on CPU (sdpa, fp32, no padding) forms A1 - λ A2 over the cache in two products
    (`decode_differential_attention`): every step's logits equal the full forward's over the same tokens (the
    reference-checked prefill path), every GQA grouping and grouped noise heads; a padded batch keeps sdpa."""
    import diff_transformer.modeling_diff as modeling
    from diff_transformer.modeling_diff import V1Strategy

    ran, select = [], modeling.select_v1_strategy
    monkeypatch.setattr(modeling, "select_v1_strategy", lambda *a, **k: ran.append(select(*a, **k)) or ran[-1])
    noise_heads = kv_heads if grouped_noise else None
    model = gqa_model(1, heads, kv_heads, hidden, head_dim, attn_implementation="sdpa", num_noise_heads=noise_heads)
    ids = torch.randint(3, 97, (2, 9))  # two sequences, no padding
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True)
        layers = model.config.num_hidden_layers
        assert ran.count(V1Strategy.DECODE_DIFF_MAP) == 4 * layers  # every step after the prefill
        ran.clear()
        full = model(out.sequences).logits[:, ids.shape[1] - 1 : -1]  # (2, 5, V): the logits each step picked from
        assert ran == [V1Strategy.BLOCKED_DIFF_MAP] * layers
        steps = torch.stack(out.logits, dim=1)
        assert_logits_match_reference(model, out.sequences, steps, full, positions=slice(ids.shape[1] - 1, -1))
        ran.clear()
        mask = torch.ones_like(ids)
        mask[0, :3] = 0  # left padding: transformers hands the decode steps a mask, so the four sdpa calls stay
        model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False)
    assert ran and V1Strategy.DECODE_DIFF_MAP not in ran


@pytest.mark.parametrize("version", [1, 2])
def test_blocked_backward_is_the_gradient(version):
    """The blocked forward/backward against torch.autograd.gradcheck (float64, finite differences): 2 groups of 2
    query heads, 7 rows in blocks of 3 (full, partial and diagonal blocks). V1: a key tensor per map, one λ, V 2d
    wide; V2: one key tensor for both maps (expanded), a λ per query row, V d wide."""
    from diff_transformer.modeling_diff import BlockedDifferentialAttention

    torch.manual_seed(0)
    B, H_kv, groups, N, d = 1, 2, 2, 7, 4
    grouped = torch.randn(B, H_kv, 2, groups, N, d, dtype=torch.float64, requires_grad=True)
    if version == 1:
        keys = torch.randn(B, H_kv, 2, N, d, dtype=torch.float64, requires_grad=True)
        wide_value = torch.randn(B, H_kv, N, 2 * d, dtype=torch.float64, requires_grad=True)
        lam = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)
    else:
        keys = torch.randn(B, H_kv, 1, N, d, dtype=torch.float64, requires_grad=True)
        wide_value = torch.randn(B, H_kv, N, d, dtype=torch.float64, requires_grad=True)
        lam = torch.rand(B, H_kv, groups, N, 1, dtype=torch.float64, requires_grad=True)

    def blocked(grouped, keys, wide_value, lam):
        keys = keys.expand(B, H_kv, 2, N, d)  # V2: stride 0 over the two maps, as DiffAttentionV2 passes it
        return BlockedDifferentialAttention.apply(grouped, keys, wide_value, lam, 3)

    assert torch.autograd.gradcheck(blocked, (grouped, keys, wide_value, lam))


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (3, 1)])
def test_blocked_cpu_training_has_the_padded_kernels_gradients(heads, kv_heads, monkeypatch):
    """A training step's loss and every parameter's gradient through the blocked strategy equal those through
    PyTorch's flash kernel (the padded strategy), blocks of 4 over 13 tokens."""
    import diff_transformer.modeling_diff as modeling
    from diff_transformer.modeling_diff import V1Strategy

    monkeypatch.setattr(modeling, "BLOCKED_ROWS", 4)
    monkeypatch.setattr(modeling, "BLOCKED_MIN_ROWS", 1)
    select = modeling.select_v1_strategy
    model = tiny_model(1, attn_implementation="sdpa", num_attention_heads=heads, num_key_value_heads=kv_heads).train()
    ids = torch.randint(3, 97, (2, 13))
    gradients = {}
    for strategy in (V1Strategy.BLOCKED_DIFF_MAP, V1Strategy.PADDED_WIDE_VALUE):
        ran = []
        monkeypatch.setattr(
            modeling,
            "select_v1_strategy",
            lambda *a, s=strategy, **k: ran.append(select(*a, **k)) or s,
        )
        model.zero_grad()
        loss = model(ids, labels=ids).loss
        loss.backward()
        assert set(ran) == {V1Strategy.BLOCKED_DIFF_MAP}  # what the selection picks for this training step
        gradients[strategy] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    (loss_b, grads_b), (loss_p, grads_p) = gradients.values()
    torch.testing.assert_close(loss_b, loss_p, rtol=0, atol=1e-5)
    for name, grad in grads_p.items():
        torch.testing.assert_close(grads_b[name], grad, rtol=1e-4, atol=1e-5, msg=name)


def count_v2_blocked(monkeypatch) -> list:
    """Record each V2 layer call that took the blocked path (prefill/training with sdpa on CPU in fp32)."""
    import diff_transformer.modeling_diff as modeling

    ran, blocked = [], modeling.blocked_differential_attention
    monkeypatch.setattr(modeling, "blocked_differential_attention", lambda *a: ran.append(a[0].shape) or blocked(*a))
    return ran


@pytest.mark.parametrize("heads,kv_heads,hidden,head_dim", GQA_CASES)
def test_v2_blocked_cpu_prefill_matches_reference(heads, kv_heads, hidden, head_dim, monkeypatch):
    """V2 on the blocked path (sdpa, fp32, no mask, train mode): blocks of 4 queries over 13 tokens, every GQA
    grouping (pairs of query heads over one key/value head), against the reference."""
    import diff_transformer.modeling_diff as modeling

    monkeypatch.setattr(modeling, "V2_ROWS", 4)
    monkeypatch.setattr(modeling, "BLOCKED_MIN_ROWS", 1)
    ran = count_v2_blocked(monkeypatch)
    model = gqa_model(2, heads, kv_heads, hidden, head_dim, attn_implementation="sdpa").train()  # no dropout
    assert_matches_reference(model, torch.randint(3, 97, (2, 13)))
    assert len(ran) == model.config.num_hidden_layers


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (3, 1), (4, 4)])
def test_v2_blocked_cpu_training_has_the_fused_kernels_gradients(heads, kv_heads, monkeypatch):
    """A V2 training step's loss and every parameter's gradient (λ's projection included) through the blocked path
    equal those through PyTorch's fused kernel (one sdpa call over 2H query heads), blocks of 4 over 13 tokens."""
    import diff_transformer.modeling_diff as modeling

    monkeypatch.setattr(modeling, "V2_ROWS", 4)
    monkeypatch.setattr(modeling, "BLOCKED_MIN_ROWS", 1)
    model = tiny_model(2, attn_implementation="sdpa", num_attention_heads=heads, num_key_value_heads=kv_heads).train()
    ids = torch.randint(3, 97, (2, 13))
    results, applies = [], modeling.blocked_applies
    for blocked in (True, False):
        ran = count_v2_blocked(monkeypatch)
        monkeypatch.setattr(modeling, "blocked_applies", lambda *a, b=blocked, **k: b and applies(*a, **k))
        model.zero_grad()
        loss = model(ids, labels=ids).loss
        loss.backward()
        assert len(ran) == (model.config.num_hidden_layers if blocked else 0)
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (loss_b, grads_b), (loss_f, grads_f) = results
    torch.testing.assert_close(loss_b, loss_f, rtol=0, atol=1e-5)
    for name, grad in grads_f.items():
        torch.testing.assert_close(grads_b[name], grad, rtol=1e-4, atol=1e-5, msg=name)


def test_v2_blocked_only_where_it_applies(monkeypatch):
    """V2 takes the blocked path in train mode, for plain causal self-attention only: not in eval mode, gradients or
    not (there the fused call stays, through which a converted V2 computes its Llama to the last bit), not for a
    padded batch, not in bf16, not with attention dropout, not where a block of `V2_ROWS` rows would not fit
    `V2_BLOCK_SCORES` (long contexts)."""
    import diff_transformer.modeling_diff as modeling

    ran = count_v2_blocked(monkeypatch)
    model = tiny_model(2, attn_implementation="sdpa")
    layers = model.config.num_hidden_layers
    ids = torch.randint(3, 97, (2, 20))
    model.generate(ids, max_new_tokens=3, do_sample=False)
    model(ids, labels=ids).loss.backward()  # eval mode with gradients (e.g. attribution)
    assert ran == []
    model.train()(ids, labels=ids).loss.backward()
    assert len(ran) == layers
    ran.clear()
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding
    model(ids, attention_mask=mask, labels=ids).loss.backward()
    model.to(torch.bfloat16)(ids, labels=ids).loss.backward()
    dropout = tiny_model(2, attn_implementation="sdpa", attention_dropout=0.1).train()
    dropout(ids, labels=ids).loss.backward()
    assert ran == []
    block = 4 * ids.shape[1] * modeling.V2_ROWS  # 2H / H_kv = 4 query heads of a key/value head, 20 keys, V2_ROWS
    model.float()
    for scores, blocked in ((block, True), (block - 1, False)):
        monkeypatch.setattr(modeling, "V2_BLOCK_SCORES", scores)
        with torch.no_grad():
            model(ids)
        assert len(ran) == (layers if blocked else 0)
        ran.clear()


def test_v2_map_first_inference_is_an_opt_in(tmp_path, monkeypatch):
    """`map_first_inference=True` (from_pretrained's config override) puts eval-mode prefill on the blocked path:
    logits within the reference tolerance of the fused call's, while decode steps (a cached prefix) keep the fused
    call, and greedy generation picks the same tokens. The flag is saved with the config and is off by default."""
    tiny_model(2).save_pretrained(tmp_path)
    ids = torch.randint(3, 97, (2, 20))
    fused = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa")
    assert fused.config.map_first_inference is False
    ran = count_v2_blocked(monkeypatch)
    opted = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa", map_first_inference=True)
    with torch.no_grad():
        expected, logits = fused(ids).logits, opted(ids).logits
    assert len(ran) == opted.config.num_hidden_layers
    ran.clear()
    # another summation order: close, not bit-identical; both within fp32's rounding of the formulas
    assert_logits_match_reference(opted, ids, logits, expected)
    tokens = opted.generate(ids, max_new_tokens=4, do_sample=False)
    assert len(ran) == opted.config.num_hidden_layers  # the prefill only
    assert torch.equal(tokens, fused.generate(ids, max_new_tokens=4, do_sample=False))
    opted.save_pretrained(tmp_path / "opted")
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "opted").config.map_first_inference is True


def test_blocked_cpu_prefill_only_where_it_applies(monkeypatch):
    """The blocked strategy is fp32, unmasked self-attention within the score budget (prefill and training);
    everything else keeps the padded flash kernel (padding masks, a cached prefix, bf16, long contexts)."""
    import diff_transformer.modeling_diff as modeling
    from diff_transformer.modeling_diff import V1Strategy, select_v1_strategy

    query = torch.zeros(1, 8, 64, 16)  # (B, 2H, N, d)
    blocked, padded = V1Strategy.BLOCKED_DIFF_MAP, V1Strategy.PADDED_WIDE_VALUE
    with torch.no_grad():
        assert select_v1_strategy("sdpa", query) is blocked
        assert select_v1_strategy("sdpa", query, attention_mask=torch.ones(1, 1, 64, 64, dtype=torch.bool)) is padded
        assert select_v1_strategy("sdpa", query, key_length=80) is padded  # a cached prefix
        assert select_v1_strategy("sdpa", query, causal=False) is padded
        assert select_v1_strategy("sdpa", query.bfloat16()) is padded
        assert select_v1_strategy("eager", query) is V1Strategy.WIDE_VALUE
        token, split = query[:, :, :1], V1Strategy.SPLIT_VALUE  # decoding one token over a cache
        assert select_v1_strategy("sdpa", token, key_length=80) is V1Strategy.DECODE_DIFF_MAP
        assert select_v1_strategy("sdpa", token, key_length=80, paged=True) is split
        assert select_v1_strategy("sdpa", token, attention_mask=torch.ones(1, 1, 1, 80, dtype=torch.bool)) is split
        assert select_v1_strategy("sdpa", token.bfloat16(), key_length=80) is split
        assert select_v1_strategy("flash_attention_2", token, key_length=80) is split
    assert select_v1_strategy("sdpa", query.clone().requires_grad_()) is blocked  # training: its own backward
    monkeypatch.setattr(modeling, "BLOCKED_SCORE_BUDGET", 4 * 64 * 8)  # 4 heads x 64 keys x 8 rows: under 16 rows
    with torch.no_grad():
        assert select_v1_strategy("sdpa", query) is padded


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
        {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0, "original_max_position_embeddings": 1024},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024,
            "rope_theta": 500000.0,
        },
    ],
    ids=lambda r: r["rope_type"],
)
def test_rope_scaling_matches_reference(diff_version, rope):
    model = tiny_model(diff_version, rope_parameters=rope)
    ids = torch.randint(3, 97, (1, 11))
    with torch.no_grad():
        logits = model(ids).logits[0]
    assert_within_rounding(logits, *reference_logits(model, ids[0]))


def test_v1_lambda_schedule_and_constant():
    model = tiny_model(1, num_hidden_layers=3)
    inits = [layer.self_attn.lambda_init for layer in model.model.layers]
    assert inits == pytest.approx([0.8 - 0.6 * math.exp(-0.3 * i) for i in range(3)])
    assert tiny_model(1, lambda_init=0.5).model.layers[1].self_attn.lambda_init == 0.5


def test_v1_lambda_floor_keeps_lambda_above_it_and_leaves_it_alone_above():
    """λ = m + softplus₁₀₀(λ_paper − m): at least m (also where the paper's λ is far below, e.g. −3), the paper's λ
    within 3e-9 from m + 0.2 up, and a gradient through it near the floor."""
    module = tiny_model(1, lambda_floor=0.05).model.layers[0].self_attn.diff_lambda
    plain = tiny_model(1).model.layers[0].self_attn.diff_lambda
    assert module.lambda_floor == 0.05 and plain.lambda_floor is None
    with torch.no_grad():
        for target in (-3.0, 0.0, 0.05, 0.1, 0.25, 0.6, 0.95):  # set the paper's λ through λq2 (λk2 non-zero)
            for lam in (module, plain):
                lam.lambda_q1.zero_(), lam.lambda_k1.zero_(), lam.lambda_k2.fill_(1.0)
                s2 = math.log(1.0 + lam.lambda_init - target)  # exp(0) − exp(s2) + λ_init = target
                lam.lambda_q2.fill_(s2 / lam.lambda_k2.numel())
            paper, floored = plain().item(), module().item()
            assert paper == pytest.approx(target, abs=1e-6)
            assert floored == pytest.approx(0.05 + math.log1p(math.exp(100 * (paper - 0.05))) / 100, abs=1e-6)
            assert floored > 0.05
            if paper >= 0.25:
                assert floored == pytest.approx(paper, abs=1e-7)
    module.lambda_q2.requires_grad_(True)
    module().backward()
    assert module.lambda_q2.grad.abs().sum() > 0


def test_parameter_layout_matches_design():
    H, H_kv, d, D = 4, 2, 6, 48
    for version, shapes in {
        1: {
            "q_proj": (H * 2 * d, D),
            "k_proj": (H_kv * 2 * d, D),
            "v_proj": (H_kv * 2 * d, D),
            "o_proj": (D, H * 2 * d),
        },
        2: {"q_proj": (2 * H * d, D), "k_proj": (H_kv * d, D), "v_proj": (H_kv * d, D), "o_proj": (D, H * d)},
    }.items():
        attn = tiny_model(version).model.layers[0].self_attn
        for name, shape in shapes.items():
            assert tuple(getattr(attn, name).weight.shape) == shape
    v1 = tiny_model(1).state_dict()
    for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
        assert v1[f"model.layers.0.self_attn.diff_lambda.{name}"].shape == (d,)
        assert v1[f"model.layers.0.self_attn.diff_lambda.{name}"].dtype == torch.float32
    assert v1["model.layers.0.self_attn.subln.weight"].shape == (2 * d,)
    assert tiny_model(2).state_dict()["model.layers.0.self_attn.diff_lambda.proj.weight"].shape == (H, D)


def test_output_attentions_are_differential_maps(diff_version):
    model = tiny_model(diff_version)
    if diff_version == 1:  # push λ above 1 so that A1 - λ A2 goes negative
        with torch.no_grad():
            lam = model.model.layers[0].self_attn.diff_lambda
            lam.lambda_q1.fill_(1.0), lam.lambda_k1.fill_(1.0)
    ids = torch.randint(3, 97, (12,))
    with torch.no_grad():
        out = model(ids[None], output_attentions=True, output_hidden_states=True)
    maps, sigma = rounding_scale(lambda: torch.stack(reference_forward(model, ids)[1]))  # (layers, H, N, N)
    assert len(out.attentions) == 2 and len(out.hidden_states) == 3
    for layer, got in enumerate(out.attentions):
        assert got.shape == (1, 4, 12, 12)
        assert_within_rounding(got[0], maps[layer], sigma[layer], msg=f"layer {layer}:")
    assert out.attentions[0].min() < 0  # not a softmax map
    # raw softmax rows would sum to 1; differential rows sum to 1 - λ
    assert not torch.allclose(out.attentions[0].sum(-1), torch.ones(1, 4, 12), atol=1e-3)


def test_output_attentions_maps_are_on_the_gradient_path(diff_version):
    """In eager mode the output is computed from the maps returned (as Llama's eager attention does), so
    `retain_grad()` on them gets a gradient."""
    model = tiny_model(diff_version).train()
    out = model(torch.randint(3, 97, (2, 9)), output_attentions=True)
    for maps in out.attentions:
        maps.retain_grad()
    out.logits[:, -1].sum().backward()
    for maps in out.attentions:
        assert maps.grad is not None and maps.grad.abs().sum() > 0


def test_keep_in_fp32_modules_name_modules_of_the_version(diff_version):
    model = tiny_model(diff_version)
    names = [name for name, _ in model.named_parameters()]
    listed = [*model._keep_in_fp32_modules, *model._keep_in_fp32_modules_strict]
    assert listed, "each version keeps its λ in fp32"
    for entry in listed:
        assert any(re.search(rf"(?:^|\.){entry}(?:\.|$)", name) for name in names), entry


BACKENDS = ["sdpa", "flex_attention"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_backends_match_eager(diff_version, backend):
    eager = tiny_model(diff_version, attn_implementation="eager")
    other = tiny_model(diff_version, attn_implementation=backend)
    assert other.config._attn_implementation == backend
    ids = torch.randint(3, 97, (2, 16))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    with torch.no_grad():
        expected = eager(ids, attention_mask=mask).logits
        got = other(ids, attention_mask=mask).logits
    assert_logits_match_reference(eager, ids, got, expected, mask=mask)


def test_cached_decoding_matches_full_forward(diff_version):
    model = tiny_model(diff_version, attn_implementation="sdpa")
    ids = torch.randint(3, 97, (2, 20))
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :12], use_cache=True)
        steps = [out.logits]
        cache = out.past_key_values
        for t in range(12, 20):
            out = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            steps.append(out.logits)
    assert_logits_match_reference(model, ids, torch.cat(steps, dim=1), full)


def test_left_padding_invariance(diff_version):
    model = tiny_model(diff_version, attn_implementation="sdpa")
    a, b = torch.randint(3, 97, (14,)), torch.randint(3, 97, (9,))
    batch = torch.zeros(2, 14, dtype=torch.long)
    mask = torch.zeros(2, 14, dtype=torch.long)
    batch[0], mask[0] = a, 1
    batch[1, 5:], mask[1, 5:] = b, 1
    with torch.no_grad():
        padded = model(batch, attention_mask=mask).logits
        alone = model(b[None]).logits
    # padded and alone: two fp32 computations of the same float64 logits, each within fp32's rounding of them
    expected, sigma = reference_logits(model, batch[1], mask[1])
    assert_within_rounding(padded[1, 5:], expected[5:], sigma[5:], msg="padded:")
    assert_within_rounding(alone[0], expected[5:], sigma[5:], msg="alone:")


def test_bf16_long_context_is_finite(diff_version):
    model = tiny_model(diff_version, attn_implementation="sdpa").to(torch.bfloat16)
    ids = torch.randint(3, 97, (1, 4096))
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()


def test_gradients_reach_every_parameter(diff_version):
    model = tiny_model(diff_version, attn_implementation="sdpa", attention_bias=True).train()
    ids = torch.randint(3, 97, (2, 16))
    model(ids, labels=ids).loss.backward()
    for name, param in model.named_parameters():
        assert param.grad is not None, name
        assert param.grad.abs().sum() > 0, name


def test_gradient_checkpointing_same_gradients(diff_version):
    ids = torch.randint(3, 97, (2, 10))
    grads = []
    for checkpointing in (False, True):
        model = tiny_model(diff_version, attn_implementation="sdpa").train()
        if checkpointing:
            model.gradient_checkpointing_enable()
        model(ids, labels=ids).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name in grads[0]:
        assert torch.allclose(grads[0][name], grads[1][name], atol=1e-6), name


def test_loss_honours_num_items_in_batch():
    model = tiny_model(2, attn_implementation="sdpa")
    ids = torch.randint(3, 97, (2, 10))
    labels = ids.clone()
    labels[:, :4] = -100
    with torch.no_grad():
        mean_loss = model(ids, labels=labels).loss
        summed = model(ids, labels=labels, num_items_in_batch=torch.tensor(100)).loss
    n_items = (labels[:, 1:] != -100).sum()
    assert torch.allclose(summed, mean_loss * n_items / 100, atol=1e-6)


def test_save_reload_equal_and_auto_classes(tmp_path, diff_version):
    model = tiny_model(diff_version, attn_implementation="sdpa")
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    assert not list(tmp_path.glob("*.bin"))
    for name in ("configuration_diff.py", "modeling_diff.py"):
        assert (tmp_path / name).exists()
    config = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(config, DiffConfig) and config.diff_version == diff_version
    assert config.auto_map == {
        "AutoConfig": "configuration_diff.DiffConfig",
        "AutoModel": "modeling_diff.DiffModel",
        "AutoModelForCausalLM": "modeling_diff.DiffForCausalLM",
        "AutoModelForSequenceClassification": "modeling_diff.DiffForSequenceClassification",
        "AutoModelForTokenClassification": "modeling_diff.DiffForTokenClassification",
        "AutoModelForQuestionAnswering": "modeling_diff.DiffForQuestionAnswering",
    }
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(reloaded) is DiffForCausalLM
    assert isinstance(AutoModel.from_pretrained(tmp_path), DiffModel)
    ids = torch.randint(3, 97, (1, 9))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reloaded(ids).logits)


def test_tied_embeddings(tmp_path):
    model = tiny_model(2, tie_word_embeddings=True)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    model.save_pretrained(tmp_path)
    reloaded = DiffForCausalLM.from_pretrained(tmp_path)
    assert reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr()


def test_bf16_load_keeps_lambda_fp32(tmp_path):
    tiny_model(1).save_pretrained(tmp_path)
    model = DiffForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.weight.dtype == torch.bfloat16
    assert attn.diff_lambda.lambda_q1.dtype == torch.float32
    with torch.no_grad():
        assert torch.isfinite(model(torch.randint(3, 97, (1, 8))).logits).all()


def test_missing_diff_parameters_are_initialised(tmp_path, diff_version):
    """A checkpoint without diff_lambda/subln (e.g. hand-made from a Llama) must not leave uninitialised memory."""
    from safetensors.torch import load_file, save_file

    model = tiny_model(diff_version)
    model.save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    dropped = {k: v for k, v in state.items() if "diff_lambda" not in k and "subln" not in k}
    assert len(dropped) < len(state)
    save_file(dropped, tmp_path / "model.safetensors", metadata={"format": "pt"})
    reloaded = DiffForCausalLM.from_pretrained(tmp_path)
    for name, param in reloaded.named_parameters():
        assert torch.isfinite(param).all(), name
        if name.endswith("subln.weight"):
            assert torch.equal(param, torch.ones_like(param))
        if "diff_lambda.lambda_" in name:
            assert 0.02 < param.std() < 0.4, (name, param.std())
        if "diff_lambda.proj" in name:
            assert 0 < param.std() < 0.1
    for name in state:
        if name in dropped:
            assert torch.equal(reloaded.state_dict()[name], state[name]), name


def test_meta_device_and_device_map_loading(tmp_path, diff_version):
    from accelerate import init_empty_weights

    model = tiny_model(diff_version)
    model.save_pretrained(tmp_path)
    with init_empty_weights():
        empty = DiffForCausalLM(tiny_config(diff_version))
    assert all(p.device.type == "meta" for p in empty.parameters())
    with torch.device("meta"):
        meta = DiffForCausalLM(tiny_config(diff_version))
    assert meta.model.layers[0].self_attn.q_proj.weight.is_meta
    mapped = DiffForCausalLM.from_pretrained(tmp_path, device_map="auto", attn_implementation="eager")
    assert {p.device.type for p in mapped.parameters()} == {"cpu"}
    mapped_layers = DiffForCausalLM.from_pretrained(
        tmp_path,
        device_map={
            "model.embed_tokens": "cpu",
            "model.layers": "cpu",
            "model.norm": "cpu",
            "model.rotary_emb": "cpu",
            "lm_head": "cpu",
        },
        attn_implementation="eager",
    )
    ids = torch.randint(3, 97, (1, 7))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, mapped(ids).logits)
        assert torch.equal(model(ids).logits, mapped_layers(ids).logits)


@pytest.mark.parametrize(
    "kwargs,fragment",
    [
        (dict(num_attention_heads=6, num_key_value_heads=4), "num_key_value_heads"),
        (dict(diff_version=3), "diff_version"),
        (dict(hidden_size=6, num_attention_heads=4), "hidden_size"),
        (dict(head_dim=7), "head_dim"),
        (dict(hidden_size=40, num_attention_heads=4), "head_dim=5"),
        (dict(lambda_init=1.5), "lambda_init"),
        (dict(lambda_std=-1.0), "lambda_std"),
        (dict(lambda_floor=1.0), "lambda_floor"),
        (dict(lambda_floor=-0.1), "lambda_floor"),
        (dict(lambda_floor=math.nan), "lambda_floor"),
        (dict(diff_version=1, attention_dropout=0.1), "attention_dropout"),
        (dict(num_key_value_heads=0), "num_key_value_heads"),
    ],
)
def test_invalid_config_raises_value_error(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        tiny_config(**{"diff_version": 2, **kwargs})


# Each of these used to be accepted and gave NaN/inf logits or failed later inside torch.
INVALID_VALUES = [
    ("lambda_std", math.nan, 1, "use e.g. 0.1"),
    ("lambda_std", math.inf, 1, "use e.g. 0.1"),
    ("rms_norm_eps", -1e-6, 2, "use e.g. 1e-6"),
    ("rms_norm_eps", 0.0, 2, "use e.g. 1e-6"),  # an all-zero hidden state (the padding embedding) gives 0/0
    ("rms_norm_eps", math.nan, 1, "use e.g. 1e-6"),
    ("rms_norm_eps", 1e-300, 2, "use e.g. 1e-6"),  # 0 in float32, where RMSNorm adds it: NaN as for 0
    ("max_position_embeddings", 0, 2, "positive integer"),
    ("max_position_embeddings", -8, 1, "positive integer"),
    ("intermediate_size", -4, 2, "positive integer"),
    ("intermediate_size", 0, 1, "positive integer"),
    ("attention_dropout", 1.0, 2, "use 0.0 to disable"),
    ("attention_dropout", -0.1, 2, "use 0.0 to disable"),
    ("attention_dropout", math.nan, 2, "use 0.0 to disable"),
    ("hidden_act", "swiglu", 2, "'silu'"),
    ("hidden_act", "SiLU", 1, "'silu'"),
    ("initializer_range", math.nan, 2, "use e.g. 0.02"),
]


@pytest.mark.parametrize("field,value,version,fix", INVALID_VALUES)
def test_invalid_value_is_one_line_naming_field_and_fix(field, value, version, fix):
    with pytest.raises(ValueError) as error:
        tiny_config(version, **{field: value})
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"{field}=") and repr(value) in message and fix in message


@pytest.mark.parametrize("field,value,version,fix", INVALID_VALUES)
def test_invalid_value_in_config_json_is_refused_at_load(tmp_path, field, value, version, fix):
    """A hand-edited config.json: refused by AutoConfig with the same message (its JSON has NaN/Infinity literals)."""
    import json

    config = tiny_config(version).to_dict()
    (tmp_path / "config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(ValueError, match=f"^{field}="):
        AutoConfig.from_pretrained(tmp_path)


def test_value_changed_after_construction_is_refused_at_save(tmp_path, diff_version):
    """`@strict` runs the `validate_*` methods again on `validate()`, which `save_pretrained` calls."""
    from huggingface_hub.errors import StrictDataclassClassValidationError

    config = tiny_config(diff_version)
    config.validate()
    config.rms_norm_eps = -1.0
    with pytest.raises(StrictDataclassClassValidationError, match="rms_norm_eps=-1.0 must be a finite number >= "):
        config.save_pretrained(tmp_path)
    assert not (tmp_path / "config.json").exists()


@pytest.mark.parametrize("theta", [0.0, 1.0, -10000.0, math.inf, math.nan, "10000"])
def test_rope_theta_is_a_finite_number_above_one(theta):
    """theta^(-2i/d): 0 (or below) gives inf/NaN frequencies, 1 rotates every pair by the same angle."""
    with pytest.raises(ValueError, match=r"rope_parameters.rope_theta=.* must be a finite number > 1"):
        tiny_config(2, rope_parameters={"rope_type": "default", "rope_theta": theta})


def test_attention_dropout_none_means_no_dropout():
    assert tiny_config(2, attention_dropout=None).attention_dropout == 0.0
    assert tiny_config(1, attention_dropout=None).attention_dropout == 0.0  # V1 refuses dropout, not None


def test_every_transformers_activation_is_accepted():
    from transformers.activations import ACT2FN

    for name in ACT2FN:
        assert tiny_config(2, hidden_act=name).hidden_act == name


def test_default_head_dim_and_parameter_budget():
    config = DiffConfig(
        hidden_size=512,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=1024,
        num_hidden_layers=1,
        vocab_size=10,
        diff_version=1,
    )
    assert config.head_dim == 64
    from transformers import LlamaConfig, LlamaForCausalLM

    llama = LlamaForCausalLM(
        LlamaConfig(
            hidden_size=512,
            num_attention_heads=8,
            num_key_value_heads=8,
            intermediate_size=1024,
            num_hidden_layers=1,
            vocab_size=10,
        )
    )
    v1 = DiffForCausalLM(DiffConfig(**{**config.to_dict(), "diff_version": 1}))
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    # docs/design.md: V1 = Llama with 2H heads of size d and 2H_kv KV heads, plus 4d + 2d per layer
    assert count(v1) == count(llama) + 6 * 64


def test_flash_style_backend_gets_equal_head_dims(diff_version, monkeypatch):
    """Flash kernels need V as wide as Q/K; V1 then attends once per V half. Checked on CPU with a stand-in backend
    that enforces the kernel's constraint and computes with sdpa (no flash kernel runs on CPU)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    import diff_transformer.modeling_diff as modeling

    calls = []

    def flash_like(module, query, key, value, attention_mask, **kwargs):
        assert query.shape[-1] == key.shape[-1] == value.shape[-1], "flash kernels need equal head dims"
        calls.append(value.shape)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("equal_head_dims_cpu", flash_like)
    select = modeling.select_v1_strategy  # decides by name: the stand-in is chosen as flash kernels are
    monkeypatch.setattr(
        modeling,
        "select_v1_strategy",
        lambda name, *a, **k: select("flash_attention_2" if name == "equal_head_dims_cpu" else name, *a, **k),
    )
    eager = tiny_model(diff_version)
    flash = tiny_model(diff_version, attn_implementation="sdpa")
    flash.set_attn_implementation("equal_head_dims_cpu")
    ids = torch.randint(3, 97, (2, 12))
    with torch.no_grad():
        assert (flash(ids).logits - eager(ids).logits).abs().max() <= 1e-4
    # per layer: V1 attends each map (q_c, k_c) once per V half, V2 makes one call
    assert len(calls) == 2 * (4 if diff_version == 1 else 1)
