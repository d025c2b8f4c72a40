"""Small source checkpoints written to disk (Llama, DiffLlama, a trainable Diff with the shipped tokenizer) and a
digest of a directory tree, for tests that convert, train or check that nothing of the user's changed."""

import hashlib
from pathlib import Path

import torch
from transformers import AutoTokenizer, DiffLlamaConfig, DiffLlamaForCausalLM, LlamaConfig, LlamaForCausalLM

from diff_transformer import DiffForCausalLM

from . import REPOSITORY
from .tiny import tiny_config


ASSETS = REPOSITORY / "src" / "diff_transformer" / "assets"
TINY_LLAMA = ASSETS / "tiny-llama"
HELDOUT = (ASSETS / "heldout.txt").read_text(encoding="utf-8")

VOCAB = 101
SIDE_FILES = {
    "tokenizer_config.json": '{"model_max_length": 256}\n',
    "special_tokens_map.json": '{"bos_token": "<s>"}\n',
    "tokenizer.json": '{"version": "1.0"}\n',
    "chat_template.jinja": "{% for m in messages %}{{ m['content'] }}{% endfor %}\n",
    "LICENSE": "license text\n",
}
SOURCE_CARD = "---\nlicense: apache-2.0\nlanguage:\n- en\n---\n# tiny llama\n"


def randomize(model, scale=0.2):
    """Fresh HF init is nearly uniform (std 0.02); spread weights so attention patterns and argmaxes are distinct."""
    generator = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * noise)
            elif "lambda_" in name:
                param.copy_(0.3 * noise)
            else:
                param.copy_(scale * noise)
    return model


def llama_config(**overrides):
    values = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    values.update(overrides)
    return LlamaConfig(**values)


def make_llama(path, *, dtype=torch.float32, max_shard_size=None, side_files=True, **overrides) -> Path:
    torch.manual_seed(0)
    model = randomize(LlamaForCausalLM(llama_config(**overrides))).to(dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    if side_files:
        for name, text in SIDE_FILES.items():
            (Path(path) / name).write_text(text)
        (Path(path) / "README.md").write_text(SOURCE_CARD)
    return Path(path)


def make_diffllama(path, *, max_shard_size=None, **overrides) -> Path:
    values = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=256,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        lambda_std_dev=0.3,
    )
    values.update(overrides)
    torch.manual_seed(0)
    # a little milder than the Llama models: DiffLlama's and our V1 kernels round differently (two attention calls vs
    # one over a 2d-wide V, nn.RMSNorm vs LlamaRMSNorm), and fp32 rounding grows with the activations' magnitude
    model = randomize(DiffLlamaForCausalLM(DiffLlamaConfig(**values)), scale=0.15)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    return Path(path)


def tree_digest(path: Path) -> dict:
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


def save_trainable_checkpoint(path, version: int, **overrides) -> None:
    """A tiny random Diff checkpoint (seed 0, 32 wide, 64 positions; `overrides` change its config) next to the
    shipped tokenizer, at `path`."""
    tokenizer = AutoTokenizer.from_pretrained(TINY_LLAMA)
    torch.manual_seed(0)
    sizes = dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)
    config = tiny_config(
        version,
        vocab_size=len(tokenizer),
        max_position_embeddings=64,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **{**sizes, **overrides},
    )
    DiffForCausalLM._from_config(config, attn_implementation="eager").save_pretrained(path)
    tokenizer.save_pretrained(path)


class _TouchWhenUnpickled:
    """Unpickling this creates a file: the proof that a loader unpickled the weights."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def make_pickle_only(folder: Path, marker: Path) -> None:
    """FOLDER's model.safetensors replaced by a pytorch_model.bin holding the same tensors and one object whose
    unpickling creates MARKER: a checkpoint a loader can only read by unpickling, and the proof if it did."""
    from safetensors.torch import load_file

    state = dict(load_file(folder / "model.safetensors"), extra=_TouchWhenUnpickled(marker))
    torch.save(state, folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
