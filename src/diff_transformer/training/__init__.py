"""Continued pretraining with transformers' Trainer (`diff-transformer train`).

* `args.py`: the command-line options (argparse only, imported by `diff_transformer.cli`).
* `checks.py`: the options and --output, checked before anything loads.
* `resume.py`: the Trainer checkpoints of a run, and which one `--resume` continues.
* `model.py`: the model a run trains (a Diff checkpoint, a LoRA adapter further, QLoRA's 4-bit base).
* `data.py`: reading .txt/.jsonl, tokenising, packing into blocks, the held-out split.
* `chat.py`: `--chat-data`, conversations rendered with the chat template, the loss on assistant turns only.
* `callbacks.py`: λ per layer in the training logs; the λ warm-up.
* `freeze.py`: `--diff-only-steps`, training only the parameters the conversion added for the first K steps.
* `train.py`: TrainingArguments + Trainer from the options; `main(argv)` / `run(args)`.

Nothing but the error class is defined here, so `diff-transformer --help` does not pay for Trainer's imports.
"""

from ..errors import UserError


class TrainingError(UserError):
    """A training option or input cannot be used. The message is one line: what is wrong, then how to fix it."""


__all__ = ["TrainingError"]
