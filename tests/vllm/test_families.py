"""vLLM serves every family the converter reads (Llama, Mistral, Qwen2, Qwen3), V1 and V2: greedy tokens equal
`DiffForCausalLM.generate`'s, also under tensor parallelism for a qk-norm (Qwen3) model; what vLLM cannot compute is
refused in one line when the engine loads the model."""

import json

import pytest


pytest.importorskip("vllm", reason="needs vLLM (the environment .ci/run builds from constraints-vllm.txt)")

from tests.matrix.models import FAMILIES, VERSIONS, build  # noqa: E402
from tests.vllm.helpers import reference_greedy, run_vllm_generate, run_vllm_job  # noqa: E402


CELLS = [(family, version) for family in FAMILIES for version in VERSIONS]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    return build(tmp_path_factory.mktemp("families"))[1]


@pytest.fixture(scope="module")
def vllm_tokens(converted, prompts, tmp_path_factory):
    # One child process loads the eight models one after the other (each engine start costs seconds).
    return run_vllm_generate(
        [converted[cell] for cell in CELLS], prompts, tmp_path_factory.mktemp("job"), timeout=1800
    )


@pytest.mark.parametrize("family, version", CELLS, ids=[f"{f}-v{v}" for f, v in CELLS])
def test_greedy_tokens_match_transformers(family, version, converted, prompts, vllm_tokens):
    expected = reference_greedy(converted[family, version], prompts)
    assert len({token for tokens in expected for token in tokens}) > 8  # not a degenerate, repetitive reference
    assert vllm_tokens[str(converted[family, version])] == expected


def test_tensor_parallel_2_with_qk_norm(converted, prompts, tmp_path):
    """Qwen3's q_norm/k_norm act on each rank's local sub-heads; V1's single key/value group is replicated."""
    cells = [("qwen3", 1), ("qwen3", 2)]
    tokens = run_vllm_generate([converted[c] for c in cells], prompts, tmp_path, tensor_parallel_size=2)
    for cell in cells:
        assert tokens[str(converted[cell])] == reference_greedy(converted[cell], prompts), cell


def test_unsupported_activation_is_refused_in_one_line(converted, tmp_path):
    model = tmp_path / "gelu"
    source = converted["llama", 2]
    model.mkdir()
    for path in source.iterdir():
        (model / path.name).write_bytes(path.read_bytes())
    config = json.loads((model / "config.json").read_text())
    config["hidden_act"] = "gelu"
    (model / "config.json").write_text(json.dumps(config))
    result = run_vllm_job([model], [[5, 6, 7]], tmp_path, max_tokens=2)
    assert result.returncode != 0
    # vLLM logs the worker's error (our one line, at the end of its traceback) on stdout, then fails on stderr.
    assert (
        "ValueError: hidden_act='gelu' is not supported by diff-transformer's vLLM model (only silu, poly_norm)"
        in (result.stdout + result.stderr)
    )
