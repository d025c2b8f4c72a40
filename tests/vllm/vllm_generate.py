"""Greedy generation with vLLM, in a process of its own: `python vllm_generate.py JOB.json` prints one JSON line.

JOB: {"models": [dir, ...], "prompts": [[token ids], ...], "max_tokens": N, "tensor_parallel_size": 1}. Every model
is loaded as `vllm.LLM(dir)` with no plugin-specific flag (the entry point registers the architecture), fp32 and
eager; all prompts go to `generate` in one call, so prompts of different lengths share batches.
Output: {"tokens": {dir: [[generated ids] per prompt]}}.

vLLM's engine starts processes of its own, hence the `__main__` guard.
"""

import json
import sys


def main(job_path: str) -> None:
    from vllm import LLM, SamplingParams

    with open(job_path) as f:
        job = json.load(f)
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True)
    tokens, repeated = {}, {}
    # Optional: `enable_prefix_caching` passed to the engine, and `repeat`: the prompts generated a second time, once
    # the first pass has filled the prefix cache (its tokens under "repeated").
    caching = (
        {} if job.get("enable_prefix_caching") is None else {"enable_prefix_caching": job["enable_prefix_caching"]}
    )
    for model in job["models"]:
        llm = LLM(
            model,
            dtype="float32",
            enforce_eager=True,
            max_model_len=job.get("max_model_len", 256),
            max_num_seqs=8,
            tensor_parallel_size=job.get("tensor_parallel_size", 1),
            seed=0,
            **caching,
        )
        outputs = llm.generate([{"prompt_token_ids": p} for p in job["prompts"]], params, use_tqdm=False)
        tokens[model] = [list(o.outputs[0].token_ids) for o in outputs]
        if job.get("repeat"):
            again = llm.generate([{"prompt_token_ids": p} for p in job["prompts"]], params, use_tqdm=False)
            repeated[model] = [list(o.outputs[0].token_ids) for o in again]
        llm.llm_engine.engine_core.shutdown()  # free this model's engine and KV cache before the next one
        del llm
    print(json.dumps({"tokens": tokens, "repeated": repeated}))


if __name__ == "__main__":
    main(sys.argv[1])
