"""The offline demo: the shipped tiny Llama (real tokenizer, trained on Austen) -> Diff V2, verified end to end."""

import contextlib
import io
import json
import re

import pytest

from diff_transformer import cli
from diff_transformer.cli.demo import DEFAULT_PROMPT, DEMO_EVAL_TOKENS, DEMO_MARK, run_demo, shipped_assets
from diff_transformer.outputs.records import wrote_this
from tests.helpers import REPOSITORY


def test_shipped_assets_are_complete():
    with shipped_assets() as (model_dir, heldout):
        names = {p.name for p in model_dir.iterdir()}
        assert {
            "config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
            "generation_config.json",
        } <= names
        config = json.loads((model_dir / "config.json").read_text())
        assert config["model_type"] == "llama"
        assert config["num_attention_heads"] > config["num_key_value_heads"]  # GQA
        assert sum(p.stat().st_size for p in model_dir.iterdir()) < 9e6
        assert len(heldout.read_text(encoding="utf-8")) > 100_000
        repo_copy = REPOSITORY / "data" / "heldout.txt"
        if repo_copy.exists():  # the package's copy is byte-identical to data/heldout.txt
            assert heldout.read_bytes() == repo_copy.read_bytes()


def test_shipped_tokenizer_round_trips_english():
    from transformers import AutoTokenizer

    with shipped_assets() as (model_dir, heldout):
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        sample = heldout.read_text(encoding="utf-8")[:5000]
    texts = [
        (
            "It is a truth universally acknowledged, that a single man in possession of a good fortune, "
            "must be in want of a wife."
        ),
        '"Oh! Mr. Darcy," said she -- £10,000 a year;\n  and   "quotes", naïve café, 1813? Zebra-quartz & jumbo!',
        sample,
    ]
    for text in texts:
        ids = tokenizer(text).input_ids
        assert ids[0] == tokenizer.bos_token_id
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
        assert tokenizer.decode(tokenizer(text, add_special_tokens=False).input_ids) == text
    # A real subword vocabulary: English prose compresses to well under one token per 3 characters.
    assert len(tokenizer(sample, add_special_tokens=False).input_ids) < len(sample) / 3
    assert 2000 <= len(tokenizer) <= 4096
    assert {tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token} == {"<s>", "</s>", "<pad>"}
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello"}], add_generation_prompt=True, tokenize=False
    )
    assert chat == "<s><|user|>\nHello</s>\n<|assistant|>\n"


@pytest.mark.slow
def test_run_demo_end_to_end(tmp_path, capsys):
    """The suite's one full demo: `run_demo` with its figures, then `diff-transformer demo` over its output."""
    out = tmp_path / "tiny-diff-v2"
    buffer = io.StringIO()
    results = {}
    code = run_demo(out, results=results, file=buffer)
    printed = buffer.getvalue()
    assert code == 0, printed
    assert results["ok"] and all(results["checks"].values()), results["checks"]

    # verify_conversion on random tokens and the demo's own comparison on real held-out text.
    assert results["verify_max_abs_logit_diff"] <= 1e-4
    assert results["verify_greedy_match"] is True
    assert results["heldout_max_abs_logit_diff"] <= 1e-4
    # Perplexity: a trained model (far below uniform), unchanged by the conversion.
    assert results["eval_tokens"] == DEMO_EVAL_TOKENS
    assert results["source_perplexity"] < results["vocab_size"] / 10
    assert results["converted_perplexity"] == pytest.approx(results["source_perplexity"], rel=1e-5)
    # Generation: identical English continuations.
    assert results["prompt"] == DEFAULT_PROMPT
    assert results["generations_identical"] is True
    assert results["source_generation"] == results["converted_generation"]
    assert results["generated_tokens"] > 0
    assert re.search(r"[A-Za-z]{3,}", results["source_generation"])
    assert results["converted_class"] == "DiffForCausalLM" and results["diff_version"] == 2

    # The printout states the same figures.
    assert "PASS" in printed and "FAIL" not in printed
    assert (
        f"held-out perplexity on the same {DEMO_EVAL_TOKENS:,} tokens: source {results['source_perplexity']:.4f}, "
        f"converted {results['converted_perplexity']:.4f}" in printed
    )
    assert (
        f"held-out perplexity on the shipped held-out Austen text ({DEMO_EVAL_TOKENS:,} tokens, 16 windows of 256)"
        in printed
    )
    # `convert --verify` scores the demo's text, windows and token count: the same number (issue 57 item 3)
    with shipped_assets() as (model_dir, _):
        verify_out = io.StringIO()
        with contextlib.redirect_stdout(verify_out), contextlib.redirect_stderr(io.StringIO()):
            assert cli.main(["convert", str(model_dir), str(tmp_path / "verified"), "--verify", "--quiet"]) == 0
    verified = re.search(
        r"held-out perplexity on the shipped held-out Austen text \(4,080 tokens, 16 windows of 256\), as the demo "
        r"scores it: source (\S+), converted (\S+)",
        verify_out.getvalue(),
    )
    assert verified, verify_out.getvalue()
    assert verified.group(1) == verified.group(2) == f"{results['source_perplexity']:.4f}"
    assert f"max |Δlogit| = {results['verify_max_abs_logit_diff']:.2e}" in printed
    assert "greedy continuations identical: True" in printed
    continuation = (DEFAULT_PROMPT + results["source_generation"]).replace("\n", "\n" + " " * 20)
    assert f"s): {continuation}" in printed
    assert "token-identical: True" in printed

    # The converted checkpoint was kept where asked, with the tokenizer and chat template.
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "diff" and config["diff_version"] == 2
    assert (out / "tokenizer.json").exists() and (out / "chat_template.jinja").exists()

    # Running again into the same directory (as `diff-transformer demo`) replaces the previous demo output...
    capsys.readouterr()
    assert cli.main(["demo", "--output", str(out), "--prompt", "Mr. Darcy"]) == 0
    printed = capsys.readouterr().out
    assert "greedy continuation of 'Mr. Darcy'" in printed and "PASS" in printed
    assert (out / "config.json").exists() and wrote_this(out, DEMO_MARK)
    # ... but not once something in it changed, unless told to.
    (out / "generation_config.json").write_text("{}")
    buffer = io.StringIO()
    assert run_demo(out, file=buffer) == 2 and "--overwrite" in buffer.getvalue()
    assert (out / "generation_config.json").read_text() == "{}"


def test_run_demo_refuses_foreign_output_dir(tmp_path):
    (tmp_path / "keep.txt").write_text("not a demo output")
    buffer = io.StringIO()
    assert run_demo(tmp_path, file=buffer) == 2
    assert "error:" in buffer.getvalue()
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]
    assert (tmp_path / "keep.txt").read_text() == "not a demo output"


def test_demo_seed_out_of_range_is_one_line(refused, tmp_path):
    """Found by tests/cli/test_option_values.py's long profile: a seed past 2**64 overflowed inside torch."""
    refused(["demo", "--scratch", "--output", tmp_path / "d", "--seed", str(10**23)], "--seed", "[0, 2**32)")
    refused(["demo", "--scratch", "--output", tmp_path / "d", "--seed=-1"], "--seed -1")
    assert not (tmp_path / "d").exists()
