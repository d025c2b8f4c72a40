"""Every suggestion the V1 converter prints works (issue 45, item 4): a walk over `convert`'s V1 options, for a
source whose heads pair (4 over 2) and one whose heads cannot (9 over 3, SmolLM2's), that reads each `note:` and
`error:` line, applies every option change it proposes (`use --x y`, `add --x y`, `(or --x y)`, `drop --x`,
`drop them` / `drop one of them` for the options the line named) and runs the result, which must convert. The walk
follows the new run's suggestions in turn, so a loop of refusals cannot hide."""

import re
from dataclasses import replace

import pytest

from diff_transformer import cli
from diff_transformer.conversion import calibrate as calibrate_module
from tests.helpers.checkpoints import make_llama


CLAUSE = re.compile(
    r"\b(use|add|drop|or)\s+((?:one of )?them|--[a-z0-9-]+(?: [a-z0-9][\w-]*(?:\.[\w-]+)*)?(?: / --[a-z0-9-]+)*)"
)
FLAG = re.compile(r"(--[a-z0-9-]+)(?: ([a-z0-9][\w.-]*))?")
VALUED = {"--diff-version", "--v1-init", "--v1-layout", "--calibration-data", "--dtype"}


def options(argv: list[str]) -> dict[str, str | None]:
    parsed, i = {}, 0
    while i < len(argv):
        flag = argv[i]
        parsed[flag] = argv[i + 1] if flag in VALUED else None
        i += 2 if flag in VALUED else 1
    return parsed


def argv_of(parsed: dict[str, str | None]) -> tuple[str, ...]:
    return tuple(
        part for flag, value in sorted(parsed.items()) for part in ((flag,) if value is None else (flag, value))
    )


def suggestions(line: str, current: dict) -> list[dict]:
    """The option sets LINE proposes instead of CURRENT (one per alternative)."""
    named = [flag for flag in re.findall(r"--[a-z0-9-]+", line) if flag in current]
    proposed = []
    for verb, rest in CLAUSE.findall(line):
        if verb == "drop":
            if rest == "them":
                proposed.append({k: v for k, v in current.items() if k not in named})
            elif rest == "one of them":
                proposed += [{k: v for k, v in current.items() if k != flag} for flag in named]
            else:
                dropped = re.findall(r"--[a-z0-9-]+", rest)
                proposed.append({k: v for k, v in current.items() if k not in dropped})
        else:  # use / add / or: set the option
            flag, value = FLAG.match(rest).groups()
            if flag in VALUED and not value:
                continue
            proposed.append({**current, flag: value if flag in VALUED else None})
    return proposed


@pytest.mark.parametrize("heads", [(4, 2, 32), (9, 3, 36)], ids=["pairs", "cannot-pair"])
def test_every_v1_suggestion_the_converter_prints_converts(tmp_path, capsys, monkeypatch, heads):
    H, H_kv, hidden = heads
    # a few short calibration blocks: what is printed does not depend on how many (the walk runs ~20 conversions)
    calibrate = calibrate_module.calibrate_conversion

    def small(source, config, tensor_map, options):
        return calibrate(source, config, tensor_map, replace(options, calibration_blocks=2, calibration_block_size=32))

    monkeypatch.setattr(calibrate_module, "calibrate_conversion", small)
    src = make_llama(tmp_path / "llama", hidden_size=hidden, num_attention_heads=H, num_key_value_heads=H_kv)
    text = tmp_path / "text.txt"
    text.write_text("Some calibration text of mine. " * 200, encoding="utf-8")
    starts = [
        {"--diff-version": "1"},
        {"--v1-init": "calibrated"},  # V2 with a V1 option
        {"--calibration-data": str(text)},
        *({"--diff-version": "1", "--v1-init": init} for init in ("calibrated-additive", "calibrated-lambda0")),
        *({"--diff-version": "1", "--v1-layout": layout} for layout in ("paired", "expanded")),
        {"--diff-version": "1", "--v1-init": "calibrated-additive", "--v1-layout": "expanded"},
        {"--diff-version": "1", "--v1-init": "paper", "--calibration-data": str(text)},
        {"--diff-version": "1", "--calibration-data": str(text)},  # the test model's tokenizer cannot read text
    ]
    seen, queue, followed, runs = set(), [(argv_of(s), None) for s in starts], [], 0
    while queue:
        argv, suggested_by = queue.pop(0)
        if argv in seen:
            continue
        seen.add(argv)
        out = tmp_path / f"out{runs}"
        runs += 1
        code = cli.main(["convert", str(src), str(out), "--quiet", *argv])
        captured = capsys.readouterr()
        if suggested_by is not None:
            assert code == 0, f"{suggested_by!r} suggested {argv}, which fails: {captured.err.strip()}"
        lines = [ln for ln in (captured.out + captured.err).splitlines() if ln.startswith(("note:", "error:"))]
        for line in lines:
            for proposal in suggestions(line, options(list(argv))):
                followed.append((line, argv_of(proposal)))
                queue.append((argv_of(proposal), line))
    proposals = {argv for _, argv in followed}
    pairs = H % 2 == 0 and H_kv % 2 == 0
    # the suggestions this walk must have reached, so that it cannot pass by parsing nothing
    assert ("--diff-version", "1", "--v1-init", "calibrated") in proposals  # V2 + a V1 option: "add --diff-version 1"
    # additive + expanded: "use --v1-init calibrated"
    assert ("--diff-version", "1", "--v1-init", "calibrated", "--v1-layout", "expanded") in proposals
    additive = ("--diff-version", "1", "--v1-init", "calibrated-additive")
    assert (additive in proposals) == pairs  # recommended only where it works
    assert (("--diff-version", "1", "--v1-init", "calibrated-additive", "--v1-layout", "paired") in proposals) == pairs
    assert any("--v1-layout" not in argv and "--diff-version" in argv for argv in proposals)  # "drop --v1-layout"
