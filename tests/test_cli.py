import subprocess
import sys


def test_demo_end_to_end(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "diff_transformer.cli", "demo", "--output", str(tmp_path)],
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
