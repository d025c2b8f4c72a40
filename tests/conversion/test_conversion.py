"""Llama / DiffLlama -> Diff conversion (docs/design.md, "Converting a Llama checkpoint")."""

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import DiffLlamaForCausalLM, LlamaForCausalLM

from diff_transformer import DiffForCausalLM
from diff_transformer.analysis import attention_maps
from diff_transformer.conversion import (
    ConversionError,
    convert_diffllama_to_diff,
    convert_llama_to_diff,
    convert_to_diff,
    verify_conversion,
)
from diff_transformer.conversion.layout import llama_to_v1_query_permutation
from tests.helpers import REPOSITORY
from tests.helpers.checkpoints import (
    SIDE_FILES,
    VOCAB,
    make_diffllama,
    make_llama,
    tree_digest,
)


def load_converted(out, **kwargs):
    model, info = DiffForCausalLM.from_pretrained(out, output_loading_info=True, **kwargs)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval()


def out_state(out: Path) -> dict:
    state = {}
    for shard in sorted(out.glob("*.safetensors")):
        state.update(load_file(shard))
    return state


# ----------------------------------------------------------------------------------------------------------------
# V2: function-preserving


V2_CASES = {
    "mha": {},
    "gqa-6-3": dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=3),
    "gqa-9-3": dict(hidden_size=36, num_attention_heads=9, num_key_value_heads=3),
    "mqa-4-1": dict(num_attention_heads=4, num_key_value_heads=1),
    "explicit-head-dim": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "tied": dict(tie_word_embeddings=True),
    "biases": dict(attention_bias=True, mlp_bias=True),
    "rope-linear": dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
    "rope-dynamic": dict(
        max_position_embeddings=16, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    ),
    "rope-yarn": dict(
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "rope_theta": 10000.0,
            "original_max_position_embeddings": 16,
        }
    ),
    "rope-llama3": dict(
        rope_parameters={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
            "rope_theta": 500000.0,
        }
    ),
}


@pytest.mark.parametrize("overrides", list(V2_CASES.values()), ids=list(V2_CASES))
def test_v2_is_function_preserving(tmp_path, overrides):
    src = make_llama(tmp_path / "llama", **overrides)
    out = convert_llama_to_diff(src, tmp_path / "diff", progress=False)
    assert out == (tmp_path / "diff").absolute()

    report = verify_conversion(src, out, num_sequences=3, seq_len=32, max_new_tokens=8)
    assert report["max_abs_logit_diff"] <= 1e-4, report
    assert report["greedy_match"] and report["expected_exact"] and report["passed"], report

    config = json.loads((out / "config.json").read_text())
    source = json.loads((src / "config.json").read_text())
    H, H_kv = source["num_attention_heads"], source["num_key_value_heads"]
    assert config["model_type"] == "diff" and config["diff_version"] == 2
    assert config["num_attention_heads"] == H and config["num_key_value_heads"] == H_kv
    assert config["head_dim"] == source["head_dim"]
    for key in (
        "rope_parameters",
        "attention_bias",
        "mlp_bias",
        "tie_word_embeddings",
        "rms_norm_eps",
        "max_position_embeddings",
        "hidden_act",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "vocab_size",
        "intermediate_size",
    ):
        assert config[key] == source[key], key
    load_converted(out)  # no missing / unexpected / mismatched tensors


def test_v2_legacy_config_fields(tmp_path):
    """Older config.json files spell RoPE as rope_theta + rope_scaling and the dtype as torch_dtype, without
    head_dim."""
    rope = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }
    src = make_llama(tmp_path / "llama", rope_parameters={**rope, "rope_theta": 500000.0})
    config = json.loads((src / "config.json").read_text())
    for key in ("rope_parameters", "dtype", "head_dim"):
        config.pop(key)
    config.update(rope_theta=500000.0, rope_scaling=rope, torch_dtype="float32")
    (src / "config.json").write_text(json.dumps(config))
    out = convert_llama_to_diff(src, tmp_path / "diff", progress=False)
    written = json.loads((out / "config.json").read_text())
    assert written["rope_parameters"]["rope_type"] == "llama3" and written["rope_parameters"]["rope_theta"] == 500000.0
    assert written["head_dim"] == 8 and written["dtype"] == "float32"
    assert verify_conversion(src, out, max_new_tokens=4)["passed"]


def test_v2_longer_sequences_and_batch_generation(tmp_path):
    src = make_llama(tmp_path / "llama", num_attention_heads=6, num_key_value_heads=2, hidden_size=48)
    out = convert_llama_to_diff(src, tmp_path / "diff", progress=False)
    llama = LlamaForCausalLM.from_pretrained(src).eval()
    diff = load_converted(out)
    ids = torch.randint(3, VOCAB, (2, 40), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :7] = 0  # left padding
    with torch.no_grad():
        assert (llama(ids, attention_mask=mask).logits - diff(ids, attention_mask=mask).logits)[
            mask.bool()
        ].abs().max() <= 1e-4
        kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
        assert torch.equal(llama.generate(ids, **kwargs), diff.generate(ids, **kwargs))


def test_v2_weight_layout(tmp_path):
    src = make_llama(
        tmp_path / "llama", hidden_size=48, num_attention_heads=6, num_key_value_heads=3, attention_bias=True
    )
    out = convert_llama_to_diff(src, tmp_path / "diff", progress=False)
    before, after = out_state(src), out_state(out)
    d = 8
    for layer in range(2):
        p = f"model.layers.{layer}.self_attn."
        q_src = before[p + "q_proj.weight"].view(6, d, 48)
        q_out = after[p + "q_proj.weight"].view(12, d, 48)
        for i in range(6):
            assert torch.equal(q_out[2 * i], q_src[i]) and torch.equal(q_out[2 * i + 1], q_src[i])
        qb_src, qb_out = before[p + "q_proj.bias"].view(6, d), after[p + "q_proj.bias"].view(12, d)
        assert torch.equal(qb_out[0::2], qb_src) and torch.equal(qb_out[1::2], qb_src)
        assert torch.equal(after[p + "o_proj.weight"], 2 * before[p + "o_proj.weight"])
        assert torch.equal(after[p + "o_proj.bias"], before[p + "o_proj.bias"])  # the bias is added once: not doubled
        for name in ("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias"):
            assert torch.equal(after[p + name], before[p + name])
        assert torch.equal(after[p + "diff_lambda.proj.weight"], torch.zeros(6, 48))
    for name in (
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.norm.weight",
        "model.layers.1.mlp.down_proj.weight",
    ):
        assert torch.equal(after[name], before[name])


def test_v2_gradients_reach_new_parameters(tmp_path):
    src = make_llama(tmp_path / "llama", hidden_size=48, num_attention_heads=6, num_key_value_heads=3)
    out = convert_llama_to_diff(src, tmp_path / "diff", progress=False)
    model = load_converted(out).train()
    ids = torch.randint(3, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    model(ids, labels=ids).loss.backward()
    d, H = 8, 6
    for layer in model.model.layers:
        attn = layer.self_attn
        grad_lambda = attn.diff_lambda.proj.weight.grad
        assert grad_lambda is not None and (grad_lambda.abs().sum(dim=1) > 0).all()  # every head's λ row moves
        grad_q = attn.q_proj.weight.grad.view(2 * H, d, -1)
        assert (grad_q[1::2].abs().flatten(1).sum(dim=1) > 0).all()  # the copied query rows q_{2i+1}
        assert (grad_q[0::2].abs().flatten(1).sum(dim=1) > 0).all()
        # The two copies get different gradients (λ weighs them differently), so they can diverge.
        assert not torch.allclose(grad_q[0::2], grad_q[1::2])


def test_bf16_is_kept(tmp_path):
    src = make_llama(
        tmp_path / "llama", dtype=torch.bfloat16, num_attention_heads=6, num_key_value_heads=2, hidden_size=48
    )
    out = convert_llama_to_diff(src, tmp_path / "diff", progress=False)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(out / "model.safetensors", "pt") as handle:
        assert {handle.get_slice(k).get_dtype() for k in handle.keys()} == {"BF16"}
    # In bf16 the conversion is still exact weight-wise (copies and a power-of-two scale); logits agree closely.
    llama = LlamaForCausalLM.from_pretrained(src, dtype=torch.bfloat16).eval()
    diff = load_converted(out, dtype=torch.bfloat16)
    assert diff.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    ids = torch.randint(3, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (llama(ids).logits.float() - diff(ids).logits.float()).abs().max() <= 0.05


def test_dtype_cast(tmp_path):
    src = make_llama(tmp_path / "llama")
    out = convert_llama_to_diff(src, tmp_path / "v2", dtype="bfloat16", progress=False)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert {t.dtype for t in out_state(out).values()} == {torch.bfloat16}
    # cast slice by slice while writing (V2's doubled q_proj is an expanded view): the same values as casting after
    full = out_state(convert_llama_to_diff(src, tmp_path / "v2-fp32", progress=False))
    assert all(torch.equal(tensor, full[name].to(torch.bfloat16)) for name, tensor in out_state(out).items())
    out1 = convert_llama_to_diff(src, tmp_path / "v1", diff_version=1, dtype=torch.float16, progress=False)
    state = out_state(out1)
    for name, tensor in state.items():
        assert tensor.dtype == (torch.float32 if ".diff_lambda.lambda_" in name else torch.float16), name


def test_sharded_input_gives_sharded_output(tmp_path):
    src = make_llama(tmp_path / "llama", max_shard_size="20KB")
    source_index = json.loads((src / "model.safetensors.index.json").read_text())
    out = convert_llama_to_diff(src, tmp_path / "diff", progress=False)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) == len(set(source_index["weight_map"].values())) > 1
    assert sorted(p.name for p in out.glob("*.safetensors")) == shards
    state = out_state(out)
    assert set(state) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in state.values())
    for name, shard in index["weight_map"].items():
        with safe_open(out / shard, "pt") as handle:
            assert name in handle.keys()
    assert verify_conversion(src, out, max_new_tokens=4)["passed"]

    # by size instead of mirroring the input
    out2 = convert_llama_to_diff(src, tmp_path / "diff2", max_shard_size="40KB", progress=False)
    index2 = json.loads((out2 / "model.safetensors.index.json").read_text())
    assert len(set(index2["weight_map"].values())) < len(shards)
    assert set(index2["weight_map"]) == set(state)


def test_streaming_holds_about_one_shard(tmp_path, monkeypatch):
    """Peak memory of a conversion: the process's resident memory, sampled around every tensor the writer receives,
    grows by about one input shard over what it was before, far less than the checkpoint (holding every source tensor
    until the end reaches the checkpoint's size)."""
    import psutil

    from diff_transformer.conversion import writer as writer_module

    sizes = dict(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_attention_heads=8)
    src = make_llama(tmp_path / "llama", max_shard_size="8MB", num_hidden_layers=3, num_key_value_heads=4, **sizes)
    shards = [p.stat().st_size for p in src.glob("*.safetensors")]  # 71 MB in 8, the largest one embedding (17 MB)
    convert_llama_to_diff(make_llama(tmp_path / "small"), tmp_path / "warm-up", progress=False)  # lazy imports
    process = psutil.Process()
    peak = 0
    original_add = writer_module.ShardWriter.add

    def add(self, name, tensor, **kwargs):
        nonlocal peak
        peak = max(peak, process.memory_info().rss)
        original_add(self, name, tensor, **kwargs)
        peak = max(peak, process.memory_info().rss)

    monkeypatch.setattr(writer_module.ShardWriter, "add", add)
    before = process.memory_info().rss
    convert_llama_to_diff(src, tmp_path / "diff", progress=False)
    assert len(shards) > 4 and peak > before
    assert peak - before <= 1.5 * max(shards) < sum(shards) / 2


def test_side_files_card_and_custom_code(tmp_path):
    src = make_llama(tmp_path / "llama")
    (src / "pytorch_model.bin").write_bytes(b"not a pickle")  # a stray pickle next to safetensors is ignored
    out = convert_llama_to_diff(src, tmp_path / "diff", progress=False)
    for name, text in SIDE_FILES.items():
        assert (out / name).read_text() == text
    assert (out / "generation_config.json").read_bytes() == (src / "generation_config.json").read_bytes()
    assert not (out / "pytorch_model.bin").exists()
    package = REPOSITORY / "src" / "diff_transformer"
    for name in ("configuration_diff.py", "modeling_diff.py"):
        assert (out / name).read_bytes() == (package / name).read_bytes()
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DiffForCausalLM"]
    assert config["auto_map"] == {
        "AutoConfig": "configuration_diff.DiffConfig",
        "AutoModel": "modeling_diff.DiffModel",
        "AutoModelForCausalLM": "modeling_diff.DiffForCausalLM",
        "AutoModelForSequenceClassification": "modeling_diff.DiffForSequenceClassification",
        "AutoModelForTokenClassification": "modeling_diff.DiffForTokenClassification",
        "AutoModelForQuestionAnswering": "modeling_diff.DiffForQuestionAnswering",
    }
    from huggingface_hub.repocard import metadata_load

    meta = metadata_load(out / "README.md")
    assert meta["library_name"] == "transformers"
    assert meta["license"] == "apache-2.0" and meta["language"] == ["en"]
    assert "diff-transformer" in meta["tags"]
    assert "base_model" not in meta  # a plain local directory has no Hub id
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary directories left


@pytest.mark.slow  # test_card.py::test_card_usage_snippet_runs_without_the_package loads a conversion that way too
def test_loads_as_remote_code_without_the_package(tmp_path):
    """The copied code files alone (diff_transformer cannot be imported in the child) give the native logits."""
    from tests.helpers.processes import run_json

    src = make_llama(tmp_path / "llama")
    out = convert_llama_to_diff(src, tmp_path / "diff", progress=False)
    script = (
        "import json, sys, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        "m = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)\n"
        "logits = m(torch.tensor([[3, 4, 5]])).logits\n"
        "print(json.dumps({'module': type(m).__module__, 'logits': logits.tolist()}))\n"
    )
    report = run_json(script, out, env={"HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1"})
    assert report["module"].startswith("transformers_modules"), report["module"]
    with torch.no_grad():
        expected = DiffForCausalLM.from_pretrained(out)(torch.tensor([[3, 4, 5]])).logits
    assert expected.shape == (1, 3, VOCAB)
    torch.testing.assert_close(torch.tensor(report["logits"]), expected, rtol=0, atol=1e-6)


def test_hub_id_from_offline_cache(tmp_path, monkeypatch):
    """A Hub id resolves through snapshot_download from the HF cache (HF_HUB_OFFLINE), and becomes base_model."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = cache / "models--tiny-org--tiny-llama" / "snapshots" / commit
    make_llama(snapshot)
    (cache / "models--tiny-org--tiny-llama" / "refs").mkdir()
    (cache / "models--tiny-org--tiny-llama" / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    digest = tree_digest(cache)

    out = convert_llama_to_diff("tiny-org/tiny-llama", tmp_path / "diff", progress=False)
    from huggingface_hub.repocard import metadata_load

    assert metadata_load(out / "README.md")["base_model"] == "tiny-org/tiny-llama"
    assert verify_conversion("tiny-org/tiny-llama", out, max_new_tokens=2)["passed"]
    assert tree_digest(cache) == digest

    with pytest.raises(ConversionError, match="not in the local HF cache"):
        convert_llama_to_diff("tiny-org/not-cached", tmp_path / "diff2", progress=False)
    assert not (tmp_path / "diff2").exists()


def test_hub_download_fetches_config_first_and_safetensors_only(tmp_path, monkeypatch):
    import huggingface_hub

    src = make_llama(tmp_path / "llama")
    calls = []

    def fake_hf_hub_download(repo_id, filename, **kwargs):
        calls.append(("config", repo_id, filename, kwargs))
        return str(src / filename)

    def fake_snapshot_download(repo_id, **kwargs):
        calls.append(("snapshot", repo_id, kwargs))
        return str(src)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_hf_hub_download)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    convert_llama_to_diff("org/model", tmp_path / "diff", progress=False, revision="v1")
    (first, second) = calls
    assert first[:3] == ("config", "org/model", "config.json") and first[3]["revision"] == "v1"
    assert second[:2] == ("snapshot", "org/model")
    kwargs = second[2]
    assert kwargs["revision"] == "v1"
    assert "model*.safetensors" in kwargs["allow_patterns"]
    assert not any(p.endswith((".bin", ".pth", ".pt")) or p == "*" for p in kwargs["allow_patterns"])

    # a wrong model is refused from its config.json alone, before any weights are downloaded
    calls.clear()
    _edit_config(src, model_type="gpt2")
    with pytest.raises(ConversionError, match="model_type 'gpt2'"):
        convert_llama_to_diff("org/model", tmp_path / "diff2", progress=False)
    assert [c[0] for c in calls] == ["config"]


def test_convert_to_diff_dispatches(tmp_path):
    llama = make_llama(tmp_path / "llama")
    out = convert_to_diff(llama, tmp_path / "a", progress=False)
    assert json.loads((out / "config.json").read_text())["diff_version"] == 2
    diffllama = make_diffllama(tmp_path / "dl", num_hidden_layers=1)
    out = convert_to_diff(diffllama, tmp_path / "b", progress=False)
    assert json.loads((out / "config.json").read_text())["diff_version"] == 1


# ----------------------------------------------------------------------------------------------------------------
# V1: paper layout from Llama (v1_init="paper"; the calibrated start is tested in test_v1_init.py)


def test_v1_layout_mha(tmp_path):
    """docs/design.md's pairing: q1 of head h = Llama head 2h, q2 = head 2h+1; k/v of group g = kv heads 2g, 2g+1."""
    src = make_llama(tmp_path / "llama", num_attention_heads=4, num_key_value_heads=4, attention_bias=True)
    out = convert_llama_to_diff(
        src, tmp_path / "diff", diff_version=1, v1_init="paper", lambda_std=0.05, seed=3, progress=False
    )
    config = json.loads((out / "config.json").read_text())
    assert (
        config["diff_version"],
        config["num_attention_heads"],
        config["num_key_value_heads"],
        config["head_dim"],
    ) == (1, 2, 2, 8)
    assert config["lambda_init"] is None and config["lambda_std"] == 0.05
    before, after = out_state(src), out_state(out)
    d, D = 8, 32
    for layer in range(2):
        p = f"model.layers.{layer}.self_attn."
        llama_q = before[p + "q_proj.weight"].view(4, d, D)
        q = after[p + "q_proj.weight"].view(2, 2, d, D)  # (H, 2, d, D): q1 = [:, 0], q2 = [:, 1]
        k = after[p + "k_proj.weight"].view(2, 2, d, D)
        v = after[p + "v_proj.weight"].view(2, 2 * d, D)  # (H_kv, 2d, D)
        llama_k, llama_v = before[p + "k_proj.weight"].view(4, d, D), before[p + "v_proj.weight"].view(4, d, D)
        for h in range(2):
            assert torch.equal(q[h, 0], llama_q[2 * h]) and torch.equal(q[h, 1], llama_q[2 * h + 1])
            assert torch.equal(k[h, 0], llama_k[2 * h]) and torch.equal(k[h, 1], llama_k[2 * h + 1])
            assert torch.equal(v[h], torch.cat([llama_v[2 * h], llama_v[2 * h + 1]]))
        for name in ("q_proj.bias", "k_proj.bias", "v_proj.bias", "o_proj.weight", "o_proj.bias"):
            assert torch.equal(after[p + name], before[p + name]), name  # MHA: every block already in place
        assert torch.equal(after[p + "subln.weight"], torch.ones(2 * d))
        lambdas = torch.stack(
            [after[p + f"diff_lambda.{n}"] for n in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")]
        )
        assert lambdas.dtype == torch.float32 and lambdas.shape == (4, d) and 0 < lambdas.std() < 0.15
    # seeded: the same seed gives the same λ vectors, another seed others
    again = out_state(
        convert_llama_to_diff(
            src, tmp_path / "again", diff_version=1, v1_init="paper", lambda_std=0.05, seed=3, progress=False
        )
    )
    other = out_state(
        convert_llama_to_diff(
            src, tmp_path / "other", diff_version=1, v1_init="paper", lambda_std=0.05, seed=4, progress=False
        )
    )
    name = "model.layers.1.self_attn.diff_lambda.lambda_q2"
    assert torch.equal(again[name], after[name]) and not torch.equal(other[name], after[name])
    model = load_converted(out)
    ids = torch.randint(3, VOCAB, (1, 8))
    assert torch.isfinite(model(ids).logits).all()


@pytest.mark.parametrize("heads,kv_heads,hidden", [(4, 4, 32), (8, 4, 64), (8, 2, 64), (6, 2, 48)])
def test_v1_pairs_queries_with_the_keys_they_were_trained_with(tmp_path, heads, kv_heads, hidden):
    """Under GQA every V1 map A_c of head h must be the attention map of one Llama head (same query AND key)."""
    src = make_llama(
        tmp_path / "llama",
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        hidden_size=hidden,
        attention_bias=True,
    )
    out = convert_llama_to_diff(src, tmp_path / "diff", diff_version=1, v1_init="paper", progress=False)
    llama = LlamaForCausalLM.from_pretrained(src, attn_implementation="eager").eval()
    diff = load_converted(out, attn_implementation="eager")
    ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        llama_maps = llama(ids, output_attentions=True).attentions[0]  # layer 0 sees identical inputs
        lam = diff.model.layers[0].self_attn.diff_lambda
        for p in (lam.lambda_q1, lam.lambda_k1, lam.lambda_q2, lam.lambda_k2):
            p.zero_()
        lambda_init = lam.lambda_init
        maps_init = diff(ids, output_attentions=True).attentions[0]  # A1 - λ_init A2
        lam.lambda_q2[0], lam.lambda_k2[0] = 1.0, math.log(1.0 + lambda_init)  # λ = 1 - (1 + λ_init) + λ_init = 0
        a1 = diff(ids, output_attentions=True).attentions[0]
    a2 = (a1 - maps_init) / lambda_init
    perm = llama_to_v1_query_permutation(heads, kv_heads)
    for h in range(heads // 2):
        assert (a1[:, h] - llama_maps[:, perm[2 * h]]).abs().max() <= 1e-5
        assert (a2[:, h] - llama_maps[:, perm[2 * h + 1]]).abs().max() <= 1e-4
    assert sorted(perm) == list(range(heads))


@pytest.mark.parametrize(
    "heads,kv_heads,hidden",
    [(3, 3, 36), (6, 3, 48), (9, 3, 36), (4, 1, 32)],
)
def test_v1_expanded_layout_for_head_counts_that_cannot_pair(tmp_path, heads, kv_heads, hidden):
    """Odd (or unpairable) head counts convert to the expanded layout: one differential head per Llama head whose q1,
    k1 and first value half are the Llama's rows, q2/k2 copies of them, a second value half behind zero o_proj
    columns; λ = λ_init > 0. A2 = A1, so at step 0 the output does not depend on λ (checked by moving λ)."""
    src = make_llama(tmp_path / "llama", num_attention_heads=heads, num_key_value_heads=kv_heads, hidden_size=hidden)
    digest = tree_digest(src)
    with pytest.raises(ConversionError, match=r"paired V1 layout needs even .*use --v1-layout expanded"):
        convert_llama_to_diff(src, tmp_path / "refused", diff_version=1, v1_layout="paired", progress=False)
    with pytest.raises(ConversionError, match=r"no additive start: use --v1-init calibrated"):
        convert_llama_to_diff(src, tmp_path / "refused", diff_version=1, v1_init="calibrated-additive", progress=False)
    assert not (tmp_path / "refused").exists()
    out = convert_llama_to_diff(src, tmp_path / "diff", diff_version=1, v1_init="paper", progress=False)
    assert tree_digest(src) == digest
    config = json.loads((out / "config.json").read_text())
    assert config["conversion"]["v1_layout"] == "expanded" and config["lambda_floor"] is None
    d = hidden // heads
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (heads, kv_heads, d)
    source, converted = load_file(src / "model.safetensors"), out_state(out)
    p = "model.layers.1.self_attn."
    q, k, v = (converted[p + f"{n}_proj.weight"] for n in "qkv")
    llama_q, llama_k, llama_v = (source[p + f"{n}_proj.weight"] for n in "qkv")
    assert torch.equal(q.view(heads, 2, d, hidden)[:, 0], llama_q.view(heads, d, hidden))
    assert torch.equal(q.view(heads, 2, d, hidden)[:, 1], llama_q.view(heads, d, hidden))
    assert torch.equal(k.view(kv_heads, 2, d, hidden)[:, 0], llama_k.view(kv_heads, d, hidden))
    assert torch.equal(k.view(kv_heads, 2, d, hidden)[:, 1], llama_k.view(kv_heads, d, hidden))
    halves = v.view(kv_heads, 2, d, hidden)
    assert torch.equal(halves[:, 0], llama_v.view(kv_heads, d, hidden))
    assert 0 < halves[:, 1].abs().max() < 0.05 * llama_v.abs().max()  # small noise, not zero: no saddle
    o_proj = converted[p + "o_proj.weight"].view(hidden, heads, 2, d)
    assert torch.equal(o_proj[:, :, 0], source[p + "o_proj.weight"].view(hidden, heads, d))
    assert not o_proj[:, :, 1].any()
    model = DiffForCausalLM.from_pretrained(out).eval()
    lam = model.model.layers[1].self_attn.diff_lambda
    assert lam().item() == pytest.approx(0.8 - 0.6 * math.exp(-0.3), abs=1e-6) and lam.lambda_q1.abs().min() > 0
    ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    maps = attention_maps(model, ids)[1]  # analysis sees A2 = A1 and the differential map (1 - λ) A1
    torch.testing.assert_close(maps.second, maps.first)
    torch.testing.assert_close(maps.differential, (1 - lam().item()) * maps.first)
    with torch.no_grad():
        before = model(ids).logits
        for layer in model.model.layers:  # λ up by about 0.26 (λq2·λk2 lowered by 0.3), still below 1
            module = layer.self_attn.diff_lambda
            module.lambda_q2.sub_(0.3 * module.lambda_k2 / module.lambda_k2.square().sum())
        assert model.model.layers[1].self_attn.diff_lambda().item() > lam.lambda_init + 0.1
        moved = model(ids).logits
        assert (moved - before).abs().max() < 1e-3  # only the norm's eps sees the factor (1 - λ)
        q_proj = model.model.layers[1].self_attn.q_proj.weight.view(heads, 2, d, hidden)
        q_proj[:, 1] += 0.5 * torch.randn(q_proj[:, 1].shape, generator=torch.Generator().manual_seed(1))
        assert (model(ids).logits - moved).abs().max() > 1e-2  # once A2 differs from A1, λ matters


# ----------------------------------------------------------------------------------------------------------------
# DiffLlama -> V1


@pytest.mark.parametrize(
    "overrides",
    [
        dict(num_attention_heads=4, num_key_value_heads=4),
        dict(num_attention_heads=8, num_key_value_heads=4),
        dict(num_attention_heads=8, num_key_value_heads=2, attention_bias=True),
        dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True),
    ],
    ids=["mha", "gqa-2", "gqa-4-bias", "head-dim-tied"],
)
def test_diffllama_import_is_exact(tmp_path, overrides):
    src = make_diffllama(tmp_path / "dl", **overrides)
    out = convert_diffllama_to_diff(src, tmp_path / "diff", progress=False)
    report = verify_conversion(src, out, num_sequences=3, seq_len=32, max_new_tokens=8)
    assert report["max_abs_logit_diff"] <= 1e-5, report
    assert report["greedy_match"] and report["passed"], report
    config = json.loads((out / "config.json").read_text())
    source = json.loads((src / "config.json").read_text())
    assert config["diff_version"] == 1 and config["lambda_init"] is None and config["lambda_std"] == 0.3
    assert config["num_attention_heads"] * 2 == source["num_attention_heads"]
    assert config["num_key_value_heads"] * 2 == source["num_key_value_heads"]
    assert config["head_dim"] == source["head_dim"]
    diff = load_converted(out)
    assert [layer.self_attn.lambda_init for layer in diff.model.layers] == [
        0.8 - 0.6 * math.exp(-0.3 * i) for i in range(source["num_hidden_layers"])
    ]


def test_diffllama_import_sharded_with_cache_generation(tmp_path):
    src = make_diffllama(tmp_path / "dl", max_shard_size="20KB")
    out = convert_diffllama_to_diff(src, tmp_path / "diff", progress=False)
    assert (out / "model.safetensors.index.json").is_file()
    dl = DiffLlamaForCausalLM.from_pretrained(src).eval()
    diff = load_converted(out)
    ids = torch.randint(3, VOCAB, (2, 10), generator=torch.Generator().manual_seed(2))
    kwargs = dict(max_new_tokens=10, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(dl.generate(ids, **kwargs), diff.generate(ids, **kwargs))


def test_diffllama_importer_refuses_v2_and_llama(tmp_path):
    src = make_diffllama(tmp_path / "dl", num_hidden_layers=1)
    with pytest.raises(ConversionError, match="diff_version=1 only"):
        convert_diffllama_to_diff(src, tmp_path / "x", diff_version=2, progress=False)
    with pytest.raises(ConversionError, match="model_type 'diffllama'.*use convert_diffllama_to_diff"):
        convert_llama_to_diff(src, tmp_path / "x", progress=False)
    llama = make_llama(tmp_path / "llama", side_files=False)
    with pytest.raises(ConversionError, match="model_type 'llama'.*use convert_llama_to_diff"):
        convert_diffllama_to_diff(llama, tmp_path / "x", progress=False)
    assert not (tmp_path / "x").exists()


# ----------------------------------------------------------------------------------------------------------------
# Bad inputs: clear one-line error, nothing written, SRC untouched


def _edit_config(src, **changes):
    config = json.loads((src / "config.json").read_text())
    config.update(changes)
    (src / "config.json").write_text(json.dumps(config))


def _first_shard(src):
    return sorted(src.glob("model-*.safetensors"))[0]


def _drop_tensor(src, name):
    path = src / "model.safetensors"
    state = load_file(path)
    del state[name]
    save_file(state, path, metadata={"format": "pt"})


def _add_tensor(src, name):
    path = src / "model.safetensors"
    state = load_file(path)
    state[name] = torch.zeros(3)
    save_file(state, path, metadata={"format": "pt"})


def _truncate(path, keep=0.6):
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def _corrupt_header(path):
    data = bytearray(path.read_bytes())
    data[8:40] = b"\x00garbage-not-json" + b"\xff" * 15
    path.write_bytes(bytes(data))


def _bin_only(src):
    for p in src.glob("*.safetensors*"):
        p.unlink()
    (src / "pytorch_model.bin").write_bytes(b"\x80\x02 would be unpickled here")


def _misplace_in_index(src):
    path = src / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    assert index["weight_map"]["model.norm.weight"] != _first_shard(src).name
    index["weight_map"]["model.norm.weight"] = _first_shard(src).name
    path.write_text(json.dumps(index))


BAD_INPUTS = {
    "unsupported-family": (
        lambda s: _edit_config(s, model_type="gemma"),
        {},
        r"model_type 'gemma'; only 'llama', 'mistral', 'qwen2', 'qwen3' checkpoints convert",
    ),
    "already-diff": (lambda s: _edit_config(s, model_type="diff"), {}, r"already a Diff checkpoint"),
    "missing-config": (lambda s: (s / "config.json").unlink(), {}, r"no config\.json in .*save_pretrained"),
    "broken-config": (lambda s: (s / "config.json").write_text("{not json"), {}, r"config\.json is not valid JSON"),
    "missing-shard": (
        lambda s: _first_shard(s).unlink(),
        dict(max_shard_size="20KB"),
        r"shard model-00001-of-\d+\.safetensors listed in model\.safetensors\.index\.json is missing",
    ),
    "truncated-shard": (
        lambda s: _truncate(_first_shard(s)),
        dict(max_shard_size="20KB"),
        r"shard model-00001-of-\d+\.safetensors .* is corrupt or truncated",
    ),
    "corrupt-shard": (
        lambda s: _corrupt_header(s / "model.safetensors"),
        {},
        r"shard model\.safetensors .* is corrupt or truncated",
    ),
    "empty-shard": (lambda s: (s / "model.safetensors").write_bytes(b""), {}, r"corrupt or truncated"),
    "shape-mismatch": (
        lambda s: _edit_config(s, intermediate_size=48),
        {},
        r"mlp\.\w+_proj\.weight in model\.safetensors has shape \[\d+, \d+\], but config\.json implies \[\d+, \d+\]",
    ),
    "layer-count": (
        lambda s: _edit_config(s, num_hidden_layers=3),
        {},
        # the config-vs-weights check every entry point runs first (checkpoints/loading.py)
        r"config\.json says num_hidden_layers=3, but the weights hold 2 layers",
    ),
    "rope-theta-zero": (
        lambda s: _edit_config(s, rope_parameters={"rope_type": "default", "rope_theta": 0}),
        {},
        r"rope_parameters\.rope_theta=0 must be a finite number > 1",
    ),
    "rms-eps-zero-in-fp32": (lambda s: _edit_config(s, rms_norm_eps=1e-300), {}, r"rms_norm_eps=1e-300 must be a"),
    "missing-tensor": (lambda s: _drop_tensor(s, "model.norm.weight"), {}, r"tensor model\.norm\.weight is missing"),
    "missing-lm-head": (lambda s: _drop_tensor(s, "lm_head.weight"), {}, r"tensor lm_head\.weight is missing"),
    "unexpected-tensor": (
        lambda s: _add_tensor(s, "model.layers.0.self_attn.q_norm.weight"),
        {},
        r"unexpected tensor model\.layers\.0\.self_attn\.q_norm\.weight",
    ),
    "bin-only": (_bin_only, {}, r"only pickle weights \(pytorch_model\.bin\); refusing to unpickle"),
    "no-weights": (lambda s: [p.unlink() for p in s.glob("*.safetensors")], {}, r"no model weights"),
    "quantized": (
        lambda s: _edit_config(s, quantization_config={"quant_method": "bitsandbytes"}),
        {},
        r"quantized checkpoint \(bitsandbytes\)",
    ),
    "base-model-only": (
        lambda s: _edit_config(s, architectures=["LlamaModel"]),
        {},
        r"holds a LlamaModel checkpoint; only LlamaForCausalLM, LlamaForSequenceClassification, "
        r"LlamaForTokenClassification, LlamaForQuestionAnswering convert",
    ),
    "index-disagrees": (
        _misplace_in_index,
        dict(max_shard_size="20KB"),
        r"index\.json places tensor model\.norm\.weight in model-00001-of-\d+\.safetensors, "
        r"but that shard does not hold it",
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_refused_cleanly(tmp_path, case):
    damage, build, message = BAD_INPUTS[case]
    src = make_llama(tmp_path / "llama", side_files=False, **build)
    damage(src)
    digest = tree_digest(src)
    parent = tmp_path / "outputs"
    parent.mkdir()
    with pytest.raises(ConversionError, match=message) as info:
        convert_llama_to_diff(src, parent / "diff", progress=False)
    assert "\n" not in str(info.value)
    assert isinstance(info.value, ValueError)
    assert list(parent.iterdir()) == []  # neither OUT nor a temporary directory
    assert tree_digest(src) == digest


def test_stale_rotary_buffers_are_skipped(tmp_path):
    """Old checkpoints carry non-persistent `rotary_emb.inv_freq` buffers: dropped, not an error."""
    src = make_llama(tmp_path / "llama", side_files=False)
    _add_tensor(src, "model.layers.0.self_attn.rotary_emb.inv_freq")
    out = convert_llama_to_diff(src, tmp_path / "diff", progress=False)
    assert not any("inv_freq" in name for name in out_state(out))
    assert verify_conversion(src, out, max_new_tokens=2)["passed"]


def test_nonexistent_source(tmp_path):
    with pytest.raises(ConversionError, match="neither an existing directory nor a valid Hub model id"):
        convert_llama_to_diff(tmp_path / "nope", tmp_path / "diff", progress=False)
    with pytest.raises(ConversionError, match="is a file"):
        (tmp_path / "file").write_text("x")
        convert_llama_to_diff(tmp_path / "file", tmp_path / "diff", progress=False)
    assert not (tmp_path / "diff").exists()


def test_non_empty_out_is_refused_then_overwritten(tmp_path):
    src = make_llama(tmp_path / "llama")
    digest = tree_digest(src)
    out = tmp_path / "diff"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    with pytest.raises(ConversionError, match=r"is not empty: pass overwrite=True"):
        convert_llama_to_diff(src, out, progress=False)
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "precious"

    # a failing conversion with overwrite=True leaves the old OUT in place
    bad = make_llama(tmp_path / "bad", side_files=False)
    _edit_config(bad, intermediate_size=48)
    with pytest.raises(ConversionError):
        convert_llama_to_diff(bad, out, overwrite=True, progress=False)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]

    # a model's file that no run of ours provably wrote is never deleted: refused, named, nothing changed
    (out / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    with pytest.raises(ConversionError, match=r"holds model\.safetensors\.index\.json, which no record"):
        convert_llama_to_diff(src, out, overwrite=True, progress=False)
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt", "model.safetensors.index.json"]
    # without it, the new checkpoint is installed whole and the user's own files stay
    (out / "model.safetensors.index.json").unlink()
    convert_llama_to_diff(src, out, overwrite=True, progress=False)
    assert (out / "keep.txt").read_text() == "precious" and (out / "config.json").is_file()
    # and a second --overwrite replaces what the first one provably wrote
    convert_llama_to_diff(src, out, overwrite=True, progress=False)
    assert (out / "keep.txt").read_text() == "precious" and (out / "config.json").is_file()
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert tree_digest(src) == digest

    empty = tmp_path / "empty"
    empty.mkdir()
    convert_llama_to_diff(src, empty, progress=False)  # an empty OUT is fine without overwrite
    assert (empty / "config.json").is_file()


def test_out_must_not_overlap_src(tmp_path):
    src = make_llama(tmp_path / "llama")
    digest = tree_digest(src)
    for out, overwrite in ((src / "diff", False), (tmp_path, True)):
        with pytest.raises(ConversionError, match="overlaps SRC"):
            convert_llama_to_diff(src, out, overwrite=overwrite, progress=False)
    for overwrite in (False, True):  # OUT = SRC: said as such, with or without overwrite (which would not help)
        with pytest.raises(ConversionError, match=r"is SRC: choose another OUT \(SRC is never modified\)\.$"):
            convert_llama_to_diff(src, src, overwrite=overwrite, progress=False)
    assert tree_digest(src) == digest and not (src / "diff").exists()


def test_convert_src_src_says_out_is_src_without_advising_overwrite(tmp_path, capsys):
    """`convert SRC SRC` advised --overwrite, which was then refused as "overlaps SRC" (issue 46)."""
    from diff_transformer import cli

    src = make_llama(tmp_path / "llama")
    capsys.readouterr()  # save_pretrained's progress bar
    for extra in ([], ["--overwrite"]):
        assert cli.main(["convert", str(src), str(src), *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert err == f"error: OUT {src} is SRC: choose another OUT (SRC is never modified).", err


def test_missing_parents_are_created_and_removed_on_failure(tmp_path):
    src = make_llama(tmp_path / "llama")
    out = convert_llama_to_diff(src, tmp_path / "a" / "b" / "diff", progress=False)
    assert (out / "config.json").is_file()
    _edit_config(src, vocab_size=7)
    with pytest.raises(ConversionError, match="vocab_size=7, but the embedding holds"):
        convert_llama_to_diff(src, tmp_path / "c" / "d" / "diff", progress=False)
    assert not (tmp_path / "c").exists()


def test_bad_arguments(tmp_path):
    src = make_llama(tmp_path / "llama")
    with pytest.raises(ConversionError, match="dtype='int8' is not supported"):
        convert_llama_to_diff(src, tmp_path / "x", dtype="int8", progress=False)
    with pytest.raises(ConversionError, match="diff_version=3 is not supported"):
        convert_llama_to_diff(src, tmp_path / "x", diff_version=3, progress=False)
    with pytest.raises(ConversionError, match="max_shard_size='lots'"):
        convert_llama_to_diff(src, tmp_path / "x", max_shard_size="lots", progress=False)
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("expected_tensors", [1, 64], ids=["header-rewritten", "header-reserved"])
def test_streaming_writer_writes_valid_safetensors(tmp_path, expected_tensors):
    """Each tensor goes to disk as it arrives; the header fits its reservation or the shard is rewritten once."""
    from safetensors import safe_open

    from diff_transformer.conversion.writer import ShardWriter

    torch.manual_seed(0)
    tensors = {
        "a.weight": torch.randn(7, 5).to(torch.bfloat16),
        "b.bias": torch.randn(3),
        "c.empty": torch.zeros(0, 4, dtype=torch.float16),
        "d.scalar": torch.tensor(2.5, dtype=torch.float64),
        "e.long_name_" + "x" * 300: torch.randn(2, 2).t(),  # non-contiguous input
    }
    writer = ShardWriter(tmp_path, max_shard_bytes=None, expected_tensors=expected_tensors)
    for name, tensor in tensors.items():
        writer.add(name, tensor)
    assert writer.finish() == ["model.safetensors"]
    with safe_open(tmp_path / "model.safetensors", framework="pt") as handle:
        assert set(handle.keys()) == set(tensors)
        for name, tensor in tensors.items():
            loaded = handle.get_tensor(name)
            assert loaded.dtype == tensor.dtype and torch.equal(loaded, tensor), name
        assert handle.metadata() == {"format": "pt"}
    assert not list(tmp_path.glob("*.part")) and not list(tmp_path.glob("*.rewrite"))


def test_streaming_writer_stores_expanded_views_without_copying(tmp_path):
    from safetensors.torch import load_file

    from diff_transformer.conversion.layout import stored_as
    from diff_transformer.conversion.writer import ShardWriter

    q = torch.randn(3 * 4, 5)  # 3 heads of 4 rows
    doubled = stored_as(q.reshape(3, 1, 4, 5).expand(3, 2, 4, 5), (24, 5))
    writer = ShardWriter(tmp_path)
    writer.add("q", doubled)
    writer.finish()
    assert writer.shapes["q"] == (24, 5)
    expected = q.reshape(3, 4, 5).repeat_interleave(2, dim=0).reshape(24, 5)  # head i's rows twice
    assert torch.equal(load_file(tmp_path / "model.safetensors")["q"], expected)
