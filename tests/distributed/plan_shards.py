"""What FSDP2 leaves on each rank, counted for the planner's check (tests/training/test_plan.py): tiny V1 and V2
models sharded with torch's `fully_shard` (every decoder layer, then the root, as transformers' `DistributedConfig`
does), one AdamW step so that every state exists, then the bytes of each rank's local parameter, gradient and moment
shards. Run under `torchrun --nproc_per_node 2` (CPU: gloo)."""

import argparse

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from tests.distributed.dist_common import tiny_model, token_batches, write_rank_record


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def nbytes(tensor: torch.Tensor) -> int:
    tensor = local(tensor)
    return tensor.numel() * tensor.element_size()


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    args = parser.parse_args(argv)
    dist.init_process_group("gloo")
    records = {}
    for version in (1, 2):
        model = tiny_model(version)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        batch = token_batches(2)[dist.get_rank() :: dist.get_world_size()]
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        params = list(model.parameters())
        states = [optimizer.state[p] for p in params]
        records[f"v{version}"] = {
            "weights": sum(nbytes(p) for p in params),
            "gradients": sum(nbytes(p.grad) for p in params),
            "optimizer": sum(nbytes(s["exp_avg"]) + nbytes(s["exp_avg_sq"]) for s in states),
            "steps": [(local(s["step"]).numel(), local(s["step"]).device.type) for s in states],
            "parameter_tensors": len(params),
            "all_dtensors": all(hasattr(p, "to_local") for p in params),
        }
    write_rank_record(args.out, records)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
