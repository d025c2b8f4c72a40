"""Helpers of the vLLM plugin's tests: every vLLM engine runs in a child process with a time limit (vLLM starts
processes of its own); references come from `DiffForCausalLM.generate` in the test process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

import diff_transformer
from diff_transformer import DiffConfig, DiffForCausalLM


HERE = Path(__file__).parent
TINY_LLAMA = Path(diff_transformer.__file__).parent / "assets" / "tiny-llama"
MAX_TOKENS = 16


def vllm_env(tensor_parallel_size=1, engine_in_process=False):
    """This environment for a vLLM child: small KV cache, no Hub, no telemetry, one core per tensor-parallel rank.
    ENGINE_IN_PROCESS: `vllm.LLM`'s engine core in the caller's process instead of one spawned per engine, which
    costs about 25 s an engine on 2 cores (the tokens are the same; the servers, bench_vllm and the tensor-parallel
    workers still load the plugin in processes vLLM spawns)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_", "VLLM_"))}
    env.update(HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    if engine_in_process:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if tensor_parallel_size > 1:
        # vLLM binds each CPU worker to NUMA nodes by default and refuses with fewer nodes than ranks: give each rank
        # its own core (or share one where the machine has fewer).
        cores = sorted(os.sched_getaffinity(0))
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(cores[i % len(cores)]) for i in range(tensor_parallel_size))
    return env


def run_vllm_job(models, prompts, tmp_path, max_tokens=MAX_TOKENS, tensor_parallel_size=1, timeout=600, **extra):
    """tests/vllm/vllm_generate.py on MODELS in a child process: the finished process (exit code and output).
    EXTRA: more job keys (`enable_prefix_caching`, `repeat`)."""
    job = tmp_path / "job.json"
    models = [str(m) for m in models]
    job.write_text(
        json.dumps(
            {
                "models": models,
                "prompts": prompts,
                "max_tokens": max_tokens,
                "tensor_parallel_size": tensor_parallel_size,
                **extra,
            }
        )
    )
    return subprocess.run(
        [sys.executable, str(HERE / "vllm_generate.py"), str(job)],
        capture_output=True,
        text=True,
        env=vllm_env(tensor_parallel_size, engine_in_process=True),
        stdin=subprocess.DEVNULL,
        timeout=timeout,
        check=False,
    )


def run_vllm_generate(
    models, prompts, tmp_path, max_tokens=MAX_TOKENS, tensor_parallel_size=1, timeout=600, full=False, **extra
):
    """{model dir: generated token ids per prompt} from vLLM (tests/vllm/vllm_generate.py in a child process); with
    `full`, the whole report ({"tokens": ..., "repeated": ...})."""
    result = run_vllm_job(models, prompts, tmp_path, max_tokens, tensor_parallel_size, timeout, **extra)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    return report if full else report["tokens"]


def reference_greedy(model_dir, prompts, max_tokens=MAX_TOKENS):
    """The transformers model's greedy continuation of each prompt (one at a time, no padding), EOS ignored."""
    model = DiffForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    config = model.generation_config
    config.eos_token_id, config.repetition_penalty, config.do_sample = None, 1.0, False
    out = []
    for prompt in prompts:
        ids = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, min_new_tokens=max_tokens)
        out.append(ids[0, len(prompt) :].tolist())
    return out


def random_model(path, diff_version, seed=0, **overrides):
    """A random tiny Diff model saved as `save_pretrained` writes it, with the tiny Llama's tokenizer."""
    from transformers import AutoTokenizer

    values = dict(
        vocab_size=2048,  # the tiny Llama tokenizer's
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16 if diff_version == 1 else 32,  # vLLM's CPU attention: head sizes 32, 64, ... (V1 attends 2d wide)
        max_position_embeddings=512,
        initializer_range=0.2,  # peaked logits: greedy choices are not near-ties
        diff_version=diff_version,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    values.update(overrides)
    torch.manual_seed(seed)
    model = DiffForCausalLM(DiffConfig(**values)).eval()
    with torch.no_grad():  # biases start at zero: make them count
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.1)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(TINY_LLAMA).save_pretrained(path)
    return Path(path)
