"""lm-eval's RULER runs offline on a Diff checkpoint, with prompts of the requested length, as docs/evaluation.md says.

RULER's offline tasks generate their data at run time with the tokenizer of the model under test, sized by the
`max_seq_lengths` metadata (docs/evaluation.md gives the command). One small task on the shipped tiny Llama and its
V2 conversion, with the network cut: the prompts are sized to the requested length, and the score is the model's own
greedy answers checked against the needles.
"""

import socket

import datasets
import lm_eval
import pytest
import torch
from huggingface_hub import constants
from lm_eval.tasks import TaskManager
from transformers import AutoModelForCausalLM, AutoTokenizer

from diff_transformer.conversion import convert_llama_to_diff
from tests.evaluation.test_lm_eval import TINY_LLAMA, no_network


pytestmark = pytest.mark.slow  # lm-eval generates RULER data and indexes its tasks: ~1 min, 4 on a loaded machine

pytest.importorskip("wonderwords", reason="RULER needs the `ruler` extra: pip install -e '.[ruler]'")

TASK = "niah_single_1"  # a single needle (a 7-digit number) in a repeated haystack: no data files, no NLTK data
LENGTH = 512  # the tiny model's context; RULER reserves 128 tokens of it for the answer
LIMIT = 3
HAYSTACK_LINE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"
TEMPLATE_START = "A special magic number is hidden within the following text."


@pytest.fixture(scope="module")
def offline():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(constants, "HF_HUB_OFFLINE", True)
        mp.setattr(datasets.config, "HF_HUB_OFFLINE", True)
        # lm-eval's RULER module asks NLTK to fetch punkt_tab when imported; the offline tasks never use it, and the
        # refused connection is only reported (see docs/evaluation.md)
        mp.setattr(socket.socket, "connect", no_network)
        yield


@pytest.fixture(scope="module")
def runs(tmp_path_factory, one_torch_thread, offline):
    """{"llama"|"v2": (score, samples, path)} of RULER's TASK at LENGTH tokens."""
    paths = {"llama": TINY_LLAMA}
    paths["v2"] = convert_llama_to_diff(TINY_LLAMA, tmp_path_factory.mktemp("ruler") / "v2", progress=False)
    runs = {}
    for name, path in paths.items():
        out = lm_eval.simple_evaluate(
            model="hf",
            model_args=f"pretrained={path},dtype=float32",  # pretrained= is also the tokenizer RULER sizes data with
            tasks=[TASK],
            metadata={"max_seq_lengths": [LENGTH]},
            limit=LIMIT,
            batch_size=1,
            device="cpu",
            log_samples=True,
            bootstrap_iters=0,
        )
        samples = sorted(out["samples"][TASK], key=lambda s: s["doc_id"])
        runs[name] = out["results"][TASK][f"{LENGTH},none"], samples, path
    return runs


def test_prompts_have_the_requested_length(runs):
    _, samples, path = runs["llama"]
    tokenizer = AutoTokenizer.from_pretrained(path)
    haystack_line = len(tokenizer(HAYSTACK_LINE).input_ids)
    assert len(samples) == LIMIT
    for sample in samples:
        doc = sample["doc"]
        assert doc["max_length"] == LENGTH
        # RULER's length: the input's tokens plus the 128 it reserves to answer, within the requested length and
        # short of it by less than one step of its haystack search (5 lines at this length)
        assert doc["length"] == len(tokenizer(doc["input"]).input_ids) + 128
        assert LENGTH - 5 * haystack_line - 10 < doc["length"] <= LENGTH
        prompt = sample["arguments"][0][0]
        # what the model continues: the whole input (nothing truncated away) and the answer's prefix
        assert prompt.startswith(TEMPLATE_START) and doc["input"] in prompt
        assert doc["outputs"][0] in prompt and prompt.endswith("mentioned in the provided text is")
        assert len(tokenizer(prompt).input_ids) <= LENGTH - 128 + len(tokenizer(" " + doc["gen_prefix"]).input_ids)


def test_the_singular_metadata_key_is_ignored(offline):
    """The pitfall docs/evaluation.md warns about: `max_seq_length` (singular) leaves RULER at its default 4096."""
    for key, expected in (("max_seq_lengths", [LENGTH]), ("max_seq_length", [4096])):
        manager = TaskManager(metadata={"pretrained": str(TINY_LLAMA), key: [LENGTH]})
        task = manager.load([TASK])["tasks"][TASK]
        assert sorted(set(task.dataset["test"]["max_length"])) == expected, key


def test_score_is_the_models_greedy_answers_against_the_needles(runs):
    score, samples, path = runs["llama"]
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for sample in samples:
        ids = tokenizer(sample["arguments"][0][0], return_tensors="pt")
        with torch.no_grad():  # the checkpoint's generation config, as lm-eval's generate call has it
            out = model.generate(**ids, do_sample=False, max_length=ids.input_ids.shape[1] + 128)
        text = tokenizer.decode(out[0, ids.input_ids.shape[1] :], skip_special_tokens=True)
        assert sample["filtered_resps"][0] == text
        found = all(needle.lower() in text.strip().lower() for needle in sample["doc"]["outputs"])
        assert sample[str(LENGTH)] == float(found)
    assert score == pytest.approx(sum(s[str(LENGTH)] for s in samples) / LIMIT)
    assert 0 <= score <= 1


def test_v2_answers_exactly_as_the_llama(runs):
    llama_score, llama_samples, _ = runs["llama"]
    v2_score, v2_samples, _ = runs["v2"]
    assert v2_score == llama_score
    assert [s["doc"] for s in v2_samples] == [s["doc"] for s in llama_samples]  # the same data: same tokenizer
    assert [s["filtered_resps"] for s in v2_samples] == [s["filtered_resps"] for s in llama_samples]
