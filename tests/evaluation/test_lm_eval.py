"""lm-evaluation-harness scores a V2 conversion exactly as it scores the source Llama.

lm-eval runs through its own `hf` model (transformers' Auto classes) on the small local tasks in lm_eval_tasks/ (a
multiple choice, a perplexity and a greedy-generation task over Jane Austen sentences), offline.
"""

import json
import math
import socket
import textwrap
from pathlib import Path

import datasets
import lm_eval
import pytest
import torch
from huggingface_hub import constants
from lm_eval.tasks import TaskManager
from transformers import AutoTokenizer, LlamaForCausalLM

import diff_transformer
from diff_transformer.conversion import convert_llama_to_diff
from tests.helpers.processes import run_json


TINY_LLAMA = Path(diff_transformer.__file__).parent / "assets" / "tiny-llama"
TASKS_DIR = Path(__file__).parent / "lm_eval_tasks"
TASKS = {"diff_tiny_choice": 8, "diff_tiny_rolling": 4, "diff_tiny_generate": 4}  # task: number of documents
MODEL_ARGS = "dtype=float32"
BATCH_SIZE = 4  # pads the shorter requests of a batch
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def evaluate(path):
    """(metrics, samples) of lm-eval's hf model on PATH: {task: {metric: value}}, {task: [per-document responses]}."""
    out = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={path},{MODEL_ARGS}",
        tasks=list(TASKS),
        batch_size=BATCH_SIZE,
        device="cpu",
        task_manager=TaskManager(include_path=str(TASKS_DIR), include_defaults=False),  # lm-eval's own: 5 s to index
        log_samples=True,
        bootstrap_iters=0,
    )
    return metrics_of(out["results"]), {task: responses_of(docs) for task, docs in out["samples"].items()}


def metrics_of(results):
    # lm-eval reports "metric,filter" keys, plus names and "_stderr" entries (N/A without bootstrap).
    return {task: {k: v for k, v in r.items() if "," in k and "_stderr" not in k} for task, r in results.items()}


def responses_of(docs):
    # Loglikelihoods (with is-greedy flags) or generated strings, as JSON would give them back (tuples become lists).
    return json.loads(json.dumps([(d["doc_id"], d["resps"], d["filtered_resps"]) for d in sorted_docs(docs)]))


def sorted_docs(docs):
    return sorted(docs, key=lambda d: d["doc_id"])


@pytest.fixture(scope="module")
def runs(tmp_path_factory, one_torch_thread):
    """{"llama"|"v2"|"v1": (metrics, samples)} of the shipped tiny Llama and its two conversions, plus their paths."""
    root = tmp_path_factory.mktemp("lm_eval")
    paths = {"llama": TINY_LLAMA}
    for version in (1, 2):
        paths[f"v{version}"] = convert_llama_to_diff(
            TINY_LLAMA, root / f"v{version}", diff_version=version, progress=False
        )
    with pytest.MonkeyPatch.context() as mp:
        # Both libraries read the offline flags at import; and any connection at all fails.
        mp.setattr(constants, "HF_HUB_OFFLINE", True)
        mp.setattr(datasets.config, "HF_HUB_OFFLINE", True)
        mp.setattr(socket.socket, "connect", no_network)
        return {name: (*evaluate(path), path) for name, path in paths.items()}


def no_network(*args):
    raise OSError("a test tried to use the network")


def test_v2_scores_equal_the_llama_scores_exactly(runs):
    llama_metrics, llama_samples, _ = runs["llama"]
    v2_metrics, v2_samples, _ = runs["v2"]
    assert set(llama_metrics) == set(TASKS)
    assert set(llama_metrics["diff_tiny_choice"]) == {"acc,none", "acc_norm,none"}
    assert set(llama_metrics["diff_tiny_rolling"]) == {
        "word_perplexity,none",
        "byte_perplexity,none",
        "bits_per_byte,none",
    }
    assert set(llama_metrics["diff_tiny_generate"]) == {"exact_match,strip"}
    assert v2_metrics == llama_metrics
    for task, count in TASKS.items():
        assert len(llama_samples[task]) == count
        # Every loglikelihood to the last bit, and every generated string.
        assert v2_samples[task] == llama_samples[task], task
    assert llama_metrics["diff_tiny_rolling"]["byte_perplexity,none"] > 1
    assert all(text.strip() for _, [[text]], _ in llama_samples["diff_tiny_generate"])


def test_lm_eval_scores_are_the_models_loglikelihoods(runs):
    """The first document's four choices, scored by hand with transformers' Llama: lm-eval measures the model."""
    _, samples, _ = runs["llama"]
    doc = json.loads((TASKS_DIR / "diff_tiny" / "choice.jsonl").read_text().splitlines()[0])
    tokenizer = AutoTokenizer.from_pretrained(TINY_LLAMA)
    model = LlamaForCausalLM.from_pretrained(TINY_LLAMA, dtype=torch.float32).eval()
    context = tokenizer.encode(doc["context"])
    expected = []
    for choice in doc["choices"]:
        ids = tokenizer.encode(doc["context"] + " " + choice)
        assert ids[: len(context)] == context
        with torch.no_grad():
            logprobs = model(torch.tensor([ids])).logits[0].log_softmax(-1)  # (N, V)
        expected.append(sum(logprobs[i - 1, ids[i]].item() for i in range(len(context), len(ids))))
    doc_id, responses, _ = samples["diff_tiny_choice"][0]
    assert doc_id == 0
    got = [ll for [[ll, _]] in responses]
    assert got == pytest.approx(expected, abs=1e-4)


def test_v1_is_scored_and_differs_from_the_llama(runs):
    """V1 reuses every weight but is not function-preserving: valid scores, other loglikelihoods."""
    llama_metrics, llama_samples, _ = runs["llama"]
    v1_metrics, v1_samples, _ = runs["v1"]
    assert set(v1_metrics) == set(llama_metrics)
    for task in ("diff_tiny_choice", "diff_tiny_generate"):
        for name, value in v1_metrics[task].items():
            assert value * TASKS[task] == round(value * TASKS[task]), (task, name, value)  # a count of documents
            assert 0 <= value <= 1
    rolling = v1_metrics["diff_tiny_rolling"]
    assert all(math.isfinite(v) for v in rolling.values())
    assert rolling["byte_perplexity,none"] > 1 and rolling["bits_per_byte,none"] > 0
    assert rolling["bits_per_byte,none"] == pytest.approx(math.log2(rolling["byte_perplexity,none"]))
    assert rolling != llama_metrics["diff_tiny_rolling"]
    for task in ("diff_tiny_choice", "diff_tiny_rolling"):
        loglikelihoods = [ll for _, responses, _ in v1_samples[task] for ll in flat(responses)]
        assert len(loglikelihoods) == len([ll for _, responses, _ in llama_samples[task] for ll in flat(responses)])
        assert all(math.isfinite(ll) and ll < 0 for ll in loglikelihoods)
        assert v1_samples[task] != llama_samples[task]


def flat(responses):
    # [[ll, is_greedy]] per choice (multiple choice) or [ll] (rolling) -> the loglikelihoods.
    return [r[0] if isinstance(r, list) else r for [r] in responses]


# Runs in a fresh interpreter where any attempt to import diff_transformer fails (see _subprocess.py): lm-eval's hf
# model refuses the checkpoint without trust_remote_code=True; its command line scores it with it.
CLI = textwrap.dedent(
    """
    import json, sys
    from lm_eval.__main__ import cli_evaluate
    from lm_eval.models.huggingface import HFLM

    path, model_args, batch_size, tasks, tasks_dir, output = sys.argv[1:7]
    try:
        HFLM(pretrained=path, device="cpu")
    except ValueError as error:
        refused = "trust_remote_code" in str(error)
    else:
        refused = False
    model_args = f"pretrained={path},{model_args},trust_remote_code=True"
    sys.argv = ["lm-eval", "run", "--model", "hf", "--model_args", model_args,
                "--batch_size", batch_size, "--device", "cpu", "--tasks", tasks, "--include_path", tasks_dir,
                "--log_samples", "--output_path", output]
    cli_evaluate()
    print(json.dumps({
        "refused_without_trust": refused,
        "imported_diff_transformer": any(m.startswith("diff_transformer") for m in sys.modules),
        "remote_code": sorted(m for m in sys.modules if m.startswith("transformers_modules.") and "modeling" in m),
    }))
    """
)


@pytest.mark.slow  # end to end (a command, a training run): in the whole suite, not the quick loop
def test_command_line_with_trust_remote_code_without_the_package(runs, tmp_path):
    """docs/evaluation.md's `lm-eval run --model hf --model_args pretrained=...,trust_remote_code=True` where
    diff_transformer is not installed: the checkpoint's own code runs and scores exactly as the Llama does."""
    llama_metrics, llama_samples, _ = runs["llama"]
    env = {**OFFLINE, "HF_HOME": str(tmp_path / "hf"), "OMP_NUM_THREADS": "1"}
    args = runs["v2"][2], MODEL_ARGS, BATCH_SIZE, ",".join(TASKS), TASKS_DIR, tmp_path / "out"
    report = run_json(CLI, *args, env=env)
    assert report["refused_without_trust"]
    assert report["imported_diff_transformer"] is False
    assert [m.rsplit(".", 1)[-1] for m in report["remote_code"]] == ["modeling_diff"]
    [results_file] = (tmp_path / "out").glob("*/results_*.json")
    assert metrics_of(json.loads(results_file.read_text())["results"]) == llama_metrics
    for task in TASKS:
        [samples_file] = results_file.parent.glob(f"samples_{task}_*.jsonl")
        docs = [json.loads(line) for line in samples_file.read_text().splitlines()]
        # str() of a float is its repr, which gives back the same float to the last bit.
        assert responses_of(docs) == as_text(llama_samples[task]), task


def as_text(value):
    # lm-eval's samples file: str() of every float and bool
    if isinstance(value, list):
        return [as_text(v) for v in value]
    return str(value) if isinstance(value, (float, bool)) else value
