"""Hub round trip over HTTP: push with the real huggingface_hub/transformers/peft clients to a local fake Hub
(hub_server.py), pull back in this process (diff_transformer installed) and in a fresh interpreter without it."""

import json
import pickle
from pathlib import Path

import pytest
import torch
from huggingface_hub import HfApi, constants
from peft import AutoPeftModelForCausalLM, LoraConfig, get_peft_model
from safetensors.torch import load as load_safetensors
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

import diff_transformer
from diff_transformer.configuration_diff import AUTO_MAP
from diff_transformer.conversion import convert_to_diff
from tests.helpers.checkpoints import make_pickle_only
from tests.helpers.hub_server import hub_env, running_hub
from tests.helpers.processes import run_json
from tests.helpers.tiny import tiny_model


PACKAGE = Path(diff_transformer.__file__).parent
TINY_LLAMA = PACKAGE / "assets" / "tiny-llama"
TEXT = "It is a truth universally acknowledged"
CHAT = [{"role": "user", "content": "Who is Mr. Darcy?"}]
CODE_FILES = ("configuration_diff.py", "modeling_diff.py")
# What our repos may hold: weights only as safetensors, never a pickle (.bin/.pt/.pth/.pkl/.ckpt).
ALLOWED_SUFFIXES = (".safetensors", ".json", ".py", ".md", ".jinja", ".txt", ".gitattributes")


def logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids)).logits


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    with running_hub(tmp_path_factory.mktemp("hf")) as hub:
        yield hub
    assert not hub.problems, hub.problems  # a route the fake lacks, or a crash in it, would otherwise go unseen


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TINY_LLAMA)


@pytest.fixture(scope="module")
def ids(tokenizer):
    return [tokenizer(TEXT).input_ids]


def diff_model(tokenizer, version, seed=0):
    special = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    return tiny_model(version, seed=seed, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, **special)


@pytest.fixture(scope="module")
def pushed(hub, tokenizer):
    """One repo per version, filled by `model.push_to_hub` then `tokenizer.push_to_hub`: {version: (model, repo)}."""
    repos = {}
    for version in (1, 2):
        model = diff_model(tokenizer, version)
        commit = model.push_to_hub(f"tiny-diff-v{version}")  # no namespace: the Hub puts it under the user
        tokenizer.push_to_hub(commit.repo_url.repo_id)
        repos[version] = model, commit.repo_url.repo_id
    return repos


@pytest.fixture(scope="module")
def revisions(hub, tokenizer):
    """A repo with two commits on main and a third on branch "dev": {"repo", "first", "models": {rev: model}}."""
    first_model, second_model, dev_model = (diff_model(tokenizer, 2, seed=s) for s in (1, 2, 3))
    first = first_model.push_to_hub("tiny-diff-revisions").oid
    second_model.push_to_hub("tiny-diff-revisions")
    dev_model.push_to_hub("tiny-diff-revisions", revision="dev")  # creates the branch from main
    models = {first: first_model, "main": second_model, "dev": dev_model}
    return {"repo": f"{hub.user}/tiny-diff-revisions", "first": first, "models": models}


@pytest.fixture(scope="module")
def converted(hub, tmp_path_factory):
    """tiny-llama uploaded with `upload_folder`, converted to V2 from the Hub id, the result uploaded likewise."""
    api = HfApi()
    llama_repo = api.create_repo("tiny-llama").repo_id
    api.upload_folder(repo_id=llama_repo, folder_path=TINY_LLAMA)
    out = convert_to_diff(llama_repo, tmp_path_factory.mktemp("converted") / "tiny-diff", progress=False)
    repo = api.create_repo("tiny-llama-diff").repo_id
    api.upload_folder(repo_id=repo, folder_path=out, commit_message="Converted from tiny-llama")
    return {"dir": out, "repo": repo}


@pytest.fixture(scope="module")
def bare(hub, pushed, tmp_path_factory):
    """config.json (model_type "diff") + model.safetensors without the code files, uploaded file by file."""
    model, _ = pushed[2]
    folder = tmp_path_factory.mktemp("bare")
    model.save_pretrained(folder)
    api = HfApi()
    repo = api.create_repo("tiny-diff-no-code").repo_id
    for name in ("config.json", "model.safetensors"):
        api.upload_file(repo_id=repo, path_or_fileobj=folder / name, path_in_repo=name)
    return {"model": model, "repo": repo}


@pytest.fixture(scope="module")
def adapters(hub, pushed):
    """A LoRA (q_proj, v_proj) + trained λ (modules_to_save) on each pulled base, pushed with `push_to_hub`."""
    repos = {}
    for version, (_, base_repo) in pushed.items():
        base = AutoModelForCausalLM.from_pretrained(base_repo, attn_implementation="eager")
        config = LoraConfig(
            task_type="CAUSAL_LM", r=4, target_modules=["q_proj", "v_proj"], modules_to_save=["diff_lambda"]
        )
        model = get_peft_model(base, config)
        torch.manual_seed(version)
        with torch.no_grad():  # as if trained: LoRA B starts at zero and the λ copies equal the base's
            for param in model.parameters():
                if param.requires_grad:
                    param.add_(0.2 * torch.randn_like(param))
        repo = f"{hub.user}/tiny-diff-v{version}-lora"
        model.push_to_hub(repo)
        repos[version] = model.eval(), repo
    return repos


# ---- a fresh interpreter where diff_transformer cannot be imported ----

ISOLATED = """
import json, sys
import torch
from peft import AutoPeftModelForCausalLM
from transformers import AutoModelForCausalLM, AutoTokenizer

report = {}
for name, repo, kwargs, ids in json.loads(sys.argv[1]):
    try:
        auto = AutoPeftModelForCausalLM if name.startswith("adapter") else AutoModelForCausalLM
        if ids is None:
            tokenizer = AutoTokenizer.from_pretrained(repo, **kwargs)
            report[name] = {
                "ids": tokenizer(sys.argv[2]).input_ids,
                "chat": tokenizer.apply_chat_template(json.loads(sys.argv[3]), tokenize=False),
            }
            continue
        model = auto.from_pretrained(repo, attn_implementation="eager", **kwargs)
        with torch.no_grad():
            logits = model(torch.tensor(ids)).logits
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        report[name] = {"class": type(base).__name__, "module": type(base).__module__, "logits": logits.tolist()}
    except Exception as error:
        report[name] = {"error": f"{type(error).__name__}: {error}"}
report["imported_diff_transformer"] = any(m.startswith("diff_transformer") for m in sys.modules)
print()  # ends a trust_remote_code prompt that input() left unanswered
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def isolated(hub, pushed, revisions, converted, bare, adapters, ids, tmp_path_factory):
    """One fresh interpreter without diff_transformer pulls everything the tests below look at (saves start-ups)."""
    trust = {"trust_remote_code": True}
    jobs = [[f"v{v}", repo, trust, ids] for v, (_, repo) in pushed.items()]
    # trust_remote_code for the tokenizer too: AutoTokenizer reads config.json, whose auto_map names our code, and
    # would otherwise ask interactively (then load the same tokenizer after a 15 s timeout).
    jobs += [[f"tokenizer v{v}", repo, trust, None] for v, (_, repo) in pushed.items()]
    jobs += [[f"adapter v{v}", repo, trust, ids] for v, (_, repo) in adapters.items()]
    jobs += [
        ["pinned", revisions["repo"], {**trust, "revision": revisions["first"]}, ids],
        ["dev", revisions["repo"], {**trust, "revision": "dev"}, ids],
        ["converted", converted["repo"], trust, ids],
        ["untrusted", pushed[2][1], {"trust_remote_code": False}, ids],
        ["no code", bare["repo"], trust, ids],
        ["no code untrusted", bare["repo"], {"trust_remote_code": False}, ids],
    ]
    env = hub_env(hub, tmp_path_factory.mktemp("fresh-hf-home"))
    return run_json(ISOLATED, json.dumps(jobs), TEXT, json.dumps(CHAT), env=env)


def remote(isolated, name):
    """What the fresh interpreter got for job NAME, which must have loaded."""
    report = isolated[name]
    assert "error" not in report, report["error"]
    return report


# ---- push ----


def test_push_uploads_code_files_auto_map_and_safetensors_only(hub, pushed):
    for version, (model, repo) in pushed.items():
        files = hub.files(repo)
        expected = {"config.json", "generation_config.json", "model.safetensors", *CODE_FILES}
        expected |= {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "README.md", ".gitattributes"}
        assert set(files) == expected
        for name in CODE_FILES:  # the code shipped is the package's own source, byte for byte
            assert files[name] == (PACKAGE / name).read_bytes()
        config = json.loads(files["config.json"])
        assert config["model_type"] == "diff" and config["diff_version"] == version
        assert config["auto_map"] == AUTO_MAP
        assert len(hub.repos[repo].commits) == 3  # the Hub's initial commit, the model, the tokenizer


def test_pull_with_package_uses_native_classes_and_exact_logits(hub, pushed, tokenizer, ids, diff_version):
    model, repo = pushed[diff_version]
    for trust in (None, True):  # once diff_transformer is imported, even trust_remote_code=True keeps our classes
        pulled = AutoModelForCausalLM.from_pretrained(repo, trust_remote_code=trust, attn_implementation="eager")
        assert type(pulled) is diff_transformer.DiffForCausalLM
        assert torch.equal(logits(pulled, ids), logits(model, ids))
    pulled_tokenizer = AutoTokenizer.from_pretrained(repo)
    assert pulled_tokenizer(TEXT).input_ids == ids[0]
    assert pulled_tokenizer.apply_chat_template(CHAT, tokenize=False) == tokenizer.apply_chat_template(
        CHAT, tokenize=False
    )


# ---- pull without the package (remote code) ----


def test_pull_without_package_runs_the_pushed_code_exactly(isolated, pushed, adapters, tokenizer, ids, diff_version):
    assert isolated["imported_diff_transformer"] is False
    model, _ = pushed[diff_version]
    report = remote(isolated, f"v{diff_version}")
    assert report["class"] == "DiffForCausalLM" and report["module"].startswith("transformers_modules.")
    assert torch.equal(torch.tensor(report["logits"]), logits(model, ids))
    report = remote(isolated, f"adapter v{diff_version}")  # AutoPeftModelForCausalLM: remote-code base + adapter
    assert report["module"].startswith("transformers_modules.")
    assert torch.equal(torch.tensor(report["logits"]), logits(adapters[diff_version][0], ids))
    assert remote(isolated, f"tokenizer v{diff_version}") == {
        "ids": ids[0],
        "chat": tokenizer.apply_chat_template(CHAT, tokenize=False),
    }


def test_revision_pins_commits_and_branches(hub, revisions, isolated, ids):
    repo, models = revisions["repo"], revisions["models"]
    assert len({logits(model, ids).sum().item() for model in models.values()}) == 3  # three different models
    for revision, model in models.items():
        kwargs = {} if revision == "main" else {"revision": revision}
        pulled = AutoModelForCausalLM.from_pretrained(repo, attn_implementation="eager", **kwargs)
        assert torch.equal(logits(pulled, ids), logits(model, ids)), revision
    # Without the package (remote code; transformers fetches the code at the same revision).
    assert torch.equal(torch.tensor(remote(isolated, "pinned")["logits"]), logits(models[revisions["first"]], ids))
    assert torch.equal(torch.tensor(remote(isolated, "dev")["logits"]), logits(models["dev"], ids))


@pytest.mark.canary
def test_unknown_revision_and_repo_keep_transformers_messages(hub, revisions):
    """Canary for the OSError wording of transformers' `from_pretrained` (through huggingface_hub) for an unknown
    branch and an unknown repo, which users of a Diff checkpoint see as they are."""
    with pytest.raises(OSError, match="not-a-branch is not a valid git identifier"):
        AutoModelForCausalLM.from_pretrained(revisions["repo"], revision="not-a-branch")
    with pytest.raises(OSError, match="no-such-repo is not a local folder and is not a valid model identifier"):
        AutoModelForCausalLM.from_pretrained(f"{hub.user}/no-such-repo")


def test_converted_checkpoint_round_trip_through_upload_folder(hub, converted, isolated, ids):
    files = hub.files(converted["repo"])
    written = sorted(p.name for p in converted["dir"].iterdir() if p.is_file())
    assert sorted(set(files) - {".gitattributes"}) == written
    assert {"model.safetensors", "tokenizer.json", *CODE_FILES} <= set(files)
    assert json.loads(files["config.json"])["auto_map"] == AUTO_MAP
    local = diff_transformer.DiffForCausalLM.from_pretrained(converted["dir"], attn_implementation="eager")
    expected = logits(local, ids)
    pulled = AutoModelForCausalLM.from_pretrained(converted["repo"], attn_implementation="eager")
    assert torch.equal(logits(pulled, ids), expected)
    assert torch.equal(torch.tensor(remote(isolated, "converted")["logits"]), expected)
    # Independent reference: V2 conversion preserves the source Llama's function.
    llama = LlamaForCausalLM.from_pretrained(TINY_LLAMA, attn_implementation="eager")
    assert torch.allclose(expected, logits(llama, ids), atol=1e-4)


# ---- PEFT ----


def test_peft_adapter_round_trip(hub, adapters, pushed, ids, diff_version):
    trained, repo = adapters[diff_version]
    files = hub.files(repo)
    assert set(files) == {".gitattributes", "README.md", "adapter_config.json", "adapter_model.safetensors"}
    config = json.loads(files["adapter_config.json"])
    assert config["base_model_name_or_path"] == pushed[diff_version][1]
    pulled = AutoPeftModelForCausalLM.from_pretrained(repo, attn_implementation="eager")
    assert type(pulled.get_base_model()) is diff_transformer.DiffForCausalLM
    assert torch.equal(logits(pulled, ids), logits(trained, ids))
    # The adapter matters: disabled, the logits are the base model's, which differ.
    base_logits = logits(pushed[diff_version][0], ids)
    assert not torch.allclose(base_logits, logits(trained, ids))
    with pulled.disable_adapter():
        assert torch.equal(logits(pulled, ids), base_logits)
    # The trained λ copies (modules_to_save) came back as trained.
    trained_lambda = {k: v for k, v in trained.state_dict().items() if "modules_to_save" in k}
    assert len(trained_lambda) == 2 * (1 if diff_version == 2 else 4)  # 2 layers x (V2: proj.weight, V1: 4 vectors)
    for key, value in trained_lambda.items():
        assert torch.equal(pulled.state_dict()[key], value), key
    stored = load_safetensors(files["adapter_model.safetensors"])
    assert any("diff_lambda" in key for key in stored) and any("lora_B" in key for key in stored)


def test_train_lora_on_a_hub_base_names_the_hub_id_for_peft(hub, pushed, ids, tmp_path, monkeypatch):
    """`train hf://ID --lora`: adapter_config.json names the base by its Hub id (what PEFT and the Hub resolve), the
    card's metadata too; AutoPeftModelForCausalLM from another directory loads what the package's commands load, and
    the adapter pushes with its base named as trained."""
    from diff_transformer import cli
    from diff_transformer.checkpoints.opening import open_checkpoint
    from tests.helpers.training import QUIET

    _, repo = pushed[2]
    (tmp_path / "data.txt").write_text((PACKAGE / "assets" / "heldout.txt").read_text(encoding="utf-8")[:3000])
    out = tmp_path / "lora"
    run = ["--data", tmp_path / "data.txt", "--output", out, "--lora", "--max-steps", "2", "--lr", "1e-2"]
    assert cli.main([str(a) for a in ["train", f"hf://{repo}", *run, "--eval-fraction", "0", *QUIET]]) == 0
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == repo and config["revision"] is None  # main, what the run loaded
    assert json.loads((out / "base_model.json").read_text()) == {"hub_id": repo, "named": f"hf://{repo}"}
    assert f"base_model: {repo}" in (out / "README.md").read_text()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    pulled = AutoPeftModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    ours = open_checkpoint(out).load(attn_implementation="eager").eval()
    assert torch.equal(logits(pulled, ids), logits(ours, ids))
    assert not torch.equal(logits(pulled, ids), logits(pushed[2][0], ids))  # the adapter is on
    pulled.push_to_hub("trained-lora")
    assert json.loads(hub.files(f"{hub.user}/trained-lora")["adapter_config.json"])["base_model_name_or_path"] == repo


def test_push_of_an_adapter_on_a_local_base_is_refused_before_anything_is_created(hub, pushed, tokenizer, tmp_path):
    """An adapter on a local Diff base names the base by its directory (what `train --lora` writes, so that PEFT
    finds it anywhere here): on the Hub that path means nothing, so its push is refused in one message naming the
    fix, before the repo is created; named by the Hub id, it pushes. Adapters on other models push as PEFT pushes."""
    diff_model(tokenizer, 2).save_pretrained(tmp_path / "base")
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    model = get_peft_model(base, LoraConfig(task_type="CAUSAL_LM", r=4, target_modules=["q_proj", "v_proj"]))
    assert model.peft_config["default"].base_model_name_or_path == str(tmp_path / "base")
    with pytest.raises(ValueError) as refusal:
        model.push_to_hub("local-lora")
    message = str(refusal.value)
    assert f"local directory {tmp_path / 'base'}, which means nothing on the Hub" in message, message
    assert "base_model_name_or_path = 'you/base'" in message and "\n" not in message
    assert f"{hub.user}/local-lora" not in hub.repos
    model.peft_config["default"].base_model_name_or_path = pushed[2][1]
    model.push_to_hub("local-lora")
    config = json.loads(hub.files(f"{hub.user}/local-lora")["adapter_config.json"])
    assert config["base_model_name_or_path"] == pushed[2][1]

    llama = LlamaForCausalLM.from_pretrained(TINY_LLAMA)
    other = get_peft_model(llama, LoraConfig(task_type="CAUSAL_LM", r=4, target_modules=["q_proj", "v_proj"]))
    other.push_to_hub("llama-lora")  # not a Diff base: PEFT's behaviour, unchanged
    assert json.loads(hub.files(f"{hub.user}/llama-lora")["adapter_config.json"])["base_model_name_or_path"] == str(
        TINY_LLAMA
    )


# ---- safety ----


@pytest.mark.canary
def test_no_code_files_without_package_fails_with_a_clear_message(isolated, bare, ids):
    """Canary for transformers' message when auto_map names a code file the repo lacks (and for its trust_remote_code
    refusal coming first); the native load with the package is this package's behaviour."""
    # auto_map points at configuration_diff.py, which the repo lacks: transformers names the missing file.
    message = isolated["no code"]["error"]
    assert "does not appear to have a file named configuration_diff.py" in message, message
    # Without trust_remote_code the refusal comes first; it asks for trust_remote_code=True, which then fails as above.
    assert "trust_remote_code=True" in isolated["no code untrusted"]["error"]
    # With the package installed the same repo loads natively: the code files are only needed without it.
    pulled = AutoModelForCausalLM.from_pretrained(bare["repo"], attn_implementation="eager")
    assert type(pulled) is diff_transformer.DiffForCausalLM
    assert torch.equal(logits(pulled, ids), logits(bare["model"], ids))


@pytest.mark.canary
def test_trust_remote_code_false_is_refused_with_transformers_message(isolated, pushed):
    """Canary for the wording of transformers' refusal of custom code without trust_remote_code=True, which docs/hub.md
    quotes."""
    message = isolated["untrusted"]["error"]
    assert message.startswith("ValueError: ")
    assert f"The repository {pushed[2][1]} contains custom code which must be executed" in message
    assert "Please pass the argument `trust_remote_code=True` to allow custom code to be run." in message


def test_nothing_unpickles_and_only_safetensors_are_stored(hub, pushed, adapters, tmp_path, monkeypatch, ids):
    def refuse(*args, **kwargs):
        raise AssertionError("unpickling attempted while loading from the Hub")

    for module, name in [(pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"), (torch, "load")]:
        monkeypatch.setattr(module, name, refuse)
    monkeypatch.setattr(torch.serialization, "load", refuse)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))  # every file is downloaded anew
    for version, (trained, repo) in adapters.items():
        pulled = AutoPeftModelForCausalLM.from_pretrained(repo, attn_implementation="eager")
        assert torch.equal(logits(pulled, ids), logits(trained, ids))
        AutoTokenizer.from_pretrained(pushed[version][1])
    assert any((tmp_path / "empty-cache").rglob("*.safetensors"))
    for repo in hub.repos.values():
        for commit in repo.commits.values():
            for path in commit.files:
                assert path.endswith(ALLOWED_SUFFIXES), f"{repo.repo_id}: {path}"


def test_a_hub_repo_with_only_pickled_weights_is_refused_not_unpickled(hub, tmp_path, capsys):
    """Issue 56: a Hub model whose weights are only pytorch_model.bin is one line of ours (safetensors only, the fix)
    for a loading command; transformers' own refusal advised "do not set use_safetensors=True", and without it the
    pickle would have been unpickled (torch's refusal of an unsafe one advises weights_only=False)."""
    from diff_transformer import cli

    folder = tmp_path / "pickled"
    tiny_model(2).save_pretrained(folder)
    marker = tmp_path / "unpickled"
    make_pickle_only(folder, marker)
    repo = HfApi().create_repo("pickled-only").repo_id
    HfApi().upload_folder(repo_id=repo, folder_path=folder)
    capsys.readouterr()
    assert cli.main(["generate", repo, "5 6 7", "--max-new-tokens", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: MODEL {repo!r} has no safetensors weights"), err
    for words in ("refusing to unpickle", "save_pretrained", "trusted environment"):
        assert words in err[0], err
    assert "use_safetensors" not in err[0] and "weights_only" not in err[0], err
    assert not marker.exists()


def test_serve_loads_hub_models_through_the_road_at_their_revision_and_never_unpickles(
    hub, revisions, tokenizer, ids, tmp_path, monkeypatch
):
    """`serve`'s model manager loads through `checkpoints.open(...).load()` like every command: a Hub repo whose only
    weights are pickles is a 400 with the road's line (transformers' own loader unpickled its pytorch_model.bin with
    torch's weights-only unpickler and answered with torch's `weights_only` advice), and a `@revision` (a commit, a
    branch) loads that revision's weights."""
    from diff_transformer.serving import models as serving_models
    from diff_transformer.serving.patches import ServeSettings

    manager = serving_models.diff_model_manager(ServeSettings(quiet=True))(device="cpu", model_timeout=-1)
    try:
        expected = {revision: logits(model, ids) for revision, model in revisions["models"].items()}
        for revision in expected:
            served = logits(manager._load_model(f"{revisions['repo']}@{revision}"), ids)
            # The server's attention backend (sdpa) against the pushed model's (eager): fp32 rounding, ~1e-7 here;
            # the three revisions' logits differ by ~0.8.
            distances = {other: (served - value).abs().max().item() for other, value in expected.items()}
            assert distances[revision] < 1e-5 and min(distances.values()) == distances[revision], distances
            assert sorted(distances.values())[1] > 1e-2, distances

        # The checks read the revision that loads: main's out-of-range generation_config.json refuses main only.
        checked = HfApi().create_repo("served-generation-revisions").repo_id
        tiny_model(2).push_to_hub(checked)
        HfApi().create_branch(checked, branch="good")
        HfApi().upload_file(
            repo_id=checked, path_or_fileobj=b'{"temperature": -1.0}', path_in_repo="generation_config.json"
        )
        assert type(manager._load_model(f"{checked}@good")).__name__ == "DiffForCausalLM"
        with pytest.raises(Exception, match="generation_config.json"):
            manager._load_model(f"{checked}@main")

        folder = tmp_path / "pickled"
        tiny_model(2).save_pretrained(folder)
        tokenizer.save_pretrained(folder)  # the processor loads first: the refusal must come from the weights
        marker = tmp_path / "unpickled"
        make_pickle_only(folder, marker)
        repo = HfApi().create_repo("served-pickled-only").repo_id
        HfApi().upload_folder(repo_id=repo, folder_path=folder)
        unpickled = []
        monkeypatch.setattr(torch, "load", lambda *args, **kwargs: unpickled.append(args) or {})
        with pytest.raises(Exception) as caught:
            manager.acquire(f"{repo}@main")
        assert caught.value.status_code == 400, caught.value
        message = caught.value.detail["message"]
        assert message.startswith(f"model {repo!r} has no safetensors weights, only pickles"), message
        assert "refusing to unpickle" in message and "weights_only" not in message, message
        assert not unpickled and not marker.exists()
        assert not manager.loaded_models
    finally:
        manager.shutdown()
