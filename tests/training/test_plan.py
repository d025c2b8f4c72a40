"""The memory planner (training/plan.py, `diff-transformer plan`): exact parameter counts against a hand count and
against a converted checkpoint, bytes per parameter as Trainer's AdamW keeps them, shards as torch splits them, and
each rank's weights + gradients + AdamW moments against what FSDP2 actually leaves on 2 gloo ranks."""

import contextlib
import json
import math
import re
import shlex

import pytest
import torch
from safetensors import safe_open

from diff_transformer.conversion import convert_llama_to_diff
from diff_transformer.errors import UserError
from diff_transformer.training.plan import (
    Layout,
    Training,
    activation_bytes,
    activation_bytes_per_token,
    autocast_copy_bytes,
    chunk_rows,
    load_config,
    local_shapes,
    meta_model,
    plan_memory,
    state_bytes,
)
from tests.helpers import REPOSITORY, load_script
from tests.helpers.processes import launch
from tests.helpers.tiny import tiny_config


TINY_LLAMA = REPOSITORY / "src" / "diff_transformer" / "assets" / "tiny-llama"


def hand_count(config) -> int:
    """Parameters of a Diff model written out from the layer shapes (H differential heads, H_kv groups, d = head_dim):
    V1: q 2Hd, k and v 2H_kv·d each, o_proj from H·2d, four λ vectors of d, subln 2d; V2: q 2Hd, k and v H_kv·d each,
    o_proj from H·d, λ's projection H x D; both: a SwiGLU MLP, two norms per layer, the final norm, embeddings and an
    untied head."""
    D, inter, vocab, layers = config.hidden_size, config.intermediate_size, config.vocab_size, config.num_hidden_layers
    H, kv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    if config.diff_version == 1:
        attention = D * 2 * H * d + 2 * (D * 2 * kv * d) + 2 * H * d * D + 4 * d + 2 * d
    else:
        attention = D * 2 * H * d + 2 * (D * kv * d) + H * d * D + H * D
    layer = attention + 3 * D * inter + 2 * D
    return vocab * D * (1 if config.tie_word_embeddings else 2) + layers * layer + D


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("tied", [False, True])
def test_parameter_count_is_the_hand_count(version, tied):
    config = tiny_config(version, tie_word_embeddings=tied)
    plan = plan_memory(config, Layout(1, 1, "ddp"), Training())
    assert plan.parameters == hand_count(config)


@pytest.mark.parametrize("diff_version, v1_init", [(2, None), (1, "paper")])
def test_a_llama_config_is_planned_as_the_converter_converts_it(tmp_path, diff_version, v1_init):
    """The config `convert` writes, reused (not re-derived): its parameters are those of the converted checkpoint."""
    options = dict(diff_version=diff_version, v1_init=v1_init, progress=False)
    out = convert_llama_to_diff(TINY_LLAMA, tmp_path / "out", **options)
    with safe_open(out / "model.safetensors", framework="pt") as handle:
        stored = sum(math.prod(handle.get_slice(name).get_shape()) for name in handle.keys())
    config = load_config(TINY_LLAMA / "config.json", diff_version)
    written = json.loads((out / "config.json").read_text())
    assert (config.num_attention_heads, config.num_key_value_heads) == (
        written["num_attention_heads"],
        written["num_key_value_heads"],
    )
    training = Training(seq_len=512)  # the tiny Llama's context
    assert plan_memory(config, Layout(1, 1, "ddp"), training).parameters == stored  # tied head: stored once


def test_bytes_per_parameter_follow_what_trainer_keeps():
    """float32 weights under bf16 autocast: 4 + 4 + 8 = 16 bytes per parameter. bfloat16 weights: 2 + 2 + 4, except
    V1's λ vectors, which transformers keeps in float32 (`_keep_in_fp32_modules_strict`)."""
    for version in (1, 2):
        config = tiny_config(version)
        n = hand_count(config)
        plan = plan_memory(config, Layout(1, 1, "ddp"), Training(bf16=True))
        assert (plan.weights, plan.gradients, plan.optimizer) == (4 * n, 4 * n, 8 * n)
        lambdas = 4 * config.head_dim * config.num_hidden_layers if version == 1 else 0
        plan = plan_memory(config, Layout(1, 1, "ddp"), Training(dtype=torch.bfloat16, bf16=False))
        assert plan.weights == 2 * (n - lambdas) + 4 * lambdas
        assert (plan.gradients, plan.optimizer) == (plan.weights, 2 * plan.weights)


@pytest.mark.parametrize("rows, world", [(97, 2), (96, 2), (3, 4), (48, 3), (1, 8), (10, 4)])
def test_shards_split_as_torch_chunk_splits_them(rows, world):
    chunks = [len(c) for c in torch.arange(rows).chunk(world)]
    assert [chunk_rows(rows, world, rank) for rank in range(world)] == chunks + [0] * (world - len(chunks))
    assert chunk_rows(rows, world, 0) == max(chunks)  # why state_bytes counts rank 0 as the rank holding the most


def test_sharding_strategies_divide_the_model_state():
    config = tiny_config(2, hidden_size=64, intermediate_size=128, vocab_size=128)  # every row count even
    whole = plan_memory(config, Layout(1, 1, "ddp"), Training()).model_state
    assert plan_memory(config, Layout(2, 4, "ddp"), Training()).model_state == whole
    assert plan_memory(config, Layout(2, 2, "fsdp"), Training()).model_state == whole // 4
    assert plan_memory(config, Layout(2, 2, "hsdp"), Training()).model_state == whole // 2


@pytest.mark.parametrize("version", [1, 2])
def test_tensor_parallel_shapes_follow_the_plan_transformers_applies(version):
    """docs/training.md's tensor parallelism: q/k/v and the MLP's gate/up split by rows, o_proj and down_proj by
    columns, the embeddings and the head by vocabulary (97 rows: 49 on the larger rank), V2's λ projection with its
    heads; norms and V1's λ vectors and subln replicated."""
    model = meta_model(tiny_config(version))
    shapes = {name: shape for name, shape, _ in local_shapes(model, Layout(1, 2, "tp"))}
    full = {name: tuple(p.shape) for name, p in model.named_parameters()}
    rows = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "diff_lambda.proj", "embed_tokens", "lm_head")
    for name, shape in full.items():
        module = name.rsplit(".", 1)[0]
        if module.endswith(rows):
            assert shapes[name] == (math.ceil(shape[0] / 2), *shape[1:]), name
        elif module.endswith(("o_proj", "down_proj")):
            assert shapes[name] == (shape[0], shape[1] // 2), name
        else:  # norms, V1's λ vectors and subln
            assert shapes[name] == shape, name
    with pytest.raises(UserError, match="cannot split 2 key/value heads"):
        plan_memory(tiny_config(2), Layout(1, 4, "tp"), Training())


def test_activations_shrink_with_checkpointing_and_tensor_parallelism():
    for version in (1, 2):
        config = tiny_config(version)
        full = activation_bytes(config, Training(seq_len=64))
        checkpointed = activation_bytes(config, Training(seq_len=64, gradient_checkpointing=True))
        split = activation_bytes(config, Training(seq_len=64), tp=2)
        assert checkpointed < split < full
        assert activation_bytes(config, Training(seq_len=128)) == 2 * full  # linear in the tokens
    v1, v2 = (activation_bytes(tiny_config(v), Training(seq_len=64)) for v in (1, 2))
    assert v1 != v2  # V1 keeps double-width values and the sub-layer norm's input, V2 its two maps and λ


@pytest.mark.parametrize(
    "config_name, kv_heads",
    [("v1/sdpa", 4), ("v1/sdpa", 16), ("v2/sdpa", 4), ("v2/sdpa", 8), ("v1/diff_triton", 4), ("v1/diff_triton", 16)],
    ids=["v1-gqa", "v1-no-gqa", "v2-gqa", "v2-h-kv-groups", "v1-fused-gqa", "v1-fused-no-gqa"],
)
def test_activations_are_what_autograd_keeps_on_a_gpu_s_code_path(config_name, kv_heads):
    """The planner's bytes per token of one layer against autograd's saved tensors, counted on the meta device with
    sdpa and RMSNorm dispatched as on CUDA (benchmarks/census.py; bf16 weights, as FSDP2's bf16 policy computes), a
    2-layer model minus a 1-layer one, per token (64 more tokens: what a layer keeps whatever the length, e.g. V1's
    λ scalars, drops out): equal to the byte, with and without V1's GQA (its memory-efficient kernel then expands K
    and V to the query heads). Census geometry: 16 query heads of 64, so V1 has H = 8 and H_kv = kv_heads / 2, V2
    H = 8 and H_kv = kv_heads."""
    census = load_script(REPOSITORY / "benchmarks" / "census.py")
    geometry = dict(census.TINY, kv_heads=kv_heads)
    box = [census.Census()]  # diff_triton: the op's own Python on meta, its Triton launches recorded, not run
    fused = census.counted_triton(lambda: box[0]) if config_name.endswith("diff_triton") else contextlib.nullcontext()
    with fused:
        counted = [census.saved_bytes_per_layer(config_name, dict(geometry, seq=seq)) for seq in (64, 128)]
    training = Training(dtype=torch.bfloat16, bf16=False, attn_implementation=config_name.split("/")[1])
    planned = activation_bytes_per_token(census.build(config_name, geometry, 1).config, training)
    assert planned["layer_whole"] + planned["layer_split"] == (counted[1] - counted[0]) / 64


def test_sharded_bf16_runs_are_planned_as_fsdp2_s_mixed_precision_computes():
    """train turns --bf16 on into FSDP2's MixedPrecisionPolicy when it shards (training/parallel.py): bf16 weights in
    the layers, so a bf16 residual stream, where DDP's autocast keeps it float32 (float32 weights)."""
    config, training = tiny_config(2), Training(seq_len=64)
    sharded = plan_memory(config, Layout(1, 2, "fsdp"), training).activations
    replicated = plan_memory(config, Layout(1, 2, "ddp"), training).activations
    copies = autocast_copy_bytes(meta_model(config), Layout(1, 2, "ddp"), training)  # autocast's, unsharded only
    assert copies > 0 and replicated == activation_bytes(config, training) + copies
    assert sharded == activation_bytes(config, Training(seq_len=64, dtype=torch.bfloat16)) < replicated
    assert plan_memory(config, Layout(1, 2, "fsdp"), Training(seq_len=64, bf16=False)).activations == activation_bytes(
        config, Training(seq_len=64, bf16=False)
    )


@pytest.mark.parametrize("version, tied", [(1, False), (2, False), (2, True)])
def test_autocast_s_weight_copies_are_what_autograd_keeps(version, tied):
    """Under bf16 autocast with float32 weights every matmul saves the bf16 copy of its weight for the backward: the
    planner's `autocast_copy_bytes` equals the bytes of the saved bf16 tensors that are exactly a weight cast to bf16
    (found by value, on the CPU's autocast, 23 tokens: no activation has a weight's shape), the tied head included;
    none with bf16 weights, without autocast, or when FSDP2 shards."""
    import diff_transformer.modeling_diff as modeling
    from tests.helpers.tiny import tiny_model

    model = tiny_model(version, attn_implementation="sdpa", tie_word_embeddings=tied).train()
    weights = {name: p.detach().to(torch.bfloat16) for name, p in model.named_parameters()}
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen, copies = set(), 0

    def pack(tensor):
        nonlocal copies
        storage = tensor.untyped_storage()
        if tensor.dtype == torch.bfloat16 and storage.data_ptr() not in parameters | seen:
            seen.add(storage.data_ptr())
            as_weight = [tensor, tensor.t()] if tensor.dim() == 2 else [tensor]
            if any(w.shape == t.shape and torch.equal(w, t) for w in weights.values() for t in as_weight):
                copies += storage.nbytes()
        return tensor

    ids = torch.randint(3, 97, (1, 23))
    plain = {"differential_attention_function": lambda *args: None}  # the GPU's path: sdpa calls, no CPU function
    with pytest.MonkeyPatch.context() as patch:
        for name, value in plain.items():
            patch.setattr(modeling, name, value)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
            model(input_ids=ids, labels=ids)
    planned = autocast_copy_bytes(meta_model(model.config), Layout(1, 1, "ddp"), Training())
    assert copies > 0 and planned == copies
    meta = meta_model(model.config)
    assert autocast_copy_bytes(meta, Layout(1, 2, "fsdp"), Training()) == 0
    assert autocast_copy_bytes(meta, Layout(1, 1, "ddp"), Training(bf16=False)) == 0
    assert autocast_copy_bytes(meta, Layout(1, 1, "ddp"), Training(dtype=torch.bfloat16)) == 0


def test_plan_command_prints_the_table_and_refuses_bad_input(capsys, refused, tmp_path):
    from diff_transformer import cli

    assert cli.main(["plan", str(TINY_LLAMA), "--diff-version", "2", "--nodes", "2", "--gpus-per-node", "2"]) == 0
    out = capsys.readouterr().out
    assert "Diff V2" in out and all(f"| {strategy} |" in out for strategy in ("ddp", "fsdp", "hsdp", "tp", "tp+fsdp"))
    # a model under 1B parameters is counted in millions (the tiny Llama's V2 printed "0.00B" before)
    parameters = hand_count(load_config(TINY_LLAMA / "config.json", 2))
    assert out.startswith(f"Diff V2 ({parameters / 1e6:.2f}M parameters, ")
    # V1 pairs the tiny Llama's 6 heads over 2 KV heads into 3 over 1: 2-way tp cannot split them, said per strategy
    assert cli.main(["plan", str(TINY_LLAMA), "--diff-version", "1", "--nodes", "2", "--gpus-per-node", "2"]) == 0
    out = capsys.readouterr().out
    assert "| fsdp |" in out and "| tp |" not in out and "not planned: tp: " in out
    # V1's fused kernel keeps K and V as projected: fewer activations than sdpa's expanded ones
    activations = {}
    for backend in ("sdpa", "diff_triton"):
        argv = ["plan", str(TINY_LLAMA), "--diff-version", "1", "--strategy", "ddp", "--attn-implementation", backend]
        argv += ["--micro-batch", "512", "--seq-len", "512"]  # GiB to one decimal: the tiny model needs many tokens
        assert cli.main(argv) == 0
        activations[backend] = float(
            capsys.readouterr().out.split("| ddp |")[1].split("|")[3]
        )  # weights, grads, AdamW, activations
    assert activations["diff_triton"] < activations["sdpa"]
    with pytest.raises(SystemExit) as exited:  # argparse's own refusal: usage and one error line, exit 2
        cli.main(["plan", str(TINY_LLAMA), "--attn-implementation", "flash"])
    assert exited.value.code == 2 and "invalid choice: 'flash'" in capsys.readouterr().err
    refused(["plan", tmp_path / "missing"], "does not exist")
    refused(["plan", TINY_LLAMA, "--strategy", "hsdp"], "--nodes 2")
    refused(["plan", TINY_LLAMA, "--strategy", "tp", "--gpus-per-node", "4"], "cannot split")
    (tmp_path / "config.json").write_text("[1, 2]")
    refused(["plan", tmp_path], "not a config")


def test_hsdp_with_one_gpu_per_node_is_planned_with_fsdp2_s_bf16_policy():
    """train turns --bf16 into FSDP2's bf16 policy whenever FSDP2 spans more than one rank (replicas x shards > 1,
    training/parallel.py), so hsdp over 2 nodes of 1 GPU computes like fsdp over 2 GPUs, sharding nothing; a 1-GPU
    fsdp run is not sharded and autocasts like ddp."""
    config, training = tiny_config(2), Training(seq_len=64)
    hsdp = plan_memory(config, Layout(2, 1, "hsdp"), training)
    fsdp = plan_memory(config, Layout(1, 2, "fsdp"), training)
    assert (hsdp.activations, hsdp.transient) == (fsdp.activations, fsdp.transient)
    alone, ddp = (plan_memory(config, Layout(1, 1, strategy), training) for strategy in ("fsdp", "ddp"))
    assert hsdp.model_state == ddp.model_state  # one GPU per node: nothing sharded
    assert (alone.activations, alone.transient) == (ddp.activations, 0) and ddp.activations > hsdp.activations


def test_gpu_memory_needs_a_unit_and_more_than_zero(capsys):
    """A bare number was read as bytes (`--gpu-memory 80`: "fits 7.45058e-08 GiB"); accelerate's max_memory strings
    refuse it too. Zero said "not a memory size"."""
    from diff_transformer import cli

    for value, message in [
        ("80", "argument --gpu-memory: 80 has no unit: write 80GiB or 80GB"),
        ("0.5", "0.5 has no unit: write 0.5GiB or 0.5GB"),
        ("0GiB", "'0GiB' must be more than zero"),
        ("0", "'0' must be more than zero"),
        ("80ib", "'80ib' is not a memory size"),  # a KeyError before
        ("1" + "0" * 400 + "GB", "is not a memory size"),  # an OverflowError before
    ]:
        with pytest.raises(SystemExit) as exited:
            cli.main(["plan", str(TINY_LLAMA), "--gpu-memory", value])
        errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
        assert exited.value.code == 2 and len(errors) == 1 and message in errors[0], (value, errors)
    for value, gib in [("80GiB", "80"), ("141 GB", "131.316"), ("0.5GiB", "0.5")]:
        assert cli.main(["plan", str(TINY_LLAMA), "--strategy", "ddp", "--gpu-memory", value]) == 0
        assert f"fits {gib} GiB" in capsys.readouterr().out


def test_seq_len_is_refused_past_the_model_s_context_and_defaults_within_it(capsys, refused):
    """As train refuses a --block-size longer than max_position_embeddings and defaults to min(2048, context): the
    shipped tiny Llama has 512 positions, so a bare `plan` on it plans 512 tokens, and 513 are refused."""
    from diff_transformer import cli

    refused(["plan", TINY_LLAMA, "--seq-len", "513"], "--seq-len 513", "(512 positions", "--seq-len 512 or less")
    assert cli.main(["plan", str(TINY_LLAMA), "--strategy", "ddp", "--seq-len", "512"]) == 0
    assert "micro-batch 1 x 512 tokens" in capsys.readouterr().out
    assert cli.main(["plan", str(TINY_LLAMA), "--strategy", "ddp"]) == 0
    assert "micro-batch 1 x 512 tokens" in capsys.readouterr().out
    assert cli.main(["plan", str(REPOSITORY / "benchmarks" / "configs" / "llama3-1b.json"), "--strategy", "ddp"]) == 0
    assert "micro-batch 1 x 2048 tokens" in capsys.readouterr().out  # 131072 positions: 2048
    with pytest.raises(UserError, match="exceeds the model's context"):
        plan_memory(load_config(TINY_LLAMA, 2), Layout(1, 1, "ddp"), Training(seq_len=513))


PLAN_EXAMPLE = re.compile(r"```bash\n((?:diff-transformer plan [^\n]*\n)+)```\n\n```text\n(.*?)\n```", re.S)


@pytest.mark.parametrize("page", ["docs/memory.md", "docs/training.md"])
def test_the_docs_plan_examples_print_what_they_quote(page, capsys, monkeypatch, tmp_path):
    """The docs' `plan` examples on real-size configs (not run by tests/docs: their configs are not in its
    directory) print exactly the output the page shows. docs/training.md's FSDP2 section once quoted figures no
    `plan` command printed (18.5 GiB of activations beside a one-GPU model state)."""
    from diff_transformer import cli

    config = json.loads((REPOSITORY / "benchmarks" / "configs" / "llama3-1b.json").read_text())
    config.update(vocab_size=32000, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)  # as the page says
    (tmp_path / "llama3-1b-32k.json").write_text(json.dumps(config))
    (tmp_path / "benchmarks").symlink_to(REPOSITORY / "benchmarks")
    monkeypatch.chdir(tmp_path)
    examples = PLAN_EXAMPLE.findall((REPOSITORY / page).read_text(encoding="utf-8"))
    assert examples, f"{page} has no plan example with its output"
    for commands, shown in examples:
        printed = []
        for line in commands.splitlines():
            assert cli.main(shlex.split(line)[1:]) == 0, line
            printed.append(capsys.readouterr().out.rstrip("\n"))
        assert "\n".join(printed) == shown, commands


@pytest.mark.slow  # one 2-process torchrun launch (~1 min on a loaded 2-core machine)
def test_planner_agrees_with_the_shards_fsdp2_leaves_on_each_rank(tmp_path):
    launch("plan_shards", tmp_path, timeout=300)
    for rank in range(2):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for version in (1, 2):
            measured = record[f"v{version}"]
            assert measured["all_dtensors"]
            model = meta_model(tiny_config(version))
            planned = state_bytes(model, Layout(1, 2, "fsdp"), Training(), rank=rank)
            for part in ("weights", "gradients", "optimizer"):
                assert measured[part] == planned[part], (rank, version, part)
            # AdamW's step: a float32 scalar per parameter tensor on the CPU, which the planner leaves out
            assert measured["steps"] == [[1, "cpu"]] * measured["parameter_tensors"]
