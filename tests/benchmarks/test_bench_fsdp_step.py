"""benchmarks/bench_fsdp_step.py (gpu_checks.sh's FSDP2 step) on CPU with --tiny: it runs under torchrun, shards,
trains every model and reports tokens/s with the ratio to Llama from its own numbers."""

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import REPOSITORY


@pytest.mark.slow
def test_tiny_fsdp_step_smoke(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(REPOSITORY / "src"), env.get("PYTHONPATH", "")]))
    out = tmp_path / "fsdp.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
               str(REPOSITORY / "benchmarks" / "bench_fsdp_step.py"), "--tiny", "--batch", "2", "--seq", "16",
               "--steps", "1", "--out", str(out)]  # fmt: skip
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, cwd=REPOSITORY)
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads(out.read_text())
    rows = record["results"]
    assert set(rows) == {"llama", "v1", "v2"}
    for row in rows.values():
        assert "error" not in row, row
        assert row["tokens_per_s"] == pytest.approx(2 * 16 / row["step_s"])
        assert row["ratio_llama"] == pytest.approx(row["tokens_per_s"] / rows["llama"]["tokens_per_s"])
