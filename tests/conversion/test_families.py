"""Mistral, Qwen2/2.5 and Qwen3 -> Diff through `diff-transformer convert` (docs/design.md, "Converting a Llama
checkpoint"): tiny random models with the real models' head layouts, V2 exact against transformers' own classes, V1
pairing each query with its source key (q_norm/k_norm and biases included), and one clear line for what stays
unsupported."""

import json
import math
import re

import pytest
import torch
from safetensors.torch import load_file
from transformers import (
    GemmaConfig,
    GemmaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from diff_transformer import DiffForCausalLM, cli
from diff_transformer.conversion.layout import llama_to_v1_query_permutation


VOCAB = 101
COMMON = dict(
    vocab_size=VOCAB,
    intermediate_size=64,
    num_hidden_layers=2,
    max_position_embeddings=256,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
# The real models' head layouts, narrower: only hidden_size and head_dim shrink.
FAMILIES = {
    # Qwen2.5-0.5B: 14 heads, 2 key/value heads, head_dim = hidden / heads (64 = 896 / 14); q/k/v biases
    "qwen2.5": (Qwen2Config, Qwen2ForCausalLM, dict(hidden_size=56, num_attention_heads=14, num_key_value_heads=2)),
    # Qwen3-0.6B: 16 heads, 8 key/value heads, head_dim = 2 hidden / heads (128 vs 1024 / 16); q_norm, k_norm
    "qwen3": (
        Qwen3Config,
        Qwen3ForCausalLM,
        dict(hidden_size=32, num_attention_heads=16, num_key_value_heads=8, head_dim=4),
    ),
    # Mistral-7B (v0.2 and later: no sliding window): 32 heads, 8 key/value heads
    "mistral": (
        MistralConfig,
        MistralForCausalLM,
        dict(hidden_size=128, num_attention_heads=32, num_key_value_heads=8, sliding_window=None),
    ),
}


def randomize(model):
    """Spread the weights (fresh init is nearly uniform) so attention patterns and argmaxes are distinct; norms,
    q_norm and k_norm included, so a misplaced norm shows."""
    generator = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.2 * noise)
    return model


def make_source(path, family, **overrides):
    config_class, model_class, layout = FAMILIES[family]
    torch.manual_seed(0)
    model = randomize(model_class(config_class(**{**COMMON, **layout, **overrides}))).eval()
    model.save_pretrained(path)
    return path, model


def convert(capsys, *argv):
    """`diff-transformer convert ...` in-process: (exit code, stdout, stderr)."""
    capsys.readouterr()
    code = cli.main(["convert", *map(str, argv), "--quiet"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def tensors(path):
    return load_file(path / "model.safetensors")


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_v2_through_the_cli_is_exact(tmp_path, capsys, family, tied):
    src, source = make_source(tmp_path / family, family, tie_word_embeddings=tied)
    code, out, err = convert(capsys, src, tmp_path / "diff", "--verify")
    assert code == 0, err
    reported = float(re.search(r"max \|Δlogit\| = (\S+),", out).group(1))
    assert reported <= 1e-5 and "greedy continuations match: True" in out, out

    # Independently of --verify: a left-padded batch, and batched greedy generation.
    diff, info = DiffForCausalLM.from_pretrained(tmp_path / "diff", output_loading_info=True)
    assert not any(info.values()), info
    diff.eval()
    ids = torch.randint(3, VOCAB, (2, 24), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    with torch.no_grad():
        expected, got = source(ids, attention_mask=mask).logits, diff(ids, attention_mask=mask).logits
        assert (expected - got)[mask.bool()].abs().max() <= 1e-5
        kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert torch.equal(source.generate(ids, **kwargs), diff.generate(ids, **kwargs))

    config = json.loads((tmp_path / "diff" / "config.json").read_text())
    source_config = source.config
    d = source_config.head_dim if family != "qwen2.5" else source_config.hidden_size // 14
    heads = (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"])
    assert config["diff_version"] == 2
    assert heads == (source_config.num_attention_heads, source_config.num_key_value_heads, d)
    assert config["tie_word_embeddings"] is tied
    assert config["conversion"]["source_model_type"] == source_config.model_type
    state, before = tensors(tmp_path / "diff"), source.state_dict()
    assert ("lm_head.weight" in state) is not tied
    p = "model.layers.1.self_attn."
    H = source_config.num_attention_heads
    if family == "qwen2.5":  # q/k/v biases, none on o_proj; query head i's bias is duplicated with its rows
        assert config["attention_bias"] is True and config["attention_out_bias"] is False
        assert p + "o_proj.bias" not in state
        doubled = before[p + "q_proj.bias"].view(H, 1, d).expand(H, 2, d)
        assert torch.equal(state[p + "q_proj.bias"].view(H, 2, d), doubled)
        assert torch.equal(state[p + "k_proj.bias"], before[p + "k_proj.bias"])
    else:
        assert config["attention_bias"] is False and not any(name.endswith("bias") for name in state)
    if family == "qwen3":  # q_norm / k_norm over each d-wide head, one shared weight: copied as they are
        assert config["use_qk_norm"] is True and d * H == 2 * source_config.hidden_size
        assert torch.equal(state[p + "q_norm.weight"], before[p + "q_norm.weight"])
        assert torch.equal(state[p + "k_norm.weight"], before[p + "k_norm.weight"])
    else:
        assert config["use_qk_norm"] is False
        assert not any("self_attn.q_norm" in name or "self_attn.k_norm" in name for name in state)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_v1_through_the_cli_pairs_each_query_with_its_key(tmp_path, capsys, family):
    """V1 is not function-preserving, but each of its maps A_c of head h must be one source head's attention map:
    same query (bias, q_norm) and same key (bias, k_norm). Checked on layer 0 with λ set to isolate A1 and A2."""
    src, source = make_source(tmp_path / family, family)
    # the paper start: its λ_init != 0 is what isolates A2 below (the calibrated start has λ_init = 0)
    code, out, err = convert(capsys, src, tmp_path / "diff", "--diff-version", "1", "--v1-init", "paper")
    assert code == 0, err
    assert "not function-preserving" in out
    diff, info = DiffForCausalLM.from_pretrained(
        tmp_path / "diff", output_loading_info=True, attn_implementation="eager"
    )
    assert not any(info.values()), info
    diff.eval()
    heads, kv_heads = source.config.num_attention_heads, source.config.num_key_value_heads
    assert (diff.config.num_attention_heads, diff.config.num_key_value_heads) == (heads // 2, kv_heads // 2)
    source.config._attn_implementation = "eager"
    ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        source_maps = source(ids, output_attentions=True).attentions[0]
        lam = diff.model.layers[0].self_attn.diff_lambda
        for param in (lam.lambda_q1, lam.lambda_k1, lam.lambda_q2, lam.lambda_k2):
            param.zero_()
        maps_init = diff(ids, output_attentions=True).attentions[0]  # A1 - λ_init A2
        lam.lambda_q2[0], lam.lambda_k2[0] = 1.0, math.log(1.0 + lam.lambda_init)  # λ = 0
        a1 = diff(ids, output_attentions=True).attentions[0]
    a2 = (a1 - maps_init) / lam.lambda_init
    perm = llama_to_v1_query_permutation(heads, kv_heads)
    for h in range(heads // 2):
        assert (a1[:, h] - source_maps[:, perm[2 * h]]).abs().max() <= 1e-5
        assert (a2[:, h] - source_maps[:, perm[2 * h + 1]]).abs().max() <= 1e-4


def test_windows_that_never_slide_convert_exactly(tmp_path, capsys):
    """A window as long as the context (Mistral), or one that no layer uses (Qwen2's max_window_layers), is full
    attention: converted, and exact."""
    src, _ = make_source(tmp_path / "mistral", "mistral", sliding_window=256)
    code, out, err = convert(capsys, src, tmp_path / "a", "--verify")
    assert code == 0 and "greedy continuations match: True" in out, err
    overrides = dict(use_sliding_window=True, sliding_window=16, max_window_layers=2)  # layers >= 2 would slide
    src, _ = make_source(tmp_path / "qwen2", "qwen2.5", **overrides)
    code, out, err = convert(capsys, src, tmp_path / "b", "--verify")
    assert code == 0 and "greedy continuations match: True" in out, err


def _gemma(path):
    config = GemmaConfig(**COMMON, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    GemmaForCausalLM(config).save_pretrained(path)
    return path


UNSUPPORTED = {
    "mistral-sliding-window": (
        lambda path: make_source(path, "mistral", sliding_window=16)[0],
        ["sliding_window=16 < max_position_embeddings=256", "Diff models do not implement", '"sliding_window": null'],
    ),
    "qwen2-use-sliding-window": (
        lambda path: make_source(path, "qwen2.5", use_sliding_window=True, sliding_window=16, max_window_layers=1)[0],
        ["use_sliding_window=true, sliding_window=16 < max_position_embeddings=256", '"use_sliding_window": false'],
    ),
    "other-family": (
        _gemma,
        [
            "model_type 'gemma'",
            "only 'llama', 'mistral', 'qwen2', 'qwen3', 'diffllama' or Motif (architectures "
            '["MotifForCausalLM"]) checkpoints convert',
        ],
    ),
}


@pytest.mark.parametrize("case", list(UNSUPPORTED))
def test_unsupported_is_refused_in_one_line(tmp_path, capsys, case):
    build, words = UNSUPPORTED[case]
    src = build(tmp_path / "src")
    before = sorted((p.name, p.read_bytes()) for p in src.iterdir())
    code, _, err = convert(capsys, src, tmp_path / "diff")
    assert code == 2
    err = err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    for word in words:
        assert word in err, (word, err)
    assert not (tmp_path / "diff").exists()
    assert sorted((p.name, p.read_bytes()) for p in src.iterdir()) == before


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2", "qwen3", "diffllama"])
def test_each_family_s_flags_are_what_its_transformers_modules_build(name, bias):
    """The registry's attention/MLP flags (`diff_transformer.families`, read by `conversion.families.attention_flags`)
    against the modules transformers builds for that family from a config asking for biases (or not): q/k/v, o_proj
    and MLP biases where the family's layer has them, q_norm/k_norm where it normalises heads."""
    import transformers

    from diff_transformer.conversion.families import attention_flags
    from diff_transformer.families import family_of

    family = family_of(name)
    config_class = getattr(transformers, family.config_class)
    config = config_class(
        **COMMON, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, attention_bias=bias, mlp_bias=bias
    )
    layer = getattr(transformers, family.prefix + "ForCausalLM")(config).model.layers[0]
    flags, attention, mlp = attention_flags(family, config), layer.self_attn, layer.mlp
    assert flags["attention_bias"] == (attention.q_proj.bias is not None) == (attention.k_proj.bias is not None)
    assert flags["attention_bias"] == (attention.v_proj.bias is not None)
    assert flags["attention_out_bias"] == (attention.o_proj.bias is not None)
    assert flags["mlp_bias"] == (mlp.gate_proj.bias is not None) == (mlp.down_proj.bias is not None)
    assert flags["qk_norm"] == hasattr(attention, "q_norm") == hasattr(attention, "k_norm")
