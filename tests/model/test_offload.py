"""Big-model inference: `device_map="auto"` with a CPU budget and disk offload keeps every decoder layer whole and
computes exactly what the model computes in memory."""

import re

import pytest
import torch
from accelerate.utils import OffloadedWeightsLoader
from transformers import AutoModelForCausalLM

from diff_transformer import DiffForCausalLM
from tests.helpers.tiny import tiny_model


def nbytes(module):
    return sum(p.numel() * p.element_size() for p in module.parameters())


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_disk_offload_keeps_layers_whole_and_logits_exact(tmp_path, diff_version, tied):
    model = tiny_model(diff_version, num_hidden_layers=4, tie_word_embeddings=tied)
    model.save_pretrained(tmp_path / "model")
    assert DiffForCausalLM._no_split_modules == ["DiffDecoderLayer"]

    # Room for the embeddings and about one layer, plus the one-layer buffer accelerate reserves for onloading
    # offloaded weights: the other layers, the final norm and lm_head go to disk.
    budget = nbytes(model.model.embed_tokens) + int(2.5 * nbytes(model.model.layers[0]))
    offloaded = AutoModelForCausalLM.from_pretrained(
        tmp_path / "model",
        device_map="auto",
        max_memory={"cpu": budget},
        offload_folder=tmp_path / "offload",
        attn_implementation="eager",
    )
    device_map = offloaded.hf_device_map
    assert "cpu" in device_map.values() and "disk" in device_map.values(), device_map
    # Placement is decided per whole `model.layers.N` (or coarser), never inside a layer.
    assert not [key for key in device_map if re.match(r"model\.layers\.\d+\.", key)], device_map
    layers = {key: device for key, device in device_map.items() if re.fullmatch(r"model\.layers\.\d+", key)}
    assert set(layers.values()) == {"cpu", "disk"}, device_map
    assert offloaded.model.layers[3].self_attn.q_proj.weight.device.type == "meta"

    # Offloaded weights are read from safetensors files (the checkpoint itself here), never from pickles.
    loaders = {
        id(hook.weights_map.dataset): hook.weights_map.dataset
        for module in offloaded.modules()
        if (hook := getattr(module, "_hf_hook", None)) is not None and getattr(hook, "weights_map", None) is not None
    }
    assert loaders and all(isinstance(loader, OffloadedWeightsLoader) for loader in loaders.values())
    for loader in loaders.values():
        assert loader.index
        assert all(entry["safetensors_file"].endswith(".safetensors") for entry in loader.index.values())
    assert all(path.suffix == ".safetensors" for path in (tmp_path / "offload").rglob("*") if path.is_file())

    ids = torch.tensor([[5, 17, 42, 8, 9, 30, 11, 64], [3, 4, 5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        torch.testing.assert_close(offloaded(ids).logits, model(ids).logits, rtol=0, atol=1e-6)
    kwargs = {"max_new_tokens": 6, "min_new_tokens": 6, "do_sample": False}
    assert torch.equal(offloaded.generate(ids, **kwargs), model.generate(ids, **kwargs))
