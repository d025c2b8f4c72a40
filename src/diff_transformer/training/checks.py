"""The options of `diff-transformer train`, checked before anything loads: ranges, combinations, the integrations
--report-to names, and an --output that the run may write into (never the model, nor files no run wrote)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from ..checkpoints.adapters import Source
from ..checkpoints.weights import SAFETENSORS_INDEX, SAFETENSORS_SINGLE
from ..errors import installed, missing, require
from ..outputs.files import check_target, refuse_links
from ..outputs.staging import LOADER_READS, _matches, _shown, ours, refuse_users_entries, users_entries
from . import TrainingError
from .args import check_option_values
from .resume import holds_run


DEFAULT_BLOCK_SIZE = 1024


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
        require(["tensorboard"], "train", "--report-to tensorboard")
    return args.report_to, None


# What a run writes at the top of --output (Trainer, save_pretrained, PEFT, this package's callbacks), as patterns:
# a user's entry of such a name is refused under --overwrite (a name decides a refusal, never a deletion). Not
# `runs/`: TensorBoard only adds new files of unique names inside it.
TRAIN_WRITES = (
    *LOADER_READS,
    "README.md",
    "configuration_diff.py",
    "modeling_diff.py",
    "training_args.bin",
    "trainer_state.json",
    "*_results.json",
    "checkpoint-[0-9]*",  # Trainer writes into checkpoint-N (and `--resume auto` reads the last one) whoever made it
)
_MODEL_FILES = ("config.json", "adapter_config.json", SAFETENSORS_SINGLE, SAFETENSORS_INDEX)


def check_output(args, source: Source) -> Path:
    """--output must not be the model SOURCE (or overlap it), a file, or a model that is no training run (the final
    save would overwrite it) unless --overwrite."""
    local = source.adapter or source.local  # what MODEL names: the adapter directory, or the model's
    sources = {"MODEL": local} if local else {}
    if source.adapter is not None and source.local is not None:
        sources["base model"] = source.local  # the adapter's base: never written either
    output = check_target(args.output, name="--output", sources=sources or None)
    if output.is_symlink():  # the run would write wherever it points, and --overwrite delete there
        raise TrainingError(
            f"--output {args.output} is a symbolic link: pass the directory it points to, or another path"
        )
    if os.path.lexists(output) and not output.is_dir():
        raise TrainingError(f"--output {args.output} is a file: pass a directory (it is created if missing)")
    refuse_links(output, name="--output")  # before anything loads: Trainer's files would be written through one
    if output.is_dir() and args.overwrite:
        # The run writes in place: of what no run provably wrote, what it would write over (or read as part of the
        # model beside its own files) is refused by name; the rest stays where it is, untouched.
        refuse_users_entries(output, [n for n in users_entries(output) if _matches(n, TRAIN_WRITES)], name="--output")
    if output.is_dir() and not args.overwrite and not holds_run(output):
        model = [name for name in _MODEL_FILES if (output / name).exists()]
        bookkeeping = ours(output)  # a record left by a run killed before its first save, say: not the user's
        others = sorted(p.name for p in output.iterdir() if p.name not in bookkeeping)
        if model:
            raise TrainingError(
                f"--output {output} holds a model ({model[0]}) that no training run wrote, and the final save would "
                "overwrite it: choose another --output, or pass --overwrite to replace it"
            )
        written = [name for name in others if _matches(name, TRAIN_WRITES)]
        if written:  # the final save writes README.md, config.json, tokenizer files...: --overwrite refuses them too
            raise TrainingError(
                f"--output {output} holds {_shown(written, 4)}, which no training run wrote and the run writes: move "
                "them out of it, or choose a new or empty --output"
            )
        if others:
            raise TrainingError(
                f"--output {output} holds files that no training run wrote ({_shown(others, 4)}): choose a new or "
                "empty --output, or pass --overwrite to train beside them (they stay untouched)"
            )
    return output


def check_args(args, config) -> int:
    """Validate the options that do not need the data; returns the block size. Those that need no model either were
    checked before torch loaded (`args.check_option_values`) and are checked again here, for callers of `run`."""
    check_option_values(args)
    context = getattr(config, "max_position_embeddings", None)
    block_size = (
        args.block_size if args.block_size is not None else min(DEFAULT_BLOCK_SIZE, context or DEFAULT_BLOCK_SIZE)
    )
    if block_size < 2:
        raise TrainingError(f"--block-size {block_size} must be at least 2")
    if context is not None and block_size > context:
        raise TrainingError(f"--block-size {block_size} exceeds the model's context ({context} positions): lower it")
    if args.lora:
        require(["peft"], "train", "--lora")
    report_targets(args)
    if args.diff_only_steps and config.model_type != "diff":
        raise TrainingError("--diff-only-steps needs a Diff model")
    if args.lambda_warmup_steps and config.model_type != "diff":
        raise TrainingError("--lambda-warmup-steps needs a Diff model (it ramps in differential attention's λ)")
    if args.lambda_warmup_steps and config.diff_version == 2 and getattr(config, "conversion", None):
        print(  # a choice, not an error (the ramp still trains), but it gives up the conversion's exact start
            "note: --lambda-warmup-steps on a converted V2: its first steps use λ x 0, not the λ its exact start "
            "needs, so the run does not begin from the source model's function",
            file=sys.stderr,
            flush=True,
        )
    if args.report_to is not None:  # None: TensorBoard if installed (report_targets)
        _check_report_to(args.report_to)
    if args.load_in_4bit:
        require(["bitsandbytes"], "qlora", "--load-in-4bit")
    if args.compile_backend is not None:
        _check_compile_backend(args.compile_backend)
    return block_size


def _check_compile_backend(name: str) -> None:
    """A backend torch has registered and accelerate's `DynamoBackend` names (Trainer compiles through accelerate,
    which refuses any other name with a ValueError of its own)."""
    import torch._dynamo
    from accelerate.utils import DynamoBackend

    usable = name.upper() in DynamoBackend.__members__ and name.upper() != "NO"
    if not usable or name not in torch._dynamo.list_backends(exclude_tags=()):
        raise TrainingError(
            f"--compile-backend {name} is not a torch.compile backend: use inductor (the default), aot_eager, eager "
            "or cudagraphs, or a name that torch._dynamo.list_backends() lists"
        )


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
