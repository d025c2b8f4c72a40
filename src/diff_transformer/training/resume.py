"""Which Trainer checkpoints an --output holds, whether each is complete, and which one `--resume` continues (checked
to continue this run as configured). Only checkpoint-N directories that Trainer wrote count: a user's own
`checkpoint-mynotes/` or `checkpoint-3/` of other files is neither counted nor ever deleted. `--save-total-limit`
rotates only the checkpoints the run record proves a run wrote (`RecordCheckpointCallback`, `rotate_checkpoints`)."""

from __future__ import annotations

import json
import shutil
import sys
import zipfile
from pathlib import Path

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from ..checkpoints.configs import read_json
from ..checkpoints.weights import SAFETENSORS_INDEX, SAFETENSORS_SINGLE
from ..outputs.records import forget_entry, proven, record_entry, record_flag, recorded
from ..outputs.staging import _shown
from ..text_input import whole_number
from . import TrainingError
from .callbacks import RunSettingsCallback
from .parallel import SHARDED_DIR, is_sharded_checkpoint, sharded_shapes


_RUN_FILES = ("trainer_state.json", "runs")  # what Trainer writes into every run's output directory


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
    SHARDED_DIR,
)


def trainer_checkpoints(output: Path) -> list[Path]:
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


CHECKPOINTS_RECORDED = "checkpoints-recorded"  # a run-record flag: this --output's checkpoints are in its record


class RecordCheckpointCallback(TrainerCallback):
    """Each checkpoint this run saves goes into the run record (`outputs.records.record_entry`, with the hashes of its
    files) as soon as it is complete: the proof that lets this run's rotation, a resumed run's, or a later --overwrite
    delete it, and nothing else. The record also says that it records checkpoints (`old_checkpoints`)."""

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            record_flag(args.output_dir, CHECKPOINTS_RECORDED)

    def on_save(self, args, state, control, **kwargs):
        checkpoint = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        if state.is_world_process_zero and checkpoint.is_dir() and not checkpoint.is_symlink():
            record_entry(checkpoint.parent, checkpoint.name)


def old_checkpoints(output: Path) -> list[Path]:
    """The checkpoints of an earlier run that --overwrite would delete without its run record's proof: none. A
    Trainer checkpoint that no record proves (a run from before checkpoints were recorded, a user's `checkpoint-0/`)
    is refused by name before the run starts (`checks.check_output`), never deleted by its name; the record's proven
    ones go with `outputs.records.remove_recorded`."""
    return []


def rotate_checkpoints(output: Path, limit: int, newest: Path, best: str | None = None) -> list[str]:
    """`--save-total-limit`: keep at most LIMIT of the run's checkpoints in OUTPUT, deleting the oldest (by step)
    first. Only checkpoints the run record lists count, and one is deleted only while its files still hash as
    recorded (one the user changed is theirs now: it is dropped from the record and kept). NEWEST (just saved, not yet
    recorded) and BEST are never deleted. Anything else named checkpoint-* (a user's `checkpoint-0/`) is never
    considered. Returns the names deleted."""
    keep = {newest.name} | ({Path(best).name} if best and Path(best).parent == output else set())
    ours = sorted(
        (name for name in recorded(output) if _step(output / name) >= 0 and name not in keep),
        key=lambda name: _step(output / name),
    )
    excess = len(ours) + len(keep) - limit
    deleted = []
    for name in ours:
        if excess <= 0:
            break
        excess -= 1  # deleted, or no longer counted as the run's
        if proven(output, name):
            shutil.rmtree(output / name)
            deleted.append(name)
        forget_entry(output, name)
    return deleted


def holds_run(output: Path) -> list[str]:
    """What shows that `output` holds a training run: its checkpoints, or the files a finished run leaves."""
    found = [path.name for path in trainer_checkpoints(output)]
    found += [name for name in _RUN_FILES if (output / name).exists()]
    return found


def resolve_resume(args, block_size: int) -> str | None:
    """The checkpoint to resume from (None: start), checked to be complete and to continue this run as configured."""
    output = Path(args.output)
    if args.resume is None:
        if trainer_checkpoints(output) and not args.overwrite:
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
    state = checkpoint_state(checkpoint)
    if args.resume != "auto":
        _check_resume_target(checkpoint, output, args.overwrite)
    settings = state.get("stateful_callbacks", {}).get(RunSettingsCallback.__name__, {}).get("args", {})
    if settings.get("block_size", block_size) != block_size:
        raise TrainingError(
            f"--resume {checkpoint}: that run packed blocks of {settings['block_size']} tokens, "
            f"not {block_size}: pass "
            f"--block-size {settings['block_size']} to continue it, or start a new run in another --output"
        )
    chat = bool(getattr(args, "chat_data", None))
    if settings.get("chat", False) != chat:
        trained, given = ("--chat-data", "--data") if settings["chat"] else ("--data", "--chat-data")
        raise TrainingError(
            f"--resume {checkpoint}: that run trained on {trained}, not {given}: resume it the same way"
        )
    if settings.get("bos", not args.no_bos) != (not args.no_bos):
        flag = "without --no-bos" if settings["bos"] else "with --no-bos"
        raise TrainingError(f"--resume {checkpoint}: that run packed its blocks {flag}: resume it the same way")
    changed = _changed_run(settings.get("run"), run_identity(args))
    # Trainer resumes with any data and batch: said, not refused (more data, or a larger batch, is a choice)
    if changed:
        print(
            f"note: --resume {checkpoint} continues a run that had other {changed}: it goes on from the checkpoint, "
            "but is no longer the run the checkpoint was part of (a changed held-out split may train on blocks held "
            "out before)",
            file=sys.stderr,
            flush=True,
        )
    step = state.get("global_step", 0)
    if args.max_steps is not None and step >= args.max_steps:
        raise TrainingError(
            f"--resume {checkpoint}: the run is already complete ({step} of --max-steps {args.max_steps} steps): "
            "raise --max-steps to train further"
        )
    return str(checkpoint)


def run_identity(args) -> dict:
    """What makes a run the same run beside its blocks: the data files (names and sizes: cheap at any size), the
    held-out split, the global batch (per-device batch x accumulation x processes: resharding keeps it), the seed."""
    from .parallel import world_sizes

    def files(paths):
        return [[Path(p).name, Path(p).stat().st_size if Path(p).is_file() else None] for p in paths or []]

    data = getattr(args, "chat_data", None) or args.data
    return {
        "data": files(data),
        "eval_data": files(args.eval_data),
        "eval_fraction": None if args.eval_data else args.eval_fraction,
        "global_batch": args.batch_size * args.grad_accum * world_sizes()[0],
        "seed": args.seed,
    }


_RUN_NAMES = {  # run_identity's keys as the user sets them
    "data": "--data files",
    "eval_data": "--eval-data files",
    "eval_fraction": "--eval-fraction",
    "global_batch": "global batch (--batch-size x --grad-accum x processes)",
    "seed": "--seed",
}


def _changed_run(saved, now: dict) -> str:
    """The settings of NOW that differ from the SAVED run's (nothing for a checkpoint from before they were saved)."""
    if not isinstance(saved, dict):
        return ""
    changed = [
        f"{_RUN_NAMES[key]} ({saved[key]!r}, now {now[key]!r})"
        for key in now
        if key in saved and saved[key] != now[key]
    ]
    return "; ".join(changed)


def _check_resume_target(checkpoint: Path, output: Path, overwrite: bool) -> None:
    """Resuming run Y's checkpoint into an --output that holds another run X would overwrite X's later checkpoints
    and final model with Y's: only with --overwrite (which then deletes X's checkpoints first)."""
    if checkpoint.resolve().parent == output.resolve() or overwrite:
        return
    found = holds_run(output)
    if found:
        shown = _shown(found, 4)
        raise TrainingError(
            f"--output {output} holds another training run ({shown}) than the one --resume {checkpoint} continues: "
            f"resume into {checkpoint.parent} (the run it belongs to) or a new --output, or pass --overwrite to "
            f"replace the run in {output}"
        )


def checkpoint_state(checkpoint: Path) -> dict:
    """The checkpoint's trainer_state.json, once its files are known to be complete (a checkpoint written while the
    run was killed can be empty or truncated)."""

    def incomplete(reason: str):
        if _step(checkpoint) < 0:  # not a checkpoint-N directory: maybe the user's own, never advise deleting it
            return TrainingError(
                f"--resume {checkpoint}: not a Trainer checkpoint ({reason}): pass a checkpoint-N directory"
            )
        earlier = [
            c for c in trainer_checkpoints(checkpoint.parent) if 0 <= _step(c) < _step(checkpoint) and _complete(c)
        ]
        hint = f"resume from {max(earlier, key=_step)} (--resume PATH)" if earlier else "start over with --overwrite"
        return TrainingError(f"--resume: {checkpoint} is incomplete ({reason}): delete it, or {hint}")

    problem = _incomplete(checkpoint)
    if problem:
        raise incomplete(problem)
    state = read_json(checkpoint / "trainer_state.json")
    if not isinstance(state, dict):
        raise incomplete("trainer_state.json holds no JSON object")
    problem = _state_problem(state)
    if problem:
        raise TrainingError(
            f"--resume: {checkpoint / 'trainer_state.json'} is corrupt ({problem}): restore it from a copy of the "
            "run, or resume from another checkpoint (--resume PATH)"
        )
    return state


# trainer_state.json fields (transformers.TrainerState) and what Trainer needs them to be: a wrong type fails deep in
# Trainer (a string global_step in a comparison, a list of stateful_callbacks in a .get), so it is refused here.
# global_step is compared and counted with (an int); the other counts only need to be numbers (or null where Trainer
# leaves them unset), as the versions of Trainer that wrote them may store some as floats.
_INT_FIELDS = ("global_step",)
_OPTIONAL_INT_FIELDS = ("best_global_step",)
_NUMBER_FIELDS = ("epoch", "total_flos", "max_steps", "logging_steps", "save_steps", "num_train_epochs")
_NUMBER_FIELDS += ("num_input_tokens_seen",)
_OPTIONAL_NUMBER_FIELDS = ("eval_steps", "train_batch_size", "best_metric")


def _state_problem(state: dict) -> str | None:
    """What is wrong with a trainer_state.json's fields, or None."""

    def shown(value):
        text = json.dumps(value)
        return text if len(text) <= 40 else text[:37] + "..."

    def is_int(value):
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0

    for key in _INT_FIELDS:
        if key in state and not is_int(state[key]):
            return f"{key} is {shown(state[key])}, not a whole number >= 0"
    for key in _OPTIONAL_INT_FIELDS:
        if state.get(key) is not None and not is_int(state[key]):
            return f"{key} is {shown(state[key])}, not a whole number >= 0 or null"
    for key in _NUMBER_FIELDS:
        value = state.get(key)
        if key in state and (isinstance(value, bool) or not isinstance(value, (int, float))):
            return f"{key} is {shown(value)}, not a number"
    for key in _OPTIONAL_NUMBER_FIELDS:
        value = state.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            return f"{key} is {shown(value)}, not a number or null"
    if state.get("best_model_checkpoint") is not None and not isinstance(state["best_model_checkpoint"], str):
        return f"best_model_checkpoint is {shown(state['best_model_checkpoint'])}, not a path or null"
    history = state.get("log_history", [])
    if not isinstance(history, list) or not all(isinstance(entry, dict) for entry in history):
        return "log_history is not a list of objects"
    callbacks = state.get("stateful_callbacks", {})
    if not isinstance(callbacks, dict):
        return f"stateful_callbacks is {shown(callbacks)}, not an object"
    for name, saved in callbacks.items():
        for entry in saved if isinstance(saved, list) else [saved]:
            if not isinstance(entry, dict) or not isinstance(entry.get("args", {}), dict):
                return f"stateful_callbacks.{name} is {shown(saved)}, not an object with args"
    return None


def check_checkpoint_fits(checkpoint, model, lora: bool, sharded: bool = False) -> None:
    """`--resume CHECKPOINT` holds what this run trains: an adapter for a --lora run, a full model otherwise, with the
    parameters (names and shapes) of MODEL. Trainer would stop in a traceback on a shape, or silently leave a
    parameter it does not find untrained from the checkpoint (a V1 checkpoint resumed into a V2 model)."""
    from ..checkpoints import adapters

    checkpoint = Path(checkpoint)
    if is_sharded_checkpoint(checkpoint) != sharded:
        kind, fix = (
            ("sharded (DCP, from --parallelism fsdp/hsdp/tp)", "a sharded --parallelism on 2 or more processes")
            if not sharded
            else ("whole (from --parallelism ddp or one process)", "--parallelism ddp")
        )
        raise TrainingError(f"--resume {checkpoint} is a {kind} checkpoint: resume it with {fix}")
    is_adapter = (checkpoint / adapters.ADAPTER_CONFIG).is_file()
    if is_adapter:
        adapters.read_adapter_config(checkpoint)
    if is_adapter and not lora:
        raise TrainingError(
            f"--resume {checkpoint} is a checkpoint of a LoRA adapter ({adapters.ADAPTER_CONFIG}), but this run "
            "trains the full model: resume it with --lora and the LoRA options it was trained with, or pass a "
            "checkpoint of a full-model run"
        )
    if lora and not is_adapter:
        raise TrainingError(
            f"--resume {checkpoint} is a checkpoint of a full-model run (no {adapters.ADAPTER_CONFIG}), but this run "
            "trains a LoRA adapter (--lora, or MODEL an adapter): resume it without --lora, or pass a checkpoint of "
            "a --lora run"
        )
    tied = set()
    if is_adapter:
        from peft import get_peft_model_state_dict

        expected = {key: tuple(value.shape) for key, value in get_peft_model_state_dict(model).items()}
    else:
        tied = set(getattr(model, "all_tied_weights_keys", None) or {})
        expected = {key: tuple(value.shape) for key, value in model.state_dict().items() if key not in tied}
    stored = sharded_shapes(checkpoint) if sharded else _stored_shapes(checkpoint)
    missing = sorted(set(expected) - set(stored))
    unexpected = sorted(set(stored) - set(expected) - tied)
    wrong = sorted(key for key in set(expected) & set(stored) if expected[key] != stored[key])
    if not (missing or unexpected or wrong):
        return
    if wrong:
        key = wrong[0]
        detail = f"{key} is {list(stored[key])} there, {list(expected[key])} in this model"
    elif missing:
        detail = f"{len(missing)} of this model's parameters are not in it, e.g. {missing[0]}"
    else:
        detail = f"{len(unexpected)} of its tensors are not in this model, e.g. {unexpected[0]}"
    versions = _diff_versions(checkpoint, model)
    raise TrainingError(
        f"--resume {checkpoint} does not fit this model ({detail}{versions}): resume with the MODEL and options the "
        "run was started with, or start a new run in another --output"
    )


def _stored_shapes(checkpoint: Path) -> dict[str, tuple]:
    """name -> shape of every tensor in the checkpoint's safetensors files (headers only)."""
    from safetensors import safe_open

    shapes = {}
    for path in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(path, framework="pt") as handle:
            for key in handle.keys():
                shapes[key] = tuple(handle.get_slice(key).get_shape())
    return shapes


def _diff_versions(checkpoint: Path, model) -> str:
    """ "; a V1 checkpoint, a V2 model" where the checkpoint's config.json and the model differ in diff_version."""
    config = getattr(model, "config", None)
    try:
        theirs = (
            read_json(checkpoint / "config.json").get("diff_version")
            if (checkpoint / "config.json").is_file()
            else None
        )
    except Exception:
        return ""
    ours = getattr(config, "diff_version", None)
    if theirs is not None and ours is not None and theirs != ours:
        return f"; a Diff V{theirs} checkpoint, a V{ours} model"
    return ""


def _step(checkpoint: Path) -> int:
    prefix, _, step = checkpoint.name.rpartition("-")
    number = whole_number(step) if prefix == PREFIX_CHECKPOINT_DIR else None
    return -1 if number is None else number


def _incomplete(checkpoint: Path) -> str | None:
    """Why a checkpoint cannot be resumed from, or None: its state, weights and optimizer files must be whole."""
    from safetensors import safe_open

    if not (checkpoint / "trainer_state.json").is_file():
        return "no trainer_state.json"
    try:
        json.loads((checkpoint / "trainer_state.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return "trainer_state.json is truncated or corrupt"
    sharded = is_sharded_checkpoint(checkpoint)
    if sharded and not (checkpoint / "optimizer_param_groups.json").is_file():
        return "no optimizer_param_groups.json beside its sharded weights"
    weights = sorted((checkpoint / SHARDED_DIR if sharded else checkpoint).glob("*.safetensors"))
    if not weights:
        return "no model weights"
    for path in weights:
        try:
            with safe_open(path, framework="pt"):
                pass
        except Exception:
            return f"{path.name} is truncated or corrupt"
    # Trainer resumes without a missing optimizer.pt, scheduler.pt or rng_state (fresh Adam moments, the schedule
    # from its start): a different run than the one saved, so they must all be there (a sharded run's moments are
    # under sharded/, beside optimizer_param_groups.json)
    needed = ["scheduler.pt"] if sharded else ["optimizer.pt", "scheduler.pt"]
    missing = [name for name in needed if not (checkpoint / name).is_file()]
    missing += [] if any(checkpoint.glob("rng_state*.pth")) else ["rng_state.pth"]
    if missing:
        return f"no {', '.join(missing)}"
    for path in sorted(checkpoint.iterdir()):  # optimizer.pt, scheduler.pt, rng_state.pth: zip archives when whole
        if path.suffix in (".pt", ".pth") and not zipfile.is_zipfile(path):
            return f"{path.name} is truncated or corrupt"
    return None


def _complete(checkpoint: Path) -> bool:
    return _incomplete(checkpoint) is None
