"""The tiny random Diff models most tests build: the sizes they share with the Llama / DiffLlama they are compared
with, and a model whose attention is sharp enough that mixed-up heads show in the logits."""

import torch

from diff_transformer import DiffConfig, DiffForCausalLM


# The sizes every tiny test model shares: Diff (tiny_config) and the Llama / DiffLlama it is compared with.
TINY_SIZES = dict(
    vocab_size=97,
    hidden_size=48,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    pad_token_id=0,
)


# The model kinds the converter makes, as overrides of `tiny_config`: V2, V1, and a Motif-shaped V1 (grouped noise
# heads, PolyNorm).
MODEL_KINDS = {
    "v2": dict(diff_version=2),
    "v1": dict(diff_version=1),
    "motif-v1": dict(diff_version=1, num_noise_heads=2, head_dim=8, hidden_act="poly_norm"),
}


def tiny_config(diff_version=2, **overrides):
    values = dict(
        TINY_SIZES,
        max_position_embeddings=4096,
        diff_version=diff_version,
        bos_token_id=1,
        eos_token_id=2,
    )
    values.update(overrides)
    return DiffConfig(**values)


def tiny_model(diff_version=2, seed=0, attn_implementation="eager", **overrides):
    torch.manual_seed(seed)
    config = tiny_config(diff_version, **overrides)
    model = DiffForCausalLM._from_config(config, attn_implementation=attn_implementation)
    # Make the freshly initialised model less uniform so that comparisons are meaningful.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight", "diff_lambda.proj.weight")):
                param.mul_(8.0)
    return model.eval()
