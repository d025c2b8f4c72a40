"""diff_transformer.analysis: maps against eager `output_attentions`, λ against the λ modules, metrics by hand."""

import json
import math
import os

import pytest
import torch
from transformers import (
    DiffLlamaConfig,
    DiffLlamaForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
)
from transformers.dynamic_module_utils import get_class_from_dynamic_module
from transformers.models.llama import modeling_llama
from transformers.models.llama.modeling_llama import repeat_kv

from diff_transformer.analysis import (
    attention_maps,
    entropy,
    lambda_per_layer,
    layer_metrics,
    negative_fraction,
    noise_mass,
    span_mass,
)
from tests.helpers.tiny import TINY_SIZES, tiny_model


def batch():
    torch.manual_seed(1)
    ids = torch.randint(3, 97, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, :3] = 0  # left padding
    return ids, mask


def eager_reference(model, ids, mask):
    """What eager attention returns with output_attentions=True, the model switched to eager and back."""
    before = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            return model(ids, attention_mask=mask, output_attentions=True).attentions
    finally:
        model.set_attn_implementation(before)


def assert_rows_sum_to_one(maps, mask):
    valid = mask.bool()  # query rows that are not padding
    sums = maps.sum(-1).permute(0, 2, 1)[valid]  # (rows, H)
    torch.testing.assert_close(sums, torch.ones_like(sums), atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_differential_maps_equal_eager_output_attentions(diff_version, backend):
    model = tiny_model(diff_version, attn_implementation=backend)
    ids, mask = batch()
    entries = attention_maps(model, ids, mask)
    reference = eager_reference(model, ids, mask)
    assert len(entries) == model.config.num_hidden_layers == len(reference)
    H = model.config.num_attention_heads
    for entry, expected in zip(entries, reference):
        assert entry.first.shape == entry.second.shape == entry.differential.shape == (2, H, 10, 10)
        assert entry.lam.shape == (() if diff_version == 1 else (2, H, 10))
        rows = mask.bool()  # padding query rows see no key: not compared
        got, want = entry.differential.permute(0, 2, 1, 3)[rows], expected.permute(0, 2, 1, 3)[rows]
        torch.testing.assert_close(got, want.float(), atol=2e-6, rtol=1e-5)
        assert_rows_sum_to_one(entry.first, mask)
        assert_rows_sum_to_one(entry.second, mask)
        assert not entry.first[1, :, :, :3].any()  # padding keys get no weight
        assert not entry.first.triu(1).any()  # causal
        # The two maps are different softmaxes (q1 k1 vs q2 k2, or query heads 2h vs 2h+1).
        assert (entry.first - entry.second).abs().max() > 1e-3
        # The logits are what the two maps are the softmax of: first's heads, then second's (V1), or pairs (V2).
        assert entry.logits.shape == (2, 2 * H, 10, 10)
        maps = torch.softmax(entry.logits, -1).nan_to_num(0.0)
        first, second = maps.chunk(2, 1) if diff_version == 1 else (maps[:, 0::2], maps[:, 1::2])
        torch.testing.assert_close(first, entry.first)
        torch.testing.assert_close(second, entry.second)


def test_lambda_matches_the_lambda_modules(diff_version):
    model = tiny_model(diff_version)
    ids, mask = batch()
    outputs, handles = [], []
    for layer in model.model.layers:
        handles.append(layer.self_attn.diff_lambda.register_forward_hook(lambda m, a, out: outputs.append(out)))
    with torch.no_grad():
        model(ids, attention_mask=mask)
    for handle in handles:
        handle.remove()
    entries = attention_maps(model, ids, mask)
    for entry, expected in zip(entries, outputs):
        if diff_version == 1:
            assert entry.lam.dim() == 0
            assert entry.lam.item() == expected.item()
        else:
            torch.testing.assert_close(entry.lam, expected.transpose(1, 2))  # (B, N, H) -> (B, H, N)
    per_layer = lambda_per_layer(entries)
    assert per_layer.shape == (2, 4)
    if diff_version == 1:
        assert torch.equal(per_layer[:, 0], torch.stack(list(outputs)))
    else:
        valid = mask.bool()
        torch.testing.assert_close(per_layer[0], outputs[0][valid].mean(0))


def test_forward_unchanged_afterwards(diff_version):
    model = tiny_model(diff_version, attn_implementation="sdpa")
    ids, mask = batch()
    with torch.no_grad():
        before = model(ids, attention_mask=mask).logits
    attention_maps(model, ids, mask)
    with torch.no_grad():
        after = model(ids, attention_mask=mask).logits
    assert torch.equal(before, after)
    assert model.config._attn_implementation == "sdpa"
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())


def test_remote_code_model(tmp_path, diff_version):
    model = tiny_model(diff_version)
    model.save_pretrained(tmp_path)
    # The checkpoint's own custom code (a transformers_modules class), not the package's class that Auto prefers here.
    auto_map = json.loads((tmp_path / "config.json").read_text())["auto_map"]["AutoModelForCausalLM"]
    remote_class = get_class_from_dynamic_module(auto_map, tmp_path)
    remote = remote_class.from_pretrained(tmp_path, attn_implementation="sdpa").eval()
    assert type(remote).__module__.startswith("transformers_modules.")
    ids, mask = batch()
    entries = attention_maps(remote, ids, mask)
    expected = attention_maps(model, ids, mask)
    for got, want in zip(entries, expected):
        torch.testing.assert_close(got.differential, want.differential)
        if diff_version == 1:
            torch.testing.assert_close(got.lam, want.lam)
        else:  # padding positions' hidden states depend on the backend's fully-masked rows: valid tokens only
            torch.testing.assert_close(got.lam.transpose(1, 2)[mask.bool()], want.lam.transpose(1, 2)[mask.bool()])
    assert remote.config._attn_implementation == "sdpa"


def test_llama_maps_and_metrics(monkeypatch):
    torch.manual_seed(0)
    config = LlamaConfig(**TINY_SIZES)
    model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa").eval()
    ids, mask = batch()
    entries = attention_maps(model, ids, mask)
    # transformers' own eager attention, its rotated query and key captured: q kᵀ · scaling is the logit reference.
    qk = []
    eager = modeling_llama.eager_attention_forward

    def capture(module, query, key, value, attention_mask, scaling, **kwargs):
        qk.append(torch.matmul(query, repeat_kv(key, module.num_key_value_groups).transpose(2, 3)) * scaling)
        return eager(module, query, key, value, attention_mask, scaling=scaling, **kwargs)

    monkeypatch.setattr(modeling_llama, "eager_attention_forward", capture)
    reference = eager_reference(model, ids, mask)
    rows = mask.bool()
    allowed = mask.bool()[:, None, None, :] & torch.ones(10, 10, dtype=torch.bool).tril()  # (B, 1, N, L)
    for entry, expected, logits in zip(entries, reference, qk, strict=True):
        assert entry.second is None and entry.lam is None and entry.differential is entry.first
        torch.testing.assert_close(entry.first.permute(0, 2, 1, 3)[rows], expected.permute(0, 2, 1, 3)[rows])
        allowed_h = allowed.expand_as(logits)
        torch.testing.assert_close(entry.logits[allowed_h], logits[allowed_h])
        assert torch.isinf(entry.logits[~allowed_h]).all()
    metrics = layer_metrics(entries, span=(4, 6))
    assert torch.all(metrics["negative_fraction"] == 0)
    assert torch.isnan(metrics["lambda"]).all()
    torch.testing.assert_close(metrics["answer"] + metrics["noise"], torch.ones(2, 4))  # softmax: answer + noise = 1
    assert torch.all(metrics["entropy"] > 0) and torch.all(metrics["entropy"] <= math.log(10) + 1e-6)


def test_diffllama_maps_and_lambda():
    torch.manual_seed(0)
    config = DiffLlamaConfig(**TINY_SIZES, lambda_std_dev=0.3)
    model = DiffLlamaForCausalLM._from_config(config, attn_implementation="sdpa").eval()
    ids, mask = batch()
    entries = attention_maps(model, ids, mask)
    reference = eager_reference(model, ids, mask)  # DiffLlama's eager returns its raw softmax maps, H heads
    rows = mask.bool()
    for layer, entry, expected in zip(model.model.layers, entries, reference):
        both = torch.cat([entry.first, entry.second], dim=1)  # (B, H, N, L): A1 heads, then A2 heads
        torch.testing.assert_close(both.permute(0, 2, 1, 3)[rows], expected.permute(0, 2, 1, 3)[rows])
        attn = layer.self_attn
        lam = (
            math.exp((attn.lambda_q1 * attn.lambda_k1).sum().item())
            - math.exp((attn.lambda_q2 * attn.lambda_k2).sum().item())
            + attn.lambda_init
        )
        assert entry.lam.item() == pytest.approx(lam, rel=1e-6)
        torch.testing.assert_close(entry.differential, entry.first - lam * entry.second)
    metrics = layer_metrics(entries, span=(4, 6))
    assert metrics["entropy"].shape == metrics["answer"].shape == (2, 2)
    torch.testing.assert_close(metrics["lambda"][:, 0], torch.stack([e.lam for e in entries]))
    assert ((metrics["negative_fraction"] >= 0) & (metrics["negative_fraction"] <= 1)).all()


def test_span_mass_and_metrics_on_a_hand_computed_map():
    # One head, two queries, three keys; query 0 sees key 0 only, query 1 sees all three.
    weights = torch.tensor([[[[1.0, 0.0, 0.0], [0.5, 0.7, -0.2]]]])  # (B=1, H=1, N=2, L=3)
    mask = torch.tensor([[[True, False, False], [True, True, True]]])  # (B, N, L)
    # Row 1, span = keys 1..2: (0.7 - 0.2) / (0.5 + 0.7 + 0.2) = 0.5 / 1.4; noise: 0.5 / 1.4.
    assert span_mass(weights, mask, (1, 3)).item() == pytest.approx(0.5 / 1.4)
    assert noise_mass(weights, mask, (1, 3)).item() == pytest.approx(0.5 / 1.4)
    # Both rows, span = key 0: row 0 gives 1, row 1 gives 0.5 / 1.4; averaged.
    assert span_mass(weights, mask, (0, 1), queries=None).item() == pytest.approx((1 + 0.5 / 1.4) / 2)
    # Entropy of |w| / Σ|w|: row 0 is 0, row 1 is that of (0.5, 0.7, 0.2) / 1.4.
    p = [0.5 / 1.4, 0.7 / 1.4, 0.2 / 1.4]
    assert entropy(weights, mask).item() == pytest.approx(-sum(x * math.log(x) for x in p) / 2)
    # One negative among the four allowed entries.
    assert negative_fraction(weights, mask).item() == pytest.approx(0.25)


def test_inspect_writes_png_and_json(tmp_path, capsys, diff_version):
    from diff_transformer import cli

    model = tiny_model(diff_version)
    model.save_pretrained(tmp_path / "model")
    out, maps = tmp_path / "fig.png", tmp_path / "maps.json"
    argv = ["inspect", tmp_path / "model", "5 17 42 8 9 30", "--layer", 1, "--head", 3, "--out", out, "--json", maps]
    assert cli.main([str(a) for a in argv]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = json.loads(maps.read_text())
    entry = attention_maps(model, torch.tensor([[5, 17, 42, 8, 9, 30]]))[1]
    assert report["kind"] == f"diff-v{diff_version}" and report["tokens"] == ["5", "17", "42", "8", "9", "30"]
    torch.testing.assert_close(torch.tensor(report["differential"]), entry.differential[0, 3])
    torch.testing.assert_close(torch.tensor(report["second"]), entry.second[0, 3])
    assert torch.tensor(report["metrics"]["entropy"]).shape == (2, 4)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary file left
    printed = capsys.readouterr().out
    lambdas = [
        float(layer.lam.float().mean()) for layer in attention_maps(model, torch.tensor([[5, 17, 42, 8, 9, 30]]))
    ]
    negative = sum(value < 0 for value in lambdas)
    assert f"λ per layer ({'mean over tokens and heads' if diff_version == 2 else 'one per layer'}): " in printed
    assert ", ".join(f"{value:+.3f}" for value in lambdas) in printed
    assert f"{negative} of 2 layers have λ < 0" in printed


def test_inspect_json_alone_needs_no_figure(refused, tmp_path, capsys):
    from diff_transformer import cli

    model = tiny_model(1)
    model.save_pretrained(tmp_path / "model")
    maps = tmp_path / "maps.json"
    assert cli.main(["inspect", str(tmp_path / "model"), "5 17 42 8", "--json", str(maps)]) == 0
    entry = attention_maps(model, torch.tensor([[5, 17, 42, 8]]))[0]
    torch.testing.assert_close(torch.tensor(json.loads(maps.read_text())["differential"]), entry.differential[0, 0])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["maps.json", "model"]  # no figure written
    refused(["inspect", tmp_path / "model", "5 17"], "name at least one")


def test_inspect_on_the_shipped_llama(tmp_path):
    import diff_transformer
    from diff_transformer import cli

    TINY_LLAMA = os.path.join(os.path.dirname(diff_transformer.__file__), "assets", "tiny-llama")

    out, maps = tmp_path / "llama.png", tmp_path / "llama.json"
    assert cli.main(["inspect", str(TINY_LLAMA), "It is a truth", "--out", str(out), "--json", str(maps)]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG"
    report = json.loads(maps.read_text())
    assert report["kind"] == "llama" and report["second"] is None and report["lambda"] is None
    assert all(v is None for row in report["metrics"]["lambda"] for v in row)
    rows = torch.tensor(report["first"]).sum(-1)
    torch.testing.assert_close(rows, torch.ones_like(rows))


def test_inspect_errors_are_one_line(refused, tmp_path, capsys):
    from transformers import MistralConfig, MistralForCausalLM

    model = tiny_model(2)
    model.save_pretrained(tmp_path / "model")
    m = tmp_path / "model"
    out = tmp_path / "fig.png"
    refused(["inspect", m, "5 6", "--layer", 2, "--out", out], "--layer 2", "layers 0 to 1")
    refused(["inspect", m, "5 6", "--head", 4, "--out", out], "--head 4", "heads 0 to 3")
    refused(["inspect", m, "5 6", "--head", -1, "--out", out], "--head -1")
    refused(["inspect", m, "hello", "--out", out], "has no tokenizer", "token ids")
    refused(["inspect", m, "5 97", "--out", out], "out of range", "0 to 96")
    refused(["inspect", m, "5 6", "--out", tmp_path / "fig.txt"], "--out", ".png")
    refused(["inspect", m, "5 6", "--out", tmp_path / "missing" / "fig.png"], "does not exist")
    refused(["inspect", m, "5 6", "--out", out, "--json", tmp_path / "maps.txt"], "--json", ".json")
    refused(["inspect", tmp_path / "nothing", "5 6", "--out", out], "nothing")
    refused(["inspect", m, "5 6", "--span", "1:3", "--out", out], "--span 1:3", "<= 2")
    refused(["inspect", m, "5 6", "--span", "x", "--out", out], "--span x", "START:STOP")
    refused(["inspect", m, "5 6", "--grid", tmp_path / "g.png", "--metric", "noise", "--out", out], "--span")
    refused(["inspect", m, "5 6", "--grid", out, "--out", out], "same file")
    assert not out.exists()
    out.write_bytes(b"mine")
    refused(["inspect", m, "5 6", "--out", out], "already exists", "--overwrite")
    assert out.read_bytes() == b"mine"  # the user's file is untouched
    config = MistralConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    MistralForCausalLM(config).save_pretrained(tmp_path / "mistral")
    refused(["inspect", tmp_path / "mistral", "5 6", "--out", tmp_path / "m.png"], "model_type='mistral'", "convert")


def test_head_figure_and_metric_grid(diff_version):
    from diff_transformer.analysis.plotting import head_figure, metric_grid

    model = tiny_model(diff_version)
    ids, mask = batch()
    entries = attention_maps(model, ids, mask)
    figure = head_figure(entries, layer=1, head=2, tokens=[str(i) for i in ids[1].tolist()], batch=1)
    axes = figure.get_axes()
    maps = [ax for ax in axes if ax.get_images()]
    assert len(maps) == 3  # A1, A2, differential (and their colorbars)
    # The padded sequence's maps are shown for its 7 real tokens only.
    assert maps[0].get_images()[0].get_array().shape == (7, 7)
    differential = maps[2].get_images()[0]
    low, high = differential.norm.vmin, differential.norm.vmax
    assert low == -high and differential.norm.vcenter == 0  # diverging, centred at 0
    torch.testing.assert_close(torch.tensor(differential.get_array()), entries[1].differential[1, 2][3:, 3:])
    grid = metric_grid(layer_metrics(entries)["entropy"], "entropy")
    cells = [text.get_text() for text in grid.get_axes()[0].texts]
    expected = layer_metrics(entries)["entropy"]
    assert cells == [f"{v:.2f}" for v in expected.flatten().tolist()]


@pytest.mark.parametrize("layers", [4, 30])
def test_lambda_axis_labels_do_not_overlap(diff_version, layers):
    """Issue 45: the λ panel labelled every layer, and at 30 layers (SmolLM2) the labels ran into each other. Now at
    most 10 layers are labelled, every k-th from 0 (every layer for a small model); drawn, neighbouring labels are
    apart by at least half a label's width."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from diff_transformer.analysis.plotting import head_figure

    entries = attention_maps(tiny_model(diff_version, num_hidden_layers=layers), torch.tensor([[5, 6, 7, 8]]))
    figure = head_figure(entries, layer=layers - 2, head=0)
    FigureCanvasAgg(figure).draw()
    axis = next(ax for ax in figure.get_axes() if ax.get_xlabel() == "layer")
    labels = [label for label in axis.get_xticklabels() if label.get_text()]
    step = 1 if layers <= 10 else 3
    assert [label.get_text() for label in labels] == [str(i) for i in range(0, layers, step)]
    boxes = [label.get_window_extent() for label in labels]
    for left, right in zip(boxes, boxes[1:]):
        assert right.x0 - left.x1 >= max(left.width, right.width) / 2, (left, right)


def test_qk_norm_and_base_model(diff_version):
    """Qwen3-converted models normalise every d-wide query/key head; a base DiffModel has no LM head."""
    model = tiny_model(diff_version, attn_implementation="sdpa", use_qk_norm=True)
    ids, mask = batch()
    reference = eager_reference(model, ids, mask)
    rows = mask.bool()
    for source in (model, model.model):
        for entry, expected in zip(attention_maps(source, ids, mask), reference):
            got, want = entry.differential.permute(0, 2, 1, 3)[rows], expected.permute(0, 2, 1, 3)[rows]
            torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


def test_inspect_span_and_grid(tmp_path):
    from diff_transformer import cli

    model = tiny_model(1)
    model.save_pretrained(tmp_path / "model")
    out, grid, maps = tmp_path / "fig.png", tmp_path / "grid.png", tmp_path / "maps.json"
    argv = ["inspect", tmp_path / "model", "5 17 42 8 9 30", "--span", "1:3", "--grid", grid, "--metric", "noise"]
    assert cli.main([str(a) for a in argv + ["--out", out, "--json", maps]]) == 0
    assert grid.read_bytes()[:4] == b"\x89PNG"
    report = json.loads(maps.read_text())
    assert report["span"] == [1, 3]
    entries = attention_maps(model, torch.tensor([[5, 17, 42, 8, 9, 30]]))
    expected = torch.stack([span_mass(e.differential, e.mask, (1, 3)) for e in entries])  # at the last position
    torch.testing.assert_close(torch.tensor(report["metrics"]["answer"]), expected)
    noise = torch.stack([noise_mass(e.differential, e.mask, (1, 3)) for e in entries])
    torch.testing.assert_close(torch.tensor(report["metrics"]["noise"]), noise)


def test_chosen_layers_only():
    model = tiny_model(2, num_hidden_layers=3)
    ids, mask = batch()
    every = attention_maps(model, ids, mask)
    chosen = attention_maps(model, ids, mask, layers=[-1])
    assert len(chosen) == 1
    torch.testing.assert_close(chosen[0].differential, every[2].differential)
    with pytest.raises(ValueError, match="layer 3 is out of range"):
        attention_maps(model, ids, mask, layers=[3])
