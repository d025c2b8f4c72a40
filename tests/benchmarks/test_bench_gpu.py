"""benchmarks/bench_gpu.py: the --smoke run end to end (tiny shapes on CPU), its JSON checked against its own raw
samples, the ratio arithmetic against hand-computed numbers, and its refusals (exit code 2, nothing written)."""

import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys

import pytest
import torch

from tests.helpers import REPOSITORY, load_script


REPO = REPOSITORY
SCRIPT = REPO / "benchmarks" / "bench_gpu.py"
bench_gpu = load_script(SCRIPT)


MODELS = ["llama", "diffllama", "v1", "v2", "v2wide"]
COMPILED = ["llama/sdpa", "v1/sdpa", "v2/sdpa"]  # the default compile configs but v1/diff_triton (it needs a GPU)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_gpu")
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--out-dir", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out, json.loads((out / "results_gpu.json").read_text())


def ok_configs(data, metric):
    return {c: r for c, r in data["metrics"][metric]["configs"].items() if r["status"] == "ok"}


@pytest.mark.slow
def test_smoke_measures_every_section_for_every_model(smoke):
    _, data = smoke
    specs = bench_gpu.metric_specs(data["size"])
    assert set(data["metrics"]) == set(specs)  # every metric of every section
    assert {s for s, *_ in specs.values()} == set(bench_gpu.SECTIONS)
    reps = data["runs"][0]["reps"]
    for metric, entry in data["metrics"].items():
        section = entry["section"]
        ok = ok_configs(data, metric)
        if metric == "attn_core":
            expected = {"llama/sdpa", "v1/sdpa"}
        elif section in ("train_compile", "decode_static"):
            expected = set(COMPILED)
        else:  # every model, on sdpa and on eager (the smoke's backends that run on CPU)
            expected = {f"{m}/{b}" for m in MODELS for b in ("sdpa", "eager")}
            if metric == "attn_layer":
                expected = {f"{m}/sdpa" for m in MODELS}
        assert set(ok) == expected, (metric, sorted(ok))
        for c, r in ok.items():
            assert r["reps"] == list(range(reps)), (metric, c)
            for v in r["values"] + r["peak_mib"]:
                assert math.isfinite(v) and v > 0, (metric, c, v)
        if section in ("train_compile", "decode_static"):
            for c in COMPILED:
                assert ok[c]["notes"]["compile_s"] > 0
        if section == "decode_static":
            assert all(x["compiled"] for r in ok.values() for x in r["extra"])
    for m in MODELS:
        assert data["models"][m]["params_lm"] > 0
    # V1 has exactly Llama's matrices plus its lambda vectors (4d) and subln (2d) per layer.
    size = data["size"]
    extra = data["models"]["v1"]["params_lm"] - data["models"]["llama"]["params_lm"]
    assert extra == 6 * size["head_dim"] * size["layers"]


@pytest.mark.slow
def test_smoke_records_why_backends_were_not_measured(smoke):
    _, data = smoke
    probes = data["probes"]
    if importlib.util.find_spec("flash_attn") is None:
        assert probes["llama/flash_attention_2"] == {
            "ok": False,
            "reason": "not installed (the flash_attn package does not import)",
        }
    if not torch.cuda.is_available():  # the fused kernel needs a GPU
        assert probes["v1/diff_triton"]["reason"].startswith("unavailable: ")
        assert data["metrics"]["attn_core"]["configs"]["v1/diff_triton"]["status"].startswith("unavailable: ")
        assert data["metrics"]["train_compile"]["configs"].get("v1/diff_triton") is None
    assert "v2/diff_triton" not in probes  # the kernel is V1's


@pytest.mark.slow
def test_smoke_ratios_follow_from_the_raw_samples(smoke):
    _, data = smoke
    for metric, rows in data["summary"].items():
        configs = ok_configs(data, metric)
        higher = data["metrics"][metric]["higher_is_better"]
        llama = {c: statistics.median(r["values"]) for c, r in configs.items() if c.startswith("llama/")}
        best = (max if higher else min)(llama, key=llama.get)
        for c, row in rows.items():
            r = configs[c]
            assert row["median"] == statistics.median(r["values"])
            same = configs.get("llama/" + c.split("/")[1])
            if same is None:
                assert row["ratio_llama_same"] is None
            else:  # one group: the median of the per-rep ratios
                expected = statistics.median(v / w for v, w in zip(r["values"], same["values"]))
                assert row["ratio_llama_same"] == pytest.approx(expected, rel=1e-12)
            expected = statistics.median(v / w for v, w in zip(r["values"], configs[best]["values"]))
            assert row["llama_best"] == best
            assert row["ratio_llama_best"] == pytest.approx(expected, rel=1e-12)
        assert rows["llama/sdpa"]["ratio_llama_same"] == 1.0


@pytest.mark.slow
def test_smoke_report_is_generated_from_the_json(smoke):
    out, data = smoke
    md = (out / "results_gpu.md").read_text()
    for metric in data["metrics"]:
        assert f"## {metric}:" in md
    assert "SMOKE" in md and "not installed" in md
    (out / "results_gpu.md").unlink()
    assert bench_gpu.main(["--report-only", "--out-dir", str(out)]) == 0
    assert (out / "results_gpu.md").read_text() == md


def test_paired_ratios_by_hand():
    def rec(values, group="0.0", reps=None):
        return {
            "status": "ok",
            "group": group,
            "reps": reps or list(range(len(values))),
            "values": values,
            "peak_mib": [10.0] * len(values),
        }

    data = {
        "metrics": {
            "train": {
                "higher_is_better": True,
                "configs": {
                    "llama/sdpa": rec([100.0, 200.0, 400.0]),
                    "llama/flex_attention": rec([50.0, 100.0, 300.0], group="0.1"),
                    "v1/sdpa": rec([90.0, 150.0, 440.0]),
                    "v1/diff_triton": rec([80.0, 210.0], reps=[0, 2]),
                    "v2/sdpa": {"status": "error: CUDA out of memory", "reps": [], "values": [], "peak_mib": []},
                },
            }
        }
    }
    summary, _ = bench_gpu.summarize(data)
    rows = summary["train"]
    assert rows["llama/sdpa"]["llama_best"] == "llama/sdpa"  # median 200 > 100
    assert rows["v1/sdpa"]["ratio_llama_same"] == pytest.approx(0.9)  # median of 0.9, 0.75, 1.1
    # v1/diff_triton has no Llama on its backend; paired with llama/sdpa on reps 0 and 2: 0.8, 0.525
    assert rows["v1/diff_triton"]["ratio_llama_same"] is None
    assert rows["v1/diff_triton"]["ratio_llama_best"] == pytest.approx((0.8 + 0.525) / 2)
    # another group (another pass): not paired by rep, ratio of medians 100 / 200
    assert rows["llama/flex_attention"]["ratio_llama_best"] == pytest.approx(0.5)
    assert "v2/sdpa" not in rows


def test_refusals_exit_2_and_write_nothing(tmp_path, capsys):
    assert bench_gpu.main(["--smoke", "--sections", "train,bogus", "--out-dir", str(tmp_path)]) == 2
    assert "unknown section bogus" in capsys.readouterr().err
    assert bench_gpu.main(["--smoke", "--compile-configs", "v1", "--out-dir", str(tmp_path)]) == 2
    assert bench_gpu.main(["--report-only", "--out-dir", str(tmp_path)]) == 2
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "results_gpu.json").write_text("{}")
    assert bench_gpu.main(["--smoke", "--out-dir", str(tmp_path)]) == 2
    assert "pass --merge to add to it or --overwrite" in capsys.readouterr().err
    assert (tmp_path / "results_gpu.json").read_text() == "{}"
    if not torch.cuda.is_available():
        assert bench_gpu.main(["--out-dir", str(tmp_path / "gpu")]) == 2
        assert "no CUDA device" in capsys.readouterr().err
        assert not (tmp_path / "gpu").exists()


def test_failures_and_the_time_budget_are_recorded_not_raised(tmp_path):
    import argparse

    size = dict(bench_gpu.SMOKE)
    data = {"schema": 1, "smoke": True, "size": size, "runs": [], "models": {}, "probes": {}, "metrics": {}}
    results = bench_gpu.Results(tmp_path / "r.json", tmp_path / "r.md", data)
    args = argparse.Namespace(reps=3, time_budget=None, smoke=True)
    runner = bench_gpu.Runner(args, size, bench_gpu.Device(torch.device("cpu")), torch.float32, results)
    calls = {"n": 0}

    def fine():
        return {"value": 2.0, "peak_mib": 1.0}

    def ooms_on_second_rep():
        calls["n"] += 1
        if calls["n"] == 3:  # warm-up, rep 0, then rep 1 fails
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB\nmore text")
        return {"value": 1.0, "peak_mib": 1.0}

    runner.run_metric("train", {"llama/sdpa": fine, "v1/sdpa": ooms_on_second_rep, "v2/sdpa": "not installed (x)"})
    saved = json.loads((tmp_path / "r.json").read_text())["metrics"]["train"]["configs"]
    assert saved["llama/sdpa"]["values"] == [2.0, 2.0, 2.0]
    assert saved["v1/sdpa"]["status"] == (
        "error: CUDA out of memory: OutOfMemoryError: CUDA out of memory. Tried to allocate 4.00 GiB"
    )
    assert saved["v1/sdpa"]["values"] == [1.0]  # rep 0 kept
    assert saved["v2/sdpa"]["status"] == "not installed (x)"
    assert "error: CUDA out of memory" in (tmp_path / "r.md").read_text()

    args.time_budget = 1e-3  # already spent: nothing new starts
    runner.run_metric("prefill_16", {"llama/sdpa": fine})
    assert data["metrics"]["prefill_16"]["configs"]["llama/sdpa"]["status"] == "skipped: time budget"
    assert runner.budget_hit
