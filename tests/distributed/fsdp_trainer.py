"""docs/training.md's recipe for a user's own Trainer script: the model loaded with
`DistributedConfig(fsdp_size=WORLD_SIZE)` (FSDP2, sharded at load time) and handed to a plain `Trainer` with
`save_only_model=True`. Run under `torchrun --nproc_per_node 2` (CPU: gloo); each rank writes its logged losses, the
type of what Trainer trained and the gathered final weights to OUT."""

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments
from transformers.distributed import DistributedConfig

import diff_transformer  # noqa: F401  (registers the Auto classes)
from tests.distributed.dist_common import token_batches, write_rank_record


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("--per-device-batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)

    world = int(os.environ["WORLD_SIZE"])
    model = AutoModelForCausalLM.from_pretrained(args.model, distributed_config=DistributedConfig(fsdp_size=world))
    training_args = TrainingArguments(  # as tests/distributed/ddp_train.py, so the same reference applies
        output_dir=f"{args.out}/trainer", use_cpu=True, per_device_train_batch_size=args.per_device_batch,
        max_steps=args.steps, learning_rate=0.5, lr_scheduler_type="constant", optim="sgd",
        train_sampling_strategy="sequential", logging_steps=1, save_strategy="no", save_only_model=True,
        report_to=[], disable_tqdm=True, seed=0,
    )  # fmt: skip
    ids = token_batches(32)
    trainer = Trainer(model=model, args=training_args, train_dataset=[{"input_ids": s, "labels": s} for s in ids])
    trainer.train()
    weight = model.model.layers[0].self_attn.q_proj.weight
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    record = {
        "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
        "model_wrapped": type(trainer.model_wrapped).__name__,
        "q_proj_local_rows": weight.to_local().shape[0] if hasattr(weight, "to_local") else weight.shape[0],
        "backend": dist.get_backend(),
    }
    write_rank_record(args.out, record, state)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
