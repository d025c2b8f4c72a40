"""Chat (instruction) data for `train --chat-data`: OpenAI-style conversations, rendered with the model's chat
template, with the loss on the assistant turns only.

* A `.jsonl` file holds one conversation per line: `{"messages": [{"role": "system"|"user"|"assistant", "content":
  "..."}, ...]}`, with at least one assistant turn (other keys of a message are ignored).
* Masking: assistant turn i is the tokens that `messages[: i + 1]` adds to `messages[:i]` rendered with the
  generation prompt, so the template's own tokens before each answer (the prompt, e.g. `<|assistant|>\\n`) get label
  -100 like every system and user turn, and what the template closes an answer with (e.g. eos) is learned. Each
  rendering must be a token prefix of the next (true of templates that only append); a template for which it is not
  (one that rewrites earlier turns, or whose tokens merge across a turn's edge) is refused.
* Linear in the number of turns (`conversation_tokens`): the conversation is rendered and tokenised once, and the
  turn boundaries found in it from renders of a few messages each (the first message and the last two or three before
  the boundary), their concatenation checked against the whole rendering character for character. A template whose
  turns depend on messages further back (it numbers turns, say) is split by rendering each prefix instead, the way
  it always was, up to `EXACT_MESSAGES` messages; longer conversations with such a template are refused.
* Work bounds: every render is `chat_templates.render_chat`'s (one conversation at most its `MAX_INPUT_CHARS`,
  1 Mi characters, the template within its time, step and size bounds); conversations are read and tokenised one at a
  time into flat int32 arrays (8 bytes per token; a line note on stderr every `PROGRESS_EVERY` conversations).
* An example longer than the block size is truncated to its first `block_size` tokens; one whose answers all start
  beyond that is dropped (both counted and printed). Batches are padded to their longest example (`ChatCollator`).
* The held-out split takes evenly spaced whole conversations, as `data.held_out_indices` does for blocks.
"""

from __future__ import annotations

import bisect
import contextlib
from array import array
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch

from ..generation.chat_templates import ChatRenderError, ChatTemplateFailedError, in_process, isolation, render_chat
from ..text_input import parse_json_line
from . import TrainingError
from .data import _read_text, held_out_indices, require_files


IGNORE = -100  # the label that transformers' causal-LM loss skips
ROLES = ("system", "user", "assistant")
EXACT_MESSAGES = 64  # a template that is not message by message: each prefix rendered, up to this many messages
PROGRESS_EVERY = 10_000  # conversations between two progress lines
_WINDOW = 4  # boundaries of the first messages come from renders of the prefix itself
_JSON_TYPES = {str: "string", list: "array", int: "number", float: "number", bool: "boolean", type(None): "null"}


def read_conversations(path: str | Path) -> Iterator[tuple[str, list[dict]]]:
    """(where, messages) of every conversation of a chat .jsonl file, `where` being "FILE:LINE", one at a time."""
    path = Path(path)
    require_files([path], "chat data")
    text = _read_text(path)
    found = False
    for number, line in enumerate(text.split("\n"), 1):  # not splitlines(): JSON may hold U+2028
        if not line.strip():
            continue
        where = f"{path}:{number}"
        record = parse_json_line(line, where)
        found = True
        yield where, check_messages(record, where)
    if not found:
        raise TrainingError(f"chat data file {path} holds no conversation (one JSON object per line)")


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


def _text(tokenizer, messages: list[dict], prompt: bool, where: str) -> str:
    try:
        return render_chat(tokenizer, messages, add_generation_prompt=prompt)
    except ChatRenderError as error:  # too large, past a bound, or the template's own raise_exception
        raise TrainingError(f"{where}: {error}") from None


def _tokens(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False, verbose=False).input_ids  # the template places bos itself


class _NotMessageByMessage(Exception):
    """The windowed renders do not add up to the whole rendering (or its tokens do not split at a boundary)."""

    def __init__(self, message: int):
        self.message = message


def _not_turn_by_turn(where: str, message: int) -> TrainingError:
    return TrainingError(
        f"{where}: the chat template does not render this conversation turn by turn (message {message} changes "
        "the tokens before it), so the assistant turns cannot be told apart: use a template that only appends"
    )


def _context(messages: list[dict], k: int) -> list[dict]:
    """Messages whose rendering ends like that of `messages[:k]`: the prefix itself up to `_WINDOW` messages, else the
    first message (its content left out: only its role and place matter to what follows) and the last two or three,
    as many dropped between as keeps every message's index parity (templates check that roles alternate by
    `loop.index0`)."""
    if k <= _WINDOW:
        return messages[:k]
    j = k - 2 if (k - 2) % 2 == 1 else k - 3  # odd: message t keeps the parity of its index, t - j + 1
    return [{**messages[0], "content": ""}, *messages[j:k]]


def _windowed_boundaries(tokenizer, messages: list[dict], text: str, where: str) -> list[tuple[int, int]]:
    """(start, end) in characters of `text` (the whole rendering) of each assistant turn: start where the rendering of
    the messages before it with the generation prompt ends, end where the rendering through it ends. Each message's
    piece is the difference of two renders of a few messages (`_context`), and the pieces must add up to `text`."""
    cache: dict[tuple[int, bool], str] = {}

    def window_text(window: list[dict], prompt: bool, k: int) -> str:
        try:
            return render_chat(tokenizer, window, add_generation_prompt=prompt)
        except ChatTemplateFailedError:  # a shortened context the template rejects: every prefix rendered instead
            raise _NotMessageByMessage(k) from None
        except ChatRenderError as error:
            raise TrainingError(f"{where}: {error}") from None

    def render(k: int, prompt: bool) -> str:  # the context of messages[:k]
        if (k, prompt) not in cache:
            cache[(k, prompt)] = window_text(_context(messages, k), prompt, k)
        return cache[(k, prompt)]

    ends = []  # ends[k]: characters of text through message k
    for k in range(len(messages)):
        if k + 1 <= _WINDOW:
            whole = render(k + 1, False)
            before = render(k, False) if k else ""
        else:
            window = _context(messages, k + 1)
            whole = render(k + 1, False)
            before = window_text(window[:-1], False, k)
        if not whole.startswith(before):
            raise _NotMessageByMessage(k)
        piece = whole[len(before) :]
        offset = ends[-1] if ends else 0
        if not text.startswith(piece, offset):
            raise _NotMessageByMessage(k)
        ends.append(offset + len(piece))
    if ends[-1] != len(text):
        raise _NotMessageByMessage(len(messages) - 1)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if i == 0:
            prompt, offset = render(0, True), 0
        else:
            plain, prompt = render(i, False), render(i, True)
            if not prompt.startswith(plain):
                raise _NotMessageByMessage(i)
            prompt, offset = prompt[len(plain) :], ends[i - 1]
        if not text.startswith(prompt, offset) or offset + len(prompt) > ends[i]:
            raise _NotMessageByMessage(i)
        spans.append((i, offset + len(prompt), ends[i]))
    return spans


def _token_index(offsets: list[tuple[int, int]], ends: list[int], x: int, message: int) -> int:
    """Tokens of the text before character x (the offsets sorted, as a tokenizer returns them); no token may
    straddle x (then the tokens of the prefix alone would differ: refused as today)."""
    n = bisect.bisect_right(ends, x)  # tokens that end at or before x
    if n < len(offsets) and offsets[n][0] < x:
        raise _NotMessageByMessage(message)
    return n


def _linear_tokens(tokenizer, messages: list[dict], where: str, text: str) -> tuple[list[int], list[int]]:
    spans = _windowed_boundaries(tokenizer, messages, text, where)
    encoding = tokenizer(text, add_special_tokens=False, verbose=False, return_offsets_mapping=True)
    ids, offsets = encoding.input_ids, [tuple(o) for o in encoding["offset_mapping"]]
    ends = [end for _, end in offsets]
    if any(b < a for a, b in zip(ends, ends[1:])):  # offsets out of order: no split by characters
        raise _NotMessageByMessage(0)
    labels = [IGNORE] * len(ids)
    for i, start, end in spans:
        a, b = _token_index(offsets, ends, start, i), _token_index(offsets, ends, end, i)
        labels[a:b] = ids[a:b]
    return ids, labels


def _prefix_tokens(tokenizer, messages: list[dict], where: str, text: str) -> tuple[list[int], list[int]]:
    """Every prefix rendered and tokenised (quadratic in the turns: for templates that are not message by message)."""
    ids = _tokens(tokenizer, text)
    labels = [IGNORE] * len(ids)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = _tokens(tokenizer, _text(tokenizer, messages[:i], True, where))
        through = _tokens(tokenizer, _text(tokenizer, messages[: i + 1], False, where))
        if through[: len(start)] != start or ids[: len(through)] != through:
            raise _not_turn_by_turn(where, i)
        labels[len(start) : len(through)] = through[len(start) :]
    return ids, labels


def conversation_tokens(tokenizer, messages: list[dict], where: str = "conversation") -> tuple[list[int], list[int]]:
    """(input_ids, labels) of one conversation: labels are the input ids on the assistant turns, -100 elsewhere."""
    text = _text(tokenizer, messages, False, where)
    if getattr(tokenizer, "is_fast", False):  # character offsets: the boundaries found in one tokenisation
        try:
            return _linear_tokens(tokenizer, messages, where, text)
        except _NotMessageByMessage as error:
            if len(messages) > EXACT_MESSAGES:
                raise TrainingError(
                    f"{where}: the chat template does not render this conversation message by message (message "
                    f"{error.message}'s tokens depend on messages further back, or merge across a turn's edge), and "
                    f"its {len(messages):,} messages are more than the {EXACT_MESSAGES} whose prefixes are each "
                    "rendered instead: split the conversation, or use a template that only appends"
                ) from None
    elif len(messages) > EXACT_MESSAGES:
        raise TrainingError(
            f"{where}: {len(messages):,} messages with a slow (Python) tokenizer, which gives no character offsets to "
            f"split one tokenisation at the turns: at most {EXACT_MESSAGES} (each prefix is tokenised), or save the "
            "model with a fast tokenizer (tokenizer.json)"
        )
    return _prefix_tokens(tokenizer, messages, where, text)


class ChatDataset(torch.utils.data.Dataset):
    """Tokenised conversations as {"input_ids", "labels"}, held in flat int32 arrays (8 bytes a token, whatever the
    number of conversations); `truncated` and `dropped` count the conversations the block size cut short or left out
    (of the files read: a held-out split's are counted in the training set's)."""

    def __init__(self, truncated: int = 0, dropped: int = 0):
        self.ids, self.labels, self.starts = array("i"), array("i"), array("q", [0])
        self.truncated, self.dropped = truncated, dropped

    def append(self, ids: Sequence[int], labels: Sequence[int]) -> None:
        self.ids.extend(ids)
        self.labels.extend(labels)
        self.starts.append(len(self.ids))

    def __len__(self) -> int:
        return len(self.starts) - 1

    def example(self, i: int) -> tuple[list[int], list[int]]:
        a, b = self.starts[i], self.starts[i + 1]
        return self.ids[a:b].tolist(), self.labels[a:b].tolist()

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        a, b = self.starts[i], self.starts[i + 1]
        return {
            "input_ids": torch.frombuffer(self.ids[a:b], dtype=torch.int32).long(),
            "labels": torch.frombuffer(self.labels[a:b], dtype=torch.int32).long(),
        }

    def subset(self, indices, counts: bool = True) -> ChatDataset:
        subset = ChatDataset(self.truncated, self.dropped) if counts else ChatDataset()
        for i in indices:
            subset.append(*self.example(i))
        return subset


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


def tokenize_conversations(
    tokenizer,
    paths: Sequence[str | Path],
    block_size: int,
    role: str,
    progress: Callable[[str], None] | None = None,
) -> ChatDataset:
    """The conversations of `paths`, read and tokenised one at a time; `progress` gets a line every
    `PROGRESS_EVERY` conversations."""
    dataset, count = ChatDataset(), 0
    for path in paths:
        for where, messages in read_conversations(path):
            # The first conversation renders as every CLI render does (`render_chat`: in a forked child where the
            # platform forks), so a template that builds gigabytes in one C call whatever the data is stopped there;
            # the others render in this process under the Python-level bounds: a fork costs tens of milliseconds a
            # render (benchmarks/render_isolation.py), several renders a conversation, for every conversation.
            with contextlib.nullcontext() if count == 0 else isolation(in_process):
                ids, labels = conversation_tokens(tokenizer, messages, where)
            if len(ids) > block_size:
                ids, labels, dataset.truncated = ids[:block_size], labels[:block_size], dataset.truncated + 1
            count += 1
            if progress is not None and count % PROGRESS_EVERY == 0:
                progress(f"{role} chat data: {count:,} conversations tokenised ({where})")
            if all(label == IGNORE for label in labels[1:]):  # the first token is never predicted
                dataset.dropped += 1
                continue
            dataset.append(ids, labels)
    if not len(dataset):
        names = ", ".join(str(p) for p in paths)
        raise TrainingError(
            f"{role} chat data ({names}): every conversation's first answer starts after --block-size {block_size} "
            "tokens: raise --block-size"
        )
    return dataset


def build_chat_datasets(
    tokenizer,
    data: Sequence[str | Path],
    block_size: int,
    *,
    eval_data: Sequence[str | Path] | None = None,
    eval_fraction: float = 0.05,
    progress: Callable[[str], None] | None = None,
) -> tuple[ChatDataset, ChatDataset | None]:
    """(train, eval): eval is `eval_data` tokenised alike, else an `eval_fraction` split of the conversations."""
    require_files([*data, *(eval_data or [])], "chat data")
    train = tokenize_conversations(tokenizer, data, block_size, "training", progress)
    if eval_data:
        return train, tokenize_conversations(tokenizer, eval_data, block_size, "eval", progress)
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
