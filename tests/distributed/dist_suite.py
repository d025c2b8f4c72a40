"""Every engine one after the other in a single torchrun launch, so that the tests pay the start-up of two
interpreters (torch + transformers + accelerate) once:

    torchrun --nproc_per_node 2 --standalone -m tests.distributed.dist_suite OUT MODELS

MODELS holds the checkpoints fsdp/ (a V1 model), fsdp_trainer/ (V2, for docs/training.md's Trainer recipe), v1/,
v2/, qk/, kv1/ (for tensor parallelism) and train/ + train.txt (for `diff-transformer train`); each engine writes its
per-rank records under OUT/<engine>/, exactly as the script run alone would, and `diff-transformer train` writes its
usual output to OUT/train/.
"""

import sys

import torch
import torch.distributed as dist

from diff_transformer import cli
from tests.distributed import ddp_train, fsdp_train, fsdp_trainer, tp_run
from tests.distributed.dist_common import write_rank_record


TRAIN_ARGS = [
    "--quiet",
    "--report-to",
    "none",
    "--block-size",
    "32",
    "--eval-fraction",
    "0",
    "--max-steps",
    "3",
    "--logging-steps",
    "1",
    "--lr",
    "1e-3",
    "--save-steps",
    "1000",
]


def main():
    out, models = sys.argv[1], sys.argv[2]
    ddp_train.main([f"{out}/ddp", "--per-device-batch", "2", "--steps", "3"])
    fsdp_train.main([f"{models}/fsdp", f"{out}/fsdp", "--steps", "3", "--global-batch", "4"])
    fsdp_trainer.main([f"{models}/fsdp_trainer", f"{out}/fsdp_trainer", "--per-device-batch", "2", "--steps", "3"])
    tp_run.main([f"{out}/tp", *(f"{tag}={models}/{tag}" for tag in ("v1", "v2", "qk", "kv1"))])
    # The package's own training command, exactly as `torchrun ... -m diff_transformer.cli train ...` runs it.
    status = cli.main(
        [
            "train",
            f"{models}/train",
            "--data",
            f"{models}/train.txt",
            "--output",
            f"{out}/train",
            "--batch-size",
            "2",
            *TRAIN_ARGS,
        ]
    )
    write_rank_record(f"{out}/train_ranks", {"status": status, "backend": dist.get_backend()}, {})


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
