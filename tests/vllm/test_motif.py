"""vLLM serves converted Motif checkpoints (docs/motif.md): Motif-2.6B's layout and grouped differential attention,
PolyNorm included, with greedy tokens equal to `DiffForCausalLM.generate`'s, with prefix caching on (a second pass over
the same prompts, served from the cache, gives the same tokens), and under tensor parallelism over 2 CPU ranks
(PolyNorm's statistics all-reduced over the intermediate width; each rank takes whole noise groups)."""

import pytest


pytest.importorskip("vllm", reason="needs vLLM (the environment .ci/run builds from constraints-vllm.txt)")

from tests.matrix.models import MOTIF, build  # noqa: E402
from tests.vllm.helpers import reference_greedy, run_vllm_generate  # noqa: E402


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    return build(tmp_path_factory.mktemp("motif"), list(MOTIF))[1]


@pytest.fixture(scope="module")
def references(converted, prompts):
    return {layout: reference_greedy(converted[layout, 1], prompts) for layout in MOTIF}


def test_greedy_tokens_match_transformers_with_prefix_caching(converted, prompts, references, tmp_path):
    models = [converted[layout, 1] for layout in MOTIF]
    report = run_vllm_generate(
        models, prompts, tmp_path, timeout=1200, full=True, enable_prefix_caching=True, repeat=True
    )
    for layout in MOTIF:
        expected = references[layout]
        assert len({token for tokens in expected for token in tokens}) > 8  # not a degenerate reference
        assert report["tokens"][str(converted[layout, 1])] == expected, layout
        assert report["repeated"][str(converted[layout, 1])] == expected, layout  # from the prefix cache


def test_tensor_parallel_2(converted, prompts, references, tmp_path):
    models = [converted[layout, 1] for layout in MOTIF]
    tokens = run_vllm_generate(models, prompts, tmp_path, tensor_parallel_size=2, timeout=1200)
    for layout in MOTIF:
        assert tokens[str(converted[layout, 1])] == references[layout], layout
