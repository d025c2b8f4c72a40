"""experiments/multi_needle/multi_needle.py: the task it builds is the one docs/experiments/multi_needle.md describes,
and the script runs."""

import importlib.util
import json

import numpy as np
import pytest
import torch

from tests.helpers import REPOSITORY


REPO = REPOSITORY


@pytest.fixture(scope="module")
def mn():
    spec = importlib.util.spec_from_file_location(
        "multi_needle", REPO / "experiments" / "multi_needle" / "multi_needle.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def task(mn):
    corpus = mn.words(REPO / "data" / "heldout.txt")
    return mn.NeedleTask(mn.build_tokenizer(corpus, 600), corpus, 200), mn


def test_every_answer_is_the_number_of_the_asked_city(task):
    task, mn = task
    rng = np.random.default_rng(0)
    for n, r in [(1, 1), (3, 2), (6, 6)]:
        for depth in (None, 0.0, 0.5, 1.0):
            ids, answers, starts = task.sample(rng, n, r, first_depth=depth)
            assert len(ids) == 200 and ids[0] == task.bos
            needles, needle_starts = {}, []  # city -> number, read back from the token stream
            for i in range(len(ids) - 3):
                if ids[i : i + 4] == [task.the, task.magic, task.number, task.of] and (
                    i == 0 or ids[i - 1] != task.is_
                ):
                    assert ids[i + 5] == task.is_ and ids[i + 7] == task.dot
                    needles[ids[i + 4]] = ids[i + 6]
                    needle_starts.append(i)
            assert len(needles) == n  # distinct cities, every needle intact
            assert len(answers) == r
            for (position, answer), start in zip(answers, starts):
                assert ids[position] == task.question and ids[position + 1] == answer
                city = ids[position - 1]
                assert needles[city] == answer and ids[start + 4] == city and ids[start + 6] == answer
            if depth is not None:
                hay_len = 200 - 1 - mn.NEEDLE_LEN * n - mn.QUERY_LEN * r
                before = sum(1 for s in needle_starts if s < starts[0])
                hay_before = starts[0] - 1 - mn.NEEDLE_LEN * before  # haystack tokens before the first asked needle
                assert hay_before == round(depth * hay_len)


def test_needle_starts_finds_every_needle_and_no_query(task):
    task, _ = task
    ids, answers, starts = task.sample(np.random.default_rng(2), 5, 3)
    found = task.needle_starts(ids)
    assert len(found) == 5 and set(starts) <= set(found)
    assert all(ids[s + 7] == task.dot and s < answers[0][0] - 9 for s in found)


def test_training_labels_are_the_answers_only(task):
    task, _ = task
    rng = np.random.default_rng(1)
    ids, labels = task.training_batch(rng, 4, 6, min_length=120)
    assert 120 <= ids.shape[1] <= 200 and labels.shape == ids.shape
    picked = labels != -100
    assert (ids[picked] == task.question).all()  # the loss sits on "?" positions ...
    shifted = torch.cat([ids[:, 1:], ids[:, :1]], 1)
    assert (labels[picked] == shifted[picked]).all()  # ... predicting the next token, the number
    # Every query is trained: one per needle (the haystack's own "?" tokens are not queries).
    assert picked.sum(1).tolist() == [len(task.needle_starts(row)) for row in ids.tolist()]


def test_training_queries_are_drawn_with_replacement(task):
    """Asking every needle once (the first version) let elimination, "a number not asked yet", score 0.75 / 0.29 /
    0.18 at N = 2 / 4 / 6 with no retrieval; with replacement an earlier query says nothing about a later one."""
    task, _ = task
    rng = np.random.default_rng(3)
    repeated = permutations = 0
    for _ in range(40):
        ids, labels = task.training_batch(rng, 4, 6, min_length=120)
        for row, row_labels in zip(ids.tolist(), labels.tolist()):
            asked = [row[t - 1] for t, label in enumerate(row_labels) if label != -100]  # the CITY before each "?"
            needles = len(task.needle_starts(row))
            assert len(asked) == needles  # N questions for N needles ...
            repeated += len(set(asked)) < len(asked)  # ... some asking a needle twice
            permutations += needles > 1 and len(set(asked)) == needles
    assert repeated > 20 and permutations > 5


def test_the_three_models_have_equal_parameter_counts(mn):
    args = mn.parse_args(["--output", "unused"])
    configs = mn.build_configs(args, vocab_size=2048)
    counts = {name: sum(p.numel() for p in mn.build_model(name, c, 0).parameters()) for name, c in configs.items()}
    assert abs(counts["v1"] / counts["llama"] - 1) < 1e-3 and abs(counts["v2"] / counts["llama"] - 1) < 1e-3
    assert configs["v1"].num_attention_heads == args.heads // 2 and configs["v2"].num_attention_heads == args.heads


@pytest.mark.slow  # 10-25 s (server starts, subprocesses): the full suite runs it, the quick loop does not
def test_script_trains_evaluates_and_writes_its_outputs(mn, tmp_path):
    small = ["--length", "128", "--min-length", "128", "--hidden-size", "32", "--intermediate-size", "64",
             "--layers", "2", "--steps", "2", "--batch-size", "2", "--eval-per-cell", "1", "--eval-batch", "5",
             "--attention-per-depth", "1", "--vocab-size", "400"]  # fmt: skip
    mn.main(["--output", str(tmp_path), *small])
    results = json.loads((tmp_path / "results.json").read_text())
    assert set(results["models"]) == {"llama", "v1", "v2"}
    for name, model in results["models"].items():
        run = model["seeds"][0]
        assert len(run["curve"]) == 1 and np.isfinite(run["curve"][0]["loss"])
        assert set(run["accuracy"]) == {"N=1,R=1", "N=2,R=2", "N=4,R=2", "N=6,R=2"}
        for (n, r), cell in zip(mn.EVAL_CELLS, run["accuracy"].values()):  # the first answer, and each query's
            assert len(cell["by_query"]) == r and cell["accuracy"] == cell["by_query"][0]
            assert cell["all_answers"] == pytest.approx(np.mean(cell["by_query"]))
        answer, noise = np.array(run["attention"]["answer"]), np.array(run["attention"]["noise"])
        assert answer.shape == (2, model["config"]["num_attention_heads"])
        distractors = np.array(run["attention"]["distractors"])
        if name == "llama":  # a softmax row: answer + noise = 1, and the other needles are part of the noise
            np.testing.assert_allclose(answer + noise, 1, atol=1e-5)
            assert (distractors > 0).all() and (distractors < noise).all()
        assert (tmp_path / "models" / f"{name}-seed0" / "model.safetensors").is_file()
        assert set(run["accuracy_by_length"]) == {"128"}  # the lengths up to --length
    for name in ("curves.png", "accuracy.png", "attention.png", "maps.png", "tables.md"):
        assert (tmp_path / name).stat().st_size > 0
    # Re-evaluating the saved models reproduces the figures (same seeds, same weights).
    mn.main(["--output", str(tmp_path), *small, "--evaluate-only"])
    again = json.loads((tmp_path / "results.json").read_text())
    for name, model in results["models"].items():
        before, after = model["seeds"][0], again["models"][name]["seeds"][0]
        assert after["accuracy"] == before["accuracy"] and after["accuracy_by_length"] == before["accuracy_by_length"]
        for key in ("answer", "noise", "entropy"):
            np.testing.assert_allclose(after["attention"][key], before["attention"][key], atol=1e-6)


def test_sequences_too_short_for_the_needles_are_refused(mn, capsys):
    with pytest.raises(SystemExit) as exit_info:
        mn.parse_args(["--output", "x", "--min-length", "64"])
    assert exit_info.value.code == 2 and "raise them or lower --max-needles" in capsys.readouterr().err


def test_outputs_that_would_overwrite_are_refused(mn, tmp_path, monkeypatch, capsys):
    user = tmp_path / "user"
    user.mkdir()
    (user / "mine.txt").write_text("the user's")
    monkeypatch.chdir(user)
    for argv, message in [
        (["--output", ""], "is empty"),
        (["--output", "."], "is the current directory"),
        (["--output", str(tmp_path)], "is a parent of the current directory"),
        (["--output", str(user / "..")], "is a parent of the current directory"),
        (["--output", str(tmp_path / "new"), "--plot-only"], "holds no results.json"),
        (["--output", str(tmp_path / "new"), "--evaluate-only"], "holds no results.json"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            mn.parse_args(argv)
        assert exit_info.value.code == 2 and message in capsys.readouterr().err, argv
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        mn.parse_args(["--output", "user"])
    assert (
        exit_info.value.code == 2 and "is not empty: pass a new directory, or --overwrite" in capsys.readouterr().err
    )
    assert mn.parse_args(["--output", "user", "--overwrite"]).output == user
    assert [p.name for p in user.iterdir()] == ["mine.txt"]
