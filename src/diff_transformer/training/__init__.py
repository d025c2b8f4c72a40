"""Continued pretraining with transformers' Trainer (`diff-transformer train`).

* `args.py`: the command-line options (argparse only, imported by `diff_transformer.cli`).
* `data.py`: reading .txt/.jsonl, tokenising, packing into blocks, the held-out split.
* `callbacks.py`: λ per layer in the training logs.
* `freeze.py`: `--diff-only-steps`, training only the parameters the conversion added for the first K steps.
* `train.py`: TrainingArguments + Trainer from the options; `main(argv)` / `run(args)`.

Nothing is imported here, so `diff-transformer --help` does not pay for Trainer's imports.
"""
