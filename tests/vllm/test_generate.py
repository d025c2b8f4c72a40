"""vLLM's greedy tokens equal `DiffForCausalLM.generate`'s, for V1 and V2, one process and tensor parallel 2."""

import pytest


pytest.importorskip("vllm", reason="needs vLLM (the environment .ci/run builds from constraints-vllm.txt)")

from tests.vllm.helpers import reference_greedy, run_vllm_generate  # noqa: E402


MODELS = ["v1-random", "v2-random", "tiny-llama-v2", "tiny-llama-v1", "v1-odd-random"]


@pytest.fixture(scope="module")
def vllm_tokens(models, prompts, tmp_path_factory):
    # One child process loads the models one after the other (each engine start costs tens of seconds).
    return run_vllm_generate([models[name] for name in MODELS], prompts, tmp_path_factory.mktemp("job"))


@pytest.mark.parametrize("name", MODELS)
def test_greedy_tokens_match_transformers(name, models, prompts, vllm_tokens):
    expected = reference_greedy(models[name], prompts)
    assert len({token for tokens in expected for token in tokens}) > 8  # not a degenerate, repetitive reference
    assert vllm_tokens[str(models[name])] == expected


def test_tensor_parallel_2(models, prompts, tmp_path):
    """Heads, key/value groups (split for V1's 2 groups, replicated for V2's single one) and V2's λ rows on 2 ranks."""
    names = ["v1-random", "v2-random"]
    tokens = run_vllm_generate([models[n] for n in names], prompts, tmp_path, tensor_parallel_size=2)
    for name in names:
        assert tokens[str(models[name])] == reference_greedy(models[name], prompts), name
