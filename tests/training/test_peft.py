"""PEFT on Diff models: default targets as for Llama, λ trained via modules_to_save, adapter save/reload (also as Hub
custom code), merge_and_unload, gradient checkpointing, and QLoRA through transformers' bitsandbytes integration."""

import copy
import json
import textwrap
from pathlib import Path

import pytest
import torch
from peft import AutoPeftModelForCausalLM, IA3Config, LoraConfig, get_peft_model
from peft.tuners.tuners_utils import BaseTunerLayer
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

import diff_transformer
from diff_transformer.conversion import convert_to_diff
from tests.helpers.processes import run_json
from tests.helpers.tiny import tiny_config, tiny_model


ASSETS = Path(diff_transformer.__file__).parent / "assets"
LLAMA_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def llama_twin(config):
    """A LlamaForCausalLM with the Diff config's layer count and sizes: the reference for PEFT's choices."""
    llama_config = LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=2 * config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
    )
    return LlamaForCausalLM(llama_config)


def adapted_modules(peft_model):
    """Names (relative to the base model) of the modules PEFT wrapped with an adapter layer."""
    modules = peft_model.named_modules()
    return {name.removeprefix("base_model.model.") for name, module in modules if isinstance(module, BaseTunerLayer)}


def train_step(model, ids, lr=1e-2):
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    loss = model(ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return model.eval(), loss.item()


def lambda_state(model):
    """λ parameters by name (the trained copies under modules_to_save when there are any)."""
    params = model.named_parameters()
    return {name: p.detach().clone() for name, p in params if "diff_lambda" in name and p.requires_grad}


@pytest.mark.parametrize(
    "make_config",
    [
        lambda: LoraConfig(task_type="CAUSAL_LM"),  # PEFT's default for llama: q_proj, v_proj
        lambda: LoraConfig(task_type="CAUSAL_LM", target_modules=list(LLAMA_LINEAR)),
        lambda: LoraConfig(task_type="CAUSAL_LM", target_modules="all-linear"),
        lambda: IA3Config(task_type="CAUSAL_LM"),  # llama's IA3 default: k_proj, v_proj, down_proj
    ],
    ids=["lora-default", "lora-llama-names", "lora-all-linear", "ia3-default"],
)
def test_targets_are_llamas(diff_version, make_config):
    config = tiny_config(diff_version)
    diff = adapted_modules(get_peft_model(tiny_model(diff_version), make_config()))
    llama = adapted_modules(get_peft_model(llama_twin(config), make_config()))

    assert llama and all(name.startswith("model.layers.") for name in llama)  # never lm_head or embeddings
    expected = set(llama)
    if make_config().target_modules == "all-linear" and diff_version == 2:
        # V2's λ gate is a Linear of the block too, so "all-linear" adapts it (V1's λ is four vectors, no Linear).
        expected |= {f"model.layers.{i}.self_attn.diff_lambda.proj" for i in range(config.num_hidden_layers)}
    assert diff == expected


@pytest.mark.canary
def test_defaults_registered_on_construction_and_on_request():
    """Canary for PEFT's internal `peft.utils.constants.TRANSFORMERS_MODELS_TO_*` tables (keyed by model_type, with a
    "llama" entry), into which `register_peft_defaults` copies Llama's defaults for "diff"."""
    from peft.utils import constants

    tables = [t for name, t in vars(constants).items() if name.startswith("TRANSFORMERS_MODELS_TO_") and "llama" in t]
    assert len(tables) > 20  # LoRA and the methods that copy its table, IA3, LN tuning, ...
    for table in tables:
        table.pop("diff", None)
    tiny_model(2)  # building a Diff model while peft is imported registers (this is all Hub custom code can do)
    assert all(table["diff"] == table["llama"] for table in tables)
    for table in tables:
        table.pop("diff")
    assert diff_transformer.register_peft_defaults() is True  # for a model built before peft was imported
    assert all(table["diff"] == table["llama"] for table in tables)


def test_lambda_trains_is_saved_and_reloads(tmp_path, diff_version):
    tiny_model(diff_version).save_pretrained(tmp_path / "base")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "base", attn_implementation="eager")
    peft_model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", modules_to_save=["diff_lambda"]))

    before = lambda_state(peft_model)
    expected_count = 4 if diff_version == 1 else 1  # λq1, λk1, λq2, λk2 or diff_lambda.proj.weight, per layer
    assert len(before) == expected_count * tiny_config().num_hidden_layers
    ids = torch.tensor([[5, 17, 42, 8, 9, 30, 11, 64]])
    peft_model, _ = train_step(peft_model, ids)
    after = lambda_state(peft_model)
    assert all(not torch.equal(before[name], after[name]) for name in before)

    peft_model.save_pretrained(tmp_path / "adapter")
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    saved_lambda = {name: tensor for name, tensor in saved.items() if "diff_lambda" in name}
    assert len(saved_lambda) == len(after)
    for name, tensor in after.items():  # saved under the base model's own parameter names
        key = name.replace(".modules_to_save.default", "")
        assert torch.equal(saved_lambda[key], tensor), key

    reloaded = AutoPeftModelForCausalLM.from_pretrained(tmp_path / "adapter", attn_implementation="eager").eval()
    restored = {name: p for name, p in reloaded.named_parameters() if "diff_lambda.modules_to_save" in name}
    assert restored.keys() == after.keys()
    assert all(torch.equal(restored[name], after[name]) for name in after)
    with torch.no_grad():
        logits = reloaded(ids).logits
        base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", attn_implementation="eager")(ids).logits
    assert torch.equal(logits, peft_model(ids).logits)
    assert (logits - base).abs().max() > 1e-3  # the reloaded adapter (LoRA and λ) is really in use


def test_merge_and_unload_matches_adapter(diff_version):
    config = LoraConfig(task_type="CAUSAL_LM", target_modules="all-linear", modules_to_save=["diff_lambda"])
    peft_model = get_peft_model(tiny_model(diff_version), config)
    lora_modules = adapted_modules(peft_model)
    ids = torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16, 17, 18]])
    with torch.no_grad():
        untrained = peft_model(ids).logits
    peft_model, _ = train_step(peft_model, ids)
    assert any(p.abs().sum() > 0 for n, p in peft_model.named_parameters() if "lora_B" in n)
    with torch.no_grad():
        adapted = peft_model(ids).logits
        merged_model = peft_model.merge_and_unload()
        merged = merged_model(ids).logits
    assert not any(isinstance(m, BaseTunerLayer) for m in merged_model.modules())
    # With λ trained in full, "all-linear" leaves V2's λ gate to modules_to_save: LoRA goes where Llama's goes.
    all_linear = LoraConfig(task_type="CAUSAL_LM", target_modules="all-linear")
    llama = get_peft_model(llama_twin(tiny_config(diff_version)), all_linear)
    assert lora_modules == adapted_modules(llama)
    assert (adapted - untrained).abs().max() > 1e-3  # the step changed the function
    torch.testing.assert_close(merged, adapted, rtol=0, atol=1e-5)


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_gradient_checkpointing_with_lora(diff_version, use_reentrant):
    config = LoraConfig(
        task_type="CAUSAL_LM", target_modules="all-linear", modules_to_save=["diff_lambda"], init_lora_weights=False
    )  # random LoRA B, so that every LoRA matrix gets a non-zero gradient
    plain = get_peft_model(tiny_model(diff_version), config)
    checkpointed = copy.deepcopy(plain)
    checkpointed.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    checkpointed.enable_input_require_grads()  # reentrant checkpointing needs an input that requires grad

    layer_calls = []
    # Hooks on the layer itself stay outside the checkpoint; one inside it runs again when backward recomputes.
    checkpointed.get_base_model().model.layers[0].self_attn.register_forward_hook(lambda *args: layer_calls.append(1))
    ids = torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10]])
    grads = []
    for model in (plain, checkpointed):
        model.train()
        model(ids, labels=ids).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    assert len(layer_calls) == 2  # forward once, recomputed once in backward: checkpointing is really on
    assert grads[0].keys() == grads[1].keys() and any("diff_lambda" in n for n in grads[0])
    for name, grad in grads[0].items():
        assert grad is not None and grad.abs().sum() > 0, name
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_lambda_gate_stays_fp32_in_fp16(tmp_path):
    """`_keep_in_fp32_modules` (which also keeps quantizers off V2's λ gate) upcasts it under fp16; it still runs."""
    model = tiny_model(2)
    model.save_pretrained(tmp_path)
    half = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float16, attn_implementation="eager")
    attn = half.model.layers[0].self_attn
    assert attn.q_proj.weight.dtype == torch.float16 and attn.diff_lambda.proj.weight.dtype == torch.float32
    ids = torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        expected = model(ids).logits
        torch.testing.assert_close(half(ids).logits.float(), expected, rtol=0, atol=1e-2 * expected.abs().max().item())


# ---- converted checkpoints: Hub custom code, QLoRA ----


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """{version: directory} of the shipped tiny Llama converted to Diff (saved with its custom code)."""
    out = tmp_path_factory.mktemp("converted")
    return {v: convert_to_diff(ASSETS / "tiny-llama", out / f"v{v}", diff_version=v, progress=False) for v in (1, 2)}


@pytest.fixture(scope="module")
def heldout_ids():
    tokenizer = AutoTokenizer.from_pretrained(ASSETS / "tiny-llama")
    return tokenizer((ASSETS / "heldout.txt").read_text()[:600], return_tensors="pt").input_ids[:, :96]


# Runs where diff_transformer cannot be imported (see _subprocess.py): peft is imported first, as a user would.
REMOTE = textwrap.dedent(
    """
    import json, sys
    import torch
    from peft import AutoPeftModelForCausalLM

    cases, ids = json.loads(sys.argv[1]), torch.tensor(json.loads(sys.argv[2]))
    report = {}
    for version, (base, adapter) in cases.items():
        reloaded = AutoPeftModelForCausalLM.from_pretrained(
            adapter, trust_remote_code=True, attn_implementation="eager"
        )
        with torch.no_grad():
            logits = reloaded(ids).logits
        report[version] = {
            "base_module": type(reloaded.get_base_model()).__module__,
            "logits": logits.flatten().tolist(),
        }
    report["imported_diff_transformer"] = any(m.startswith("diff_transformer") for m in sys.modules)
    print(json.dumps(report))
    """
)


def test_adapter_on_converted_model_reloads_as_remote_code(tmp_path, converted, heldout_ids):
    ids = heldout_ids[:, :24]
    cases, expected = {}, {}
    for version, base in converted.items():
        model = AutoModelForCausalLM.from_pretrained(base, attn_implementation="eager")
        peft_model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", modules_to_save=["diff_lambda"]))
        peft_model, _ = train_step(peft_model, ids, lr=1e-3)
        peft_model.save_pretrained(tmp_path / f"adapter-v{version}")
        adapter_config = json.loads((tmp_path / f"adapter-v{version}" / "adapter_config.json").read_text())
        assert adapter_config["base_model_name_or_path"] == str(base)
        with torch.no_grad():
            expected[version] = peft_model(ids).logits.flatten()
        cases[version] = (str(base), str(tmp_path / f"adapter-v{version}"))

    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    report = run_json(REMOTE, json.dumps(cases), json.dumps(ids.tolist()), env=env)
    assert report["imported_diff_transformer"] is False
    for version in converted:
        got = report[str(version)]
        assert got["base_module"].startswith("transformers_modules.")
        torch.testing.assert_close(torch.tensor(got["logits"]), expected[version], rtol=0, atol=1e-5)


def test_train_and_eval_keep_cpu_4bit_layers_differentiable():
    """The package's bitsandbytes hook (not the checkpoint's code): `train()` and `eval()` turn off the CPU inference
    repacking of 4-bit layers, whose matmul has no autograd. A stand-in attribute: no bitsandbytes needed."""
    model = tiny_model(2)
    layer = model.model.layers[0].mlp.up_proj
    for switch in (model.train, model.eval):
        layer.support_avx512bf16_for_cpu = True
        switch()
        assert layer.support_avx512bf16_for_cpu is False
    assert "support_avx512bf16_for_cpu" not in Path(diff_transformer.modeling_diff.__file__).read_text()


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CI has none; run on a lent H100)")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_qlora_4bit(converted, heldout_ids, device):
    """4-bit NF4 loading through transformers' bitsandbytes integration (bitsandbytes 0.50.2 runs NF4 on CPU too), then
    PEFT's k-bit preparation and one LoRA step that also trains λ."""
    import bitsandbytes as bnb
    from peft import prepare_model_for_kbit_training
    from transformers import BitsAndBytesConfig

    quantization = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32
    )
    ids = heldout_ids[:, :48].to(device)

    def load(path, quantized):
        kwargs = {"quantization_config": quantization} if quantized else {}
        return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", device_map=device, **kwargs)

    llama = load(ASSETS / "tiny-llama", True)
    for module in llama.modules():  # the reference computes as Diff models do: bitsandbytes' differentiable CPU kernel
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    with torch.no_grad():
        llama_4bit = llama(ids).logits
    for version, path in converted.items():
        model = load(path, True)
        attn = model.model.layers[0].self_attn
        assert isinstance(attn.q_proj, bnb.nn.Linear4bit) and isinstance(attn.o_proj, bnb.nn.Linear4bit)
        assert isinstance(model.model.layers[-1].mlp.down_proj, bnb.nn.Linear4bit)
        assert not isinstance(model.lm_head, bnb.nn.Linear4bit)
        if version == 2:  # the λ gate is kept out of quantization (`_keep_in_fp32_modules`), so it stays trainable
            gate = attn.diff_lambda.proj
            assert type(gate) is torch.nn.Linear and gate.weight.dtype == torch.float32
        with torch.no_grad():  # an evaluation first: bitsandbytes' CPU inference repacking must not cut the gradients
            out = model(ids, labels=ids)
            reference = load(path, False)(ids, labels=ids).loss
        if version == 2:  # function-preserving conversion: quantized the same way, so the same logits as the Llama's
            torch.testing.assert_close(out.logits, llama_4bit, rtol=0, atol=1e-5)
        assert abs(out.loss - reference) < 0.02 * reference  # NF4 costs little on this model

        model = prepare_model_for_kbit_training(model, gradient_checkpointing_kwargs={"use_reentrant": False})
        peft_model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", modules_to_save=["diff_lambda"]))
        before = lambda_state(peft_model)
        peft_model, loss = train_step(peft_model, ids, lr=1e-3)
        assert loss == pytest.approx(out.loss.item(), abs=1e-4)
        assert all(not torch.equal(before[name], p) for name, p in lambda_state(peft_model).items())
        with torch.no_grad():
            assert peft_model(ids, labels=ids).loss < loss  # the step on this batch lowered its loss


def test_dora_adapters_load_whole_and_an_adapter_missing_weights_is_refused(tmp_path, converted, heldout_ids):
    """Issue 46: PEFT's DoRA (`use_dora`) works on the Diff modules PEFT targets (plain nn.Linear): the package's
    loader (`checkpoints.open(...).load()`) gives the saved adapter's logits, and merged its weights. An adapter file
    that lacks what its config asks for (use_dora without lora_magnitude_vector) loaded with PEFT's initial values
    and one warning, i.e. silently another model: now one line."""
    from safetensors.torch import save_file

    from diff_transformer import checkpoints
    from diff_transformer.checkpoints import CheckpointError

    ids = heldout_ids[:, :24]
    for version, base in converted.items():
        model = AutoModelForCausalLM.from_pretrained(base, attn_implementation="eager")
        peft_model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", use_dora=True, r=4))
        torch.manual_seed(version)
        with torch.no_grad():  # away from the start (B = 0, magnitude = |W|), where DoRA computes the base model
            for name, parameter in peft_model.named_parameters():
                if "lora_B" in name or "lora_magnitude_vector" in name:
                    parameter.add_(0.05 * torch.randn_like(parameter))
            expected = peft_model(ids).logits
        adapter = tmp_path / f"dora-v{version}"
        peft_model.save_pretrained(adapter)
        stored = load_file(adapter / "adapter_model.safetensors")
        assert any("lora_magnitude_vector" in key for key in stored)

        with torch.no_grad():
            loaded = checkpoints.open(str(adapter)).load(attn_implementation="eager")
            torch.testing.assert_close(loaded(ids).logits, expected, rtol=0, atol=1e-5)
            merged = checkpoints.open(str(adapter)).load(merge=True, attn_implementation="eager")
            # W' = m · (W + s·BA) / |W + s·BA| folded in fp32: rounding of the norms and products, not a formula
            torch.testing.assert_close(merged(ids).logits, expected, rtol=1e-4, atol=1e-4)

        save_file(
            {k: v for k, v in stored.items() if "lora_magnitude_vector" not in k},
            adapter / "adapter_model.safetensors",
        )
        with pytest.raises(CheckpointError, match=r"lacks \d+ weight\(s\) its adapter_config.json asks for") as caught:
            checkpoints.open(str(adapter)).load()
        assert "lora_magnitude_vector" in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize("diff_version", [1, 2], ids=["v1", "v2"])
def test_prefix_tuning_equals_an_explicit_cache(diff_version):
    """PEFT's prefix tuning: its virtual keys and values are sized as each version's cache holds them (V1: 2 H_kv heads
    of size d, [k1 | k2] and V's halves; V2: Llama's H_kv; PEFT sizes V1's from `num_key_value_heads` alone and
    failed at the first forward before `size_prefixes_for_v1_caches`), and the adapted model's logits equal the base
    model's over a DynamicCache built by hand from the prompt encoder's table. A training step moves the table only."""
    from peft import PrefixTuningConfig
    from transformers import DynamicCache

    model = tiny_model(diff_version, attn_implementation="sdpa")
    config = model.config
    T, layers, d = 3, config.num_hidden_layers, config.head_dim
    heads = config.num_key_value_heads * (2 if diff_version == 1 else 1)
    peft_model = get_peft_model(copy.deepcopy(model), PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=T))
    table = peft_model.prompt_encoder["default"].embedding.weight  # (T, layers · 2 · heads · d), PEFT's layout
    assert table.shape == (T, layers * 2 * heads * d)
    ids = torch.randint(3, 97, (2, 9))
    with torch.no_grad():
        table.normal_()  # PEFT's initial table is random too; a fresh draw keeps the test independent of it
        got = peft_model(ids, attention_mask=torch.ones_like(ids)).logits
        prefix = table.view(T, layers, 2, heads, d).permute(1, 2, 3, 0, 4)  # (layers, k/v, heads, T, d)
        cache = DynamicCache(config=config)
        for i in range(layers):
            cache.update(prefix[i, 0].expand(2, -1, -1, -1), prefix[i, 1].expand(2, -1, -1, -1), i)
        expected = model(ids, attention_mask=torch.ones(2, T + 9, dtype=torch.long), past_key_values=cache).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    base = {n: p.detach().clone() for n, p in peft_model.base_model.named_parameters()}
    before = table.detach().clone()
    train_step(peft_model, ids)
    assert not torch.equal(table, before)
    assert all(torch.equal(p, base[n]) for n, p in peft_model.base_model.named_parameters())


@pytest.mark.parametrize("diff_version", [1, 2], ids=["v1", "v2"])
def test_prompt_tuning_and_ia3_compute_their_formulas(diff_version):
    """Prompt tuning: the logits over the inputs equal the base model's over [virtual embeddings | input embeddings].
    IA³ (PEFT's llama default: k_proj, v_proj outputs and down_proj's input scaled per feature): with random scales,
    the logits equal a copy of the base whose weights carry them. Each trains (its own parameters move)."""
    from peft import PromptTuningConfig

    model = tiny_model(diff_version, attn_implementation="sdpa")
    ids = torch.randint(3, 97, (2, 9))
    prompt = get_peft_model(copy.deepcopy(model), PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    ia3 = get_peft_model(copy.deepcopy(model), IA3Config(task_type="CAUSAL_LM"))
    scaled = copy.deepcopy(model)
    with torch.no_grad():
        virtual = prompt.prompt_encoder["default"].embedding.weight.normal_()  # (4, D)
        got = prompt(ids).logits[:, 4:]  # PEFT returns the virtual positions' logits too
        embeds = torch.cat((virtual.expand(2, -1, -1), model.get_input_embeddings()(ids)), dim=1)
        torch.testing.assert_close(got, model(inputs_embeds=embeds).logits[:, 4:], rtol=1e-5, atol=1e-5)
        modules = dict(scaled.named_modules())
        for name, module in ia3.base_model.model.named_modules():
            if hasattr(module, "ia3_l"):
                scale = module.ia3_l["default"].uniform_(0.5, 1.5).flatten()
                weight = modules[name].weight
                weight.mul_(scale if name.endswith("down_proj") else scale[:, None])  # input or output features
        assert sum(hasattr(m, "ia3_l") for m in ia3.modules()) == 3 * model.config.num_hidden_layers
        torch.testing.assert_close(ia3(ids).logits, scaled(ids).logits, rtol=1e-5, atol=1e-5)
    for peft_model, name in ((prompt, "prompt_encoder"), (ia3, "ia3_l")):
        before = {n: p.detach().clone() for n, p in peft_model.named_parameters() if p.requires_grad}
        assert before and all(name in n for n in before)
        train_step(peft_model, ids)
        assert all(not torch.equal(p, before[n]) for n, p in peft_model.named_parameters() if p.requires_grad)
