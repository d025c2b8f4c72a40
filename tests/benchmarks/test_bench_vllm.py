"""benchmarks/bench_vllm.py without vLLM: its requests (no prompt repeats, the prefill-heavy prompts share exactly
the document), its floors (benchmarks/floors.py: bytes for the decode-heavy mix, multiply-adds for the prefill-heavy
one, the prefix cache's whole blocks left out), its report and its refusals. The run itself, with vLLM servers, is
tests/vllm/test_bench_vllm.py."""

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from diff_transformer import DiffConfig, DiffForCausalLM
from tests.helpers import REPOSITORY, load_script


bench = load_script(REPOSITORY / "benchmarks" / "bench_vllm.py")
floors = load_script(REPOSITORY / "benchmarks" / "floors.py")
COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, vocab_size=50, head_dim=8)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(bench.TINY_LLAMA)


@pytest.fixture(scope="module")
def models():
    with torch.device("meta"):
        return {
            "llama": LlamaForCausalLM(LlamaConfig(num_attention_heads=8, num_key_value_heads=4, **COMMON)),
            "v1": DiffForCausalLM(DiffConfig(diff_version=1, num_attention_heads=4, num_key_value_heads=2, **COMMON)),
            "v2": DiffForCausalLM(DiffConfig(diff_version=2, num_attention_heads=8, num_key_value_heads=2, **COMMON)),
        }


def test_prefill_heavy_prompts_share_the_document_and_nothing_repeats(tokenizer):
    doc = bench.document(tokenizer, 120)
    assert 100 < len(tokenizer(doc, add_special_tokens=False)["input_ids"]) <= 120
    messages = {bench.message(mix, w, i, doc) for mix in bench.MIXES for w in range(3) for i in range(20)}
    assert len(messages) == 2 * 3 * 20  # every request of every wave its own prompt
    assert bench.message("decode", 1, 0, doc) in bench.message("prefill", 1, 0, doc)

    def ids(wave):
        text = bench.message("prefill", wave, 0, doc)
        encoded = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)

    shared = bench.shared_prefix_tokens(tokenizer, doc)
    a, b = ids(1), ids(2)
    assert a[:shared] == b[:shared] and a[shared] != b[shared]
    assert shared > len(tokenizer(doc, add_special_tokens=False)["input_ids"])  # the template's head too


def test_floors_count_bytes_for_decode_and_multiply_adds_for_prefill(models):
    floor, kind = bench.floors_of(models, "decode", prompt=20, tokens=100, requests=8, cached=0)
    assert kind == "bytes" and floor["llama"] == 1.0
    context = 20 + 50
    for name, model in models.items():
        expected = floors.decode_bytes(models["llama"], context, 8) / floors.decode_bytes(model, context, 8)
        assert floor[name] == pytest.approx(expected)

    floor, kind = bench.floors_of(models, "prefill", prompt=300, tokens=4, requests=8, cached=0)
    assert kind == "FLOPs" and floor["llama"] == 1.0
    for name, model in models.items():
        macs = floors.forward_macs(model.model, 303) + 4 * 50 * 64  # causal over prompt + decode steps, LM head x4
        assert bench.request_macs(model, 300, 0, 4) == pytest.approx(macs)
    # the cached prefix is not computed again: the rest attends to it (its keys), so the attention share grows
    cached, _ = bench.floors_of(models, "prefill", prompt=300, tokens=4, requests=8, cached=256)
    for name, model in models.items():
        assert bench.request_macs(model, 300, 256, 4) == pytest.approx(
            bench.request_macs(model, 300, 0, 4) - floors.forward_macs(model.model, 256)
        )
    assert cached["v2"] < floor["v2"] < 1  # V2's attention does 2x Llama's products


def test_report_has_one_table_per_mix_with_ratios_floors_machine_and_load():
    def row(server, model, mix, caching, rps, ratio, floor):
        vllm = server == "vllm"
        return {
            "server": server, "model": model, "mix": mix, "prefix_caching": caching, "requests": 8,
            "tokens": 128 if mix == "decode" else 8, "prompt_tokens": 20.0 if mix == "decode" else 400.0,
            "wave_s": [1.0, 1.1], "requests_per_s": rps, "tokens_per_s": rps * (128 if mix == "decode" else 8),
            "startup_s": 20.0, "floor": floor, "floor_kind": "bytes" if mix == "decode" else "FLOPs",
            "ratio_llama": ratio, "ratio_vllm": None if vllm else 0.1, "best_ratio_llama": ratio + 0.01,
            "wave_cpu_s": [0.5, 0.6], "requests_per_cpu_s": rps * 2, "cpu_ratio_llama": ratio - 0.01,
        }  # fmt: skip

    data = {
        "meta": {
            "date": "2026-11-26 08:00", "git": "abc", "machine": "x86_64, AMD EPYC, 2 CPU cores", "cpus": 2,
            "vllm": "0.32.0", "torch": "2.13.0", "transformers": "5.19.0", "python": "3.11", "wall_s": 120,
            "loadavg": [6.5, 7.0],
        },
        "setup": {
            "source": "the shipped tiny Llama", "models": ["llama", "v2"], "mixes": ["decode", "prefill"],
            "requests": 8, "reps": 2, "kv_cache_gib": 1, "params": {"llama": 2e6, "v2": 2.1e6},
        },
        "rows": [
            row("vllm", "llama", "decode", True, 10.0, 1.0, 1.0),
            row("vllm", "v2", "decode", True, 8.0, 0.8, 0.94),
            row("serve", "v2", "decode", None, 0.8, 0.7, 0.94),
            row("vllm", "llama", "prefill", False, 20.0, 1.0, 1.0),
            row("vllm", "v2", "prefill", False, 15.0, 0.75, 0.8),
        ],
    }  # fmt: skip
    text = bench.render(data)
    assert "x86_64, AMD EPYC, 2 CPU cores" in text and "6.5, 7.0" in text and "2026-11-26 08:00" in text
    assert "shared with other jobs" in text  # load above half the cores
    assert "## decode-heavy: 20-token prompts, 128 generated tokens" in text
    assert "## prefill-heavy: 400-token prompts, 8 generated tokens" in text
    row_v2 = "| Diff V2 | vLLM | on | 8.00 | 1024 | 0.80x | 0.81x | 16.00 | 0.79x | 0.94x | 1.00, 1.10 | 0.50, 0.60 |"
    assert row_v2 in text
    assert "| Diff V2 | diff-transformer serve | - | 0.80 | 102 | 0.70x (0.10x of vLLM's) | 0.71x | 1.60 |" in text
    assert "| Diff V2 | vLLM | off | 15.00 | 120 | 0.75x | 0.76x | 30.00 | 0.74x | 0.80x |" in text
    assert "floor (bytes)" in text and "floor (FLOPs)" in text


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--mixes", "decode,long"], "--mixes 'decode,long': choose from decode,prefill"),
        (["--servers", "tgi"], "--servers 'tgi': choose from vllm,serve"),
        (["--prefix-caching", ""], "--prefix-caching '': choose from on,off"),
        (["--source", "/nonexistent"], "--source /nonexistent: no config.json there"),
        (["--vllm-python", "/nonexistent/python"], "--vllm-python /nonexistent/python does not exist"),
        (["--reps", "0"], "--reps must be at least 1"),
    ],
)
def test_refusals(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_defaults_are_the_short_run():
    args = bench.parse_args([])
    assert args.servers == ["vllm"] and args.models == ["llama", "v2", "v1"]
    assert args.mixes == ["decode", "prefill"] and args.prefix_caching == [True, False]
    assert bench.parse_args(["--models", "v1"]).models == ["llama", "v1"]  # the Llama is always measured


def test_recorded_arguments_publish_no_directory_of_the_machine(tmp_path):
    """The committed JSON records the command line: a path outside the repository keeps only its name."""
    source = tmp_path / "smollm2"
    inside = REPOSITORY / "benchmarks" / "results" / "out.json"
    recorded = bench.recorded_argv(["--source", str(source), f"--json={inside}", "--reps", "3", "--out=x"])
    assert recorded == ["--source", "DIR/smollm2", "--json=benchmarks/results/out.json", "--reps", "3", "--out=x"]
