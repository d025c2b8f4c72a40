"""What generation needs, in one place: what `diff-transformer generate` hands to transformers' `generate`, and what
every command that renders a chat or reads generation settings shares.

* `call.py`: the prompt (PROMPT through the tokenizer or the chat template, checked against the model's vocabulary
  and context), the keywords of `generate` (sampling, NaN logits refused, --compile's static cache) and the
  interactive chat session.
* `config.py`: generation_config.json's settings (value ranges, the temperature floor, float fields, token ids).
* `chat_templates.py`: the one chat-template renderer, within bounds (train --chat-data, generate --chat, niah,
  serve).

Nothing is imported here, so naming this package costs nothing (`checkpoints` reads `config` while it opens a model).
"""

from ..errors import UserError


class GenerationError(UserError):
    """What generation was asked cannot be done (a prompt, a generation setting, non-finite logits). One line: what is
    wrong, then how to fix it."""


__all__ = ["GenerationError"]
