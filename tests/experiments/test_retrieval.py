"""experiments/retrieval/retrieval.py: the task is the one docs/experiments/retrieval.md describes, the models match in
size, and the script's saved figures are what re-evaluating its saved models gives."""

import importlib.util
import json

import numpy as np
import pytest
import torch

from tests.helpers import REPOSITORY


REPO = REPOSITORY


@pytest.fixture(scope="module")
def rt():
    spec = importlib.util.spec_from_file_location("retrieval", REPO / "experiments" / "retrieval" / "retrieval.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read_back(task, ids):
    """{key: value} from a context, read from the tokens alone, and the (key, position) of every pair token."""
    pairs, where = {}, []
    for t, token in enumerate(ids):
        if task.kind == "single" and token >= task.pair:
            key, value = divmod(token - task.pair, task.values)
        elif (
            task.kind == "composed"
            and task.key <= token < task.value
            and t + 1 < len(ids)
            and (task.value <= ids[t + 1] < task.pair)
        ):
            key, value = token - task.key, ids[t + 1] - task.value
        else:
            continue
        assert key not in pairs  # distinct keys
        pairs[key] = value
        where.append(t)
    return pairs, where


@pytest.mark.parametrize("kind", ["single", "composed"])
def test_every_label_is_the_value_of_the_asked_key(rt, kind):
    task = rt.RetrievalTask(kind, queries=6, keys=20, values=5, noise=7)
    rng = np.random.default_rng(0)
    asked_twice = 0
    for n, length in [(1, 10), (4, 10), (10, 20), (20, 40)]:
        ids, labels, meta = task.batch(rng, 16, n, length)
        assert ids.shape == labels.shape == (16, 1 + length + 6)
        assert (ids[:, 0] == rt.BOS).all() and ids.max() < task.vocab_size
        assert (labels[:, : 1 + length] == -100).all() and (labels[:, 1 + length :] != -100).all()  # values only
        for row, row_labels, starts, asked in zip(ids.tolist(), labels.tolist(), meta["starts"], meta["asked"]):
            context, queries = row[1 : 1 + length], row[1 + length :]
            pairs, where = read_back(task, context)
            assert len(pairs) == n and [1 + t for t in where] == sorted(starts.tolist())
            others = [tok for t, tok in enumerate(context) if all(not 0 <= t - w < task.width for w in where)]
            assert all(rt.NOISE <= tok < rt.NOISE + 7 for tok in others)  # the rest is noise
            for query, label, pick in zip(queries, row_labels[1 + length :], asked):
                key = query - task.key
                assert 0 <= key < 20 and label == task.value + pairs[key]
                assert row[starts[pick]] in (task.key + key, task.pair + key * 5 + pairs[key])  # meta: its pair
            asked_twice += len(set(queries)) < len(queries)
    assert asked_twice > 0  # queries are drawn with replacement


def test_the_three_models_have_equal_parameter_counts(rt):
    args = rt.parse_args(["--output", "unused"])
    task = rt.make_task(args)
    configs = rt.build_configs(args, task.vocab_size)
    counts = {name: sum(p.numel() for p in rt.build_model(name, c, 0).parameters()) for name, c in configs.items()}
    assert abs(counts["v1"] / counts["llama"] - 1) < 2e-3 and abs(counts["v2"] / counts["llama"] - 1) < 2e-3
    assert configs["v1"].num_attention_heads == args.heads // 2 and configs["v2"].num_attention_heads == args.heads


def test_round_to_nearest_quantization(rt):
    layer = torch.nn.Linear(4, 3, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[1.0, -0.55, 0.26, 0.0], [7.0, 3.2, -7.0, 1.1], [0.1, 0.2, 0.3, -0.35]]))

    class Model(torch.nn.Module):  # what quantize_weights walks: model.model.layers
        def __init__(self):
            super().__init__()
            self.model = torch.nn.Module()
            self.model.layers = torch.nn.ModuleList([layer])

    rt.quantize_weights(Model(), 4)  # 7 levels per sign, per row: scale = max|w| / 7
    # Rows' scales 1/7, 1, 0.05; w / scale = [7, -3.85, 1.82, 0], [7, 3.2, -7, 1.1], [2, 4, 6, -7], rounded.
    expected = torch.tensor([[7.0, -4, 2, 0], [7, 3, -7, 1], [2, 4, 6, -7]]) * torch.tensor([[1 / 7], [1.0], [0.05]])
    torch.testing.assert_close(layer.weight, expected)


def test_bad_sizes_are_refused(rt, capsys):
    for argv in (["--max-pairs", "40"], ["--max-pairs", "16", "--min-length", "20", "--task", "composed"],
                 ["--steps", "0"]):  # fmt: skip
        with pytest.raises(SystemExit) as exit_info:
            rt.parse_args(["--output", "x", *argv])
        assert exit_info.value.code == 2 and "--" in capsys.readouterr().err


@pytest.mark.slow
def test_script_runs_and_re_evaluation_reproduces_it(rt, tmp_path):
    small = ["--length", "16", "--min-length", "8", "--max-pairs", "4", "--keys", "8", "--values", "4",
             "--hidden-size", "32", "--intermediate-size", "64", "--steps", "4", "--batch-size", "4",
             "--grid-steps", "2", "--eval-per-cell", "4", "--eval-batch", "4", "--attention-sequences", "2",
             "--seeds", "2", "--log-every", "2"]  # fmt: skip
    results = rt.main(["--output", str(tmp_path), *small])
    assert set(results["models"]) == {"llama", "v1", "v2"}
    for name, model in results["models"].items():
        assert [run["seed"] for run in model["seeds"]] == [0, 1]
        run = model["seeds"][0]
        assert set(run["accuracy"]) == {"L=16", "L=32", "L=64"}  # 1x, 2x, 4x the training length
        assert set(run["accuracy"]["L=16"]) == {"N=2", "N=4", "N=8"}  # up to --keys
        assert set(run["grid"]) == {"2"} and len(run["curve"]) == 2
        attention = run["attention_summary"]
        assert -1 <= attention["answer_retrieval_head"] <= 1 and 0 <= attention["noise_retrieval_head"] <= 1
        if name == "llama":  # softmax: answer + noise = 1, and the distractor keys are part of the noise
            assert attention["answer_retrieval_head"] + attention["noise_retrieval_head"] == pytest.approx(1)
            assert 0 < attention["distractors_retrieval_head"] < attention["noise_retrieval_head"]
            assert attention["lambda_per_layer"] is None
        else:
            assert len(attention["lambda_per_layer"]) == 2
        outliers = run["outliers"]
        assert 0 <= outliers["logit_median"] <= outliers["logit_max"]
        assert 0 < outliers["hidden_median"] <= outliers["hidden_max"]
        assert set(run["quantized"]) == {"int8", "int4"}
    assert "/" not in json.dumps(results["args"])  # the settings, not where they were written
    for name in ("accuracy.png", "attention.png", "tables.md", "results.json"):
        assert (tmp_path / name).stat().st_size > 0
    again = rt.main(["--output", str(tmp_path), "--evaluate-only"])
    for name, model in results["models"].items():
        for before, after in zip(model["seeds"], again["models"][name]["seeds"]):
            assert after["accuracy"] == before["accuracy"] and after["quantized"] == before["quantized"]
            assert after["attention_summary"]["retrieval_head"] == before["attention_summary"]["retrieval_head"]
            for key in ("answer", "noise", "distractors", "entropy"):
                np.testing.assert_allclose(after["attention"][key], before["attention"][key], atol=1e-6)
            for key, value in before["outliers"].items():
                assert after["outliers"][key] == pytest.approx(value, rel=1e-5), (name, key)
