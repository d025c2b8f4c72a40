"""The package's CPU attention paths (`diff_transformer.integrations.cpu_attention`, the differential attention
functions of "sdpa" and "diff_map_first"): each strategy against the reference formula and the fused/padded kernels'
gradients, where each applies, and V2's map-first opt-in. Hub custom code without the package takes the plain path
(tests/bare)."""

import json
import logging

import pytest
import torch
from transformers import AutoModelForCausalLM

import diff_transformer.integrations.cpu_attention as cpu
from diff_transformer.integrations.cpu_attention import BlockedDifferentialAttention, CpuStrategy
from tests.helpers.tiny import tiny_model
from tests.model.test_model import GQA_CASES, assert_logits_match_reference, assert_matches_reference, gqa_model


def record_strategies(monkeypatch) -> list:
    """Record what the CPU function chose at each layer call (None: the layer's plain calls)."""
    ran, select = [], cpu.select_cpu_strategy
    monkeypatch.setattr(cpu, "select_cpu_strategy", lambda *a, **k: ran.append(select(*a, **k)) or ran[-1])
    return ran


@pytest.mark.parametrize("heads,kv_heads,hidden,head_dim", GQA_CASES)
@pytest.mark.parametrize("grouped_noise", [False, True], ids=["v1", "grouped-noise"])
def test_blocked_cpu_prefill_matches_reference(heads, kv_heads, hidden, head_dim, grouped_noise, monkeypatch):
    """V1's blocked CPU attention (sdpa, fp32, no mask): blocks of 4 queries over 13 tokens, so full,
    partial and diagonal blocks all count; every GQA grouping and grouped noise heads, against the reference."""
    monkeypatch.setattr(cpu, "BLOCKED_ROWS", 4)
    monkeypatch.setattr(cpu, "BLOCKED_MIN_ROWS", 1)
    ran = record_strategies(monkeypatch)
    noise_heads = kv_heads if grouped_noise else None  # one noise query per key/value group
    model = gqa_model(1, heads, kv_heads, hidden, head_dim, attn_implementation="sdpa", num_noise_heads=noise_heads)
    assert_matches_reference(model, torch.randint(3, 97, (2, 13)))
    assert ran and set(ran) == {CpuStrategy.BLOCKED_DIFF_MAP}


@pytest.mark.parametrize("heads,kv_heads,hidden,head_dim", GQA_CASES)
@pytest.mark.parametrize("grouped_noise", [False, True], ids=["v1", "grouped-noise"])
def test_v1_cpu_decode_matches_the_full_forward(heads, kv_heads, hidden, head_dim, grouped_noise, monkeypatch):
    """V1 decoding on CPU (sdpa, fp32, no padding) forms A1 - λ A2 over the cache in two products
    (`decode_differential_attention`): every step's logits equal the full forward's over the same tokens (the
    reference-checked prefill path), every GQA grouping and grouped noise heads; a padded batch keeps sdpa."""
    ran = record_strategies(monkeypatch)
    noise_heads = kv_heads if grouped_noise else None
    model = gqa_model(1, heads, kv_heads, hidden, head_dim, attn_implementation="sdpa", num_noise_heads=noise_heads)
    ids = torch.randint(3, 97, (2, 9))  # two sequences, no padding
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True)
        layers = model.config.num_hidden_layers
        assert ran.count(CpuStrategy.DECODE_DIFF_MAP) == 4 * layers  # every step after the prefill
        ran.clear()
        full = model(out.sequences).logits[:, ids.shape[1] - 1 : -1]  # (2, 5, V): the logits each step picked from
        assert ran == [CpuStrategy.BLOCKED_DIFF_MAP] * layers
        steps = torch.stack(out.logits, dim=1)
        assert_logits_match_reference(model, out.sequences, steps, full, positions=slice(ids.shape[1] - 1, -1))
        ran.clear()
        mask = torch.ones_like(ids)
        mask[0, :3] = 0  # left padding: transformers hands the decode steps a mask, so the four sdpa calls stay
        model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False)
    assert ran and CpuStrategy.DECODE_DIFF_MAP not in ran


@pytest.mark.parametrize("version", [1, 2])
def test_blocked_backward_is_the_gradient(version):
    """The blocked forward/backward against torch.autograd.gradcheck (float64, finite differences): 2 groups of 2
    query heads, 7 rows in blocks of 3 (full, partial and diagonal blocks). V1: a key tensor per map, one λ, V 2d
    wide; V2: one key tensor for both maps (expanded), a λ per query row, V d wide."""
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


@pytest.mark.parametrize("version", [1, 2])
def test_blocked_under_autocast_computes_in_fp32(version):
    """Under CPU bf16 autocast a layer hands the blocked function fp32 q, k (RoPE's fp32 cos/sin) with a bf16 V (and
    V2's bf16 λ): it casts them up (exactly) and runs both passes with autocast off, so its output and every gradient
    are those of the fp32 call on the same values, to the bit; the bf16 inputs get bf16 gradients (the backward
    crashed on mixed dtypes before)."""
    torch.manual_seed(0)
    B, H_kv, groups, N, d = 2, 2, 2, 11, 8
    grouped = torch.randn(B, H_kv, 2, groups, N, d)
    keys = torch.randn(B, H_kv, 2 if version == 1 else 1, N, d)
    wide_value = torch.randn(B, H_kv, N, d * (3 - version)).bfloat16()
    lam = torch.tensor(0.3) if version == 1 else torch.rand(B, H_kv, groups, N, 1).bfloat16()
    grad_out = torch.randn(B, H_kv, groups, N, wide_value.shape[-1])

    def run(inputs, autocast):
        inputs = [x.detach().requires_grad_() for x in inputs]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            key_maps = inputs[1].expand(B, H_kv, 2, N, d)  # V2: one key tensor for both maps (stride 0), as passed
            out = BlockedDifferentialAttention.apply(inputs[0], key_maps, inputs[2], inputs[3], 4)
        out.backward(grad_out)
        return out, [x.grad for x in inputs]

    out, grads = run((grouped, keys, wide_value, lam), autocast=True)
    out32, grads32 = run((grouped, keys, wide_value.float(), lam.float()), autocast=False)
    assert out.dtype == torch.float32 and torch.equal(out, out32)
    for grad, grad32, x in zip(grads, grads32, (grouped, keys, wide_value, lam)):
        assert grad.dtype == x.dtype and torch.equal(grad, grad32.to(x.dtype))


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (3, 1)])
def test_blocked_cpu_training_has_the_padded_kernels_gradients(heads, kv_heads, monkeypatch):
    """A training step's loss and every parameter's gradient through the blocked strategy equal those through
    PyTorch's flash kernel (the padded strategy), blocks of 4 over 13 tokens."""
    monkeypatch.setattr(cpu, "BLOCKED_ROWS", 4)
    monkeypatch.setattr(cpu, "BLOCKED_MIN_ROWS", 1)
    select = cpu.select_cpu_strategy
    model = tiny_model(1, attn_implementation="sdpa", num_attention_heads=heads, num_key_value_heads=kv_heads).train()
    ids = torch.randint(3, 97, (2, 13))
    gradients = {}
    for strategy in (CpuStrategy.BLOCKED_DIFF_MAP, CpuStrategy.PADDED_WIDE_VALUE):
        ran = []
        monkeypatch.setattr(
            cpu,
            "select_cpu_strategy",
            lambda *a, s=strategy, **k: ran.append(select(*a, **k)) or s,
        )
        model.zero_grad()
        loss = model(ids, labels=ids).loss
        loss.backward()
        assert set(ran) == {CpuStrategy.BLOCKED_DIFF_MAP}  # what the selection picks for this training step
        gradients[strategy] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    (loss_b, grads_b), (loss_p, grads_p) = gradients.values()
    torch.testing.assert_close(loss_b, loss_p, rtol=0, atol=1e-5)
    for name, grad in grads_p.items():
        torch.testing.assert_close(grads_b[name], grad, rtol=1e-4, atol=1e-5, msg=name)


def count_v2_blocked(monkeypatch) -> list:
    """Record each V2 layer call that took the blocked path (prefill/training with sdpa on CPU in fp32)."""
    ran, blocked = [], cpu.blocked_differential_attention
    monkeypatch.setattr(cpu, "blocked_differential_attention", lambda *a: ran.append(a[0].shape) or blocked(*a))
    return ran


@pytest.mark.parametrize("heads,kv_heads,hidden,head_dim", GQA_CASES)
def test_v2_blocked_cpu_prefill_matches_reference(heads, kv_heads, hidden, head_dim, monkeypatch):
    """V2 on the blocked path (sdpa, fp32, no mask, train mode): blocks of 4 queries over 13 tokens, every GQA
    grouping (pairs of query heads over one key/value head), against the reference."""
    monkeypatch.setattr(cpu, "V2_ROWS", 4)
    monkeypatch.setattr(cpu, "BLOCKED_MIN_ROWS", 1)
    ran = count_v2_blocked(monkeypatch)
    model = gqa_model(2, heads, kv_heads, hidden, head_dim, attn_implementation="sdpa").train()  # no dropout
    assert_matches_reference(model, torch.randint(3, 97, (2, 13)))
    assert len(ran) == model.config.num_hidden_layers


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (3, 1), (4, 4)])
def test_v2_blocked_cpu_training_has_the_fused_kernels_gradients(heads, kv_heads, monkeypatch):
    """A V2 training step's loss and every parameter's gradient (λ's projection included) through the blocked path
    equal those through PyTorch's fused kernel (one sdpa call over 2H query heads), blocks of 4 over 13 tokens."""
    monkeypatch.setattr(cpu, "V2_ROWS", 4)
    monkeypatch.setattr(cpu, "BLOCKED_MIN_ROWS", 1)
    model = tiny_model(2, attn_implementation="sdpa", num_attention_heads=heads, num_key_value_heads=kv_heads).train()
    ids = torch.randint(3, 97, (2, 13))
    results, applies = [], cpu.blocked_applies
    for blocked in (True, False):
        ran = count_v2_blocked(monkeypatch)
        monkeypatch.setattr(cpu, "blocked_applies", lambda *a, b=blocked, **k: b and applies(*a, **k))
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
    block = 4 * ids.shape[1] * cpu.V2_ROWS  # 2H / H_kv = 4 query heads of a key/value head, 20 keys, V2_ROWS
    model.float()
    for scores, blocked in ((block, True), (block - 1, False)):
        monkeypatch.setattr(cpu, "V2_BLOCK_SCORES", scores)
        with torch.no_grad():
            model(ids)
        assert len(ran) == (layers if blocked else 0)
        ran.clear()


def test_v2_map_first_is_an_opt_in_backend(tmp_path, monkeypatch):
    """`attn_implementation="diff_map_first"` puts V2's eval-mode prefill on the blocked path: logits within the
    reference tolerance of the fused call's, while decode steps (a cached prefix) keep the fused call, and greedy
    generation picks the same tokens. A backend choice, not a config field: nothing of it is saved."""
    tiny_model(2).save_pretrained(tmp_path)
    ids = torch.randint(3, 97, (2, 20))
    fused = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa")
    ran = count_v2_blocked(monkeypatch)
    opted = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="diff_map_first")
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
    saved = json.loads((tmp_path / "opted" / "config.json").read_text())
    assert "map_first_inference" not in saved and "diff_map_first" not in json.dumps(saved)


def test_a_config_naming_map_first_inference_still_loads(tmp_path, caplog):
    """Checkpoints saved while `map_first_inference` was a config field load unchanged; one that set it is told,
    in one warning, which backend name asks for the same path now."""
    model = tiny_model(2)
    model.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    ids = torch.randint(3, 97, (1, 9))
    for value in (False, True):
        path.write_text(json.dumps({**json.loads(path.read_text()), "map_first_inference": value}))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="diff_transformer.configuration_diff"):
            loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
        assert not hasattr(loaded.config, "map_first_inference")
        warned = [r.getMessage() for r in caplog.records if "map_first_inference" in r.getMessage()]
        assert len(warned) == (1 if value else 0) and (not value or "diff_map_first" in warned[0])
        with torch.no_grad():
            assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_cpu_strategy_only_where_it_applies(monkeypatch):
    """V1's blocked strategy is fp32, unmasked self-attention within the score budget (prefill and training); the
    decode map one unmasked fp32 query; everything else on CPU the padded flash kernel (padding masks, a cached
    prefix, bf16, long contexts); off the CPU nothing (the layer's plain calls). Which backends have a differential
    attention function: sdpa's (the CPU paths) and the package's names; eager and flash none."""
    from diff_transformer.modeling_diff import differential_attention_function

    query, lam = torch.zeros(1, 8, 64, 16), torch.tensor(0.5)  # (B, 2H, N, d), V1's λ

    def select(query, key_length=64, mask=None, causal=True):
        return cpu.select_cpu_strategy(query, torch.zeros(1, 4, key_length, 16), mask, lam, causal)

    blocked, padded = CpuStrategy.BLOCKED_DIFF_MAP, CpuStrategy.PADDED_WIDE_VALUE
    with torch.no_grad():
        assert select(query) is blocked
        assert select(query, mask=torch.ones(1, 1, 64, 64, dtype=torch.bool)) is padded
        assert select(query, key_length=80) is padded  # a cached prefix
        assert select(query, causal=False) is padded
        assert select(query.bfloat16()) is padded
        assert select(query.to("meta")) is None  # the code path of a GPU
        token = query[:, :, :1]  # decoding one token over a cache
        assert select(token, key_length=80) is CpuStrategy.DECODE_DIFF_MAP
        assert select(token, mask=torch.ones(1, 1, 1, 80, dtype=torch.bool)) is None  # the plain calls on V's halves
        assert select(token.bfloat16(), key_length=80) is None
    assert select(query.clone().requires_grad_()) is blocked  # training: its own backward
    monkeypatch.setattr(cpu, "BLOCKED_SCORE_BUDGET", 4 * 64 * 8)  # 4 heads x 64 keys x 8 rows: under 16 rows
    with torch.no_grad():
        assert select(query) is padded
    on_cpu, on_gpu = torch.device("cpu"), torch.device("meta")  # meta: the code path of a GPU
    assert differential_attention_function("sdpa", on_cpu) is cpu.cpu_differential_attention
    assert differential_attention_function("sdpa", on_gpu) is None  # the plain calls, V's halves as a view
    assert differential_attention_function("diff_map_first", on_cpu) is cpu.map_first_differential_attention
    assert differential_attention_function("diff_triton", on_gpu) is not None
    for plain in ("eager", "flash_attention_2", "flex_attention", "paged|eager"):
        assert differential_attention_function(plain, on_cpu) is None


def without_differential_functions(monkeypatch):
    """A GPU's code path with sdpa: no differential attention function, every V1 layer makes its plain calls."""
    import diff_transformer.modeling_diff as modeling

    monkeypatch.setattr(modeling, "differential_attention_function", lambda *args: None)


@pytest.mark.parametrize("heads,kv_heads,hidden,head_dim", GQA_CASES)
@pytest.mark.parametrize("grouped_noise", [False, True], ids=["v1", "grouped-noise"])
def test_v1_plain_sdpa_calls_match_reference(heads, kv_heads, hidden, head_dim, grouped_noise, monkeypatch):
    """V1 through sdpa's plain calls (a GPU's path): both maps in one call over V's halves (uncached: v_proj's output
    as a view; cached: the cache's), and decoding's per-half calls, every GQA grouping, against the reference."""
    without_differential_functions(monkeypatch)
    noise_heads = kv_heads if grouped_noise else None
    model = gqa_model(1, heads, kv_heads, hidden, head_dim, attn_implementation="sdpa", num_noise_heads=noise_heads)
    ids = torch.randint(3, 97, (2, 9))
    with torch.no_grad():
        uncached = model(ids, use_cache=False).logits
        out = model.generate(ids, max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True)
    assert_logits_match_reference(model, ids, uncached)
    steps = torch.stack(out.logits, dim=1)  # (2, 4, V): the cached prefill's last position, then each decode step
    assert_logits_match_reference(model, out.sequences, steps, positions=slice(ids.shape[1] - 1, -1))


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (3, 1)])
def test_v1_plain_sdpa_training_has_the_cpu_paths_gradients(heads, kv_heads, monkeypatch):
    """A training step's loss and every parameter's gradient through sdpa's plain calls (one call for both maps, V's
    halves a view of v_proj's output) equal those through the CPU path's flash kernel (the padded strategy)."""
    model = tiny_model(1, attn_implementation="sdpa", num_attention_heads=heads, num_key_value_heads=kv_heads).train()
    ids = torch.randint(3, 97, (2, 13))
    monkeypatch.setattr(cpu, "select_cpu_strategy", lambda *a, **k: CpuStrategy.PADDED_WIDE_VALUE)
    results = []
    for plain in (False, True):
        if plain:
            without_differential_functions(monkeypatch)
        model.zero_grad()
        loss = model(ids, labels=ids, use_cache=False).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (loss_cpu, grads_cpu), (loss_plain, grads_plain) = results
    torch.testing.assert_close(loss_plain, loss_cpu, rtol=0, atol=1e-5)
    for name, grad in grads_cpu.items():
        torch.testing.assert_close(grads_plain[name], grad, rtol=1e-4, atol=1e-5, msg=name)
