"""What a user names on the command line or in a call (`generate MODEL`, `convert SRC`, `train MODEL`, an adapter's
base), turned into something to load: resolved, checked, then loaded, each problem one line naming the input and the
fix (`CheckpointError`).

* `opening.py`: `open_checkpoint(MODEL, base)` (also `checkpoints.open`), the one road from a name to a model:
  resolved, checked, its tokenizer found once; the `Checkpoint` it returns loads without resolving again (the
  generation settings applied: `generation.config`). Every command that loads a model starts there, and serve checks
  the models it is asked for through it.
* `names.py`: a local directory or a Hub id (`org/name`, `hf://name`).
* `configs.py`: config.json and generation_config.json, checked before anything is built from them.
* `weights.py`: the safetensors files of a checkpoint and their headers (names, shapes, dtypes; no tensor data).
* `loading.py`: a Diff checkpoint's config held against its weights; `from_pretrained` (every failure one line).
* `adapters.py`: PEFT adapter directories as MODEL (their base, the adapter put on it, their card).
* `merging.py`: `merge_adapter`, an adapter folded into its base and written as a full checkpoint.
* `backends.py`: `--attn-implementation`, the attention backend a model is loaded with.

Nothing is imported here (`open` imports `opening` when called), so naming this package costs nothing.
"""

from ..errors import UserError


# The files a Diff checkpoint carries as its code (`auto_map`), written by the converter and by merge
CUSTOM_CODE_FILES = ("configuration_diff.py", "modeling_diff.py")


class CheckpointError(UserError):
    """A named model or checkpoint cannot be used. The message is one line: what is wrong, then how to fix it."""


def open(name, base: str | None = None, **options):  # noqa: A001  (the `tarfile.open` of checkpoints)
    """NAME resolved, checked and its tokenizer found, once: `opening.open_checkpoint`, whose `Checkpoint.load()`
    then loads the model without resolving again."""
    from .opening import open_checkpoint

    return open_checkpoint(name, base, **options)


__all__ = ["CUSTOM_CODE_FILES", "CheckpointError", "open"]
