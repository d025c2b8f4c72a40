"""--calibration-data is decoded by one rule whatever its size (issue 56 item 5): strict UTF-8, only an incomplete
character at the MAX_TEXT_BYTES cut dropped. Before, a file of 4 MiB or more was decoded ignoring invalid bytes
(5 MiB of random bytes accepted, 3 MiB of Latin-1 refused)."""

import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from diff_transformer.conversion import ConversionError, calibrate
from diff_transformer.conversion.calibrate import MAX_TEXT_BYTES, read_calibration_text


# Bytes that can never start or continue a UTF-8 character where they stand (a character boundary).
INVALID = st.sampled_from([b"\xff", b"\xfe", b"\xc0", b"\xc1", b"\x80", b"\xbf", b"\xf8"])
TEXT = st.text(st.characters(exclude_categories=["Cs"], exclude_characters="\0"), min_size=1, max_size=60)


@settings(max_examples=300, deadline=None)
@given(text=TEXT, bad=st.none() | INVALID, where=st.integers(0, 60), limit=st.integers(4, 100))
def test_every_size_is_decoded_by_the_same_strict_rule(tmp_path_factory, text, bad, where, limit):
    """Independent reference: the longest whole-character prefix of the file's text that fits in `limit` bytes is
    the answer; a bad byte inside those bytes is refused, whichever side of the cut the file's size is."""
    characters = text[: min(where, len(text))], text[min(where, len(text)) :]
    data = characters[0].encode() + (bad or b"") + characters[1].encode()
    path = tmp_path_factory.mktemp("cal") / "text.txt"
    path.write_bytes(data)
    bad_at = len(characters[0].encode()) if bad else None
    expected, size = "", 0
    for character in text:  # the whole characters of the text that fit before the cut and before any bad byte
        width = len(character.encode())
        if size + width > limit or (bad_at is not None and size + width > bad_at):
            break
        expected, size = expected + character, size + width
    mp = pytest.MonkeyPatch()
    mp.setattr(calibrate, "MAX_TEXT_BYTES", limit)
    try:
        if bad_at is not None and bad_at < limit:
            with pytest.raises(ConversionError, match="is not UTF-8 text"):
                read_calibration_text(path)
        elif not expected.strip():
            with pytest.raises(ConversionError, match="is empty|is not UTF-8"):
                read_calibration_text(path)
        else:
            assert read_calibration_text(path) == expected
    finally:
        mp.undo()


def test_files_over_the_cut_are_refused_as_files_under_it(tmp_path):
    noise = bytearray(random.Random(0).randbytes(5 << 20))
    noise[:] = noise.replace(b"\0", b"\1")  # random bytes without NUL: refused as not UTF-8, not as binary
    (tmp_path / "random.bin").write_bytes(bytes(noise))
    (tmp_path / "latin1.txt").write_bytes("Café au lait. ".encode("latin-1") * ((5 << 20) // 14))
    for name in ("random.bin", "latin1.txt"):
        with pytest.raises(ConversionError, match="is not UTF-8 text"):
            read_calibration_text(tmp_path / name)
    # valid UTF-8 over the cut, with a 3-byte character straddling it: accepted, the partial character dropped
    text = "a" * (MAX_TEXT_BYTES - 1) + "€" * 10
    (tmp_path / "long.txt").write_text(text, encoding="utf-8")
    assert read_calibration_text(tmp_path / "long.txt") == "a" * (MAX_TEXT_BYTES - 1)


def test_long_text_tokenizes_without_the_indexing_errors_warning(tmp_path, caplog):
    """Issue 56 item 5: `convert --diff-version 1 --calibration-data` printed the tokenizer's "... will result in
    indexing errors" for a text longer than the model's context, which the calibration cuts into blocks of at most
    the context: advice that does not apply. The same tokenizer, asked directly, still warns (the control)."""
    from transformers import AutoTokenizer

    import diff_transformer

    tiny_llama = Path(diff_transformer.__file__).parent / "assets" / "tiny-llama"
    text = tmp_path / "long.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 400)  # ~4,000 tokens, the context 512
    caplog.clear()
    plan = calibrate.plan_calibration(tiny_llama, 2048, 512, calibration_data=text, num_blocks=2, block_size=64)
    assert plan.blocks.shape == (2, 64)
    assert not any("indexing errors" in message for message in caplog.messages), caplog.messages
    AutoTokenizer.from_pretrained(tiny_llama)(text.read_text(), add_special_tokens=False)
    assert any("will result in indexing errors" in m for m in caplog.messages)  # the control: this tokenizer warns
