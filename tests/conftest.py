import pytest
import torch

import diff_transformer  # noqa: F401  (registers the Auto classes)
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


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread for a module, restored afterwards. On a loaded 2-core machine two threads made
    test_serving's greedy decoding 5.1 s instead of 0.21 s and test_lm_eval's three runs 65 s instead of 3 s."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(params=[1, 2], ids=["v1", "v2"])
def diff_version(request):
    return request.param
