"""The three engines one after the other in a single torchrun launch, so that the tests pay the start-up of two
interpreters (torch + transformers + accelerate) once:

    torchrun --nproc_per_node 2 --standalone tests/distributed/suite.py OUT MODELS

MODELS holds the checkpoints fsdp/ (a V1 model) and v1/, v2/, kv1/ (for tensor parallelism); each engine writes its
per-rank records under OUT/<engine>/, exactly as the script run alone would.
"""

import sys

import ddp_train
import fsdp_train
import torch
import tp_run


def main():
    out, models = sys.argv[1], sys.argv[2]
    ddp_train.main([f"{out}/ddp", "--per-device-batch", "2", "--steps", "3"])
    fsdp_train.main([f"{models}/fsdp", f"{out}/fsdp", "--steps", "3", "--global-batch", "4"])
    tp_run.main([f"{out}/tp", *(f"{tag}={models}/{tag}" for tag in ("v1", "v2", "kv1"))])


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
