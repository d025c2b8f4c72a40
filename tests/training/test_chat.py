"""`diff-transformer train --chat-data` (diff_transformer.training.chat): the assistant-only label mask against a hand
computation on the shipped tiny tokenizer's chat template, padding, truncation, the held-out loss over answer tokens,
full and LoRA runs on a 2-layer model, and every refusal of bad chat data."""

import json
import shutil

import pytest
import torch
from transformers import AutoTokenizer

from diff_transformer import DiffForCausalLM, cli
from diff_transformer.errors import UserError
from diff_transformer.training.chat import IGNORE, ChatCollator, build_chat_datasets, conversation_tokens
from tests.helpers import REPOSITORY
from tests.helpers.checkpoints import save_trainable_checkpoint
from tests.helpers.training import QUIET


TOKENIZER = REPOSITORY / "src" / "diff_transformer" / "assets" / "tiny-llama"
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Who wrote Emma?"},
    {"role": "assistant", "content": "Jane Austen."},
    {"role": "user", "content": "When?"},
    {"role": "assistant", "content": "In 1815."},
]
SHORT = [  # a few conversations that fit the test model's 64 positions
    [("user", "Who wrote Emma?"), ("assistant", "Jane Austen.")],
    [("system", "Be brief."), ("user", "Her sister?"), ("assistant", "Cassandra.")],
    [("user", "Emma's home?"), ("assistant", "Hartfield."), ("user", "Near?"), ("assistant", "Highbury.")],
    [("user", "Author of Persuasion?"), ("assistant", "Austen.")],
]


def write_chats(path, conversations, repeat=1):
    lines = [json.dumps({"messages": [{"role": r, "content": c} for r, c in turns]}) for turns in conversations]
    path.write_text("\n".join(lines * repeat) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TOKENIZER)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    save_trainable_checkpoint(root / "v2", 2)
    write_chats(root / "chat.jsonl", SHORT, repeat=2)
    return root


def test_the_shipped_tokenizer_has_a_chat_template(tokenizer):
    assert tokenizer.chat_template and "add_generation_prompt" in tokenizer.chat_template


def test_labels_are_the_assistant_turns_only_by_hand(tokenizer):
    """The template written out by hand (no apply_chat_template): `<s>`, then `<|role|>\\ncontent</s>\\n` per
    message. The prompt before each answer (`<|assistant|>\\n`) is masked; the answer, its `</s>` and newline are
    learned."""
    pieces = [  # (text, learned)
        ("<s><|system|>\nBe brief.</s>\n<|user|>\nWho wrote Emma?</s>\n<|assistant|>\n", False),
        ("Jane Austen.</s>\n", True),
        ("<|user|>\nWhen?</s>\n<|assistant|>\n", False),
        ("In 1815.</s>\n", True),
    ]
    ids, labels = [], []
    for text, learned in pieces:
        piece = tokenizer(text, add_special_tokens=False).input_ids
        ids += piece
        labels += piece if learned else [IGNORE] * len(piece)
    assert conversation_tokens(tokenizer, MESSAGES) == (ids, labels)
    assert tokenizer.decode([t for t in labels if t != IGNORE]) == "Jane Austen.</s>\nIn 1815.</s>\n"
    assert ids[:2] == [tokenizer.bos_token_id, tokenizer.convert_tokens_to_ids("<|system|>")]


def test_collator_pads_right_with_masked_labels(tokenizer):
    features = [{"input_ids": torch.tensor([5, 6, 7]), "labels": torch.tensor([-100, 6, 7])}]
    features.append({"input_ids": torch.tensor([8]), "labels": torch.tensor([-100])})
    batch = ChatCollator(2)(features)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 2, 2]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7], [-100, -100, -100]]


def test_long_conversations_are_truncated_or_left_out(tokenizer, tmp_path):
    path = write_chats(tmp_path / "c.jsonl", [[("user", "x" * 40), ("assistant", "y")], SHORT[0]])
    full = [conversation_tokens(tokenizer, [{"role": r, "content": c} for r, c in SHORT[0]])]
    first_answer = full[0][1].index(next(t for t in full[0][1] if t != IGNORE))
    train, held = build_chat_datasets(tokenizer, [path], first_answer + 2, eval_fraction=0)
    assert held is None and (train.truncated, train.dropped, len(train)) == (2, 1, 1)  # the long one has no answer
    assert train[0]["input_ids"].tolist() == full[0][0][: first_answer + 2]
    train, held = build_chat_datasets(tokenizer, [path] * 2, 64, eval_fraction=0.5)
    assert (len(train), len(held), train.truncated, held.truncated) == (2, 2, 0, 0)


def history(output):
    return json.loads((output / "trainer_state.json").read_text())["log_history"]


def chat_run(workdir, output, *extra):
    argv = ["train", workdir / "v2", "--chat-data", workdir / "chat.jsonl", "--output", output, *QUIET]
    argv += ["--block-size", "64", "--batch-size", "4", "--logging-steps", "1", "--lr", "3e-3", *extra]
    assert cli.main([str(a) for a in argv]) == 0
    return {entry["step"]: entry for entry in history(output) if "loss" in entry}


def test_held_out_loss_is_the_mean_nll_of_the_answer_tokens(workdir, tmp_path, tokenizer):
    """Step-0 evaluation of all held-out conversations in one padded batch = the untrained model's mean NLL over
    every answer token, computed here one conversation at a time without padding."""
    eval_file = write_chats(tmp_path / "eval.jsonl", SHORT)
    chat_run(workdir, tmp_path / "out", "--eval-data", eval_file, "--eval-batch-size", "4", "--eval-on-start")
    logged = next(entry["eval_loss"] for entry in history(tmp_path / "out") if entry.get("step") == 0)
    model = DiffForCausalLM.from_pretrained(workdir / "v2", attn_implementation="eager").eval()
    total, count = 0.0, 0
    for turns in SHORT:
        ids, labels = conversation_tokens(tokenizer, [{"role": r, "content": c} for r, c in turns])
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, :-1]
        targets = torch.tensor(labels[1:])
        nll = torch.nn.functional.cross_entropy(logits, targets, ignore_index=IGNORE, reduction="sum")
        total, count = total + nll.item(), count + int((targets != IGNORE).sum())
    assert logged == pytest.approx(total / count, rel=1e-5)


LORA = ["--lora", "--lora-target-modules", "q_proj", "v_proj", "o_proj", "down_proj", "--lr", "3e-2"]


@pytest.mark.parametrize("extra", [[], LORA], ids=["full", "lora"])
def test_loss_decreases_in_full_and_lora_training(workdir, tmp_path, extra):
    """Every step trains on the same batch (all 8 conversations), so the loss falls steadily (LoRA's slowly: the
    random model's embeddings and lm_head stay frozen)."""
    logs = chat_run(workdir, tmp_path / "out", "--max-steps", "8", "--batch-size", "8", "--eval-fraction", "0", *extra)
    assert sorted(logs) == list(range(1, 9))
    drop = 0.08 if extra else 0.3
    assert logs[8]["loss"] < logs[1]["loss"] - drop, (logs[1]["loss"], logs[8]["loss"])
    saved = "adapter_config.json" if extra else "model.safetensors"
    assert (tmp_path / "out" / saved).is_file()
    state = json.loads((tmp_path / "out" / "checkpoint-8" / "trainer_state.json").read_text())
    assert state["stateful_callbacks"]["RunSettingsCallback"]["args"]["chat"] is True


def test_bad_chat_data_is_refused_in_one_line(refused, workdir, tmp_path):
    out = tmp_path / "out"

    def refuse(lines, *words, extra=()):
        path = tmp_path / "bad.jsonl"
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        refused(["train", workdir / "v2", "--chat-data", path, "--output", out, *QUIET, *extra], *words)
        assert not out.exists()

    good = json.dumps({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]})
    refuse([good, "{not json"], f"{tmp_path / 'bad.jsonl'}:2:", "not valid JSON")
    refuse([good, '{"text": "plain"}'], "bad.jsonl:2:", 'no "messages" list')
    refuse(['{"messages": [{"role": "tool", "content": "x"}]}'], "bad.jsonl:1:", "message 0 has role 'tool'")
    refuse(['{"messages": ["hi"]}'], "message 0 is a JSON string, not an object")
    refuse(['{"messages": [{"role": "user", "content": 7}]}'], 'message 0 (user) has no string "content"')
    refuse(['{"messages": [{"role": "user", "content": "Hi"}]}'], "bad.jsonl:1:", "no assistant turn")
    refuse([""], "holds no conversation")
    refuse([good], "--no-bos applies to --data only", extra=["--no-bos"])
    refuse([good], "--text-field applies to --data only", extra=["--text-field", "body"])
    refused(["train", workdir / "v2", "--chat-data", tmp_path / "missing.jsonl", "--output", out, *QUIET], "missing")


@pytest.mark.parametrize(
    "template, words",
    [
        (None, ["has no chat template", "--data"]),
        (  # the number of messages up front: each turn rewrites what came before
            "{{ messages|length }}{% for m in messages %}{{ m['content'] }}{% endfor %}",
            ["bad.jsonl:1:", "does not render this conversation turn by turn"],
        ),
        ("{{ raise_exception('roles must alternate') }}", ["bad.jsonl:1:", "refuses", "roles must alternate"]),
    ],
    ids=["none", "not-a-prefix", "raises"],
)
def test_unusable_chat_templates_are_refused(refused, workdir, tmp_path, template, words):
    model = tmp_path / "model"
    save_trainable_checkpoint(model, 2)
    (model / "chat_template.jinja").unlink()
    if template is not None:
        (model / "chat_template.jinja").write_text(template, encoding="utf-8")
    data = write_chats(tmp_path / "bad.jsonl", SHORT[2:3])
    refused(["train", model, "--chat-data", data, "--output", tmp_path / "out", *QUIET], *words)


def test_data_and_chat_data_are_exclusive_and_resume_keeps_the_kind(workdir, tmp_path, capsys):
    argv = ["train", str(workdir / "v2"), "--data", "a.txt", "--chat-data", "b.jsonl", "--output", str(tmp_path)]
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
    out = tmp_path / "run"
    chat_run(workdir, out, "--max-steps", "2", "--save-steps", "1", "--eval-fraction", "0")
    text = tmp_path / "text.txt"
    text.write_text("Emma Woodhouse, handsome, clever, and rich. " * 40, encoding="utf-8")
    argv = ["train", str(workdir / "v2"), "--data", str(text), "--output", str(out), *QUIET, "--max-steps", "3"]
    assert cli.main([*argv, "--block-size", "64", "--resume", str(out / "checkpoint-1")]) == 2
    assert "that run trained on --chat-data, not --data" in capsys.readouterr().err


def test_labels_equal_trls_prompt_completion_masking(workdir, tokenizer, tmp_path):
    """TRL (not a dependency: skipped without it) tokenises each conversation split before its last answer as a
    prompt and a completion, the loss on the completion: the same input ids, and the same labels on that answer."""
    pytest.importorskip("trl")
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    conversations = [json.loads(line)["messages"] for line in (REPOSITORY / "data" / "chat.jsonl").open()]
    pairs = Dataset.from_list([{"prompt": m[:-1], "completion": m[-1:]} for m in conversations])
    config = SFTConfig(output_dir=str(tmp_path / "trl"), max_length=None, bf16=False, report_to="none")
    trainer = SFTTrainer(model=str(workdir / "v2"), train_dataset=pairs, args=config)
    for messages, example in zip(conversations, trainer.train_dataset, strict=True):
        ids, labels = conversation_tokens(tokenizer, messages)
        prompt = len(
            tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True, return_dict=True)["input_ids"]
        )
        assert example["input_ids"] == ids
        assert example["labels"] == [IGNORE] * prompt + labels[prompt:]


# ---- issue 46: one bounded renderer, linear in the turns, streamed ----

NUMBERED = (  # message by message, but each turn's text depends on its index: prefixes rendered instead
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>{{ loop.index }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def turns(n, system=False):
    messages = [{"role": "system", "content": "Be brief."}] if system else []
    return messages + [
        {"role": ("user", "assistant")[i % 2], "content": f"turn {i}" + " word" * (i % 7)} for i in range(n)
    ]


def prefix_rendering(tokenizer, messages):
    """The labels as they were computed before issue 46: each assistant turn from renders of its two prefixes."""
    from diff_transformer.training import chat

    return chat._prefix_tokens(tokenizer, messages, "x", chat._text(tokenizer, messages, False, "x"))


@pytest.mark.parametrize("length", ["short", pytest.param("long", marks=pytest.mark.slow)])
def test_labels_from_one_rendering_equal_those_of_every_prefix(tokenizer, length):
    """The boundaries found in one rendering (from renders of a few messages each) give exactly the labels that
    rendering every prefix gives: the repository's chat data, the hand-checked conversation, conversations of 2 to 10
    messages with and without a system message (40 and 41 in the slow variant: the reference renders every prefix,
    quadratic work); and a template that numbers its turns (not message by message: each prefix is rendered for
    it)."""
    if length == "long":
        conversations = [turns(40), turns(40, True)]
    else:
        conversations = [json.loads(line)["messages"] for line in (REPOSITORY / "data" / "chat.jsonl").open()]
        conversations += [MESSAGES, *(turns(n) for n in (2, 3, 5, 6, 9)), *(turns(n, True) for n in (4, 7))]
    for messages in conversations:
        assert conversation_tokens(tokenizer, messages) == prefix_rendering(tokenizer, messages), messages
    if length == "long":
        return
    numbered = AutoTokenizer.from_pretrained(TOKENIZER)
    numbered.chat_template = NUMBERED
    for n in (4, 12):
        ids, labels = conversation_tokens(numbered, turns(n))
        assert (ids, labels) == prefix_rendering(numbered, turns(n))
        assert numbered.decode([t for t in labels if t != IGNORE]).startswith("turn 1 word</s>2\n")


class CountingRenders:
    """The tokenizer's renders counted: calls, and characters rendered."""

    def __init__(self, tokenizer):
        self.calls = self.characters = 0
        self.apply = tokenizer.apply_chat_template
        tokenizer.apply_chat_template = self

    def __call__(self, *args, **kwargs):
        text = self.apply(*args, **kwargs)
        self.calls += 1
        self.characters += len(text)
        return text


@pytest.mark.parametrize("n", [500, 2000])
def test_a_long_conversation_is_rendered_in_linear_work(n):
    """A 2,000-turn line took minutes: every assistant turn rendered (and tokenised) both its prefixes, n^2/2 message
    renders. Now the characters rendered are a constant multiple of the conversation's own rendering (about 9: ~3
    renders of 3-4 messages per message), whatever n; the prefix renders would have been n/2 times it."""
    from diff_transformer.generation import chat_templates

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    counter = CountingRenders(tokenizer)
    messages = turns(n)
    with chat_templates.isolation(chat_templates.in_process):  # the work counted here, not the forked child's bounds
        ids, labels = conversation_tokens(tokenizer, messages)
    whole = len(counter.apply(messages, tokenize=False))
    print(f"{n} turns: {counter.calls} renders, {counter.characters} characters, whole rendering {whole}")
    assert counter.calls <= 4 * n and counter.characters <= 12 * whole, (counter.calls, counter.characters, whole)
    assert tokenizer.decode([t for t in labels if t != IGNORE]).count("</s>") == n // 2


def test_a_template_not_message_by_message_is_refused_past_its_exact_limit(refused, workdir, tmp_path):
    from diff_transformer.training.chat import EXACT_MESSAGES

    model = tmp_path / "model"
    save_trainable_checkpoint(model, 2)
    (model / "chat_template.jinja").write_text(NUMBERED, encoding="utf-8")
    data = tmp_path / "long.jsonl"
    data.write_text(json.dumps({"messages": turns(EXACT_MESSAGES + 2)}) + "\n", encoding="utf-8")
    refused(
        ["train", model, "--chat-data", data, "--output", tmp_path / "out", *QUIET],
        "long.jsonl:1:",
        "does not render this conversation message by message",
        f"{EXACT_MESSAGES + 2} messages are more than the {EXACT_MESSAGES}",
    )


def test_hostile_templates_and_huge_conversations_are_refused_in_one_line(refused, tmp_path):
    """The renderer of every command (chat_templates.render_chat): a template with nested loops is stopped at its
    bound, one that raises is quoted, and a conversation over the input limit is refused as too large (not blamed on
    the template): each one line naming the file and line."""
    model = tmp_path / "model"
    save_trainable_checkpoint(model, 2)
    data = write_chats(tmp_path / "chat.jsonl", SHORT[:1])
    argv = ["train", model, "--chat-data", data, "--output", tmp_path / "out", *QUIET]
    nested = "{% for a in range(10**5) %}{% for b in range(10**5) %}{% endfor %}{% endfor %}"
    (model / "chat_template.jinja").write_text(nested, encoding="utf-8")
    refused(argv, "chat.jsonl:1:", "the chat template went past a bound", "rendering it")
    (model / "chat_template.jinja").write_text("{{ range(10**6)|list }}", encoding="utf-8")
    refused(argv, "chat.jsonl:1:", "the chat template went past a bound", "MAX_RANGE")
    shutil.copy(TOKENIZER / "chat_template.jinja", model / "chat_template.jinja")
    write_chats(data, [[("user", "x" * (1 << 20)), ("assistant", "y")]])
    line = refused(argv, "chat.jsonl:1:", "come to more than 1,048,576 characters", "send a shorter conversation")
    assert "fix the template" not in line
    assert not (tmp_path / "out").exists()


def test_conversations_are_tokenised_as_they_are_read_into_flat_arrays(tokenizer, tmp_path, monkeypatch):
    """Streamed: the progress line of each conversation comes before a bad line further on is read; the tokens are
    held in two flat int32 arrays, not a Python list per conversation."""
    from diff_transformer.training import chat

    monkeypatch.setattr(chat, "PROGRESS_EVERY", 2)
    path = write_chats(tmp_path / "c.jsonl", SHORT * 2)
    lines = []
    train, held = build_chat_datasets(tokenizer, [path], 64, eval_fraction=0, progress=lines.append)
    assert lines == [f"training chat data: {k:,} conversations tokenised ({path}:{k})" for k in (2, 4, 6, 8)]
    assert held is None and len(train) == 8 and train.ids.typecode == train.labels.typecode == "i"
    expected = [conversation_tokens(tokenizer, [{"role": r, "content": c} for r, c in t]) for t in SHORT * 2]
    assert [train.example(i) for i in range(8)] == expected
    assert train[3]["input_ids"].dtype == torch.long and train[3]["labels"].tolist() == expected[3][1]
    path.write_text(path.read_text() + "{not json\n", encoding="utf-8")
    lines.clear()
    with pytest.raises(UserError, match="c.jsonl:9: not valid JSON"):
        build_chat_datasets(tokenizer, [path], 64, eval_fraction=0, progress=lines.append)
    assert len(lines) == 4  # the eight conversations before it were tokenised before line 9 was read
