"""Trainer callbacks: λ per layer in the logs (one summary of it on the console), and the run settings a resume must
keep."""

from __future__ import annotations

import math
import re

import torch
import torch.distributed as dist
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState, PrinterCallback, ProgressCallback


_LAMBDA_MODULE = re.compile(r"layers\.(\d+)\.self_attn\.diff_lambda(?:\.modules_to_save\.(\w+))?$")


def lambda_modules(model) -> dict[int, torch.nn.Module]:
    """Layer index -> the `diff_lambda` module that runs in the forward pass.

    Under PEFT with `modules_to_save=["diff_lambda"]` the trained copy (`...diff_lambda.modules_to_save.<adapter>`)
    runs instead of the original, so it wins. Matched by class name, so remote-code copies of the model work too.
    """
    found: dict[int, tuple[bool, torch.nn.Module]] = {}
    for name, module in model.named_modules():
        match = _LAMBDA_MODULE.search(name)
        if match and type(module).__name__ in ("DiffLambdaV1", "DiffLambdaV2"):
            layer, is_copy = int(match.group(1)), match.group(2) is not None
            if layer not in found or is_copy:
                found[layer] = (is_copy, module)
    return {layer: found[layer][1] for layer in sorted(found)}


class LambdaLoggingCallback(TrainerCallback):
    """Adds λ per layer to every training log (so TensorBoard, the progress bar and `log_history` all see it).

    * V1: `lambda/layer_NN` = the layer's scalar exp(λq1·λk1) - exp(λq2·λk2) + λ_init at the logging step.
    * V2: `lambda/layer_NN` and `lambda_std/layer_NN` = mean and std of sigmoid(W_λ x) over every token and head of
      the training batches since the previous log (all processes), recorded by a forward hook on `diff_lambda`.
      Under gradient checkpointing the recomputed forward records the same values again, which leaves mean and
      (population) std unchanged.

    Plus `lambda_mean`, `lambda_min`, `lambda_max`: the mean, least and greatest of the per-layer λ (means) above,
    the one λ figure the console shows (`console_logs`), and `lambda_negative_layers`: how many layers have λ < 0
    (they add their second attention map instead of subtracting it), shown on the console as "k of L".

    It must run before the reporting callbacks: `train.build_trainer` puts it first in the callback list.
    """

    def __init__(self, model):
        self.modules = lambda_modules(model)
        self.version = 1 if any(type(m).__name__ == "DiffLambdaV1" for m in self.modules.values()) else 2
        self.stats: dict[int, torch.Tensor] = {}  # layer -> float64 [count, sum, sum of squares]
        self.handles = []
        if self.version == 2:
            for layer, module in self.modules.items():
                self.handles.append(module.register_forward_hook(self._hook(layer)))

    def _hook(self, layer: int):
        def record(module, inputs, output):
            if not module.training:  # evaluation batches are not training statistics
                return
            lam = output.detach().float()  # no copy in fp32; sums accumulate in fp64
            count = torch.full((), lam.numel(), dtype=torch.float64, device=lam.device)  # a fill, not a host copy
            update = torch.stack([count, lam.sum(dtype=torch.float64), lam.square().sum(dtype=torch.float64)])
            self.stats[layer] = update if layer not in self.stats else self.stats[layer] + update

        return record

    @torch.no_grad()
    def values(self, device=None) -> dict[str, float]:
        """The λ figures since the last call (V2 statistics are reset)."""
        if self.version == 1:
            return {f"lambda/layer_{layer:02d}": float(module()) for layer, module in self.modules.items()}
        if not self.modules:
            return {}
        layers = list(self.modules)
        zero = torch.zeros(3, dtype=torch.float64, device=device)
        stats = torch.stack([self.stats.get(layer, zero).to(zero.device) for layer in layers])  # (L, 3)
        self.stats = {}
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(stats)  # every process logs at the same steps, so this collective is matched
        out = {}
        for layer, (count, total, squares) in zip(layers, stats.tolist()):
            if count:
                mean = total / count
                out[f"lambda/layer_{layer:02d}"] = mean
                out[f"lambda_std/layer_{layer:02d}"] = math.sqrt(max(squares / count - mean * mean, 0.0))
        return out

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or "loss" not in logs or not self.modules:  # training logs only (not eval / summary)
            return
        values = self.values(device=args.device)
        layers = [value for key, value in values.items() if key.startswith("lambda/")]
        if layers:
            values.update(lambda_mean=sum(layers) / len(layers), lambda_min=min(layers), lambda_max=max(layers))
            # λ's sign: a layer with λ < 0 adds its second map instead of subtracting it (V2's λ is a sigmoid)
            values["lambda_negative_layers"] = sum(value < 0 for value in layers)
        _add_to_log(state, logs, values)

    def remove(self):
        for handle in self.handles:
            handle.remove()
        self.handles = []


class LambdaWarmupCallback(TrainerCallback):
    """`--lambda-warmup-steps N`: ramps the subtracted term in, λ_used = m λ with m = min(1, step / N), for V1 and V2.

    The multiplier is applied by a forward hook on every `diff_lambda` module (what λ is, not how attention uses
    it), so no parameter or buffer changes: saved weights carry no trace of it. m is set from the optimizer step
    before each step and each evaluation (step 0: m = 0; m = 1 exactly from step N on, when the hooks are removed and
    the model computes exactly what it saves). Resuming recomputes m from the checkpoint's step. The hooks go first,
    so the λ that `LambdaLoggingCallback` logs is the one used; `lambda_warmup` logs m.
    """

    def __init__(self, model, steps: int):
        if steps < 1:
            raise ValueError(f"lambda warm-up needs steps >= 1, got {steps}")
        self.steps = steps
        self.multiplier = 0.0
        modules = lambda_modules(model).values()
        self.handles = [module.register_forward_hook(self._scale, prepend=True) for module in modules]

    def _scale(self, module, inputs, output):
        return output * self.multiplier

    def set_step(self, step: int) -> None:
        self.multiplier = min(1.0, step / self.steps)
        if self.multiplier == 1.0:
            self.remove()

    def on_train_begin(self, args, state, control, **kwargs):
        if state.max_steps < self.steps:
            from .data import TrainingError

            raise TrainingError(
                f"--lambda-warmup-steps {self.steps} is longer than the run ({state.max_steps} steps): the ramp must "
                "end before the run does, or the saved model is not the one trained; lower it"
            )
        self.set_step(state.global_step)  # 0, or the step a resumed run continues from

    def on_step_end(self, args, state, control, **kwargs):
        self.set_step(state.global_step)  # for the evaluation after this step and for the next step

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is not None and "loss" in logs:
            _add_to_log(state, logs, {"lambda_warmup": self.multiplier})

    def remove(self):
        for handle in self.handles:
            handle.remove()
        self.handles = []


def _add_to_log(state, logs: dict, values: dict) -> None:
    logs.update(values)
    # Trainer appended a copy of `logs` to log_history just before calling on_log.
    if (
        state.log_history
        and state.log_history[-1].get("step") == state.global_step
        and "loss" in state.log_history[-1]
    ):
        state.log_history[-1].update(values)


class RunSettingsCallback(TrainerCallback, ExportableState):
    """Stores in every checkpoint's trainer_state.json (`stateful_callbacks`) the settings that decide which tokens
    make up each block (or chat example), so that `--resume` can refuse to continue a run with other blocks; and
    `run` (`resume.run_identity`: the data, the held-out split, the global batch, the seed), which a resume may
    change but is then no longer the run the checkpoint was part of."""

    def __init__(self, block_size: int, bos: bool, chat: bool = False, run: dict | None = None):
        self.block_size, self.bos, self.chat, self.run = block_size, bos, chat, run or {}

    def state(self) -> dict:
        settings = {"block_size": self.block_size, "bos": self.bos, "chat": self.chat, "run": self.run}
        return {"args": settings, "attributes": {}}


LAMBDA_SUMMARY = ("lambda_mean", "lambda_min", "lambda_max")
_PER_LAYER = ("lambda/", "lambda_std/")


def lambda_summary(logs: dict) -> str | None:
    """The "mean / min / max" of λ over the layers in one training log, or None when the log has no λ."""
    if not all(key in logs for key in LAMBDA_SUMMARY):
        return None
    return " / ".join(f"{logs[key]:.4g}" for key in LAMBDA_SUMMARY)


def last_lambda_summary(log_history: list[dict]) -> str | None:
    """`lambda_summary` of the last training log that has λ."""
    return next((lambda_summary(e) for e in reversed(log_history) if lambda_summary(e) is not None), None)


def _console_view(logs: dict) -> dict:
    """What a person reads on the console: loss, lr, grad norm, ... and λ as one "mean / min / max" entry."""
    hidden = (*LAMBDA_SUMMARY, "lambda_negative_layers")
    view = {k: v for k, v in logs.items() if not k.startswith(_PER_LAYER) and k not in hidden}
    summary = lambda_summary(logs)
    if summary is not None:
        view["lambda mean/min/max"] = summary
    if "lambda_negative_layers" in logs:
        layers = sum(key.startswith("lambda/") for key in logs)
        view["layers with lambda < 0"] = f"{logs['lambda_negative_layers']} of {layers}"
    return view


class _ConsoleProgress(ProgressCallback):
    def on_log(self, args, state, control, logs=None, **kwargs):
        super().on_log(args, state, control, logs=_console_view(logs or {}), **kwargs)


class _ConsolePrinter(PrinterCallback):
    def on_log(self, args, state, control, logs=None, **kwargs):
        super().on_log(args, state, control, logs=_console_view(logs or {}), **kwargs)


def console_logs(trainer) -> None:
    """Swap Trainer's console callback (the progress bar's, or the printer's under --quiet) for one that prints
    `_console_view` of each log: the per-layer λ stay in TensorBoard and `log_history` (trainer_state.json)."""
    for plain, ours in ((ProgressCallback, _ConsoleProgress), (PrinterCallback, _ConsolePrinter)):
        if trainer.pop_callback(plain) is not None:
            trainer.add_callback(ours)
