"""Models the serving tests answer with, and what greedy `generate` answers for them (the reference every server
answer is held to). Imported as fixtures by tests/serving/ and tests/cli/test_serving.py."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import diff_transformer
from diff_transformer import DiffConfig, DiffForCausalLM
from diff_transformer.conversion import convert_to_diff


TINY_LLAMA = Path(diff_transformer.__file__).parent / "assets" / "tiny-llama"
CHATS = [
    [{"role": "user", "content": "Tell me about Mr. Darcy and Elizabeth."}],
    [{"role": "user", "content": "What did Emma think of the weather?"}],
    [
        {"role": "system", "content": "You are a novelist."},
        {"role": "user", "content": "Describe a ball at Netherfield."},
    ],
]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{name: directory}: the shipped tiny Llama converted to V2 and V1, and a random V1 model saved with
    `save_pretrained` next to the same tokenizer."""
    root = tmp_path_factory.mktemp("models")
    dirs = {f"v{v}": convert_to_diff(TINY_LLAMA, root / f"v{v}", diff_version=v, progress=False) for v in (2, 1)}
    tokenizer = AutoTokenizer.from_pretrained(TINY_LLAMA)
    torch.manual_seed(0)
    config = DiffConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        diff_version=1,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = DiffForCausalLM(config)
    with torch.no_grad():  # decisive logits: greedy choices far from ties
        model.lm_head.weight.mul_(50.0)
    model.save_pretrained(root / "saved")
    tokenizer.save_pretrained(root / "saved")
    dirs["saved"] = root / "saved"
    return dirs


@pytest.fixture(scope="module")
def references(models):
    """Greedy `generate` on the chat-templated prompt, as the server would run it:
    {name: fn(messages, **kw) -> (text, number of new tokens)}."""
    loaded = {
        name: (AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path))
        for name, path in models.items()
    }

    def reference(name, messages, **generate_kwargs):
        model, tokenizer = loaded[name]
        inputs = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_dict=True, return_tensors="pt"
        )
        out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, **generate_kwargs)
        generated = out[0, inputs["input_ids"].shape[1] :]
        return tokenizer.decode(generated, skip_special_tokens=True), len(generated)

    return reference
