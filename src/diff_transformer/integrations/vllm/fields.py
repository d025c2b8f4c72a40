"""What the vLLM model does with each `DiffConfig` field: one entry per field, so a field added to the config cannot
slip past vLLM unnoticed (tests/matrix/test_matrix.py::test_every_config_field_is_placed_for_vllm).

* HONOURED: read by `model.py` and computed as the transformers model computes it;
* REFUSED_UNLESS: fields whose other values vLLM cannot compute: `check_config` refuses them in one line when the
  engine loads the model;
* NOT_USED: training-time or bookkeeping fields that do not change inference.

No vLLM import: the main test suite checks this list where vLLM is not installed.
"""

HONOURED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "rms_norm_eps",
    "tie_word_embeddings",
    "rope_parameters",
    "attention_bias",
    "attention_out_bias",
    "mlp_bias",
    "diff_version",
    "lambda_init",
    "lambda_floor",
    "use_qk_norm",
    "num_noise_heads",
    "lambda_init_depth_offset",
    "subln_eps",
)
REFUSED_UNLESS = {"hidden_act": ("silu", "poly_norm")}
NOT_USED = (
    "initializer_range",  # initialisation
    "lambda_std",  # initialisation of V1's λ vectors
    "attention_dropout",  # training only
    "use_cache",  # vLLM always caches
    "pad_token_id",  # tokenizer / batching, not the model's computation
    "bos_token_id",
    "eos_token_id",
    "conversion",  # provenance
)


def check_config(config) -> None:
    """Refuse, in one line naming the field, what the vLLM model cannot compute."""
    for field, allowed in REFUSED_UNLESS.items():
        value = getattr(config, field)
        if value not in allowed:
            supported = ", ".join(map(str, allowed))
            raise ValueError(
                f"{field}={value!r} is not supported by diff-transformer's vLLM model (only {supported}): "
                "serve this checkpoint with `diff-transformer serve` (transformers) instead."
            )
