"""benchmarks/floors.py, the floor column of the benchmarks: multiply-adds against PyTorch's own count of an eager
forward (FlopCounterMode: every matmul, attention included, at 2 FLOPs per multiply-add), hand-computed attention
ratios, and the bytes a decode step reads."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import DiffLlamaConfig, DiffLlamaForCausalLM, LlamaConfig, LlamaForCausalLM

from diff_transformer import DiffConfig, DiffForCausalLM
from tests.helpers import REPOSITORY, load_script


floors = load_script(REPOSITORY / "benchmarks" / "floors.py")
COMMON = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=2, vocab_size=50, head_dim=8, max_position_embeddings=64
)


def build(kind: str, tie: bool = False):
    torch.manual_seed(0)
    if kind == "llama":
        config = LlamaConfig(num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=tie, **COMMON)
        return LlamaForCausalLM._from_config(config, attn_implementation="eager")
    if kind == "diffllama":
        config = DiffLlamaConfig(num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=tie, **COMMON)
        return DiffLlamaForCausalLM._from_config(config, attn_implementation="eager")
    version = {"v1": 1, "v2": 2}[kind]
    heads = 4 if version == 1 else 8  # V1: 2H = 8 query sub-heads like Llama; V2: 16 query heads
    config = DiffConfig(
        diff_version=version, num_attention_heads=heads, num_key_value_heads=2, tie_word_embeddings=tie, **COMMON
    )
    return DiffForCausalLM._from_config(config, attn_implementation="eager")


@pytest.mark.parametrize("kind", ["llama", "diffllama", "v1", "v2"])
def test_multiply_adds_against_what_pytorch_counts_for_an_eager_forward(kind):
    """Projections, MLP and LM head (PyTorch's `mm`) exactly, for every model; for Llama the whole forward. Eager
    Diff models do more attention products than the floor (V2 and V1 recompute their output from the returned maps,
    DiffLlama multiplies both maps by the doubled value), so there the floor is a lower bound."""
    model = build(kind).eval()
    tokens = 12
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(torch.randint(0, 50, (1, tokens)))
    counts = {str(op): flops / 2 for op, flops in counter.get_flop_counts()["Global"].items()}
    assert tokens * floors._linear_weights(model, lm_head=True) == counts["aten.mm"]
    floor = floors.forward_macs(model, tokens, lm_head=True, causal=False)
    if kind == "llama":
        assert floor == sum(counts.values())
    else:
        assert counts["aten.mm"] < floor <= sum(counts.values())


def test_attention_costs_relative_to_llama_by_hand():
    """Per layer and query-key pair, d = 8: Llama's 8 heads do QK 64 + AV 64; DiffLlama and V1 1.5x (8 maps, each
    over a 2d-wide value); V2 with 16 query heads 2x."""
    widths = {kind: floors._attention_widths(build(kind).config) for kind in ("llama", "diffllama", "v1", "v2")}
    assert widths["llama"] == (64, 64, 2 * 4 * 8)
    assert widths["diffllama"] == (64, 128, 2 * 4 * 8)
    assert widths["v1"] == (64, 128, 4 * 2 * 8)  # K: 2 H_kv sub-heads, V: 2 H_kv halves of d
    assert widths["v2"] == (128, 128, 2 * 2 * 8)
    llama, v1 = build("llama"), build("v1")
    n = 1000  # long enough for attention to dominate: the ratio tends to 1.5
    linear = floors._linear_weights(llama, lm_head=False)
    assert floors._linear_weights(v1, lm_head=False) == linear  # Llama's matrices exactly (λ is not a Linear)
    expected = (n * linear + 2 * 192 * n * (n + 1) / 2) / (n * linear + 2 * 128 * n * (n + 1) / 2)
    assert floors.forward_macs(v1.model, n) / floors.forward_macs(llama.model, n) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_decode_reads_the_weights_and_the_caches(tie):
    model = build("v2", tie=tie)
    weights = sum(p.numel() for p in model.parameters())
    embedding = 50 * 64
    read = weights if tie else weights - embedding  # a tied table is read as the LM head; else only B rows
    cache = 2 * (2 * 2 * 8) * 100  # layers x (K + V: 2 H_kv x d each) x context
    assert floors.decode_bytes(model, context=100, batch=3, dtype_bytes=2) == 2 * (read + 3 * cache)
