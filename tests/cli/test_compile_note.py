"""generate says when it compiles before its first tokens (issue 57 item 5): --compile, and flex attention on the CPU
(C++ kernels), one line on stderr each, none under --quiet or for a backend that compiles nothing."""

import argparse

import pytest

from diff_transformer.cli.generate import _compile_note


def options(**given):
    return argparse.Namespace(**{"compile": False, "attn_implementation": None, "quiet": False, **given})


@pytest.mark.parametrize(
    ("given", "device", "said"),
    [
        ({"compile": True}, "cpu", "compiling the decoding step"),
        ({"compile": True}, "cuda", "compiling the decoding step"),
        ({"attn_implementation": "flex_attention"}, "cpu", "compiling flex attention's C++ kernels"),
        ({"attn_implementation": "flex_attention"}, "cuda", None),
        ({"attn_implementation": "sdpa"}, "cpu", None),
        ({}, "cpu", None),
    ],
)
def test_a_compiling_run_says_so_in_one_line(given, device, said, capsys):
    what = _compile_note(options(**given), device)
    captured = capsys.readouterr()
    assert captured.out == ""
    if said is None:
        assert what is None and captured.err == ""
    else:
        assert what.startswith(said) and captured.err.count("\n") == 1
        assert captured.err.startswith(f"note: {said}") and "docs/performance.md" in captured.err


def test_quiet_silences_it(capsys):
    assert _compile_note(options(compile=True, quiet=True), "cpu") is None
    assert capsys.readouterr().err == ""
