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


@pytest.mark.slow  # end to end (a command, a training run): in the whole suite, not the quick loop
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


def _load(name):
    path = REPOSITORY / "experiments" / "continued_pretraining" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_python_reference_is_split_by_topic_with_nothing_shared(tmp_path):
    from pydoc_data.topics import topics

    domain_text = _load("domain_text")
    assert domain_text.main(["pydoc", str(tmp_path)]) == 0
    train = (tmp_path / "train.txt").read_text(encoding="utf-8")
    heldout = (tmp_path / "heldout.txt").read_text(encoding="utf-8")
    names = sorted(topics)
    held = names[domain_text.HELDOUT_EVERY - 1 :: domain_text.HELDOUT_EVERY]
    # every topic is in exactly one of the two texts (a topic's text is long and unique enough to search for)
    for name in names:
        assert (topics[name] in heldout) == (name in held) and (topics[name] in train) == (name not in held), name
    assert len(train) + len(heldout) == sum(len(topics[n]) for n in names) + 2 * (len(names) - 2)
    assert 0.1 < len(heldout) / (len(train) + len(heldout)) < 0.25  # enough held-out blocks for the perplexity


def test_second_text_austen_is_the_text_the_tiny_llama_knows(one_torch_thread):
    # The tiny Llama was trained on Austen only: its perplexity on her held-out chapters is far below the Python
    # Language Reference's (47 against > 1,000 measured), so the option must have selected the other text.
    measure = _load("measure")
    llama = REPOSITORY / "src" / "diff_transformer" / "assets" / "tiny-llama"
    austen, pydoc = (measure.measure(llama, 256, text)["ppl_text2"] for text in ("austen", "pydoc"))
    assert austen * 10 < pydoc
    assert "Austen" in measure.second_text_name("austen") and "Language Reference" in measure.second_text_name()


@pytest.mark.slow  # end to end (a command, a training run): in the whole suite, not the quick loop
def test_the_page_says_how_the_v1_start_was_built(driver, tmp_path):
    # The pydoc run's V1 trained from the expanded start with the steady second value half: the merged page says so
    # from what the conversion recorded, not from the generic description of every init.
    results = REPOSITORY / "experiments" / "continued_pretraining" / "results"
    parts = [results / f"smollm2_pydoc_150_{name}.json" for name in ("llama", "v2", "v1cal")]
    argv = ["--merge", *map(str, parts), "--stem", "t", "--results", str(tmp_path), "--docs", str(tmp_path / "docs")]
    assert driver.main(argv) == 0
    page = (tmp_path / "docs" / "t.md").read_text(encoding="utf-8")
    recorded = [line for line in page.splitlines() if "as its conversion recorded it" in line]
    assert len(recorded) == 1 and "expanded layout" in recorded[0] and "second half" in recorded[0]
