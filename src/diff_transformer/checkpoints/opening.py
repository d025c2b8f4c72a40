"""One road from a name to a model. `open_checkpoint(MODEL, base)` (`checkpoints.open`) resolves what the user named
(a local directory, a Hub id, a PEFT adapter and its base) once, holds every local config against its weights, checks
generation_config.json and finds the tokenizer; the `Checkpoint` it returns reads the config once and loads the
weights (its generation settings applied) without resolving or checking anything again. Every command that loads a
model (generate, inspect, niah, merge, train) starts here, so a problem with the name, the config or the tokenizer is
one line before any weights load, whichever command met it."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from . import CheckpointError, adapters
from .configs import check_generation_config
from .loading import check_diff_checkpoint, from_pretrained


@dataclass(frozen=True)
class Checkpoint:
    """MODEL, resolved and checked: where the model (an adapter's base) and its tokenizer load from, and its tokenizer
    (None when the model has none: prompts are then token ids)."""

    name: str  # MODEL as the user wrote it, for messages
    source: adapters.Source
    tokenizer: Any = None
    label: str = "MODEL"  # what messages call it: the option or argument it came from, "model" in a request
    revision: str | None = None  # a Hub model's branch, tag or commit (None: main); its config and weights load there

    @property
    def location(self) -> str:
        return self.source.location

    @property
    def local(self):
        return self.source.local

    @property
    def adapter(self):
        return self.source.adapter

    @functools.cached_property
    def config(self):
        """The model's config (an adapter's: its base's), read once; for a multimodal config, its text config's owner
        (`text_config` gives the language model's)."""
        from transformers import AutoConfig

        from ..integrations.auto_classes import register_auto_classes

        register_auto_classes()  # AutoConfig reads Diff configs

        try:
            return AutoConfig.from_pretrained(self.location, revision=self.revision or "main")
        except Exception as exc:
            raise CheckpointError(
                f"cannot read the config of {self.label} {self.name} ({' '.join(str(exc).split())[:200]})."
            ) from None

    @property
    def text_config(self):
        return self.config.get_text_config()

    def load(self, *, merge: bool = False, trainable: bool = False, prepare=None, **kwargs):
        """The model, its generation settings ready for `generate` (`generation.config.float_generation_fields`: the
        `"repetition_penalty": 2` of a hand-written generation_config.json is the float 2.0 transformers' processors
        take); for an adapter, its base with the adapter on it (merged into the weights with `merge`, trainable with
        `trainable`; `prepare(base)`, e.g. for 4-bit training, runs before the adapter goes on). KWARGS go to
        `from_pretrained` (dtype, attn_implementation, device_map, quantization_config...), at the revision opened."""
        from ..generation.config import float_generation_fields

        if self.revision is not None:
            kwargs.setdefault("revision", self.revision)

        if self.adapter is None:
            model = from_pretrained(self.location, f"{self.label} {self.name!r}", **kwargs)
        else:
            model = adapters.put_adapter_on(
                from_pretrained(self.location, f"base model {self.source.base!r}", **kwargs),
                self.source,
                merge=merge,
                trainable=trainable,
                prepare=prepare,
            )
        if getattr(model, "generation_config", None) is not None:
            float_generation_fields(model.generation_config)
        return model


def open_checkpoint(
    name, base: str | None = None, *, tokenizer: bool = True, label: str = "MODEL", revision: str | None = None
) -> Checkpoint:
    """NAME (a directory, `org/model` or `hf://id` on the Hub, a PEFT adapter directory; BASE: the adapter's base when
    its files do not name one that exists) resolved once and checked before anything loads: each local config.json
    against its safetensors (`check_diff_checkpoint`), generation_config.json's ranges (a Hub model's at REVISION),
    and (with `tokenizer`) the tokenizer loaded. Every problem is one `CheckpointError` line naming LABEL and the
    fix."""
    source = adapters.resolve(name, base, name=label)
    shown = str(name)
    if source.local is not None:
        check_diff_checkpoint(source.local, name=label if source.adapter is None else "base model")
    check_generation_config(source.location, f"{label} {shown}", revision)
    found = None
    if tokenizer:
        from transformers import AutoTokenizer

        found = adapters.load_tokenizer(AutoTokenizer, source.tokenizer, source.tokenizer_local, shown)
    return Checkpoint(shown, source, found, label, revision)


__all__ = ["Checkpoint", "open_checkpoint"]
