"""`diff-transformer train`: continued pretraining or chat fine-tuning of a Diff checkpoint with transformers' Trainer.

    diff-transformer train MODEL --data corpus.txt --output run/ --max-steps 1000 --eval-steps 100
    diff-transformer train MODEL --chat-data chats.jsonl --output run/ --lora   # loss on the assistant turns only
    torchrun --nproc_per_node 2 -m diff_transformer.cli train MODEL --data corpus.txt --output run/   # DDP

Everything that Trainer already does (the loop, lr schedule and warm-up, gradient accumulation, mixed precision,
activation checkpointing, checkpoints with optimizer/scheduler/RNG state and exact resume, progress bars, TensorBoard,
DDP) is Trainer's; this module only turns the command line into `TrainingArguments`, packs the text (`data.py`) or
tokenises the conversations (`chat.py`) and adds three things: the perplexity of every evaluation, λ per layer in the
logs (`callbacks.py`) and `--diff-only-steps` (`freeze.py`). Summaries are printed by the main process only; Trainer
writes its own files there.
"""

from __future__ import annotations

import copy
import errno
import math
import os
import shutil
import sys
from pathlib import Path
from typing import NamedTuple

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments, set_seed
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..checkpoints import adapters
from ..checkpoints.opening import Checkpoint
from ..errors import UserError, as_one_line, one_line
from ..evaluation import format_perplexity
from ..outputs.files import follow_umask, refuse_links
from ..outputs.records import record_written, remove_recorded, top_level_state
from ..outputs.staging import OutputLock
from . import TrainingError
from .args import parse_train_args
from .callbacks import (
    LambdaLoggingCallback,
    LambdaWarmupCallback,
    RunSettingsCallback,
    console_logs,
    last_lambda_summary,
)
from .chat import ChatCollator, build_chat_datasets, check_chat_template, pad_id
from .checks import check_args, check_output, report_targets
from .data import build_datasets
from .freeze import DiffOnlyCallback
from .model import check_model, load_model, open_model
from .parallel import is_sharded, load_sharded, plan_layout, save_sharded
from .resume import (
    RecordCheckpointCallback,
    check_checkpoint_fits,
    checkpoint_state,
    old_checkpoints,
    resolve_resume,
    rotate_checkpoints,
    run_identity,
    trainer_checkpoints,
)


class CausalLMTrainer(Trainer):
    """Trainer whose evaluations also report perplexity = exp(mean token NLL) as `<prefix>_perplexity`.

    The eval loss is already the mean NLL over every predicted token: all blocks have the same length and no padding,
    and Trainer weights each batch's mean loss by its number of blocks. With --chat-data it is the mean, over
    conversations, of the mean answer-token NLL of each one's batch (answers differ in length)."""

    def evaluation_loop(
        self, dataloader, description, prediction_loss_only=None, ignore_keys=None, metric_key_prefix="eval"
    ):
        output = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix)
        loss = output.metrics.get(f"{metric_key_prefix}_loss")
        if loss is not None:
            try:
                perplexity = math.exp(loss)
            except OverflowError:  # a diverged run's: inf, never a made-up finite one
                perplexity = math.inf
            output.metrics[f"{metric_key_prefix}_perplexity"] = perplexity
        return output

    def _save_checkpoint(self, model, trial):
        # Trainer's own rotation (transformers.trainer_utils.rotate_checkpoints) deletes the oldest of every
        # checkpoint-* directory in --output, a user's `checkpoint-0/` included: it is switched off here and
        # `rotate_checkpoints` deletes only checkpoints that this run wrote or that the run record proves a run wrote.
        limit = self.args.save_total_limit
        save = self._save_sharded_checkpoint if is_sharded(self.model) else super()._save_checkpoint
        if self.args.should_save:  # Trainer writes with open(): never through a link that appeared in --output
            refuse_links(Path(self.args.output_dir), name="--output")
        self.args.save_total_limit = None
        try:
            save(model, trial)
        finally:
            self.args.save_total_limit = limit
        if self.args.should_save and limit:
            output = Path(self._get_output_dir(trial=trial))
            newest = output / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            rotate_checkpoints(output, limit, newest, self.state.best_model_checkpoint)

    def save_model(self, output_dir=None, _internal_call=False):
        if getattr(self, "_sharded_checkpoint", False):
            # A sharded run's checkpoint holds its weights as DCP shards (`_save_checkpoint`), never gathered onto one
            # rank: only the config goes beside them (what `check_checkpoint_fits` reads the model's version from).
            if self.args.should_save:
                self.accelerator.unwrap_model(self.model).config.save_pretrained(output_dir)
            return
        super().save_model(output_dir, _internal_call)
        if self.args.should_save:  # the final model, checkpoints, adapters and a sharded run's export alike
            follow_umask(Path(output_dir or self.args.output_dir).glob("*.safetensors"))

    def _save(self, output_dir=None, state_dict=None):
        if not is_sharded(self.model) or state_dict is not None:
            return super()._save(output_dir, state_dict)
        # transformers' own save of a sharded model gathers the weights well, but `fully_shard` made the model an
        # `FSDPDiffForCausalLM` (torch's class, in torch's module), so `custom_object_save` would copy torch's
        # _fsdp_*.py files as the "custom code" and point auto_map at them: the gathered weights are saved through
        # the model's own class instead, built on the meta device (guarded by tests/distributed/test_sharded_train.py).
        model = self.accelerator.unwrap_model(self.model)
        state = model.gather_sharded_state_dict_for_save(
            model, model.state_dict(), model.config.distributed_config, save_on_this_rank=self.args.should_save
        )  # collective: every rank takes part, only the main process ends up with the full tensors (on CPU)
        if self.args.should_save:
            unsharded_twin(model, state).save_pretrained(output_dir or self.args.output_dir)
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir or self.args.output_dir)

    def _save_sharded_checkpoint(self, model, trial):
        output = Path(self._get_output_dir(trial=trial)) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        # Before Trainer writes trainer_state.json, which marks the checkpoint complete (`resume._incomplete`).
        save_sharded(self.model, self.optimizer, output, self.args.should_save)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), output / "scheduler.pt")
        self._save_rng_state(str(output))
        self._sharded_checkpoint = True
        try:  # Trainer's own steps (save_only_model=True): save_model (the config), trainer_state.json
            Trainer._save_checkpoint(self, model, trial)
        finally:
            self._sharded_checkpoint = False

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        if is_sharded(self.model):  # loaded with the optimizer, once it exists (`_load_optimizer_and_scheduler`)
            return
        try:
            super()._load_from_checkpoint(resume_from_checkpoint, model)
        except (RuntimeError, ValueError, KeyError, TypeError) as error:  # what `check_checkpoint_fits` cannot see
            raise TrainingError(
                f"--resume {resume_from_checkpoint}: its weights do not load into this model ({one_line(error)}): "
                "resume with the MODEL and options the run was started with"
            ) from None

    def _load_optimizer_and_scheduler(self, checkpoint):
        if checkpoint is not None and is_sharded(self.model):
            try:
                load_sharded(self.model, self.optimizer, Path(checkpoint))
                self.lr_scheduler.load_state_dict(torch.load(Path(checkpoint) / "scheduler.pt", weights_only=True))
            except (RuntimeError, ValueError, KeyError, TypeError, OSError) as error:
                raise TrainingError(
                    f"--resume {checkpoint}: its sharded weights and optimizer states do not load into this run "
                    f"({one_line(error)}): resume with the MODEL and options the run was started with"
                ) from None
            return
        try:
            super()._load_optimizer_and_scheduler(checkpoint)
        except (RuntimeError, ValueError, KeyError, TypeError) as error:
            raise TrainingError(
                f"--resume {checkpoint}: its optimizer.pt does not fit this run's trainable parameters "
                f"({one_line(error)}): resume with the options the run was started with (--lora, --lora-r, "
                "--lora-freeze-lambda...)"
            ) from None

    def _issue_warnings_after_load(self, load_result):
        # A tied lm_head is not stored in checkpoints (it is the embedding matrix), so it is always "missing" when
        # Trainer reloads one; transformers re-ties it only for models that list it in `_keys_to_ignore_on_save`.
        tied = set(getattr(self.accelerator.unwrap_model(self.model), "all_tied_weights_keys", None) or {})
        load_result.missing_keys[:] = [key for key in load_result.missing_keys if key not in tied]
        super()._issue_warnings_after_load(load_result)


def unsharded_twin(model, state: dict):
    """A model of MODEL's own class (the one `fully_shard` subclassed) and config holding the gathered STATE (its
    tensors, not copies: built on the meta device, then assigned): what saves a sharded model as an ordinary
    checkpoint."""
    from transformers import PreTrainedModel

    cls = next(c for c in type(model).__mro__ if issubclass(c, PreTrainedModel) and "FSDP" not in c.__name__)
    config = copy.deepcopy(model.config)
    # save_pretrained would gather again (a collective the other ranks never join) for a config that has one
    config.distributed_config = None
    with torch.device("meta"):
        twin = cls(config)
    twin.load_state_dict(state, assign=True, strict=False)  # a tied head is not in STATE: tie_weights re-ties it
    twin.tie_weights()
    return twin


def use_bf16(choice: str) -> bool:
    if choice == "auto":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return choice == "on"


def training_arguments(args, has_eval: bool, resuming: bool, sharded: bool = False) -> TrainingArguments:
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
        torch_compile=args.compile or args.compile_backend is not None,
        torch_compile_backend=args.compile_backend,  # None: Trainer's default for the device (inductor)
        logging_steps=args.logging_steps,
        logging_first_step=True,
        eval_strategy="steps" if has_eval and args.eval_steps else "no",
        eval_steps=args.eval_steps,
        eval_on_start=has_eval and args.eval_on_start and not resuming,
        save_strategy="steps",
        save_steps=args.save_steps,
        save_total_limit=args.save_total_limit,
        # A model sharded when it loads: Trainer checkpoints only its weights (it refuses more); the optimizer, the
        # scheduler and the RNG go into the DCP checkpoint that `CausalLMTrainer._save_sharded_checkpoint` writes.
        save_only_model=sharded,
        seed=args.seed,
        report_to=report_to,
        disable_tqdm=args.quiet or not sys.stderr.isatty(),  # bars on a terminal only (cli.options.show_progress)
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


def build_trainer(args, checkpoint: Checkpoint | None = None) -> PreparedRun:
    """Everything `run` needs, without training: the Trainer (model, data, callbacks) for `args`, the checkpoint it
    resumes from and the block size. CHECKPOINT: MODEL opened (`open_model`), when the caller already did."""
    checkpoint = checkpoint or open_model(args)
    check_model(args, checkpoint)
    block_size = check_args(args, checkpoint.config)
    layout = plan_layout(args, checkpoint.config)  # the world size and head counts, before anything loads
    check_output(args, checkpoint.source)
    resume = resolve_resume(args, block_size)
    tokenizer = checkpoint.tokenizer
    if tokenizer is None:
        raise TrainingError(f"{args.model} has no tokenizer: save one with the model (tokenizer.save_pretrained)")
    set_seed(args.seed)  # before the model: LoRA's initialisation draws random numbers
    collator = None  # Trainer's default: it stacks the equal-length blocks
    if args.chat_data:
        check_chat_template(tokenizer, args.model)
        train_data, eval_data = build_chat_datasets(
            tokenizer, args.chat_data, block_size, eval_data=args.eval_data, eval_fraction=args.eval_fraction,
            progress=None if args.quiet else lambda line: print(line, file=sys.stderr, flush=True),
        )  # fmt: skip
        collator = ChatCollator(pad_id(tokenizer))
    else:
        train_data, eval_data = build_datasets(
            tokenizer,
            args.data,
            block_size,
            eval_data=args.eval_data,
            eval_fraction=args.eval_fraction,
            text_field=args.text_field,
            bos=not args.no_bos,
        )
    training_args = training_arguments(args, eval_data is not None, resume is not None, sharded=layout is not None)
    model = load_model(args, training_args, checkpoint, layout)
    if resume is not None:
        check_checkpoint_fits(resume, model, args.lora, sharded=is_sharded(model))
    foreign = resume is not None and Path(resume).resolve().parent != Path(args.output).resolve()
    # Only once the model has loaded: a failed start keeps the old run. --overwrite removes every file and checkpoint
    # an earlier run recorded as its own and nobody changed since (all Trainer checkpoints of a run from before
    # checkpoints were recorded: `old_checkpoints`) (a LoRA run's adapter_config.json, a V2
    # card or a sharded model's index left beside a new run would make every later command read the old run); the
    # user's files stay.
    if args.overwrite and (resume is None or foreign):
        with training_args.main_process_first(desc="removing the old run"):
            if training_args.process_index == 0:
                for old in old_checkpoints(Path(args.output)):
                    shutil.rmtree(old)
                remove_recorded(Path(args.output))  # the checkpoints it proves too

    callbacks = [RunSettingsCallback(block_size, not args.no_bos, bool(args.chat_data), run_identity(args))]
    callbacks += [DiffOnlyCallback(model, args.diff_only_steps)] if args.diff_only_steps else []
    if args.lora:
        source = checkpoint.source
        # adapter_config.json names the base PEFT loads from anywhere (not as typed); cards show it as typed
        adapters.name_base(model, base_of(source))
        callbacks.append(AdapterCardCallback(source.base or args.model, model.config, base_of(source)))
    trainer = CausalLMTrainer(
        model=model,
        args=training_args,
        train_dataset=train_data,
        eval_dataset=eval_data,
        data_collator=collator,
        processing_class=tokenizer,
        callbacks=callbacks,
    )
    # Last in line, after AdapterCardCallback has written the card into the checkpoint: what it records is final.
    trainer.add_callback(RecordCheckpointCallback())
    # First in line, so the λ values it adds to a log reach TensorBoard and the progress bar in the same call.
    trainer.callback_handler.callbacks.insert(0, LambdaLoggingCallback(model))
    console_logs(trainer)  # the console shows one λ summary; TensorBoard and log_history keep every layer
    if args.lambda_warmup_steps:
        trainer.callback_handler.callbacks.insert(0, LambdaWarmupCallback(model, args.lambda_warmup_steps))
    return PreparedRun(trainer, resume, block_size)


def base_of(source) -> Path | str:
    """What `adapters.record_base` records for a LoRA run on SOURCE: the base's directory, or its Hub id."""
    return source.local.resolve() if source.local is not None else source.location


class AdapterCardCallback(TrainerCallback):
    """The adapter's card (`adapters.adapter_card`) and base record (`adapters.record_base`) in every checkpoint of a
    LoRA run, in place of the blank template PEFT writes there: a checkpoint is an adapter directory too (`generate`,
    `merge` take it)."""

    def __init__(self, base: str, config, base_path: Path | str | None = None):
        self.base, self.config, self.base_path = base, config, base_path

    def on_save(self, args, state, control, **kwargs):
        checkpoint = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        if state.is_world_process_zero and adapters.is_adapter(checkpoint):
            summary = last_lambda_summary(state.log_history)
            adapters.write_adapter_card(checkpoint, self.base, self.config, summary)
            if self.base_path is not None:
                adapters.record_base(checkpoint, self.base_path, self.base)


def run(args) -> int:
    checkpoint = open_model(args)
    output = check_output(args, checkpoint.source)  # before the lock creates --output
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun the main process holds the lock for every rank
        return _run(args, checkpoint)
    with OutputLock(output, name="--output"):
        return _run(args, checkpoint)


def final_evaluation(trainer) -> dict:
    """The held-out metrics of the final model: those of --eval-steps' evaluation when it ran at the last step (the
    same weights: a second pass would cost its time and print the same line again), else a new evaluation."""
    last = next((entry for entry in reversed(trainer.state.log_history) if "eval_loss" in entry), None)
    if last is not None and last.get("step") == trainer.state.global_step:
        return {key: value for key, value in last.items() if key != "step"}
    return trainer.evaluate()


def _run(args, checkpoint: Checkpoint) -> int:
    trainer, resume, block_size = build_trainer(args, checkpoint)
    before = top_level_state(args.output)  # after an --overwrite cleared the old run: what this run writes is new
    main = trainer.is_world_process_zero()
    model, train_data, eval_data = trainer.model, trainer.train_dataset, trainer.eval_dataset
    if main:
        _, note = report_targets(args)
        if note:
            print(note, flush=True)
        n_params = sum(p.numel() for p in model.parameters())
        n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
        world = trainer.args.world_size
        unit = "conversations" if args.chat_data else "blocks"
        size = f"of at most {block_size} tokens" if args.chat_data else f"of {block_size} tokens"
        shown = type(model).__name__.removeprefix("FSDP")  # fully_shard's subclass of the model's own class
        if is_sharded(model):
            layout = model.config.distributed_config
            shown += (
                f" sharded by --parallelism {args.parallelism} ({layout.dp_replicate_size} replica(s) x "
                f"{layout.fsdp_size} FSDP shard(s) x {layout.tp_size} tensor-parallel)"
            )
        print(
            f"model: {shown} from {args.model}, {n_params:,} parameters ({n_train:,} trainable)\n"
            f"data: {len(train_data):,} training {unit} {size}"
            + (f", {len(eval_data):,} held out" if eval_data is not None else ", no evaluation")
            + f"; {args.batch_size} x {args.grad_accum} accumulation x {world} process(es) = "
            f"{args.batch_size * args.grad_accum * world} {unit} per step"
            + (_cut_note(train_data, eval_data, block_size) if args.chat_data else "")
            + (f"\nresuming from {resume}" if resume else ""),
            flush=True,
        )
    start = checkpoint_state(Path(resume)).get("global_step", 0) if resume else 0
    # Trainer and the tokenizer write with plain open(), which follows links: none may be in --output when they do
    # (checked before the run starts, and again before each save).
    refuse_links(Path(args.output), name="--output")
    result = trainer.train(resume_from_checkpoint=resume)
    refuse_links(Path(args.output), name="--output")
    trainer.save_model(args.output)  # model (or LoRA adapter) + tokenizer, main process only
    if main and args.lora:  # PEFT wrote its blank template as README.md: the adapter's own card replaces it
        source = checkpoint.source
        base = source.base or args.model
        adapters.write_adapter_card(args.output, base, model.config, last_lambda_summary(trainer.state.log_history))
        adapters.record_base(args.output, base_of(source), base)
    trainer.save_metrics("train", result.metrics)
    metrics = final_evaluation(trainer) if eval_data is not None else {}
    refuse_links(Path(args.output), name="--output")
    if metrics:
        trainer.save_metrics("eval", metrics)
    trainer.save_state()
    if main:  # what this run wrote, so that a later --overwrite may remove it (and nothing of the user's)
        record_written(args.output, before, skip={p.name for p in trainer_checkpoints(Path(args.output))})
    if main:
        done = result.global_step - start  # this run's steps: a resumed run starts at its checkpoint's step
        line = f"done: {done} step{'' if done == 1 else 's'}"
        if start:
            line += f" (step {start + 1}" + ("" if done == 1 else f" to {result.global_step}") + ", resumed)"
        line += f", mean training loss of this run {result.training_loss:.4f}"
        if metrics:  # named by what it scored, as every printed perplexity is (issue 57)
            line += f"; held-out loss {metrics['eval_loss']:.4f}, perplexity "
            line += f"{format_perplexity(metrics['eval_perplexity'])} on "
            line += _held_out_description(args, eval_data, unit, size)
        print(line + f"\nsaved to {args.output}", flush=True)
    return 0


def _held_out_description(args, eval_data, unit: str, size: str) -> str:
    """What the held-out loss scored: "6 blocks of 16 tokens held out of --data (--eval-fraction 0.25)"."""
    data = "--chat-data" if args.chat_data else "--data"
    where = "of --eval-data" if args.eval_data else f"held out of {data} (--eval-fraction {args.eval_fraction:g})"
    answers = ", loss on the assistant tokens" if args.chat_data else ""
    return f"{len(eval_data):,} {unit} {size} {where}{answers}"


def _cut_note(train_data, eval_data, block_size: int) -> str:
    """A line on the conversations longer than the block size, if any: how many were truncated, how many dropped."""
    truncated, dropped = (sum(getattr(d, key, 0) for d in (train_data, eval_data)) for key in ("truncated", "dropped"))
    if not truncated:
        return ""
    note = f"\nnote: {truncated:,} conversation(s) longer than --block-size {block_size} were truncated to it"
    return note + (f", {dropped:,} of them left out (no answer token within it)" if dropped else "")


_DISK_ERRORS = (errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.EDQUOT)


def run_cli(args) -> int:
    """`run`, with a bad option or input reported as one line on stderr and exit status 2 (and no empty --output
    directory left behind)."""
    existed = os.path.lexists(args.output) if args.output else True
    try:
        return run(args)
    except UserError as error:
        print(f"error: {as_one_line(str(error))}", file=sys.stderr)
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
            as_one_line(
                f"error: writing {error.filename or args.output} failed ({error.strerror}): free space or fix the "
                f"permissions, then continue with --resume"
            ),
            file=sys.stderr,
        )
        return 2


def main(argv=None) -> int:
    return run_cli(parse_train_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
