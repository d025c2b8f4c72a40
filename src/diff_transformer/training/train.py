"""`diff-transformer train`: continued pretraining of a Diff checkpoint with transformers' Trainer.

    diff-transformer train MODEL --data corpus.txt --output run/ --max-steps 1000 --eval-steps 100
    torchrun --nproc_per_node 2 -m diff_transformer.cli train MODEL --data corpus.txt --output run/   # DDP

Everything that Trainer already does (the loop, lr schedule and warm-up, gradient accumulation, mixed precision,
activation checkpointing, checkpoints with optimizer/scheduler/RNG state and exact resume, progress bars, TensorBoard,
DDP) is Trainer's; this module only turns the command line into `TrainingArguments`, packs the text
(`data.py`) and adds three things: the perplexity of every evaluation, λ per layer in the logs (`callbacks.py`) and
`--diff-only-steps` (`freeze.py`). Summaries are printed by the main process only; Trainer writes its own files there.
"""

from __future__ import annotations

import errno
import importlib.util
import json
import math
import os
import shutil
import sys
import zipfile
from pathlib import Path
from typing import NamedTuple

import torch
from transformers import AutoConfig, AutoTokenizer, Trainer, TrainerCallback, TrainingArguments, set_seed
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from .. import adapters
from ..conversion.source import SAFETENSORS_INDEX, SAFETENSORS_SINGLE
from ..errors import UserError
from ..extras import installed, missing, require
from ..loading import check_diff_checkpoint, load_causal_lm, read_json, resolve_model
from ..safe_output import RUN_LOCK, check_target
from .args import parse_train_args
from .callbacks import (
    LambdaLoggingCallback,
    LambdaWarmupCallback,
    RunSettingsCallback,
    console_logs,
    last_lambda_summary,
)
from .data import TrainingError, build_datasets
from .freeze import DiffOnlyCallback


DEFAULT_BLOCK_SIZE = 1024


class CausalLMTrainer(Trainer):
    """Trainer whose evaluations also report perplexity = exp(mean token NLL) as `<prefix>_perplexity`.

    The eval loss is already the mean NLL over every predicted token: all blocks have the same length and no padding,
    and Trainer weights each batch's mean loss by its number of blocks."""

    def evaluation_loop(
        self, dataloader, description, prediction_loss_only=None, ignore_keys=None, metric_key_prefix="eval"
    ):
        output = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix)
        loss = output.metrics.get(f"{metric_key_prefix}_loss")
        if loss is not None:
            output.metrics[f"{metric_key_prefix}_perplexity"] = math.exp(min(loss, 700.0))
        return output

    def _issue_warnings_after_load(self, load_result):
        # A tied lm_head is not stored in checkpoints (it is the embedding matrix), so it is always "missing" when
        # Trainer reloads one; transformers re-ties it only for models that list it in `_keys_to_ignore_on_save`.
        tied = set(getattr(self.accelerator.unwrap_model(self.model), "all_tied_weights_keys", None) or {})
        load_result.missing_keys[:] = [key for key in load_result.missing_keys if key not in tied]
        super()._issue_warnings_after_load(load_result)


# What Trainer writes into a checkpoint-N directory: a directory holding none of these is not one of its checkpoints.
_TRAINER_CHECKPOINT_FILES = (
    "trainer_state.json",
    "training_args.bin",
    "optimizer.pt",
    "scheduler.pt",
    "rng_state.pth",
    "config.json",
    "adapter_config.json",
    SAFETENSORS_SINGLE,
    SAFETENSORS_INDEX,
)


def _checkpoints(output: Path) -> list[Path]:
    """The Trainer checkpoints in `output`: checkpoint-N directories (N a number) that are empty (a save killed at
    once) or hold a file Trainer writes there. A user's `checkpoint-mynotes/` or a `checkpoint-3/` of other files is
    neither counted nor ever deleted."""
    if not output.is_dir():
        return []
    found = []
    for path in output.glob(f"{PREFIX_CHECKPOINT_DIR}-*"):
        if _step(path) < 0 or path.is_symlink() or not path.is_dir():
            continue
        names = {entry.name for entry in path.iterdir()}
        if not names or names & set(_TRAINER_CHECKPOINT_FILES):
            found.append(path)
    return sorted(found, key=_step)


def _holds_run(output: Path) -> list[str]:
    """What shows that `output` holds a training run: its checkpoints, or the files a finished run leaves."""
    found = [path.name for path in _checkpoints(output)]
    found += [name for name in _RUN_FILES if (output / name).exists()]
    return found


def resolve_resume(args, block_size: int) -> str | None:
    """The checkpoint to resume from (None: start), checked to be complete and to continue this run as configured."""
    output = Path(args.output)
    if args.resume is None:
        if _checkpoints(output) and not args.overwrite:
            raise TrainingError(
                f"{output} already holds checkpoints: "
                "pass --resume to continue from the last one, or --overwrite to start over"
            )
        return None
    if args.resume == "auto":
        last = get_last_checkpoint(str(output)) if output.is_dir() else None
        if last is None:
            raise TrainingError(
                f"--resume: no {PREFIX_CHECKPOINT_DIR}-N directory in {output}; run without --resume first"
            )
        checkpoint = Path(last)
    else:
        checkpoint = Path(args.resume)
        if not checkpoint.is_dir():
            raise TrainingError(f"--resume {args.resume}: no such checkpoint directory")
    state = _checkpoint_state(checkpoint)
    if args.resume != "auto":
        _check_resume_target(checkpoint, output, args.overwrite)
    settings = state.get("stateful_callbacks", {}).get(RunSettingsCallback.__name__, {}).get("args", {})
    if settings.get("block_size", block_size) != block_size:
        raise TrainingError(
            f"--resume {checkpoint}: that run packed blocks of {settings['block_size']} tokens, "
            f"not {block_size}: pass "
            f"--block-size {settings['block_size']} to continue it, or start a new run in another --output"
        )
    if settings.get("bos", not args.no_bos) != (not args.no_bos):
        flag = "without --no-bos" if settings["bos"] else "with --no-bos"
        raise TrainingError(f"--resume {checkpoint}: that run packed its blocks {flag}: resume it the same way")
    step = state.get("global_step", 0)
    if args.max_steps is not None and step >= args.max_steps:
        raise TrainingError(
            f"--resume {checkpoint}: the run is already complete ({step} of --max-steps {args.max_steps} steps): "
            "raise --max-steps to train further"
        )
    return str(checkpoint)


def _check_resume_target(checkpoint: Path, output: Path, overwrite: bool) -> None:
    """Resuming run Y's checkpoint into an --output that holds another run X would overwrite X's later checkpoints
    and final model with Y's: only with --overwrite (which then deletes X's checkpoints first)."""
    if checkpoint.resolve().parent == output.resolve() or overwrite:
        return
    found = _holds_run(output)
    if found:
        shown = ", ".join(found[:4]) + (", ..." if len(found) > 4 else "")
        raise TrainingError(
            f"--output {output} holds another training run ({shown}) than the one --resume {checkpoint} continues: "
            f"resume into {checkpoint.parent} (the run it belongs to) or a new --output, or pass --overwrite to "
            f"replace the run in {output}"
        )


def _checkpoint_state(checkpoint: Path) -> dict:
    """The checkpoint's trainer_state.json, once its files are known to be complete (a checkpoint written while the
    run was killed can be empty or truncated)."""

    def incomplete(reason: str):
        if _step(checkpoint) < 0:  # not a checkpoint-N directory: maybe the user's own, never advise deleting it
            return TrainingError(
                f"--resume {checkpoint}: not a Trainer checkpoint ({reason}): pass a checkpoint-N directory"
            )
        earlier = [c for c in _checkpoints(checkpoint.parent) if 0 <= _step(c) < _step(checkpoint) and _complete(c)]
        hint = f"resume from {max(earlier, key=_step)} (--resume PATH)" if earlier else "start over with --overwrite"
        return TrainingError(f"--resume: {checkpoint} is incomplete ({reason}): delete it, or {hint}")

    problem = _incomplete(checkpoint)
    if problem:
        raise incomplete(problem)
    state = read_json(checkpoint / "trainer_state.json", error=TrainingError)
    if not isinstance(state, dict):
        raise incomplete("trainer_state.json holds no JSON object")
    return state


def _step(checkpoint: Path) -> int:
    prefix, _, step = checkpoint.name.rpartition("-")
    return int(step) if prefix == PREFIX_CHECKPOINT_DIR and step.isdigit() else -1


def _incomplete(checkpoint: Path) -> str | None:
    """Why a checkpoint cannot be resumed from, or None: its state, weights and optimizer files must be whole."""
    from safetensors import safe_open

    if not (checkpoint / "trainer_state.json").is_file():
        return "no trainer_state.json"
    try:
        json.loads((checkpoint / "trainer_state.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return "trainer_state.json is truncated or corrupt"
    weights = sorted(checkpoint.glob("*.safetensors"))
    if not weights:
        return "no model weights"
    for path in weights:
        try:
            with safe_open(path, framework="pt"):
                pass
        except Exception:
            return f"{path.name} is truncated or corrupt"
    for path in sorted(checkpoint.iterdir()):  # optimizer.pt, scheduler.pt, rng_state.pth: zip archives when whole
        if path.suffix in (".pt", ".pth") and not zipfile.is_zipfile(path):
            return f"{path.name} is truncated or corrupt"
    return None


def _complete(checkpoint: Path) -> bool:
    return _incomplete(checkpoint) is None


def model_source(args) -> adapters.Source:
    """MODEL resolved; for a PEFT adapter directory (a --lora run's output), its base is where the model loads from."""
    return adapters.resolve(args.model, getattr(args, "base", None), error=TrainingError)


def load_config(args):
    source = model_source(args)
    location, local = source.location, source.local
    if source.adapter is not None:
        continue_adapter(args, source)
    if local is not None:
        check_diff_checkpoint(local, error=TrainingError)  # also: a config.json that does not parse, or that lies
    try:
        config = AutoConfig.from_pretrained(location)
    except (OSError, ValueError, RecursionError) as error:
        raise TrainingError(f"cannot load a model config from {args.model!r}: {str(error).splitlines()[0]}") from None
    if config.model_type != "diff" and not args.any_model:
        raise TrainingError(
            f"{args.model} is a {config.model_type!r} checkpoint, not a Diff model: convert it first "
            f"(diff-transformer convert {args.model} OUT), "
            "or pass --any-model to train it as it is (e.g. as a baseline)"
        )
    return config


_LORA_OPTIONS = {"lora_r": "r", "lora_alpha": "lora_alpha", "lora_dropout": "lora_dropout"}


def continue_adapter(args, source: adapters.Source) -> None:
    """MODEL is an adapter: the run trains it further (LoRA implied), with its own settings; a --lora-* option that
    asks for other ones is refused rather than ignored."""
    lora = read_json(source.adapter / adapters.ADAPTER_CONFIG, error=TrainingError)
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


def report_targets(args) -> tuple[list[str] | str, str | None]:
    """(Trainer's `report_to`, a note for the console or None). By default TensorBoard when it is installed, else
    the console alone, with a note on how to get TensorBoard; an explicit `--report-to tensorboard` needs it."""
    if args.report_to is None:
        if installed("tensorboard") or installed("tensorboardX"):
            return ["tensorboard"], None
        return "none", f"TensorBoard logs are off: {missing(['tensorboard'], 'train', 'TensorBoard')}"
    if args.report_to in (["none"], []):
        return "none", None
    if "tensorboard" in args.report_to:
        require(["tensorboard"], "train", "--report-to tensorboard", error=TrainingError)
    return args.report_to, None


_RUN_FILES = ("trainer_state.json", "runs")  # what Trainer writes into every run's output directory
_MODEL_FILES = ("config.json", "adapter_config.json", SAFETENSORS_SINGLE, SAFETENSORS_INDEX)


def check_output(args) -> Path:
    """--output must not be the model (or overlap it), a file, or a model that is no training run (the final save
    would overwrite it) unless --overwrite."""
    _, local = resolve_model(args.model, error=TrainingError)
    source = model_source(args)
    sources = {"MODEL": local} if local else {}
    if source.adapter is not None and source.local is not None:
        sources["base model"] = source.local  # the adapter's base: never written either
    output = check_target(args.output, name="--output", sources=sources or None, error=TrainingError)
    if os.path.lexists(output) and not output.is_dir():
        raise TrainingError(f"--output {args.output} is a file: pass a directory (it is created if missing)")
    if output.is_dir() and not args.overwrite and not _holds_run(output):
        model = [name for name in _MODEL_FILES if (output / name).exists()]
        others = sorted(p.name for p in output.iterdir() if p.name != RUN_LOCK)
        if model:
            raise TrainingError(
                f"--output {output} holds a model ({model[0]}) that no training run wrote, and the final save would "
                "overwrite it: choose another --output, or pass --overwrite to replace it"
            )
        if others:  # the final save writes README.md, config.json, tokenizer files... over whatever is there
            shown = ", ".join(others[:4]) + (", ..." if len(others) > 4 else "")
            raise TrainingError(
                f"--output {output} holds files that no training run wrote ({shown}), which the run's files could "
                "overwrite: choose a new or empty --output, or pass --overwrite to write into it anyway"
            )
    return output


def check_args(args, config) -> int:
    """Validate the options that do not need the data; returns the block size."""
    context = getattr(config, "max_position_embeddings", None)
    block_size = (
        args.block_size if args.block_size is not None else min(DEFAULT_BLOCK_SIZE, context or DEFAULT_BLOCK_SIZE)
    )
    if block_size < 2:
        raise TrainingError(f"--block-size {block_size} must be at least 2")
    if context is not None and block_size > context:
        raise TrainingError(f"--block-size {block_size} exceeds the model's context ({context} positions): lower it")
    if args.warmup_steps is not None and args.warmup_ratio is not None:
        raise TrainingError("give --warmup-steps or --warmup-ratio, not both")
    if args.warmup_ratio is not None and not 0 <= args.warmup_ratio < 1:
        raise TrainingError(f"--warmup-ratio {args.warmup_ratio} must be in [0, 1)")
    for flag in ("batch_size", "grad_accum", "logging_steps", "save_steps"):
        if getattr(args, flag) < 1:
            raise TrainingError(f"--{flag.replace('_', '-')} must be at least 1")
    if args.max_steps is not None and args.max_steps < 1:
        raise TrainingError("--max-steps must be at least 1")
    if args.eval_steps is not None and args.eval_steps < 1:
        raise TrainingError("--eval-steps must be at least 1 (--eval-fraction 0 turns evaluation off)")
    for flag, value in (("lr", args.lr), ("weight_decay", args.weight_decay), ("max_grad_norm", args.max_grad_norm)):
        if not (math.isfinite(value) and value >= 0):
            raise TrainingError(f"--{flag.replace('_', '-')} {value} must be a finite number >= 0")
    if not (math.isfinite(args.epochs) and args.epochs > 0):
        raise TrainingError(f"--epochs {args.epochs} must be a finite number > 0")
    if args.lora:
        require(["peft"], "train", "--lora", error=TrainingError)
    report_targets(args)
    if args.lora and not 0 <= args.lora_dropout < 1:
        raise TrainingError(f"--lora-dropout {args.lora_dropout} must be in [0, 1)")
    if args.diff_only_steps < 0:
        raise TrainingError("--diff-only-steps must be >= 0")
    if args.diff_only_steps and config.model_type != "diff":
        raise TrainingError("--diff-only-steps needs a Diff model")
    if args.lambda_warmup_steps < 0:
        raise TrainingError("--lambda-warmup-steps must be >= 0")
    if args.lambda_warmup_steps and config.model_type != "diff":
        raise TrainingError("--lambda-warmup-steps needs a Diff model (it ramps in differential attention's λ)")
    if args.lambda_warmup_steps and args.max_steps is not None and args.lambda_warmup_steps > args.max_steps:
        raise TrainingError(
            f"--lambda-warmup-steps {args.lambda_warmup_steps} exceeds --max-steps {args.max_steps}: the ramp must "
            "end before the run does, or the saved model is not the one trained; lower it"
        )
    if args.diff_only_steps and args.lora:
        raise TrainingError("--diff-only-steps and --lora do not combine (LoRA already trains only adapters and λ)")
    _check_ranges(args)
    if args.report_to is not None:  # None: TensorBoard if installed (report_targets)
        _check_report_to(args.report_to)
    if args.load_in_4bit:
        if not args.lora:
            raise TrainingError("--load-in-4bit needs --lora (4-bit weights cannot be trained directly)")
        require(["bitsandbytes"], "qlora", "--load-in-4bit", error=TrainingError)
    return block_size


_SEED_MAX = 2**32 - 1  # numpy's seed range (Trainer seeds numpy, random and torch alike)


def _check_ranges(args) -> None:
    """The numeric options check_args does not cover, each refused with its range before anything loads."""
    if args.warmup_steps is not None and args.warmup_steps < 0:
        raise TrainingError(f"--warmup-steps {args.warmup_steps} must be >= 0")
    if not 0 <= args.seed <= _SEED_MAX:
        raise TrainingError(f"--seed {args.seed} must be in [0, {_SEED_MAX}]")
    if args.eval_batch_size is not None and args.eval_batch_size < 1:
        raise TrainingError(f"--eval-batch-size {args.eval_batch_size} must be at least 1")
    if args.save_total_limit is not None and args.save_total_limit < 1:
        raise TrainingError(f"--save-total-limit {args.save_total_limit} must be at least 1 (omit it to keep all)")
    if not (math.isfinite(args.eval_fraction) and 0 <= args.eval_fraction < 1):
        raise TrainingError(f"--eval-fraction {args.eval_fraction} must be in [0, 1)")
    if args.lora and (args.lora_r < 1 or args.lora_alpha < 1):
        raise TrainingError(f"--lora-r {args.lora_r} and --lora-alpha {args.lora_alpha} must be at least 1")


# --report-to name -> (module that makes it available, what to install)
_REPORTERS = {
    "azure_ml": ("azureml", "azureml-core"),
    "comet_ml": ("comet_ml", "comet_ml"),
    "mlflow": ("mlflow", "mlflow"),
    "neptune": ("neptune", "neptune"),
    "tensorboard": ("tensorboard", "tensorboard"),
    "trackio": ("trackio", "trackio"),
    "wandb": ("wandb", "wandb"),
    "codecarbon": ("codecarbon", "codecarbon"),
    "clearml": ("clearml", "clearml"),
    "dagshub": ("dagshub", "dagshub"),
    "flyte": ("flytekit", "flytekit"),
    "dvclive": ("dvclive", "dvclive"),
    "swanlab": ("swanlab", "swanlab"),
    "kubeflow": ("kubeflow", "kubeflow-training"),
}


def _check_report_to(names: list[str]) -> None:
    """Every --report-to integration is one transformers knows and is installed (else: its install line)."""
    from transformers.integrations.integration_utils import (
        INTEGRATION_TO_CALLBACK,
        get_available_reporting_integrations,
    )

    if names in (["none"], ["all"], []):
        return
    available = set(get_available_reporting_integrations())
    for name in names:
        if name in ("none", "all"):
            raise TrainingError(f"--report-to {name} cannot be combined with other names: pass it alone")
        if name not in INTEGRATION_TO_CALLBACK:
            known = ", ".join(sorted(INTEGRATION_TO_CALLBACK))
            raise TrainingError(f"--report-to {name} is not an integration transformers knows: use none, all, {known}")
        module, package = _REPORTERS.get(name, (name, name))
        if name not in available and importlib.util.find_spec(module) is None:
            raise TrainingError(
                f"--report-to {name} needs {package}, which is not installed: pip install {package} "
                "(or pass --report-to none)"
            )


def use_bf16(choice: str) -> bool:
    if choice == "auto":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return choice == "on"


def load_model(args, training_args):
    kwargs = {"dtype": getattr(torch, args.dtype)}
    if args.attn_implementation:
        kwargs["attn_implementation"] = args.attn_implementation
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
    source = model_source(args)
    if source.adapter is not None:  # an adapter trained further: its base, its LoRA weights (trainable)
        return adapters.load(source, trainable=True, prepare=lambda base: _prepare_4bit(base, args), **kwargs)
    model = load_causal_lm(args.model, error=TrainingError, **kwargs)
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
        target_modules=args.lora_target_modules,
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
        raise TrainingError(f"LoRA: {str(error).splitlines()[0]}") from None


def training_arguments(args, has_eval: bool, resuming: bool) -> TrainingArguments:
    bf16 = use_bf16(args.bf16)
    warmup = args.warmup_ratio if args.warmup_ratio is not None else (args.warmup_steps or 0)
    report_to, _ = report_targets(args)
    return TrainingArguments(
        output_dir=args.output,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.eval_batch_size or args.batch_size,
        gradient_accumulation_steps=args.grad_accum,
        learning_rate=args.lr,
        lr_scheduler_type=args.lr_scheduler,
        warmup_steps=warmup,  # Trainer reads a float in [0, 1) as a ratio of all steps
        weight_decay=args.weight_decay,
        max_grad_norm=args.max_grad_norm,
        max_steps=args.max_steps or -1,
        num_train_epochs=args.epochs,
        bf16=bf16,
        # Without an accelerator Trainer must be told it runs on CPU, or it neither allows bf16 autocast nor sets up
        # DDP under torchrun (it would train one independent copy per process).
        use_cpu=not torch.accelerator.is_available(),
        activation_checkpointing=args.gradient_checkpointing or None,
        logging_steps=args.logging_steps,
        logging_first_step=True,
        eval_strategy="steps" if has_eval and args.eval_steps else "no",
        eval_steps=args.eval_steps,
        eval_on_start=has_eval and args.eval_on_start and not resuming,
        save_strategy="steps",
        save_steps=args.save_steps,
        save_total_limit=args.save_total_limit,
        seed=args.seed,
        report_to=report_to,
        disable_tqdm=args.quiet,
        # Frozen parameters get no gradient during --diff-only-steps, so DDP must look for them; otherwise every
        # parameter gets one and the search (an extra graph traversal per step) is wasted.
        ddp_find_unused_parameters=bool(args.diff_only_steps),
        remove_unused_columns=False,
        dataloader_pin_memory=torch.cuda.is_available(),
    )


class PreparedRun(NamedTuple):
    """What `build_trainer` prepares for `run`."""

    trainer: CausalLMTrainer
    resume: str | None  # the checkpoint to resume from; None: start
    block_size: int


def build_trainer(args) -> PreparedRun:
    """Everything `run` needs, without training: the Trainer (model, data, callbacks) for `args`, the checkpoint it
    resumes from and the block size."""
    config = load_config(args)
    block_size = check_args(args, config)
    check_output(args)
    resume = resolve_resume(args, block_size)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_source(args).tokenizer)
    except (OSError, ValueError, TypeError) as error:
        raise TrainingError(f"{args.model} has no usable tokenizer ({str(error).splitlines()[0]})") from None
    set_seed(args.seed)  # before the model: LoRA's initialisation draws random numbers
    train_data, eval_data = build_datasets(
        tokenizer,
        args.data,
        block_size,
        eval_data=args.eval_data,
        eval_fraction=args.eval_fraction,
        text_field=args.text_field,
        bos=not args.no_bos,
    )
    training_args = training_arguments(args, eval_data is not None, resume is not None)
    model = load_model(args, training_args)
    foreign = resume is not None and Path(resume).resolve().parent != Path(args.output).resolve()
    # Only once the model has loaded: a failed start keeps the old run.
    if args.overwrite and (resume is None or foreign):
        with training_args.main_process_first(desc="removing old checkpoints"):
            if training_args.process_index == 0:
                for old in _checkpoints(Path(args.output)):
                    shutil.rmtree(old)

    callbacks = [RunSettingsCallback(block_size, bos=not args.no_bos)]
    callbacks += [DiffOnlyCallback(model, args.diff_only_steps)] if args.diff_only_steps else []
    callbacks += [AdapterCardCallback(model_source(args).base or args.model, model.config)] if args.lora else []
    trainer = CausalLMTrainer(
        model=model,
        args=training_args,
        train_dataset=train_data,
        eval_dataset=eval_data,
        processing_class=tokenizer,
        callbacks=callbacks,
    )
    # First in line, so the λ values it adds to a log reach TensorBoard and the progress bar in the same call.
    trainer.callback_handler.callbacks.insert(0, LambdaLoggingCallback(model))
    console_logs(trainer)  # the console shows one λ summary; TensorBoard and log_history keep every layer
    if args.lambda_warmup_steps:
        trainer.callback_handler.callbacks.insert(0, LambdaWarmupCallback(model, args.lambda_warmup_steps))
    return PreparedRun(trainer, resume, block_size)


class AdapterCardCallback(TrainerCallback):
    """The adapter's card (`adapters.adapter_card`) in every checkpoint of a LoRA run, in place of the blank template
    PEFT writes there: a checkpoint is an adapter directory too (`generate`, `merge` take it)."""

    def __init__(self, base: str, config):
        self.base, self.config = base, config

    def on_save(self, args, state, control, **kwargs):
        checkpoint = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        if state.is_world_process_zero and adapters.is_adapter(checkpoint):
            summary = last_lambda_summary(state.log_history)
            adapters.write_adapter_card(checkpoint, self.base, self.config, summary)


def run(args) -> int:
    from ..safe_output import OutputLock

    output = check_output(args)  # before the lock creates --output
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun the main process holds the lock for every rank
        return _run(args)
    with OutputLock(output, name="--output", error=TrainingError):
        return _run(args)


def _run(args) -> int:
    trainer, resume, block_size = build_trainer(args)
    main = trainer.is_world_process_zero()
    model, train_data, eval_data = trainer.model, trainer.train_dataset, trainer.eval_dataset
    if main:
        _, note = report_targets(args)
        if note:
            print(note, flush=True)
        n_params = sum(p.numel() for p in model.parameters())
        n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
        world = trainer.args.world_size
        print(
            f"model: {type(model).__name__} from {args.model}, {n_params:,} parameters ({n_train:,} trainable)\n"
            f"data: {len(train_data):,} training blocks of {block_size} tokens"
            + (f", {len(eval_data):,} held out" if eval_data is not None else ", no evaluation")
            + f"; {args.batch_size} x {args.grad_accum} accumulation x {world} process(es) = "
            f"{args.batch_size * args.grad_accum * world} blocks per step"
            + (f"\nresuming from {resume}" if resume else ""),
            flush=True,
        )
    start = _checkpoint_state(Path(resume)).get("global_step", 0) if resume else 0
    result = trainer.train(resume_from_checkpoint=resume)
    trainer.save_model(args.output)  # model (or LoRA adapter) + tokenizer, main process only
    if main and args.lora:  # PEFT wrote its blank template as README.md: the adapter's own card replaces it
        base = model_source(args).base or args.model
        adapters.write_adapter_card(args.output, base, model.config, last_lambda_summary(trainer.state.log_history))
    trainer.save_metrics("train", result.metrics)
    metrics = trainer.evaluate() if eval_data is not None else {}
    if metrics:
        trainer.save_metrics("eval", metrics)
    trainer.save_state()
    if main:
        done = result.global_step - start  # this run's steps: a resumed run starts at its checkpoint's step
        line = f"done: {done} step{'' if done == 1 else 's'}"
        if start:
            line += f" (step {start + 1}" + ("" if done == 1 else f" to {result.global_step}") + ", resumed)"
        line += f", mean training loss of this run {result.training_loss:.4f}"
        if metrics:
            line += f"; held-out loss {metrics['eval_loss']:.4f}, perplexity {metrics['eval_perplexity']:.3f}"
        print(line + f"\nsaved to {args.output}", flush=True)
    return 0


_DISK_ERRORS = (errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.EDQUOT)


def run_cli(args) -> int:
    """`run`, with a bad option or input reported as one line on stderr and exit status 2 (and no empty --output
    directory left behind)."""
    existed = os.path.lexists(args.output) if args.output else True
    try:
        return run(args)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        if not existed:
            try:
                os.rmdir(args.output)
            except OSError:
                pass
        return 2
    except OSError as error:
        inside = error.filename is None or Path(os.fsdecode(error.filename)).absolute().is_relative_to(
            Path(args.output).absolute()
        )
        if error.errno not in _DISK_ERRORS or not inside:  # not a write into --output: a bug, with its traceback
            raise
        # The disk filled up or turned read-only during the run: the last complete checkpoint is resumable.
        print(
            f"error: writing {error.filename or args.output} failed ({error.strerror}): free space or fix the "
            f"permissions, then continue with --resume",
            file=sys.stderr,
        )
        return 2


def main(argv=None) -> int:
    return run_cli(parse_train_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
