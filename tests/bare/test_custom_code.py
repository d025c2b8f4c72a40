"""Converted checkpoints of every family (V1 and V2, a Qwen3 with qk-norm, task heads) load with
`trust_remote_code=True` in a venv with only torch and transformers, and compute what the package computes."""

import json
import re
import subprocess
from configparser import ConfigParser

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

import diff_transformer  # noqa: F401  (the package's own classes compute the references)
from tests.helpers import REPOSITORY
from tests.matrix.models import FAMILIES, HEADS, VERSIONS, build
from tests.model.test_model import assert_logits_match_reference


ROOT = REPOSITORY
IDS = [[5, 17, 42, 8, 9, 30, 64, 3], [11, 12, 13, 14, 15, 16, 17, 18]]
NEW_TOKENS = 8
OPTIONAL = ("diff_transformer", "peft", "accelerate", "bitsandbytes", "triton")

# Runs in the bare interpreter: loads each checkpoint as custom code, prints logits and greedy tokens as JSON.
LOADER = """
import importlib.util, json, sys
import torch, transformers
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
from tests.helpers import REPOSITORY
from tests.helpers import REPOSITORY

job = json.loads(sys.argv[1])
ids = torch.tensor(job["ids"])
report = {
    "transformers": transformers.__version__,
    "installed": [m for m in job["optional"] if importlib.util.find_spec(m) is not None],
    "models": {},
}
for path, head in job["models"].items():
    auto = AutoModelForSequenceClassification if head else AutoModelForCausalLM
    model = auto.from_pretrained(path, trust_remote_code=True)
    with torch.no_grad():
        logits = model(ids).logits
    entry = {"class": type(model).__module__ + "." + type(model).__name__, "logits": logits.flatten().tolist()}
    if not head:
        out = model.generate(ids, max_new_tokens=job["new_tokens"], min_new_tokens=job["new_tokens"], do_sample=False)
        entry["generated"] = out[:, ids.shape[1]:].tolist()
    report["models"][path] = entry
report["imported"] = sorted({m.split(".")[0] for m in sys.modules} & set(job["optional"]))
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{converted dir: whether it is a task head}: every family x version, and the heads x version."""
    root = tmp_path_factory.mktemp("bare")
    _, converted = build(root, list(FAMILIES) + list(HEADS))
    return {path: name in HEADS for (name, _), path in converted.items()}


@pytest.fixture(scope="module")
def report(bare_python, checkpoints, tmp_path_factory):
    job = {
        "models": {str(path): head for path, head in checkpoints.items()},
        "ids": IDS,
        "new_tokens": NEW_TOKENS,
        "optional": OPTIONAL,
    }
    cache = tmp_path_factory.mktemp("hf")
    env = {"HF_HOME": str(cache), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    result = subprocess.run(
        [bare_python, "-c", LOADER, json.dumps(job)],
        capture_output=True,
        text=True,
        env=env,
        stdin=subprocess.DEVNULL,
        timeout=900,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_interpreter_is_bare(report):
    assert report["installed"] == []  # neither the package nor any optional dependency is importable there
    assert report["imported"] == []


def test_lowest_and_pinned_transformers_are_covered(bare_python, report):
    """The venvs are the pinned transformers (constraints.txt) and the lowest setup.cfg declares."""
    setup = ConfigParser()
    setup.read(ROOT / "setup.cfg")
    lowest = re.search(r"transformers>=([\d.]+)", setup["options"]["install_requires"]).group(1)
    pinned = re.search(r"^transformers==(\S+)$", (ROOT / "constraints.txt").read_text(), re.MULTILINE).group(1)
    assert report["transformers"] in (pinned, lowest + ".0" if lowest.count(".") == 1 else lowest)


@pytest.mark.parametrize("name", list(FAMILIES) + list(HEADS))
@pytest.mark.parametrize("version", VERSIONS)
def test_custom_code_computes_what_the_package_computes(name, version, checkpoints, report):
    path = next(p for p in checkpoints if p.name == f"{name}-v{version}")
    got = report["models"][str(path)]
    head = checkpoints[path]
    assert got["class"].startswith("transformers_modules.")
    assert got["class"].endswith("DiffForSequenceClassification" if head else "DiffForCausalLM")
    model = (AutoModelForSequenceClassification if head else AutoModelForCausalLM).from_pretrained(path)
    assert type(model).__module__ == "diff_transformer.modeling_diff"
    ids = torch.tensor(IDS)
    with torch.no_grad():
        expected = model(ids).logits
    logits = torch.tensor(got["logits"]).view(expected.shape)
    if head:
        torch.testing.assert_close(logits, expected, rtol=0, atol=2e-5)
    else:  # the package may attend through its CPU paths, the bare code through the plain calls: both within fp32's
        # rounding of the float64 reference, whatever order each sums in
        assert_logits_match_reference(model, ids, logits, expected)
    if not head:
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        assert got["generated"] == out[:, ids.shape[1] :].tolist()
