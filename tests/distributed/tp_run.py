"""Tensor parallelism with transformers' engine and the model's own `base_model_tp_plan`:
`from_pretrained(..., distributed_config=DistributedConfig(tp_plan="auto"))` under `torchrun --nproc_per_node 2`
(CPU: gloo). For each checkpoint TAG=DIR: logits, a greedy generation, and the full gradients of one training
step, written per rank to OUT for the test to compare with the unsharded model. A checkpoint whose head counts do
not split over the ranks must be refused when loading; its error is recorded."""

import argparse

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM
from transformers.distributed import DistributedConfig

import diff_transformer  # noqa: F401  (registers the Auto classes)
from tests.distributed.dist_common import SEQ_LEN, rank_and_world, token_batches, write_rank_record


def run(path: str, tag: str, results: dict, tensors: dict):
    try:
        model = AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(tp_plan="auto"))
    except ValueError as error:
        results[tag] = {"error": str(error)}
        return
    q_proj = model.model.layers[0].self_attn.q_proj.weight
    ids = token_batches(2)[:, : SEQ_LEN // 2]
    with torch.no_grad():
        tensors[f"{tag}.logits"] = model(ids).logits
        generated = model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False)

    model.train()  # grad mode: transformers' DTensor path, where replicated-parameter gradients must be summed
    model(input_ids=ids, labels=ids).loss.backward()
    for name, param in model.named_parameters():
        grad = param.grad
        tensors[f"{tag}.grad.{name}"] = grad.full_tensor() if isinstance(grad, DTensor) else grad
    results[tag] = {
        "tp_size": model.tp_size,
        "generated": generated.tolist(),
        "q_proj_local_rows": q_proj.to_local().shape[0] if isinstance(q_proj, DTensor) else q_proj.shape[0],
        "q_proj_rows": q_proj.shape[0],
    }


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("models", nargs="+", metavar="TAG=DIR")
    args = parser.parse_args(argv)

    results, tensors = {}, {}
    for spec in args.models:
        tag, path = spec.split("=", 1)
        run(path, tag, results, tensors)
    rank, _ = rank_and_world()
    write_rank_record(args.out, {"backend": dist.get_backend(), "results": results}, tensors)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
