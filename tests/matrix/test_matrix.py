"""The integration matrix: every checkpoint the converter makes (Llama, Mistral, Qwen2, Qwen3 x V1, V2; task heads;
Motif-2.6B's and grouped differential attention's layouts x V1) through every integration the package claims.
Elsewhere: Hub custom code in a venv with only torch and transformers (tests/bare/, run by .ci/run) and vLLM
(tests/vllm/test_families.py, in the vLLM environment).

integration: test here (reference)
* forward: test_logits_match_the_formulas (tests/helpers/reference.py, design.md's math, in float64; fp32's rounding
  bounded by tests/helpers/rounding.py)
* V2 function preservation: test_v2_computes_what_the_source_computes (the source family's transformers class)
* generate, dynamic and static cache: test_greedy_decoding_with_every_cache (argmax of full forwards, no cache)
* PEFT LoRA train/save/reload, default targets: test_lora_default_targets_save_and_reload, test_lora_on_task_heads
* analysis.attention_maps: test_attention_maps_equal_eager_output_attentions (eager `output_attentions`)
* lm-eval's hf model: test_lm_eval_scores_the_checkpoint (V2: the source's loglikelihoods)
* tensor parallelism (CPU, gloo): test_tensor_parallel_matches_the_unsharded_model (the unsharded model)
* checkpoint code: test_checkpoint_code_imports_nothing_optional (transformers' own import check)
* vLLM reads or refuses every config field: test_every_config_field_is_placed_for_vllm (DiffConfig's fields)

Cheap cells run for every family and version; lm-eval and tensor parallelism run one cell in the quick loop and the
rest in the full run (`slow`).
"""

import json
import socket
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
from transformers.dynamic_module_utils import get_imports

from diff_transformer import DiffConfig
from diff_transformer.analysis import attention_maps
from diff_transformer.integrations.vllm import fields
from tests.helpers import REPOSITORY
from tests.helpers.reference import reference_logits
from tests.helpers.rounding import assert_within_rounding
from tests.matrix.models import FAMILIES, HEADS, MOTIF, MOTIF_VERSIONS, VERSIONS, build


CELLS = [(family, version) for family in FAMILIES for version in VERSIONS]
CELLS += [(layout, version) for layout in MOTIF for version in MOTIF_VERSIONS]
IDS = torch.tensor([[5, 17, 42, 8, 9, 30, 64, 3, 99, 7], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]])


def cell_params(quick, cells=CELLS):
    """Every cell (of CELLS); those not in QUICK marked slow."""
    return [pytest.param(f, v, id=f"{f}-v{v}", marks=() if (f, v) in quick else pytest.mark.slow) for f, v in cells]


ALL = cell_params(set(CELLS))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(sources {name: dir}, converted {(name, version): dir}) for the families and the heads."""
    return build(tmp_path_factory.mktemp("matrix"), list(FAMILIES) + list(HEADS) + list(MOTIF))


def load(path, **kwargs):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs).eval()


@pytest.mark.parametrize("family, version", ALL)
def test_logits_match_the_formulas(family, version, checkpoints):
    model = load(checkpoints[1][family, version])
    with torch.no_grad():
        logits = model(IDS).logits
    for row in range(IDS.shape[0]):
        assert_within_rounding(logits[row], *reference_logits(model, IDS[row]), msg=f"row {row}:")


@pytest.mark.parametrize("name", [*FAMILIES, *HEADS])
def test_v2_computes_what_the_source_computes(name, checkpoints):
    sources, converted = checkpoints
    auto = AutoModelForSequenceClassification if name in HEADS else AutoModelForCausalLM
    source = auto.from_pretrained(sources[name], dtype=torch.float32).eval()
    diff = auto.from_pretrained(converted[name, 2], dtype=torch.float32).eval()
    assert type(diff).__name__ == ("DiffForSequenceClassification" if name in HEADS else "DiffForCausalLM")
    with torch.no_grad():
        # the source's function, so both fp32 computations are within fp32's rounding of the float64 formulas
        diff_logits, source_logits = diff(IDS).logits, source(IDS).logits
    for row in range(IDS.shape[0]):
        exact, sigma = reference_logits(diff, IDS[row])
        if name in HEADS:  # the classifier scores the last token (IDS has no padding)
            exact, sigma = exact[-1], sigma[-1]
        assert_within_rounding(diff_logits[row], exact, sigma, msg=f"converted, row {row}:")
        assert_within_rounding(source_logits[row], exact, sigma, msg=f"source, row {row}:")


def greedy_without_cache(model, ids, steps):
    for _ in range(steps):
        with torch.no_grad():
            next_token = model(ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, next_token], dim=-1)
    return ids


@pytest.mark.parametrize("family, version", ALL)
def test_greedy_decoding_with_every_cache(family, version, checkpoints):
    model = load(checkpoints[1][family, version])
    expected = greedy_without_cache(model, IDS, 6)
    assert len(set(expected[:, IDS.shape[1] :].flatten().tolist())) > 3  # not degenerate
    for cache in ("dynamic", "static"):
        out = model.generate(IDS, max_new_tokens=6, min_new_tokens=6, do_sample=False, cache_implementation=cache)
        assert torch.equal(out, expected), cache


@pytest.mark.parametrize("family, version", ALL)
def test_lora_default_targets_save_and_reload(family, version, checkpoints, tmp_path):
    """`LoraConfig(task_type="CAUSAL_LM")` without target_modules adapts Llama's defaults (q_proj, v_proj); one step
    trains LoRA and λ; the adapter saves and reloads to the same logits."""
    from peft import AutoPeftModelForCausalLM, LoraConfig, get_peft_model

    path = checkpoints[1][family, version]
    model = get_peft_model(load(path), LoraConfig(task_type="CAUSAL_LM", modules_to_save=["diff_lambda"]))
    adapted = {n.split(".")[-1] for n, m in model.named_modules() if hasattr(m, "lora_A")}
    assert adapted == {"q_proj", "v_proj"}
    model.train()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    model(input_ids=IDS, labels=IDS).loss.backward()
    optimizer.step()
    model.eval()
    with torch.no_grad():
        trained = model(IDS).logits
        base = load(path)(IDS).logits
    assert (trained - base).abs().max() > 1e-3  # the step changed the function
    model.save_pretrained(tmp_path / "adapter")
    reloaded = AutoPeftModelForCausalLM.from_pretrained(tmp_path / "adapter", dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(IDS).logits, trained, rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", list(HEADS))
@pytest.mark.parametrize("version", VERSIONS)
def test_lora_on_task_heads(name, version, checkpoints, tmp_path):
    from peft import AutoPeftModelForSequenceClassification, LoraConfig, get_peft_model

    path = checkpoints[1][name, version]
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(task_type="SEQ_CLS"))
    model.train()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    model(input_ids=IDS, labels=torch.tensor([0, 2])).loss.backward()
    optimizer.step()
    model.eval()
    with torch.no_grad():
        trained = model(IDS).logits
    model.save_pretrained(tmp_path / "adapter")
    reloaded = AutoPeftModelForSequenceClassification.from_pretrained(tmp_path / "adapter", dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(reloaded.eval()(IDS).logits, trained, rtol=0, atol=1e-6)


@pytest.mark.parametrize("family, version", ALL)
def test_attention_maps_equal_eager_output_attentions(family, version, checkpoints):
    model = load(checkpoints[1][family, version], attn_implementation="eager")
    with torch.no_grad():
        eager = model(IDS, output_attentions=True).attentions
    entries = attention_maps(model, IDS)
    assert len(entries) == len(eager) == model.config.num_hidden_layers
    for entry, expected in zip(entries, eager):
        torch.testing.assert_close(entry.differential, expected, rtol=0, atol=1e-6)


def lm_eval_scores(path):
    import lm_eval
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={path},dtype=float32",
        tasks=["diff_tiny_choice"],
        batch_size=4,
        device="cpu",
        task_manager=TaskManager(
            include_path=str(REPOSITORY / "tests" / "evaluation" / "lm_eval_tasks"), include_defaults=False
        ),
        log_samples=True,
        bootstrap_iters=0,
    )
    return [doc["resps"] for doc in sorted(out["samples"]["diff_tiny_choice"], key=lambda d: d["doc_id"])]


def no_network(*args):
    raise OSError("network access is not allowed in this test")


# lm-eval compares with the source through transformers: Motif sources have no transformers class (remote code only)
@pytest.mark.parametrize("family, version", cell_params({("qwen3", 2)}, [c for c in CELLS if c[0] not in MOTIF]))
def test_lm_eval_scores_the_checkpoint(family, version, checkpoints, monkeypatch):
    """lm-eval's stock `hf` model scores each conversion: V2 with exactly the source's loglikelihoods; V1 with the
    loglikelihoods its own logits give."""
    monkeypatch.setattr(socket.socket, "connect", no_network)
    sources, converted = checkpoints
    responses = lm_eval_scores(converted[family, version])
    assert len(responses) == 8
    if version == 2:
        assert json.dumps(responses) == json.dumps(lm_eval_scores(sources[family]))
    else:
        assert json.dumps(responses) != json.dumps(lm_eval_scores(sources[family]))
        assert all(all(r[0][0] < 0 for r in doc) for doc in responses)  # real loglikelihoods


def launch_tensor_parallel(models: dict, out: Path):
    from safetensors.torch import load_file

    from tests.helpers.processes import launch

    launch("tp_run", out, *(f"{tag}={path}" for tag, path in models.items()), timeout=600)
    return json.loads((out / "rank0.json").read_text())["results"], load_file(out / "rank0.safetensors")


@pytest.fixture(scope="module")
def tensor_parallel_runs(request, checkpoints, tmp_path_factory):
    """One torchrun launch for every tensor-parallel cell this session selected (a launch costs ~10 s to start)."""
    selected = [
        item.callspec.params
        for item in request.session.items
        if item.originalname == "test_tensor_parallel_matches_the_unsharded_model"
    ]
    models = {f"{p['family']}-v{p['version']}": checkpoints[1][p["family"], p["version"]] for p in selected}
    return launch_tensor_parallel(models, tmp_path_factory.mktemp("tensor-parallel"))


@pytest.mark.parametrize("family, version", cell_params({("qwen3", 1)}))
def test_tensor_parallel_matches_the_unsharded_model(family, version, checkpoints, tensor_parallel_runs):
    """transformers' tensor parallelism (`tp_plan="auto"`, 2 ranks on CPU) with the config's plan: logits and greedy
    tokens of the unsharded model. (tests/distributed/test_distributed.py checks gradients and refusals on Llama
    shapes.)"""
    from tests.distributed.dist_common import SEQ_LEN, token_batches

    results, tensors = tensor_parallel_runs
    tag = f"{family}-v{version}"
    assert results[tag].get("tp_size") == 2, results[tag]
    model = load(checkpoints[1][family, version])
    ids = token_batches(2)[:, : SEQ_LEN // 2]
    with torch.no_grad():
        unsharded = model(ids).logits
    # fp32 summed in another order on 2 ranks: both within fp32's rounding of the float64 formulas
    for row in range(ids.shape[0]):
        exact, sigma = reference_logits(model, ids[row])
        assert_within_rounding(tensors[f"{tag}.logits"][row], exact, sigma, msg=f"sharded, row {row}:")
        assert_within_rounding(unsharded[row], exact, sigma, msg=f"unsharded, row {row}:")
    generated = model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert results[tag]["generated"] == generated.tolist()


def test_checkpoint_code_imports_nothing_optional(checkpoints):
    """A checkpoint carries configuration_diff.py and modeling_diff.py only, and transformers' own import check
    (`get_imports`, which raises for any module that is not installed) finds nothing beyond torch, transformers and
    huggingface_hub (a requirement of transformers) in them, anywhere in the file."""
    path = checkpoints[1]["qwen3", 1]
    code = sorted(p.name for p in path.glob("*.py"))
    assert code == ["configuration_diff.py", "modeling_diff.py"]
    allowed = {"torch", "transformers", "huggingface_hub", *sys.stdlib_module_names}
    for name in code:
        assert set(get_imports(path / name)) <= allowed, name


def test_every_config_field_is_placed_for_vllm():
    """Each DiffConfig field is honoured, refused unless supported, or unused by the vLLM model: a new field fails
    here until vLLM handles it (integrations/vllm/fields.py)."""
    declared = set(DiffConfig.__annotations__)
    placed = [*fields.HONOURED, *fields.REFUSED_UNLESS, *fields.NOT_USED]
    assert len(placed) == len(set(placed))  # each field in one place
    assert set(placed) == declared


def test_vllm_refuses_an_unsupported_activation_in_one_line():
    config = DiffConfig(hidden_size=64, num_attention_heads=2, vocab_size=64, hidden_act="gelu", diff_version=1)
    with pytest.raises(ValueError, match=r"^hidden_act='gelu' is not supported by diff-transformer's vLLM model"):
        fields.check_config(config)
