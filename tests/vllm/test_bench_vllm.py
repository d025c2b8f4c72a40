"""benchmarks/bench_vllm.py end to end, as small as it goes: the tiny Llama on vLLM's Llama and its V2 conversion on
the plugin, one prefill-heavy round of 2 requests with prefix caching on; the JSON and the report it writes."""

import json
import subprocess
import sys

import pytest

from tests.helpers import REPOSITORY
from tests.vllm.helpers import vllm_env


pytest.importorskip("vllm", reason="needs vLLM (the environment .ci/run builds from constraints-vllm.txt)")


def test_a_small_run_measures_llama_and_v2_with_floors(tmp_path):
    out = tmp_path / "results_vllm.json"
    command = [sys.executable, str(REPOSITORY / "benchmarks" / "bench_vllm.py"), "--models", "v2"]
    command += ["--mixes", "prefill", "--prefix-caching", "on", "--requests", "2", "--reps", "1"]
    command += ["--prefill-tokens", "2", "--prompt-tokens", "150", "--max-model-len", "256", "--block-size", "32"]
    command += ["--json", str(out), "--md", str(tmp_path / "results_vllm.md")]
    proc = subprocess.run(
        command, capture_output=True, text=True, env=vllm_env(), stdin=subprocess.DEVNULL, timeout=900, check=False
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    data = json.loads(out.read_text())
    rows = {r["model"]: r for r in data["rows"]}
    assert set(rows) == {"llama", "v2"} and data["meta"]["vllm"] == "0.32.0"
    for row in rows.values():
        assert (row["server"], row["mix"], row["prefix_caching"], row["tokens"]) == ("vllm", "prefill", True, 2)
        assert len(row["wave_s"]) == len(row["wave_cpu_s"]) == 1 and row["requests_per_s"] > 0
        assert 0 < row["wave_cpu_s"][0] < 20 * row["wave_s"][0]  # the server's processes, not the machine's
        assert row["prompt_tokens"] > data["setup"]["shared_prefix_tokens"] > 100  # about 150 document tokens
        assert row["cached_prompt_tokens"] == data["setup"]["shared_prefix_tokens"] // 32 * 32
    assert rows["llama"]["ratio_llama"] == rows["llama"]["floor"] == 1.0
    assert rows["llama"]["cpu_ratio_llama"] == 1.0 and rows["v2"]["cpu_ratio_llama"] > 0
    assert rows["v2"]["ratio_llama"] > 0 and 0.5 < rows["v2"]["floor"] < 1  # V2 doubles q_proj: more work
    assert "| Diff V2 | vLLM | on |" in (tmp_path / "results_vllm.md").read_text()
