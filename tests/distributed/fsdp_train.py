"""FSDP2 as transformers applies it: `from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=N))` calls
torch's `fully_shard` on the embeddings, every decoder layer, the final norm + head and the root. A few SGD steps
on fixed data; run alone for the single-process reference, or under `torchrun --nproc_per_node 2` (CPU: gloo)."""

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import AutoModelForCausalLM
from transformers.distributed import DistributedConfig

import diff_transformer  # noqa: F401  (registers the Auto classes)
from tests.distributed.dist_common import rank_and_world, token_batches, write_rank_record


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("--global-batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)

    world_size = int(os.environ.get("WORLD_SIZE", 1))
    distributed_config = DistributedConfig(fsdp_size=world_size) if world_size > 1 else None
    model = AutoModelForCausalLM.from_pretrained(args.model, distributed_config=distributed_config)
    rank, world_size = rank_and_world()
    layer = model.model.layers[0]
    weight = layer.self_attn.q_proj.weight
    sharding = {
        "layer_is_fsdp_module": type(layer).__name__.startswith("FSDP"),
        "q_proj_param_type": type(weight).__name__,
        "q_proj_local_rows": (weight.to_local() if hasattr(weight, "to_local") else weight).shape[0],
        "q_proj_rows": weight.shape[0],
    }

    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    ids = token_batches(args.steps * args.global_batch).view(args.steps, args.global_batch, -1)
    per_rank = args.global_batch // world_size
    losses = []
    for step in range(args.steps):
        # Equal-length sequences: the mean over the ranks' mean losses is the mean over the global batch, and FSDP2
        # averages the gradients over the ranks.
        batch = ids[step, rank * per_rank : (rank + 1) * per_rank]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        loss = loss.detach()
        if world_size > 1:
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        losses.append(loss.item())

    # Gathered on every rank (collective), so each rank can report the full weights it would save.
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    backend = dist.get_backend() if dist.is_initialized() else None
    write_rank_record(args.out, {"losses": losses, "backend": backend, **sharding}, state)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
