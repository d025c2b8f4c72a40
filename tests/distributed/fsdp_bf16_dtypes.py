"""What FSDP2 computes in when `train --parallelism fsdp --bf16 on` loads a model: the model loaded with the
`DistributedConfig` train builds (`training.parallel.distributed_config`), one forward and backward, and the dtypes a
decoder layer's projection sees (its weight and input in the forward), the master weights and their gradients
keep, written per rank for tests/distributed/test_fsdp_bf16.py. Run under `torchrun --nproc-per-node 2` (gloo)."""

import argparse
import os

from transformers import AutoModelForCausalLM

import diff_transformer  # noqa: F401  (registers the Auto classes)
from diff_transformer.training.parallel import Layout, distributed_config
from tests.distributed.dist_common import token_batches, write_rank_record


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("models", nargs="+", help="TAG=DIR")
    args = parser.parse_args(argv)
    world = int(os.environ["WORLD_SIZE"])  # the process group starts with the first sharded load
    results = {}
    for item in args.models:
        tag, _, path = item.partition("=")
        for bf16 in (True, False):
            config = distributed_config(Layout(replicas=1, fsdp=world, tp=1), bf16)
            model = AutoModelForCausalLM.from_pretrained(path, distributed_config=config)
            seen = {}
            projection = model.model.layers[0].self_attn.q_proj

            def record(module, inputs, seen=seen):
                seen["weight"], seen["input"] = str(module.weight.dtype), str(inputs[0].dtype)

            projection.register_forward_pre_hook(record)
            ids = token_batches(2)[:, :16]
            model(input_ids=ids, labels=ids).loss.backward()
            seen["master"] = sorted({str(p.dtype) for p in model.parameters()})
            seen["grads"] = sorted({str(p.grad.dtype) for p in model.parameters() if p.grad is not None})
            results[f"{tag}.bf16={bf16}"] = seen
    write_rank_record(args.out, {"results": results})


if __name__ == "__main__":
    main()
