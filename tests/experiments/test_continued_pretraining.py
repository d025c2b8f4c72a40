"""experiments/continued_pretraining: a run measured at step 0 and the end (measure.py), read back when it finished
before an interruption, and resumed from its last checkpoint when it did not."""

import importlib.util
import json
from pathlib import Path

import pytest


REPOSITORY = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def driver():
    path = REPOSITORY / "experiments" / "continued_pretraining" / "continued_pretraining.py"
    spec = importlib.util.spec_from_file_location("example_continued_pretraining", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_runs_are_measured_read_back_and_resumed(driver, tmp_path, monkeypatch, one_torch_thread):
    work, results = tmp_path / "work", tmp_path / "results"

    def run(steps):
        argv = ["--models", "llama", "--seeds", "0", "--steps", str(steps), "--save-every", "1", "--eval-every", "1"]
        argv += ["--workdir", str(work), "--resume", "--docs", str(tmp_path / "docs"), "--results", str(results)]
        assert driver.main([*argv, "--stem", "t", "--block-size", "256", "--batch-size", "1"]) == 0
        return json.loads((results / "t.json").read_text())["results"]["llama"]["runs"]["0"]

    first = run(2)
    measured = first["measured"]
    assert set(measured) == {"step0", "end"}
    for at in measured.values():
        assert len(at["noise_per_layer"]) == 4 and all(0 < n < 1 for n in at["noise_per_layer"])
        assert at["noise"] == pytest.approx(sum(at["noise_per_layer"]) / 4) and at["ppl_text2"] > 1
    assert [step for step, _ in first["eval_perplexity"]] == [0, 1, 2]

    # Finished before the interruption: read back, not trained again.
    monkeypatch.setattr(driver.cli, "main", lambda argv: pytest.fail(f"trained again: {argv}"))
    again = run(2)
    assert again["eval_perplexity"] == first["eval_perplexity"] and again["measured"] == measured
    monkeypatch.undo()

    # Interrupted after its step-2 checkpoint (the run's final files not yet written): goes on from there.
    (work / "run-llama-seed0" / "train_results.json").unlink()
    resumed = run(3)
    assert [step for step, _ in resumed["eval_perplexity"]] == [0, 1, 2, 3]
    assert resumed["eval_perplexity"][:3] == first["eval_perplexity"]
