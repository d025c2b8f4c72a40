"""The one text-input gate (`diff_transformer.text_input`): what JSON or the OS decoder accepts and the tokenizer does
not (lone surrogates, integer literals over Python's digit limit) is refused in one line naming the file and line,
in every text a command reads from the user: train's --data, --eval-data, --chat-data, generate's PROMPT and
--system, and interactive chat's stdin, where one bad message does not end the session."""

import io
import sys
from pathlib import Path

import pytest

from diff_transformer import cli


SOURCE = Path(__file__).parents[2] / "src" / "diff_transformer" / "assets" / "tiny-llama"
SURROGATE = '"ok \\ud800 then"'  # valid JSON, decodes to a lone surrogate
HUGE = "9" * 5000  # valid JSON, over Python's 4,300-digit limit
CHAT = '{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}'


@pytest.mark.parametrize(
    "line,words",
    [
        ('{"text": ' + SURROGATE + "}", ["lone surrogate (U+D800)"]),
        ('{"text": "fine", "n": ' + HUGE + "}", ["more than 4300 digits"]),
        ('{"text": "fine", "meta": {"k": [' + SURROGATE + "]}}", ["lone surrogate"]),  # nested, not the text field
    ],
    ids=["surrogate", "huge-number", "nested-surrogate"],
)
@pytest.mark.parametrize("option", ["--data", "--eval-data", "--chat-data"])
def test_train_refuses_untokenizable_text_naming_file_and_line(refused, tmp_path, line, words, option):
    good = tmp_path / "good.jsonl"
    good.write_text('{"text": "Elizabeth walked."}\n' * 4 if option != "--chat-data" else (CHAT + "\n") * 4)
    bad = tmp_path / "bad.jsonl"
    if option == "--chat-data":  # the same value inside a message's content
        line = line.replace('{"text": ', '{"messages": [{"role": "user", "content": ', 1) + "]}"
    first = CHAT if option == "--chat-data" else '{"text": "x"}'
    bad.write_text(f"{first}\n{line}\n")
    data = ["--chat-data", str(good)] if option == "--chat-data" else ["--data", str(good)]
    inputs = ["--chat-data", str(bad)] if option == "--chat-data" else [*data, option, str(bad)]
    argv = ["train", str(SOURCE), "--any-model", *inputs, "--output", str(tmp_path / "run"), "--max-steps", "1"]
    refused([*argv, "--block-size", "16", "--report-to", "none"], f"{bad}:2:", *words)
    assert not (tmp_path / "run").exists()


def test_generate_refuses_undecodable_arguments_and_chat_keeps_the_session(refused, monkeypatch, capsys):
    bad = "hi \udcff there"  # argv bytes that are not UTF-8, as Python decodes them
    refused(["generate", str(SOURCE), bad, "--max-new-tokens", "2"], "PROMPT", "lone surrogate (U+DCFF)")
    refused(["generate", str(SOURCE), "hi", "--chat", "--system", bad], "--system", "lone surrogate")
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"{bad}\nWho is Mr. Darcy?\n/exit\n"))
    capsys.readouterr()
    assert cli.main(["generate", str(SOURCE), "--chat", "--max-new-tokens", "3"]) == 0
    captured = capsys.readouterr()
    assert "error: this message: character 3 is a lone surrogate (U+DCFF)" in captured.err
    assert captured.out.strip()  # the next message was answered
