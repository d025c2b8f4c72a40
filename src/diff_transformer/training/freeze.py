"""`--diff-only-steps K`: right after conversion, train only what the conversion added, then everything.

Which parameters are "new" follows the conversion rules (docs/design.md, "Converting a Llama checkpoint"):

* V2: `diff_lambda.proj` (set to 0 by the converter) and the second query head of every pair, i.e. the rows of
  `q_proj` (weight and bias) in the odd d-row blocks 2h+1 (copies of q_2h at conversion). The even blocks are the
  source Llama's query heads and stay frozen with everything else. Without the second queries changing, a pair only
  rescales its head by 1 - λ and cannot learn to cancel attention noise.
* V1: `diff_lambda.lambda_{q,k}{1,2}` and `subln.weight`, the only tensors without a counterpart in the source (the
  other weights are the Llama's, re-paired).

Mechanics, chosen so the optimizer built by Trainer holds every parameter from the start (Trainer's
`create_optimizer` keeps only parameters with `requires_grad`, so freezing before it runs would leave the frozen ones
out of the optimizer for good): the callback freezes in `on_train_begin`, which runs after the optimizer exists,
by setting `requires_grad=False`; AdamW skips parameters whose grad is None (no update, no weight decay, no state).
A partly new tensor (V2's `q_proj`) keeps its gradient; a hook zeroes the gradient of its old rows (so clipping
sees only the trained ones) and the old rows are copied back after every optimizer step (weight decay would
otherwise shrink them). After step K everything is unfrozen; a run resumed before step K freezes again, one resumed
after it does not. Under DDP the frozen parameters get no gradient, so `train.py` sets `find_unused_parameters`.
"""

from __future__ import annotations

import re

import torch
from transformers import TrainerCallback
from transformers.utils import logging


logger = logging.get_logger(__name__)

_V1_NEW = re.compile(r"\.self_attn\.(diff_lambda\.lambda_[qk][12]|subln\.weight)$")
_V2_LAMBDA = re.compile(r"\.self_attn\.diff_lambda\.proj\.weight$")
_V2_QUERY = re.compile(r"\.self_attn\.q_proj\.(weight|bias)$")


def differential_parameters(model) -> dict[str, torch.Tensor | None]:
    """Name -> None (the whole tensor is new) or a boolean row mask (True = new row) for every new parameter."""
    config = model.config
    if getattr(config, "model_type", None) != "diff":
        raise ValueError(f"--diff-only-steps needs a Diff model, not model_type={config.model_type!r}")
    new: dict[str, torch.Tensor | None] = {}
    for name, param in model.named_parameters():
        if config.diff_version == 1:
            if _V1_NEW.search(name):
                new[name] = None
        elif _V2_LAMBDA.search(name):
            new[name] = None
        elif _V2_QUERY.search(name):
            rows = torch.arange(param.shape[0], device=param.device)
            new[name] = (rows // config.head_dim) % 2 == 1  # odd d-row blocks: q_{2h+1}
    return new


class DiffOnlyCallback(TrainerCallback):
    """Trains only `differential_parameters(model)` until `global_step == steps`, then every parameter."""

    def __init__(self, model, steps: int):
        self.model = model
        self.steps = steps
        differential_parameters(model)  # refuses a non-Diff model now, not when training starts
        self.frozen: list[torch.nn.Parameter] = []
        self.partial: list[
            tuple[torch.nn.Parameter, torch.Tensor, torch.Tensor]
        ] = []  # (param, old-row mask, old rows)
        self.hooks = []

    @property
    def active(self) -> bool:
        return bool(self.frozen or self.partial)

    def freeze(self):
        new = differential_parameters(self.model)  # row masks on the device Trainer has moved the model to by now
        for name, param in self.model.named_parameters():
            if not param.requires_grad:
                continue
            if name not in new:
                param.requires_grad_(False)
                self.frozen.append(param)
            elif new[name] is not None:
                old = ~new[name]
                self.partial.append((param, old, param.detach()[old].clone()))
                self.hooks.append(
                    param.register_hook(
                        lambda grad, old=old: grad.masked_fill(old.view(-1, *[1] * (grad.dim() - 1)), 0)
                    )
                )
        trained = sum(p.numel() for p in self.model.parameters() if p.requires_grad) - sum(
            int(m.sum()) * p[0].numel() for p, m, _ in self.partial
        )
        logger.info(f"--diff-only-steps: training {trained:,} differential parameters until step {self.steps}")

    def unfreeze(self):
        for param in self.frozen:
            param.requires_grad_(True)
        for hook in self.hooks:
            hook.remove()
        self.frozen, self.partial, self.hooks = [], [], []
        logger.info("--diff-only-steps: now training every parameter")

    def on_train_begin(self, args, state, control, **kwargs):
        if state.global_step < self.steps:
            self.freeze()

    @torch.no_grad()
    def on_optimizer_step(self, args, state, control, **kwargs):
        for param, old, rows in self.partial:
            param[old] = rows

    def on_step_end(self, args, state, control, **kwargs):
        if self.active and state.global_step >= self.steps:
            self.unfreeze()

    def on_train_end(self, args, state, control, **kwargs):
        if self.active:
            self.unfreeze()
