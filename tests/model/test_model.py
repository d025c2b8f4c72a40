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


@pytest.mark.parametrize("diff_version, num_noise_heads", [(1, None), (1, 2), (2, None)], ids=["v1", "motif-v1", "v2"])
def test_cache_layout_per_version(diff_version, num_noise_heads):
    """What a DynamicCache holds per layer after a forward (docs/design.md, "Cache layouts"): V2 Llama's H_kv heads of
    size d; V1 2H_kv heads of size d, keys [k1 of every group | k2 of every group] after RoPE, values [first d-wide
    half of every v_g | second half], grouped noise heads (Motif) alike. Tools that size a cache from the config as
    H_kv heads (transformers' common cache-shape tests, PEFT's prefix tuning) meet V1's 2H_kv: its layout, no defect.
    The expected tensors are formed here from k_proj/v_proj and Llama's RoPE on the layer's own input."""
    from transformers import DynamicCache
    from transformers.models.llama.modeling_llama import rotate_half

    model = tiny_model(diff_version, num_noise_heads=num_noise_heads, head_dim=8)  # H = 4, H_kv = 2
    H_kv, d, layers = model.config.num_key_value_heads, model.config.head_dim, model.config.num_hidden_layers
    inputs = {}
    for i, layer in enumerate(model.model.layers):
        layer.self_attn.register_forward_pre_hook(
            lambda m, args, kwargs, i=i: inputs.__setitem__(i, (args[0] if args else kwargs["hidden_states"], kwargs)),
            with_kwargs=True,
        )
    ids = torch.randint(3, 97, (2, 7))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
        assert len(cache.layers) == layers
        for i, layer in enumerate(cache.layers):
            attention = model.model.layers[i].self_attn
            hidden, kwargs = inputs[i]
            cos, sin = kwargs["position_embeddings"]  # (B, N, d)
            heads = 2 * H_kv if diff_version == 1 else H_kv
            assert layer.keys.shape == layer.values.shape == (2, heads, 7, d), (i, layer.keys.shape)
            keys = attention.k_proj(hidden).view(2, 7, -1, d)  # (B, N, heads, d): V1 [k1 | k2] per group
            values = attention.v_proj(hidden).view(2, 7, -1, d)
            if diff_version == 1:  # per group g: (k1_g, k2_g) -> component-major [k1 of every group | k2 of every]
                keys = keys.view(2, 7, H_kv, 2, d).transpose(2, 3).reshape(2, 7, heads, d)
                values = values.view(2, 7, H_kv, 2, d).transpose(2, 3).reshape(2, 7, heads, d)
            keys = keys * cos[:, :, None] + rotate_half(keys) * sin[:, :, None]  # Llama's RoPE, per head
            torch.testing.assert_close(layer.keys, keys.transpose(1, 2), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(layer.values, values.transpose(1, 2), rtol=0, atol=0)


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


_ROPE_CASES = [  # (rope_parameters, the field named): every field transformers' RoPE functions read, out of range
    ({"rope_type": "linear", "factor": 1e-9}, "factor"),
    ({"rope_type": "dynamic", "factor": -4}, "factor"),
    ({"rope_type": "linear", "factor": math.nan}, "factor"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 0}, "original_max_position_embeddings"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "attention_factor": -1.0},
     "attention_factor"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": math.inf}, "beta_fast"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_slow": 0}, "beta_slow"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "mscale": "1"}, "mscale"),
    ({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 16, "low_freq_factor": 0.0,
      "high_freq_factor": 4.0}, "low_freq_factor"),
    ({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 16, "low_freq_factor": 4.0,
      "high_freq_factor": 1.0}, "high_freq_factor"),
    ({"rope_type": "default", "partial_rotary_factor": 1.5}, "partial_rotary_factor"),
    ({"rope_type": "longrope", "short_factor": [1.0, -1.0], "long_factor": [1.0, 1.0],
      "original_max_position_embeddings": 16}, "short_factor"),
]  # fmt: skip


@pytest.mark.parametrize(("rope", "field"), _ROPE_CASES)
def test_every_rope_field_is_range_checked_like_rope_theta(rope, field):
    """Issue 56: factor 1e-9 or -4 was accepted (transformers only warns) while rope_theta was range-checked; one
    table now checks every field, with one message form naming it."""
    with pytest.raises(ValueError, match=rf"rope_parameters.{field}.* must "):
        tiny_config(2, rope_parameters={"rope_theta": 10000.0, **rope})


def test_valid_rope_scalings_still_load():
    for rope in (
        {"rope_type": "linear", "factor": 2.0},
        {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 16, "low_freq_factor": 1.0,
         "high_freq_factor": 4.0},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "mscale_all_dim": 0.0},
    ):  # fmt: skip
        tiny_config(2, rope_parameters={"rope_theta": 10000.0, **rope})


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

    # the stand-in says what it can do as any registered function may: it needs split calls, as flash kernels do
    flash_like.differential_capabilities = modeling.AttentionCapabilities(True, False, False, None)
    # registered for this test only: a name left in transformers' global mapping is seen by every later test
    monkeypatch.setitem(AttentionInterface._global_mapping, "equal_head_dims_cpu", flash_like)
    eager = tiny_model(diff_version)
    flash = tiny_model(diff_version, attn_implementation="sdpa")
    flash.set_attn_implementation("equal_head_dims_cpu")
    ids = torch.randint(3, 97, (2, 12))
    with torch.no_grad():
        assert (flash(ids).logits - eager(ids).logits).abs().max() <= 1e-4
    # per layer: V1 attends each map (q_c, k_c) once per V half, V2 makes one call
    assert len(calls) == 2 * (4 if diff_version == 1 else 1)


def test_v1_decoding_computes_lambda_once_per_generation(monkeypatch):
    """A V1 generation computes each layer's λ at the prefill and its decoding steps reuse it from the cache (the
    weights do not change within a generation); a λ vector changed in place between two generations on the same
    cache is seen at once, even by a one-token prompt: every step's logits equal the full forward's."""
    from transformers import DynamicCache

    from diff_transformer.modeling_diff import DiffLambdaV1

    calls, compute = [], DiffLambdaV1.forward
    monkeypatch.setattr(DiffLambdaV1, "forward", lambda self: calls.append(1) or compute(self))
    model = tiny_model(1, attn_implementation="sdpa")
    layers = model.config.num_hidden_layers
    ids = torch.randint(3, 97, (1, 6))
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True)
        assert len(calls) == layers  # the prefill's only
        full = model(out.sequences).logits[:, ids.shape[1] - 1 : -1]
        steps = torch.stack(out.logits, dim=1)
        assert_logits_match_reference(model, out.sequences, steps, full, positions=slice(ids.shape[1] - 1, -1))
        cache = DynamicCache(config=model.config)
        model(ids[:, :5], past_key_values=cache)
        # the last layer's λ (no cached key or value depends on it), in place: its version changes
        model.model.layers[-1].self_attn.diff_lambda.lambda_q1.add_(0.5)
        step = model(ids[:, 5:], past_key_values=cache).logits[:, -1:]
        assert_logits_match_reference(model, ids, step, model(ids).logits[:, -1:], positions=slice(-1, None))
    calls.clear()
    model.train()(ids, labels=ids).loss.backward()  # with gradients: computed at every call, on the graph
    assert len(calls) == layers and model.model.layers[0].self_attn.diff_lambda.lambda_q1.grad is not None


def test_the_model_file_holds_the_model_only():
    """Issue "Codebase 4": the checkpoint's custom code is the model: it imports only torch, transformers and its
    configuration, defines no autograd.Function (kernels and their backward live in integrations/), and stays near
    Llama's size (at most 800 lines)."""
    import ast

    import diff_transformer.modeling_diff as modeling

    source = open(modeling.__file__, encoding="utf-8").read()
    tree = ast.parse(source)
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {
        ("." * node.level) + (node.module or "") for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
    }
    allowed = ("torch", "transformers", "copy", "collections", ".configuration_diff")
    assert [name for name in imported if not name.startswith(allowed)] == []
    bases = [ast.unparse(base) for node in ast.walk(tree) if isinstance(node, ast.ClassDef) for base in node.bases]
    assert not [base for base in bases if "autograd" in base or base == "Function"]
    assert len(source.splitlines()) <= 800
