"""Model cards: `save_pretrained`, `push_to_hub` and the converter write one card (`integrations.hub`)."""

import json
import math
import shutil
from pathlib import Path

import pytest
from huggingface_hub import HfApi, ModelCard, constants
from transformers import AutoModelForCausalLM, pipeline

import diff_transformer
from diff_transformer.conversion import convert_to_diff
from tests.helpers.hub_server import running_hub
from tests.helpers.processes import run_json
from tests.helpers.tiny import tiny_model


TINY_LLAMA = Path(diff_transformer.__file__).parent / "assets" / "tiny-llama"
CORE_TAGS = {"diff-transformer", "differential-attention", "custom_code"}
PLACEHOLDER = "This model card has been automatically generated."  # transformers' card for a repo without one


def load_card(path) -> ModelCard:
    """Parse a README.md the way the Hub client does (YAML -> ModelCardData)."""
    return ModelCard.load(Path(path) / "README.md" if Path(path).is_dir() else path)


def check_hub_metadata(card: ModelCard, version: int):
    assert card.data.library_name == "transformers"
    assert card.data.pipeline_tag == "text-generation"
    assert CORE_TAGS | {f"diff-transformer-v{version}"} <= set(card.data.tags)


@pytest.fixture(scope="module")
def hub_llama(tmp_path_factory):
    """The shipped tiny Llama as a Hub id ("tiny-org/tiny-llama") in an offline HF cache, so that converting it
    records a base_model. Yields the cache directory."""
    cache = tmp_path_factory.mktemp("hf-cache")
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / "models--tiny-org--tiny-llama"
    shutil.copytree(TINY_LLAMA, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return cache


@pytest.fixture(scope="module")
def converted(hub_llama, tmp_path_factory):
    """{version: directory} of tiny-org/tiny-llama converted to Diff V1 and V2."""
    out = tmp_path_factory.mktemp("converted")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(constants, "HF_HUB_CACHE", str(hub_llama))
        patch.setattr(constants, "HF_HUB_OFFLINE", True)
        return {
            v: convert_to_diff("tiny-org/tiny-llama", out / f"v{v}", diff_version=v, progress=False) for v in (1, 2)
        }


# ---- save_pretrained ----


def test_save_pretrained_writes_a_card_with_architecture_and_lambda(tmp_path, diff_version):
    model = tiny_model(diff_version, num_hidden_layers=3)
    model.save_pretrained(tmp_path / "my-diff")
    card = load_card(tmp_path / "my-diff")
    check_hub_metadata(card, diff_version)
    assert card.data.base_model is None  # built as a Diff model: no base model to name
    text = card.text
    assert f"| diff_version | {diff_version} |" in text
    assert (
        "| differential heads H | 4 |" in text and "| key/value heads | 2 |" in text and "| head_dim d | 6 |" in text
    )
    if diff_version == 1:  # the paper's schedule, computed here independently of the model code
        schedule = ", ".join(f"{0.8 - 0.6 * math.exp(-0.3 * layer):.3f}" for layer in range(3))
        assert schedule == "0.200, 0.356, 0.471"
        assert f"per layer: {schedule}" in text and "N(0, 0.1²)" in text
    else:
        assert "λ = sigmoid(W_λ x)" in text and "(`diff_lambda.proj`, 48 → 4, no bias)" in text
    assert "## Conversion" not in text
    assert 'AutoModelForCausalLM.from_pretrained("my-diff", trust_remote_code=True)' in text


def test_fixed_lambda_init_is_reported(tmp_path):
    tiny_model(1, lambda_init=0.5).save_pretrained(tmp_path)
    assert "fixed λ_init = 0.5 in every layer" in load_card(tmp_path).text


def test_a_readme_already_in_the_directory_is_kept(tmp_path):
    (tmp_path / "README.md").write_text("# my own card\n")
    tiny_model(2).save_pretrained(tmp_path)
    assert (tmp_path / "README.md").read_text() == "# my own card\n"
    assert (tmp_path / "model.safetensors").is_file()  # the weights were still saved


def test_only_the_main_process_writes_the_card(tmp_path):
    tiny_model(2).save_pretrained(tmp_path, is_main_process=False)
    assert not (tmp_path / "README.md").exists()


@pytest.mark.parametrize(
    "card_data, words",
    [
        ({"tags": ["x"], "license": "mit"}, "card_data holds 'tags'"),
        ({"license": {"nested": "yaml"}}, "must be a string of at most 256"),
        ({"language": ["en"] * 65}, "lists 65 values"),
    ],
)
def test_card_data_the_card_cannot_carry_is_refused_before_anything_is_written(tmp_path, card_data, words):
    """The config stores `conversion` as written (the model never reads it); the card, the one consumer of
    `card_data`, checks it before the weights are written."""
    model = tiny_model(2, conversion={"source": "x", "card_data": card_data})
    with pytest.raises(ValueError, match=words):
        model.save_pretrained(tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match=words):
        diff_transformer.integrations.hub.diff_model_card(model.config)


# ---- converter ----


def test_converted_card_names_base_model_and_provenance(converted):
    for version, exact in ((2, "yes"), (1, "no")):
        card = load_card(converted[version])
        check_hub_metadata(card, version)
        assert card.data.base_model == "tiny-org/tiny-llama"
        assert "llama" in card.data.tags
        # licence and language follow the weights from the source's card
        assert card.data.license == "apache-2.0" and card.data.language == "en"
        assert "Converted from [`tiny-org/tiny-llama`](https://huggingface.co/tiny-org/tiny-llama)" in card.text
        assert f"Function-preserving at conversion: {exact}." in card.text
        config = json.loads((converted[version] / "config.json").read_text())
        assert config["conversion"]["base_model"] == "tiny-org/tiny-llama"
        assert config["conversion"]["source_model_type"] == "llama"
        assert config["conversion"]["converter"] == f"diff-transformer {diff_transformer.__version__}"
    assert "W_λ = 0, so λ = 0.5" in load_card(converted[2]).text


def test_resaved_converted_model_keeps_base_model(converted, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(converted[2])
    model.save_pretrained(tmp_path / "resaved")
    card = load_card(tmp_path / "resaved")
    assert card.data.base_model == "tiny-org/tiny-llama" and card.data.license == "apache-2.0"
    assert card.text == load_card(converted[2]).text.replace("# v2\n", "# resaved\n").replace('"v2"', '"resaved"')


USE_SNIPPET = """
import json, re, sys
text = open(sys.argv[1] + "/README.md").read()
code = re.search(r"```python\\n(.*?)```", text, re.S).group(1).replace('"v2"', repr(sys.argv[1]))
printed = []
exec(code, {"print": printed.append})
print(json.dumps({"printed": printed, "imported": any(m.startswith("diff_transformer") for m in sys.modules)}))
"""


def test_card_usage_snippet_runs_without_the_package(converted, tmp_path):
    """The README's Python snippet, run as written (model id -> local path) where diff_transformer is not installed."""
    env = {"HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path), "OMP_NUM_THREADS": "1"}
    report = run_json(USE_SNIPPET, converted[2], env=env)
    assert report["imported"] is False
    # what the same pipeline prints here, with the native classes
    expected = pipeline("text-generation", model=str(converted[2]))("Once upon a time", max_new_tokens=32)
    assert report["printed"] == [expected[0]["generated_text"]]
    assert len(expected[0]["generated_text"]) > len("Once upon a time ") + 20


# ---- push_to_hub (real transformers/huggingface_hub clients against the local fake Hub) ----


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    with running_hub(tmp_path_factory.mktemp("hf-home")) as hub:
        yield hub


def pushed_card(hub, repo) -> ModelCard:
    return ModelCard(hub.files(repo)["README.md"].decode())


def test_push_to_hub_uploads_the_diff_card_not_transformers_placeholder(hub):
    model = tiny_model(1)
    model.add_model_tags(["from-model-tags"])
    repo = model.push_to_hub("card-v1", tags=["from-push"]).repo_url.repo_id
    card = pushed_card(hub, repo)
    check_hub_metadata(card, 1)
    assert {"from-model-tags", "from-push"} <= set(card.data.tags)  # transformers' tags are kept
    assert PLACEHOLDER not in card.text
    assert f'AutoModelForCausalLM.from_pretrained("{repo}", trust_remote_code=True)' in card.text


def test_push_keeps_a_card_already_on_the_hub(hub):
    repo = HfApi().create_repo("card-existing").repo_id
    own = "---\nlicense: mit\n---\n# A card written by hand\n"
    HfApi().upload_file(repo_id=repo, path_or_fileobj=own.encode(), path_in_repo="README.md")
    tiny_model(2).push_to_hub(repo, tags=["extra"])
    card = pushed_card(hub, repo)
    assert card.text.strip() == "# A card written by hand" and card.data.license == "mit"
    assert card.data.tags == ["extra"]  # transformers adds the push's tags to an existing card, nothing else changes


def test_save_pretrained_push_to_hub_writes_the_card_locally_and_on_the_hub(hub, converted, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(converted[2])
    model.save_pretrained(tmp_path / "out", push_to_hub=True, repo_id="card-converted")
    card = pushed_card(hub, f"{hub.user}/card-converted")
    assert card.data.base_model == "tiny-org/tiny-llama"
    assert PLACEHOLDER not in card.text
    assert load_card(tmp_path / "out").text == card.text
