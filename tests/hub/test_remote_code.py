"""A saved Diff model loads with trust_remote_code=True in an interpreter where diff_transformer cannot be imported."""

import json
import shutil
import textwrap

import pytest
import torch

from tests.helpers.processes import run_json
from tests.helpers.tiny import tiny_model


# Runs in a fresh interpreter where any attempt to import diff_transformer fails (see _subprocess.py).
LOADER = textwrap.dedent(
    """
    import json, sys
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    source, ids = sys.argv[1], json.loads(sys.argv[2])
    try:
        AutoModelForCausalLM.from_pretrained(source, trust_remote_code=False)
    except ValueError as error:
        refused = "trust_remote_code" in str(error)
    else:
        refused = False
    config = AutoConfig.from_pretrained(source, trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(source, trust_remote_code=True, attn_implementation="eager")
    with torch.no_grad():
        logits = model(torch.tensor(ids)).logits
    generated = model.generate(torch.tensor(ids), max_new_tokens=5, min_new_tokens=5, do_sample=False)
    print(json.dumps({
        "refused_without_trust": refused,
        "config_module": type(config).__module__,
        "model_module": type(model).__module__,
        "model_class": type(model).__name__,
        "imported_diff_transformer": any(m.startswith("diff_transformer") for m in sys.modules),
        "logits": logits.flatten().tolist(),
        "generated": generated.tolist(),
    }))
    """
)


def run_isolated(source, ids, env_extra):
    return run_json(LOADER, source, json.dumps(ids), env=env_extra)


def check(report, model, ids, atol=1e-6):
    assert report["refused_without_trust"]
    assert report["imported_diff_transformer"] is False
    assert report["model_class"] == "DiffForCausalLM"
    assert report["model_module"].startswith("transformers_modules.")
    assert report["config_module"].startswith("transformers_modules.")
    with torch.no_grad():
        expected = model(torch.tensor(ids)).logits.flatten()
    assert torch.allclose(torch.tensor(report["logits"]), expected, atol=atol)
    generated = model.generate(torch.tensor(ids), max_new_tokens=5, min_new_tokens=5, do_sample=False)
    assert report["generated"] == generated.tolist()


def test_remote_code_from_local_directory(tmp_path, diff_version):
    model = tiny_model(diff_version)
    model.save_pretrained(tmp_path / "saved")
    ids = [[5, 17, 42, 8, 9, 30]]
    report = run_isolated(tmp_path / "saved", ids, {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"})
    check(report, model, ids)


# Loading from the cache does not depend on the version (test_remote_code_from_local_directory runs both): V1 is slow.
@pytest.mark.parametrize("version", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_remote_code_from_offline_hub_cache(tmp_path, version):
    """The repo sits in the HF cache exactly as snapshot_download leaves it; HF_HUB_OFFLINE=1 forbids the network."""
    model = tiny_model(version)
    model.save_pretrained(tmp_path / "saved")
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--someone--tiny-diff"
    shutil.copytree(tmp_path / "saved", repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    ids = [[3, 4, 5, 6]]
    env = {
        "HF_HUB_CACHE": str(tmp_path / "hub"),
        "HF_MODULES_CACHE": str(tmp_path / "modules"),
        "HF_HUB_OFFLINE": "1",
    }
    report = run_isolated("someone/tiny-diff", ids, env)
    check(report, model, ids)


def test_converted_motif_checkpoint_loads_as_remote_code(tmp_path):
    """PolyNorm and grouped differential attention live in the checkpoint's own modeling_diff.py (docs/motif.md)."""
    from diff_transformer import DiffForCausalLM
    from diff_transformer.conversion import convert_to_diff
    from tests.helpers.motif import write_motif_checkpoint

    write_motif_checkpoint(tmp_path / "motif", "motif-gda")
    out = convert_to_diff(tmp_path / "motif", tmp_path / "diff", progress=False)
    model = DiffForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    ids = [[5, 17, 42, 8, 9, 30]]
    # PolyNorm's cube and its three row norms: the child's thread count changes the summation order by a few ulps
    # more than a plain Llama layer's (CI measured 1e-6 < |Δ| on logits of about 2).
    report = run_isolated(out, ids, {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"})
    check(report, model, ids, atol=1e-5)


def test_default_version_is_2_and_a_config_without_the_field_loads_as_v1(tmp_path):
    """DiffConfig() is V2; a config.json saved while V1 was the default (no `diff_version`) still loads as V1, with
    the package and with the checkpoint's own configuration_diff.py; saved configs always name their version."""
    from transformers import AutoConfig

    from diff_transformer import DiffConfig

    assert DiffConfig().diff_version == 2
    for version in (1, 2):
        saved = tmp_path / f"v{version}"
        DiffConfig(hidden_size=32, num_attention_heads=2, diff_version=version).save_pretrained(saved)
        assert json.loads((saved / "config.json").read_text())["diff_version"] == version
    old = tmp_path / "old"
    shutil.copytree(tmp_path / "v1", old)
    values = json.loads((old / "config.json").read_text())
    del values["diff_version"]
    (old / "config.json").write_text(json.dumps(values))
    assert DiffConfig.from_pretrained(old).diff_version == 1
    assert AutoConfig.from_pretrained(old).diff_version == 1
    assert DiffConfig.from_dict(values).diff_version == 1
    assert DiffConfig(**values).diff_version == 2  # the constructor's default: only a loaded dict means V1
    script = (
        "import json, sys\nfrom transformers import AutoConfig\n"
        "config = AutoConfig.from_pretrained(sys.argv[1], trust_remote_code=True)\n"
        "print(json.dumps([type(config).__module__, config.diff_version]))\n"
    )
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    for path, version in ((old, 1), (tmp_path / "v2", 2)):
        module, loaded = run_json(script, path, env=env)
        assert module.startswith("transformers_modules.") and loaded == version
