"""The checkpoints of the integration matrix: for each family the converter reads (Llama, Mistral, Qwen2, Qwen3), a
tiny random source model with that family's distinctive features, and its V1 and V2 conversions; and the two Motif
layouts (Motif-2.6B's stripe pairs, grouped differential attention), built in Motif's key layout and imported into V1
(`MOTIF`, V1 only: the matrix's main suite covers them; vLLM refuses their options for now).

Shared by the main suite (tests/matrix/test_matrix.py), the bare-venv custom-code tests (tests/bare/) and the vLLM
tests (tests/vllm/), so every integration walks the same checkpoints. Sizes suit vLLM's CPU attention (head sizes 32,
64, ...: V2 attends d = 32 wide, V1 2d = 64 wide) and tensor parallelism over 2 ranks (8 heads over 4 key/value heads
become V1's 4 differential heads over 2 groups). Every source has the shipped tiny Llama's tokenizer (vocabulary 2048).
"""

from pathlib import Path

import torch
from transformers import (
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3ForSequenceClassification,
)

import diff_transformer
from diff_transformer.conversion import convert_to_diff
from tests.helpers.motif import write_motif_checkpoint


TINY_LLAMA = Path(diff_transformer.__file__).parent / "assets" / "tiny-llama"
COMMON = dict(
    vocab_size=2048,  # the tiny Llama tokenizer's
    intermediate_size=96,
    num_hidden_layers=2,
    max_position_embeddings=512,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=2,
)
# What each family brings that the others do not (docs/design.md, "Converting a Llama checkpoint").
FAMILIES = {
    # Llama: GQA, llama3 rope scaling, MLP biases, untied lm_head.
    "llama": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(
            hidden_size=64,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=32,
            mlp_bias=True,
            attention_bias=True,
            rope_parameters={
                "rope_type": "llama3",
                "factor": 4.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
                "rope_theta": 10000.0,
            },
        ),
    ),
    # Mistral (v0.2 and later: no sliding window): tied embeddings.
    "mistral": (
        MistralConfig,
        MistralForCausalLM,
        dict(
            hidden_size=256,
            num_attention_heads=8,
            num_key_value_heads=4,
            sliding_window=None,
            tie_word_embeddings=True,
        ),
    ),
    # Qwen2: q/k/v biases and none on o_proj; linear rope scaling.
    "qwen2": (
        Qwen2Config,
        Qwen2ForCausalLM,
        dict(
            hidden_size=256,
            num_attention_heads=8,
            num_key_value_heads=4,
            rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        ),
    ),
    # Qwen3: q_norm/k_norm, head_dim != hidden / heads, tied embeddings.
    "qwen3": (
        Qwen3Config,
        Qwen3ForCausalLM,
        dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=4, head_dim=32, tie_word_embeddings=True),
    ),
}
VERSIONS = (1, 2)
# Motif's layouts (tests/helpers/motif.py), sized like the families: 8 query heads over 4 key/value heads become 4
# differential heads over 2 groups; GDA: 10 query heads (2 groups of 4 signal + 1 noise) over 4 key/value heads.
MOTIF = {
    "motif-2.6b": dict(layout="motif-2.6b-gqa", tie_word_embeddings=True),
    "motif-gda": dict(layout="motif-gda", tie_word_embeddings=False),
}
MOTIF_VERSIONS = (1,)
# Task heads: a Llama and a Qwen3 (qk-norm) sequence classifier.
HEADS = {
    "llama-seq-cls": (LlamaConfig, LlamaForSequenceClassification, FAMILIES["llama"][2]),
    "qwen3-seq-cls": (Qwen3Config, Qwen3ForSequenceClassification, FAMILIES["qwen3"][2]),
}


def randomize(model, seed=1234):
    """Spread the weights (a fresh init is nearly uniform) so attention patterns and greedy choices are distinct and
    a misplaced bias or norm shows."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.2 * noise)
    return model


def make_source(path: Path, name: str) -> Path:
    """The tiny random source checkpoint `name` (a family, a head or a Motif layout), saved with the tiny Llama's
    tokenizer."""
    if name in MOTIF:
        write_motif_checkpoint(path, **MOTIF[name], **COMMON, hidden_size=64, head_dim=32)
        AutoTokenizer.from_pretrained(TINY_LLAMA).save_pretrained(path)
        return Path(path)
    config_class, model_class, layout = {**FAMILIES, **HEADS}[name]
    torch.manual_seed(0)
    overrides = {"num_labels": 3} if name in HEADS else {}
    randomize(model_class(config_class(**{**COMMON, **layout, **overrides})).eval()).save_pretrained(path)
    AutoTokenizer.from_pretrained(TINY_LLAMA).save_pretrained(path)
    return Path(path)


def build(root: Path, names=None, versions=VERSIONS) -> dict:
    """{(name, version): converted dir} and {name: source dir} under ROOT, for the families (or NAMES)."""
    sources, converted = {}, {}
    for name in names or FAMILIES:
        sources[name] = make_source(root / f"{name}-source", name)
        for version in MOTIF_VERSIONS if name in MOTIF else versions:
            converted[name, version] = convert_to_diff(
                sources[name], root / f"{name}-v{version}", diff_version=version, progress=False
            )
    return sources, converted
