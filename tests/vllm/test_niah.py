"""`diff-transformer niah --backend vllm`: the grid vLLM (the plugin) gives equals the one transformers gives, for the
shipped tiny Llama's V2 and V1 conversions: the same answers and VALUE log-probabilities within fp32 noise."""

import json
import subprocess
import sys

import pytest


pytest.importorskip("vllm", reason="needs vLLM (the environment .ci/run builds from constraints-vllm.txt)")

from tests.vllm.helpers import vllm_env  # noqa: E402


def niah(out, backend, models):
    argv = [sys.executable, "-m", "diff_transformer", "niah", *map(str, models), "--out", str(out), "--quiet"]
    argv += ["--lengths", "150", "300", "--depths", "0", "1", "--needles", "2", "--dtype", "float32"]
    argv += ["--no-figure"]  # the vLLM environment has no matplotlib
    done = subprocess.run(
        [*argv, "--backend", backend],
        capture_output=True,
        text=True,
        env=vllm_env(engine_in_process=True),
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out / "niah.json").read_text())["results"]


def test_vllm_grid_equals_transformers_grid(models, tmp_path):
    checkpoints = [models["tiny-llama-v2"], models["tiny-llama-v1"]]  # the plugin's two versions (one engine each)
    expected = niah(tmp_path / "hf", "transformers", checkpoints)
    served = niah(tmp_path / "vllm", "vllm", checkpoints)
    for hf, vl in zip(expected, served):
        for a, b in zip(hf["cells"], vl["cells"]):
            assert (a["length"], a["depth"], a["accuracy"]) == (b["length"], b["depth"], b["accuracy"]), hf["model"]
            assert [s["answer"] for s in a["samples"]] == [s["answer"] for s in b["samples"]], hf["model"]
            for x, y in zip(a["samples"], b["samples"]):
                assert x["value_logprob"] == pytest.approx(y["value_logprob"], abs=1e-2), hf["model"]
