"""`attn_implementation="diff_triton"` in the model: V1 layers run the fused Triton kernel (here through Triton's
interpreter on CPU, forced through the registered function's `runs_on`), everything else runs as sdpa. References:
the eager model (the formula, one explicit softmax per map) with the same weights. The kernel's own tests are in
test_kernels.py."""

import pytest
import torch

import diff_transformer.integrations.attention as attention
import diff_transformer.integrations.cpu_attention as cpu
from diff_transformer import DiffForCausalLM
from diff_transformer.integrations.attention import diff_triton_differential_attention
from diff_transformer.integrations.cpu_attention import CpuStrategy
from tests.helpers.tiny import tiny_model


pytest.importorskip("triton", reason="the fused kernel needs triton (in the test extra)")

# fp32 through the interpreter: both sides compute in fp32, only the summation order differs.
TOLERANCE = dict(rtol=1e-4, atol=1e-5)


def fused_twin(model):
    """`model`'s weights under attn_implementation="diff_triton"."""
    twin = DiffForCausalLM._from_config(model.config, attn_implementation="diff_triton")
    twin.load_state_dict(model.state_dict())
    return twin.eval()


FUSED = "the fused kernel"


@pytest.fixture
def strategies(monkeypatch):
    """What each layer call under "diff_triton" ran: FUSED, or the CPU function's strategy (None: plain calls)."""
    ran, select, fused = [], cpu.select_cpu_strategy, attention.kernels.triton_v1_attention
    monkeypatch.setattr(cpu, "select_cpu_strategy", lambda *a, **k: ran.append(select(*a, **k)) or ran[-1])
    monkeypatch.setattr(attention.kernels, "triton_v1_attention", lambda *a, **k: ran.append(FUSED) or fused(*a, **k))
    return ran


@pytest.fixture
def fused_on_cpu(monkeypatch):
    """Let the kernel run on CPU tensors (Triton's interpreter) as it would on CUDA ones."""
    monkeypatch.setattr(diff_triton_differential_attention, "runs_on", lambda device: True)


def padded_batch(model, lengths=(13, 9, 4)):
    torch.manual_seed(1)
    ids = torch.randint(3, model.config.vocab_size, (len(lengths), max(lengths)))
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        mask[row, -length:] = 1  # left padding, as for generation
    return ids, mask


@pytest.mark.parametrize(
    "heads",
    [(4, 4, None), (4, 2, None), (4, 1, None), (3, 3, 8), (9, 3, 8)],
    ids=["mha", "gqa2", "gqa4", "odd-mha", "odd-gqa3"],  # odd: what the expanded conversion makes (SmolLM2: 9 over 3)
)
def test_fused_v1_matches_eager_on_a_padded_batch(strategies, fused_on_cpu, heads):
    num_attention_heads, num_key_value_heads, head_dim = heads
    model = tiny_model(
        1, num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads, head_dim=head_dim
    )
    twin = fused_twin(model)
    ids, mask = padded_batch(model)
    with torch.no_grad():
        expected = model(ids, attention_mask=mask).logits
        fused = twin(ids, attention_mask=mask).logits
    assert strategies and set(strategies) == {FUSED}
    real = mask.bool()  # padded positions attend nothing real; their logits are not compared
    torch.testing.assert_close(fused[real], expected[real], **TOLERANCE)
    ids = ids[:1, -7:]  # no padding: transformers passes no mask and the kernel runs plain causal
    with torch.no_grad():
        torch.testing.assert_close(twin(ids).logits, model(ids).logits, **TOLERANCE)


def test_fused_v1_gradients_match_eager(fused_on_cpu):
    model = tiny_model(1).train()
    twin = fused_twin(model).train()
    ids = torch.randint(3, model.config.vocab_size, (2, 11))
    for m in (model, twin):
        m(ids, labels=ids).loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    for name, p in twin.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], rtol=1e-4, atol=1e-6, msg=name)
    assert twin.model.layers[0].self_attn.diff_lambda.lambda_q1.grad.abs().sum() > 0  # λ is on the kernel's graph


@pytest.mark.parametrize("cache_implementation", [None, "static"], ids=["dynamic", "static"])
def test_fused_v1_generates_what_eager_generates(strategies, fused_on_cpu, cache_implementation):
    model = tiny_model(1)
    twin = fused_twin(model)
    ids, mask = padded_batch(model, lengths=(9, 5))
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, cache_implementation=cache_implementation)
    expected = model.generate(ids, **kwargs)
    assert torch.equal(twin.generate(ids, **kwargs), expected)
    assert set(strategies) == {FUSED}  # the prompt and every one-token step


def test_diff_triton_runs_as_sdpa_where_the_kernel_does_not(strategies, diff_version):
    """No CUDA (or no triton, or Hub custom code without the package): "diff_triton" is sdpa, with the same logits."""
    model = tiny_model(diff_version, attn_implementation="sdpa")
    twin = fused_twin(model)
    ids, mask = padded_batch(model)
    with torch.no_grad():
        torch.testing.assert_close(
            twin(ids, attention_mask=mask).logits, model(ids, attention_mask=mask).logits, rtol=0, atol=0
        )
    if diff_version == 1:
        assert strategies and FUSED not in strategies
        assert set(strategies) == {CpuStrategy.PADDED_WIDE_VALUE}  # what sdpa on CPU runs


def test_diff_triton_is_a_transformers_backend_name():
    from transformers import AttentionInterface, AttentionMaskInterface

    for name in ("diff_triton", "diff_map_first"):
        assert name in AttentionInterface._global_mapping and name in AttentionMaskInterface._global_mapping
    model = tiny_model(1, attn_implementation="sdpa")
    model.set_attn_implementation("diff_triton")
    assert model.config._attn_implementation == "diff_triton"


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CI has none; run on a lent GPU)")
# bf16: both sides round every product to bf16, in different orders; compared against eager in fp32 instead.
CUDA_TOLERANCE = {torch.float32: dict(rtol=2e-3, atol=2e-3), torch.bfloat16: dict(rtol=5e-2, atol=5e-2)}


@CUDA
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", [(4, 2, None), (9, 3, 64)], ids=["gqa2", "odd-gqa3"])
def test_fused_v1_on_cuda_matches_eager(strategies, dtype, heads):
    """The real dispatch (no interpreter): forward on a padded batch, gradients, and greedy generation on a GPU."""
    num_attention_heads, num_key_value_heads, head_dim = heads
    model = tiny_model(
        1, num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads, head_dim=head_dim
    ).cuda()
    twin = fused_twin(model).to("cuda", dtype)
    ids, mask = (t.cuda() for t in padded_batch(model))
    with torch.no_grad():
        expected = model(ids, attention_mask=mask).logits
        fused = twin(ids, attention_mask=mask).logits.float()
    assert strategies and set(strategies) == {FUSED}
    real = mask.bool()
    torch.testing.assert_close(fused[real], expected[real], **CUDA_TOLERANCE[dtype])
    twin.train()
    twin(ids, attention_mask=mask, labels=ids).loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in twin.parameters() if p.requires_grad)
    if dtype == torch.float32:
        model.train()
        model(ids, attention_mask=mask, labels=ids).loss.backward()
        grads = dict(model.named_parameters())
        for name, p in twin.named_parameters():
            torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-2, atol=1e-4, msg=name)
        twin.eval(), model.eval()
        kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False)
        assert torch.equal(twin.generate(ids, **kwargs), model.generate(ids, **kwargs))


@CUDA
def test_fused_v1_on_cuda_compiles_for_training_and_for_generate_compile(strategies):
    """torch.compile(model) for a training step (bench_gpu's train_compile) and generate --compile's fullgraph decoding
    (decode_static), with the fused kernel inside the graphs, against the eager model in fp32. An H200 run found both
    broken: inductor could not lower the bool mask's byte view, and dynamo could not trace the launch table lookup."""
    from diff_transformer.generation.call import compile_kwargs

    model = tiny_model(1, num_attention_heads=4, num_key_value_heads=2).cuda()
    twin = fused_twin(model).cuda()
    ids, mask = (t.cuda() for t in padded_batch(model))
    twin.train(), model.train()
    loss = torch.compile(twin)(ids, attention_mask=mask, labels=ids).loss  # as Trainer compiles: graph breaks allowed
    assert strategies and set(strategies) == {FUSED}  # the kernel was traced into the graph, not left for sdpa
    loss.backward()
    expected = model(ids, attention_mask=mask, labels=ids).loss
    expected.backward()
    torch.testing.assert_close(loss, expected, **CUDA_TOLERANCE[torch.float32])
    grads = dict(model.named_parameters())
    for name, p in twin.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-2, atol=1e-4, msg=name)
    twin.eval(), model.eval()
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert torch.equal(twin.generate(ids, **kwargs, **compile_kwargs("cuda")), model.generate(ids, **kwargs))
