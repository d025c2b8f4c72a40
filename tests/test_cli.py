import subprocess
import sys


def test_scratch_demo_end_to_end(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "diff_transformer.cli", "demo", "--scratch", "--output", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.count("logits identical after reload: True") == 2
    for version in (1, 2):
        assert (tmp_path / f"diff-v{version}" / "model.safetensors").exists()
        assert (tmp_path / f"diff-v{version}" / "modeling_diff.py").exists()


def test_generate_command_with_token_ids(tmp_path):
    from conftest import tiny_model

    model = tiny_model(2)
    model.save_pretrained(tmp_path)
    result = subprocess.run(
        [sys.executable, "-m", "diff_transformer.cli", "generate", str(tmp_path), "5 6 7", "--max-new-tokens", "4"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    import torch

    expected = model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, do_sample=False)[0, 3:].tolist()
    assert result.stdout.split() == [str(t) for t in expected]


def _tiny_llama(path, **overrides):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    values = dict(vocab_size=97, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2)
    values.update(overrides)
    LlamaForCausalLM(LlamaConfig(**values)).save_pretrained(path)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "diff_transformer.cli", *map(str, args)], capture_output=True, text=True, timeout=300)


def test_convert_command_verifies_v2(tmp_path):
    _tiny_llama(tmp_path / "llama")
    result = _cli("convert", tmp_path / "llama", tmp_path / "diff", "--verify", "--quiet")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "greedy continuations match: True" in result.stdout
    import json

    config = json.loads((tmp_path / "diff" / "config.json").read_text())
    assert config["model_type"] == "diff" and config["diff_version"] == 2


def test_convert_command_v1_odd_heads_is_refused(tmp_path):
    _tiny_llama(tmp_path / "llama", num_attention_heads=3, num_key_value_heads=3)
    before = sorted((p.name, p.read_bytes()) for p in (tmp_path / "llama").iterdir())
    result = _cli("convert", tmp_path / "llama", tmp_path / "diff", "--diff-version", "1", "--quiet")
    assert result.returncode == 2
    message = result.stderr.strip().splitlines()[-1]
    assert message.startswith("error: ") and "diff_version=2" in message
    assert not (tmp_path / "diff").exists()
    assert sorted((p.name, p.read_bytes()) for p in (tmp_path / "llama").iterdir()) == before


def test_main_demo_command(tmp_path):
    result = _cli("demo", "--output", tmp_path / "demo")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert (tmp_path / "demo" / "config.json").exists()
