"""Chat (instruction) data for `train --chat-data`: OpenAI-style conversations, rendered with the model's chat
template, with the loss on the assistant turns only.

* A `.jsonl` file holds one conversation per line: `{"messages": [{"role": "system"|"user"|"assistant", "content":
  "..."}, ...]}`, with at least one assistant turn (other keys of a message are ignored).
* Masking: assistant turn i is the tokens that `messages[: i + 1]` adds to `messages[:i]` rendered with the
  generation prompt, so the template's own tokens before each answer (the prompt, e.g. `<|assistant|>\\n`) get label
  -100 like every system and user turn, and what the template closes an answer with (e.g. eos) is learned. Each
  rendering must be a token prefix of the next (true of templates that only append); a template for which it is not
  (one that rewrites earlier turns, or whose tokens merge across a turn's edge) is refused.
* An example longer than the block size is truncated to its first `block_size` tokens; one whose answers all start
  beyond that is dropped (both counted and printed). Batches are padded to their longest example (`ChatCollator`).
* The held-out split takes evenly spaced whole conversations, as `data.held_out_indices` does for blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from ..errors import one_line
from ..text_input import parse_json_line
from . import TrainingError
from .data import _read_text, held_out_indices, require_files


IGNORE = -100  # the label that transformers' causal-LM loss skips
ROLES = ("system", "user", "assistant")
_JSON_TYPES = {str: "string", list: "array", int: "number", float: "number", bool: "boolean", type(None): "null"}


def read_conversations(path: str | Path) -> list[tuple[str, list[dict]]]:
    """(where, messages) of every conversation of a chat .jsonl file, `where` being "FILE:LINE"."""
    path = Path(path)
    require_files([path], "chat data")
    conversations = []
    for number, line in enumerate(_read_text(path).split("\n"), 1):  # not splitlines(): JSON may hold U+2028
        if not line.strip():
            continue
        where = f"{path}:{number}"
        record = parse_json_line(line, where)
        conversations.append((where, check_messages(record, where)))
    if not conversations:
        raise TrainingError(f"chat data file {path} holds no conversation (one JSON object per line)")
    return conversations


def check_messages(record, where: str) -> list[dict]:
    """The record's messages as plain {"role", "content"} dicts, or one line saying what is wrong with them."""
    messages = record.get("messages") if isinstance(record, dict) else None
    if not isinstance(messages, list) or not messages:
        raise TrainingError(
            f'{where}: no "messages" list: each line must be {{"messages": [{{"role": "user", "content": "..."}}, '
            '{"role": "assistant", "content": "..."}]}'
        )
    plain = []
    for k, message in enumerate(messages):
        if not isinstance(message, dict):
            kind = _JSON_TYPES.get(type(message), type(message).__name__)
            raise TrainingError(f'{where}: message {k} is a JSON {kind}, not an object with a "role" and a "content"')
        role = message.get("role")
        if role not in ROLES:
            raise TrainingError(f"{where}: message {k} has role {role!r}: use {', '.join(ROLES)}")
        if not isinstance(message.get("content"), str):
            raise TrainingError(f'{where}: message {k} ({role}) has no string "content"')
        plain.append({"role": role, "content": message["content"]})
    if not any(message["role"] == "assistant" for message in plain):
        raise TrainingError(f"{where}: no assistant turn, so nothing to learn: add one or leave the line out")
    return plain


def check_chat_template(tokenizer, model: str) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise TrainingError(
            f"the tokenizer of {model} has no chat template, which --chat-data needs: add one (chat_template.jinja "
            "next to the tokenizer) or train on plain text with --data"
        )


def _render(tokenizer, messages: list[dict], prompt: bool, where: str) -> list[int]:
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
    except Exception as error:  # the template's raise_exception (jinja2's TemplateError), or a KeyError in it
        raise TrainingError(f"{where}: the chat template refuses this conversation ({one_line(error)})") from None
    return tokenizer(text, add_special_tokens=False, verbose=False).input_ids  # the template places bos itself


def conversation_tokens(tokenizer, messages: list[dict], where: str = "conversation") -> tuple[list[int], list[int]]:
    """(input_ids, labels) of one conversation: labels are the input ids on the assistant turns, -100 elsewhere."""
    ids = _render(tokenizer, messages, False, where)
    labels = [IGNORE] * len(ids)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = _render(tokenizer, messages[:i], True, where)
        through = _render(tokenizer, messages[: i + 1], False, where)
        if through[: len(start)] != start or ids[: len(through)] != through:
            raise TrainingError(
                f"{where}: the chat template does not render this conversation turn by turn (message {i} changes "
                "the tokens before it), so the assistant turns cannot be told apart: use a template that only appends"
            )
        labels[len(start) : len(through)] = through[len(start) :]
    return ids, labels


class ChatDataset(torch.utils.data.Dataset):
    """Tokenised conversations as {"input_ids", "labels"}; `truncated` and `dropped` count the conversations the
    block size cut short or left out (of the files read: a held-out split's are counted in the training set's)."""

    def __init__(self, examples: list[tuple[list[int], list[int]]], truncated: int = 0, dropped: int = 0):
        self.examples, self.truncated, self.dropped = examples, truncated, dropped

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids, labels = self.examples[i]
        return {"input_ids": torch.tensor(ids), "labels": torch.tensor(labels)}

    def subset(self, indices, counts: bool = True) -> ChatDataset:
        examples = [self.examples[i] for i in indices]
        return ChatDataset(examples, self.truncated, self.dropped) if counts else ChatDataset(examples)


class ChatCollator:
    """Pads a batch on the right to its longest example: input ids with `pad_id`, labels with -100, and the
    attention mask 0 there."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        length = max(len(f["input_ids"]) for f in features)
        batch = {
            "input_ids": torch.full((len(features), length), self.pad_id, dtype=torch.long),
            "attention_mask": torch.zeros((len(features), length), dtype=torch.long),
            "labels": torch.full((len(features), length), IGNORE, dtype=torch.long),
        }
        for row, feature in enumerate(features):
            n = len(feature["input_ids"])
            batch["input_ids"][row, :n] = feature["input_ids"]
            batch["attention_mask"][row, :n] = 1
            batch["labels"][row, :n] = feature["labels"]
        return batch


def pad_id(tokenizer) -> int:
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if candidate is not None:
            return candidate
    return 0  # any id: the attention mask hides it and its label is -100


def tokenize_conversations(tokenizer, paths: Sequence[str | Path], block_size: int, role: str) -> ChatDataset:
    examples, truncated, dropped = [], 0, 0
    for path in paths:
        for where, messages in read_conversations(path):
            ids, labels = conversation_tokens(tokenizer, messages, where)
            if len(ids) > block_size:
                ids, labels, truncated = ids[:block_size], labels[:block_size], truncated + 1
            if all(label == IGNORE for label in labels[1:]):  # the first token is never predicted
                dropped += 1
                continue
            examples.append((ids, labels))
    if not examples:
        names = ", ".join(str(p) for p in paths)
        raise TrainingError(
            f"{role} chat data ({names}): every conversation's first answer starts after --block-size {block_size} "
            "tokens: raise --block-size"
        )
    return ChatDataset(examples, truncated, dropped)


def build_chat_datasets(
    tokenizer,
    data: Sequence[str | Path],
    block_size: int,
    *,
    eval_data: Sequence[str | Path] | None = None,
    eval_fraction: float = 0.05,
) -> tuple[ChatDataset, ChatDataset | None]:
    """(train, eval): eval is `eval_data` tokenised alike, else an `eval_fraction` split of the conversations."""
    require_files([*data, *(eval_data or [])], "chat data")
    train = tokenize_conversations(tokenizer, data, block_size, "training")
    if eval_data:
        return train, tokenize_conversations(tokenizer, eval_data, block_size, "eval")
    held = held_out_indices(len(train), eval_fraction).tolist()
    if not held:
        return train, None
    kept = sorted(set(range(len(train))) - set(held))
    if not kept:
        raise TrainingError(
            f"only {len(train)} conversation(s): nothing left to train on after holding out {len(held)}; add "
            "conversations, lower --eval-fraction, or pass --eval-data"
        )
    return train.subset(kept), train.subset(held, counts=False)
