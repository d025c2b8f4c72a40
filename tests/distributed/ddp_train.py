"""DDP through transformers' Trainer. Run alone for the single-process reference, or under
`torchrun --nproc_per_node 2` (CPU: gloo). Each rank writes its logged losses and final weights to OUT."""

import argparse

import torch
import torch.distributed as dist
from transformers import Trainer, TrainingArguments

from tests.distributed.dist_common import tiny_model, token_batches, write_rank_record


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--per-device-batch", type=int, required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--diff-version", type=int, default=2)
    args = parser.parse_args(argv)

    model = tiny_model(args.diff_version)
    # Global batch = per-device batch x world size. Sequential sampling: step k of the 2-rank run covers the same
    # sequences as step k of a single process with twice the per-device batch (rank r takes every 2nd batch).
    ids = token_batches(32)
    train_dataset = [{"input_ids": seq, "labels": seq} for seq in ids]
    training_args = TrainingArguments(
        output_dir=f"{args.out}/trainer",
        use_cpu=True,
        per_device_train_batch_size=args.per_device_batch,
        max_steps=args.steps,
        learning_rate=0.5,
        lr_scheduler_type="constant",
        optim="sgd",  # not Adam: it would magnify float noise in near-zero gradients into lr-sized updates
        train_sampling_strategy="sequential",
        ddp_find_unused_parameters=False,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=0,
    )
    trainer = Trainer(model=model, args=training_args, train_dataset=train_dataset)
    trainer.train()

    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    write_rank_record(
        args.out,
        {
            "losses": losses,
            "trainer_world_size": training_args.world_size,
            "model_wrapped": type(trainer.model_wrapped).__name__,
            "backend": dist.get_backend() if dist.is_initialized() else None,
        },
        trainer.model.state_dict(),
    )


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
