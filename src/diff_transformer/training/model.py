"""The model a run trains: MODEL opened (a Diff checkpoint, any model with --any-model, or a LoRA adapter trained
further), its config checked, loaded (4-bit for QLoRA) and wrapped in a LoRA adapter with --lora."""

from __future__ import annotations

import torch

from ..checkpoints import adapters
from ..checkpoints.backends import check_attn_implementation
from ..checkpoints.opening import Checkpoint, open_checkpoint
from . import TrainingError
from .args import parse_train_args


def open_model(args) -> Checkpoint:
    """MODEL opened once for the whole run (`checkpoints.open`: resolved, its config held against its weights, its
    tokenizer loaded); for a PEFT adapter directory (a --lora run's output), its base is where the model loads from.
    What the run asks of it is checked by `check_model`, after --output (`run`'s order)."""
    return open_checkpoint(args.model, getattr(args, "base", None))


def check_model(args, checkpoint: Checkpoint) -> None:
    """An adapter is trained further with its own settings (`continue_adapter`); a model that is not a Diff model
    needs --any-model."""
    if checkpoint.adapter is not None:
        continue_adapter(args, checkpoint.source)
    config = checkpoint.config
    if config.model_type != "diff" and not args.any_model:
        raise TrainingError(
            f"{args.model} is a {config.model_type!r} checkpoint, not a Diff model: convert it first "
            f"(diff-transformer convert {args.model} OUT), "
            "or pass --any-model to train it as it is (e.g. as a baseline)"
        )


_LORA_OPTIONS = {"lora_r": "r", "lora_alpha": "lora_alpha", "lora_dropout": "lora_dropout"}


def continue_adapter(args, source: adapters.Source) -> None:
    """MODEL is an adapter: the run trains it further (LoRA implied), with its own settings; a --lora-* option that
    asks for other ones is refused rather than ignored."""
    lora = adapters.read_adapter_config(source.adapter)
    defaults = vars(parse_train_args([args.model, "--data", "-", "--output", "-"]))
    for option, key in _LORA_OPTIONS.items():
        value = getattr(args, option)
        if value != defaults[option] and value != lora.get(key):
            raise TrainingError(
                f"--{option.replace('_', '-')} {value}: MODEL {args.model} is a LoRA adapter with "
                f"{key}={lora.get(key)}, which this run trains further: drop the option (or train a new adapter on "
                "its base with --lora)"
            )
    targets = args.lora_target_modules
    adapted = sorted(lora.get("target_modules") or [])
    if targets is not None and sorted(targets) != adapted:
        raise TrainingError(
            f"--lora-target-modules: MODEL {args.model} is a LoRA adapter of {' '.join(adapted)}, which this run "
            "trains further: drop the option"
        )
    if args.lora_freeze_lambda and "diff_lambda" in (lora.get("modules_to_save") or []):
        raise TrainingError(
            f"--lora-freeze-lambda: MODEL {args.model} is a LoRA adapter that trains λ (modules_to_save): drop it"
        )
    args.lora = True  # what the rest of the checks and the summary go by


def load_model(args, training_args, checkpoint: Checkpoint, layout=None):
    """The model, sharded as LAYOUT says (`parallel.plan_layout`; None: whole, for DDP or one process): built on the
    meta device, each rank loading only its own shard."""
    kwargs = {"dtype": getattr(torch, args.dtype)}
    if layout is not None:
        from .parallel import distributed_config

        kwargs["distributed_config"] = distributed_config(layout, training_args.bf16)
    if args.attn_implementation:
        kwargs["attn_implementation"] = check_attn_implementation(args.attn_implementation)
    if args.load_in_4bit:
        from transformers import BitsAndBytesConfig

        compute = torch.bfloat16 if training_args.bf16 else torch.float32
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_compute_dtype=compute,
            bnb_4bit_use_double_quant=True,
        )
        kwargs["device_map"] = {"": training_args.device}
    if checkpoint.adapter is not None:  # an adapter trained further: its base, its LoRA weights (trainable)
        return checkpoint.load(trainable=True, prepare=lambda base: _prepare_4bit(base, args), **kwargs)
    model = checkpoint.load(**kwargs)
    if args.lora:
        model = add_lora(model, args)
    return model


def _prepare_4bit(model, args):
    if not args.load_in_4bit:
        return model
    from peft import prepare_model_for_kbit_training

    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=args.gradient_checkpointing)


def add_lora(model, args):
    from peft import LoraConfig, get_peft_model

    from ..integrations.peft import register_peft_defaults

    register_peft_defaults()  # LoRA's default targets for "diff", whatever imported peft first

    model = _prepare_4bit(model, args)
    # λ is tiny (V1: 4 vectors, V2: one H x D matrix per layer) and is what differential attention learns, so by
    # default it is trained in full and saved with the adapter.
    train_lambda = not args.lora_freeze_lambda and any(n.endswith("diff_lambda") for n, _ in model.named_modules())
    config = LoraConfig(
        task_type="CAUSAL_LM",
        r=args.lora_r,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        # PEFT takes its shorthand "all-linear" as a string, not as a one-item list (what argparse's nargs gives).
        target_modules="all-linear" if args.lora_target_modules == ["all-linear"] else args.lora_target_modules,
        modules_to_save=["diff_lambda"] if train_lambda else None,
    )
    try:
        with adapters.quiet_peft_wrapping():
            return get_peft_model(model, config)
    except ValueError as error:
        if args.lora_target_modules is None and "target_modules" in str(error):
            raise TrainingError(
                f"PEFT has no default LoRA target modules for model_type {model.config.model_type!r}: "
                "pass --lora-target-modules (e.g. q_proj k_proj v_proj o_proj)"
            ) from None
        if args.lora_target_modules is not None and "target modules" in str(error).lower():
            linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
            raise TrainingError(
                f"--lora-target-modules {' '.join(args.lora_target_modules)} matches no module of the model: name "
                f"some of {', '.join(linear)} (or all-linear)"
            ) from None
        raise TrainingError(f"LoRA: {str(error).splitlines()[0]}") from None
