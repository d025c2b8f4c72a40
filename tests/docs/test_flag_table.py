"""docs/training.md's table of `train` flags and their TrainingArguments / TRL / PEFT names (issue 45): every flag of
the parser is in it, every name it gives is a field of the installed class, and a flag mapped to one field sets that
field to the flag's value in the TrainingArguments that `train` builds."""

import dataclasses
import enum
import re

import pytest
from transformers import TrainingArguments

from diff_transformer.errors import installed
from diff_transformer.training.args import add_train_arguments, parse_train_args
from diff_transformer.training.train import training_arguments
from tests.helpers import REPOSITORY


HEADER = "| `train` flag |"
IDENTIFIER = re.compile(r"^([a-z_][a-z0-9_]*)(=.*)?$")  # `name` or `name=value`: a field of the column's class


def table() -> dict[str, tuple[str, str]]:
    """{flag: (TrainingArguments cell, TRL/PEFT cell)}."""
    text = (REPOSITORY / "docs" / "training.md").read_text(encoding="utf-8")
    lines = text.split(HEADER, 1)[1].split("\n\n", 1)[0].splitlines()[2:]  # after the header's rest and |---|
    rows = {}
    for line in lines:
        cells = [cell.strip() for cell in line.strip().strip("|").split(" | ")]
        assert len(cells) == 3, line
        rows[cells[0].strip("`")] = (cells[1], cells[2])
    return rows


def ticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def main_field(cell: str):
    """The IDENTIFIER match of the name a cell opens with (None: it opens with "—" or a call)."""
    return IDENTIFIER.match(ticked(cell)[0]) if cell.startswith("`") else None


def parser_flags():
    import argparse

    parser = add_train_arguments(argparse.ArgumentParser())
    return {a.option_strings[0]: a for a in parser._actions if a.option_strings and a.option_strings[0] != "-h"}


def test_every_flag_is_in_the_table_with_real_field_names():
    rows, flags = table(), parser_flags()
    assert set(rows) == set(flags)
    fields = {f.name for f in dataclasses.fields(TrainingArguments)}
    for flag, (arguments, other) in rows.items():
        first = main_field(arguments)
        if first:
            assert first[1] in fields, f"{flag}: {first[1]} is no TrainingArguments field"
        for gone in re.findall(r"has no `([a-z_]+)`", arguments):
            assert gone not in fields, f"{flag}: TrainingArguments has {gone} again"
        for name in re.findall(r"LoraConfig\.([a-z_]+)", other):
            from peft import LoraConfig

            assert name in {f.name for f in dataclasses.fields(LoraConfig)}, f"{flag}: LoraConfig.{name}"


@pytest.mark.skipif(not installed("trl"), reason="TRL is not installed (the package does not depend on it)")
def test_trl_names_are_sft_config_fields():
    from trl import SFTConfig

    fields = {f.name for f in dataclasses.fields(SFTConfig)}
    for flag, (_, other) in table().items():
        for name in ticked(other):
            match = IDENTIFIER.match(name)
            if match:
                assert match[1] in fields, f"{flag}: {match[1]} is no SFTConfig field"


def test_a_flag_mapped_to_one_field_sets_it(tmp_path):
    """The flags whose first name is a bare field and which take a number or a choice: `train` puts the value there."""
    flags, checked = parser_flags(), []
    for flag, (arguments, _) in table().items():
        match = main_field(arguments)
        action = flags[flag]
        if not match or match[2] or not (action.type in (int, float) or action.choices):
            continue
        value = {int: 3, float: 0.25}.get(action.type) or action.choices[1]
        args = parse_train_args(["model", "--data", "x.txt", "--output", str(tmp_path), flag, str(value)])
        field = getattr(training_arguments(args, has_eval=True, resuming=False), match[1])
        field = field.value if isinstance(field, enum.Enum) else field
        if isinstance(field, bool):  # --bf16 on|off|auto: a choice that becomes a boolean, not the value itself
            continue
        assert field == value, f"{flag} {value}: {match[1]} = {field!r}"
        checked.append(flag)
    assert {"--lr", "--batch-size", "--grad-accum", "--warmup-ratio", "--lr-scheduler", "--save-total-limit"} <= set(
        checked
    )
