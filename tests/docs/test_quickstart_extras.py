"""The README Quickstart's `pip install -e ".[...]"` installs what the docs' command examples need (issue 45: after
`.[train,serve]`, niah.md's first example and `inspect` stopped with "needs matplotlib").

Every `diff-transformer` command of the blocks that tests/docs/test_docs.py runs is started in a fresh interpreter
that has only what the Quickstart installs: each optional package the package checks for is importable there only if
its distribution is in the dependency closure (read from the installed metadata) of setup.cfg's requirements and
the Quickstart's extras. The commands run in an empty directory: every command checks its optional packages before
it loads anything (docs/troubleshooting.md, "A missing extra"), so a missing one is its first line, and otherwise it
stops at once on the model that is not there. The same run with every optional package missing (a plain install)
shows that the check is seen."""

import configparser
import importlib.metadata
import json
import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.docs.test_docs import BLOCKS, shell_commands
from tests.helpers import REPOSITORY
from tests.helpers.processes import run_json


# The optional packages the commands check for (`diff_transformer.errors.require` / `installed`), by import name.
OPTIONAL = ("peft", "tensorboard", "tensorboardX", "fastapi", "uvicorn", "openai", "pydantic", "matplotlib")
OPTIONAL += ("bitsandbytes", "lm_eval")
MISSING = re.compile(r"needs? ([\w, -]+?),? which (is|are) not installed")

RUN = """
import contextlib, io, json, sys

for name in json.loads(sys.argv[1]):  # as if not installed: `import x` fails, find_spec(x) is None
    sys.modules[name] = None
from diff_transformer import cli

results = []
for argv in json.loads(sys.argv[2]):
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            status = cli.main(argv)
        except SystemExit as exit:
            status = exit.code
    results.append([argv, status, err.getvalue()])
print(json.dumps(results))
"""


def quickstart_extras() -> list[str]:
    journey = (REPOSITORY / "README.md").read_text(encoding="utf-8").split("<!-- journey -->", 1)[1]
    return re.search(r'pip install [^\n]*-e "\.\[([\w,-]+)\]"', journey)[1].split(",")


def setup_requirements(extras) -> list[str]:
    config = configparser.ConfigParser()
    config.read(REPOSITORY / "setup.cfg", encoding="utf-8")
    lines = config["options"]["install_requires"].split("\n")
    for extra in extras:
        lines += config["options.extras_require"][extra].split("\n")
    return [line.strip() for line in lines if line.strip()]


def closure(requirements) -> set[str]:
    """The distributions REQUIREMENTS install, with their extras, transitively (as far as they are installed here)."""
    seen, todo = set(), [Requirement(text) for text in requirements]
    while todo:
        requirement = todo.pop()
        key = (canonicalize_name(requirement.name), frozenset(requirement.extras))
        if key in seen:
            continue
        seen.add(key)
        try:
            needs = importlib.metadata.requires(requirement.name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for text in needs:
            need = Requirement(text)
            chosen = requirement.extras or {""}
            if need.marker is None or any(need.marker.evaluate({"extra": extra}) for extra in chosen):
                todo.append(need)
    return {name for name, _ in seen}


def absent_after(extras) -> list[str]:
    """The optional packages a `pip install -e ".[EXTRAS]"` would not install."""
    installed = closure(setup_requirements(extras))
    owners = importlib.metadata.packages_distributions()
    return [name for name in OPTIONAL if not {canonicalize_name(d) for d in owners.get(name, [])} & installed]


def docs_commands() -> list[list[str]]:
    """Every diff-transformer command of the shell blocks test_docs runs in the quick loop (not the `fails` examples
    of errors, nor `slow` blocks), `serve` aside (it runs until stopped; it checks its packages first too)."""
    commands = []
    for blocks in BLOCKS.values():
        for block in blocks:
            if block.lang != "python" and block.kind in (None, "partial"):
                commands += shell_commands(block.code, partial=block.kind == "partial")
    return commands


def stand_in_models(commands, cwd) -> None:
    """An empty directory in CWD for each model a command names (`cli.MODEL_ARGUMENTS`), made by earlier steps of
    the docs: the name resolves, so the command goes on to check its packages (before it opens the model)."""
    from diff_transformer import cli

    parser = cli.build_parser()
    for argv in commands:
        if {"--help", "-h", "--version"} & set(argv):
            continue  # argparse answers these itself
        args, _ = parser.parse_known_args(argv)
        attribute, _ = cli.MODEL_ARGUMENTS.get(args.command, (None, None))
        names = getattr(args, attribute, None) if attribute else None
        for name in names if isinstance(names, list) else [names] if names else []:
            if not Path(name).is_absolute() and not name.startswith("hf://"):
                (cwd / name).mkdir(parents=True, exist_ok=True)


def missing_packages(blocked, commands, cwd) -> dict[str, str]:
    """{command: the line that names a missing package} of COMMANDS run with BLOCKED modules missing."""
    stand_in_models(commands, cwd)
    results = run_json(
        RUN,
        json.dumps(blocked),
        json.dumps(commands),
        env={"HF_HUB_OFFLINE": "1"},
        block_diff_transformer=False,
        cwd=cwd,
    )
    found = {}
    for argv, _, err in results:
        line = next((line for line in err.splitlines() if MISSING.search(line)), None)
        if line:
            found[" ".join(argv)] = line
    return found


@pytest.mark.slow  # 10-25 s (server starts, subprocesses): the full suite runs it, the quick loop does not
def test_the_quickstart_installs_what_the_docs_commands_need(tmp_path):
    extras = quickstart_extras()
    commands = docs_commands()
    assert {argv[0] for argv in commands} >= {"convert", "generate", "train", "merge", "niah", "inspect"}
    blocked = absent_after(extras)
    assert not missing_packages(blocked, commands, tmp_path)
    # A plain install lacks them: the same commands say so (the check above sees what it looks for).
    plain = missing_packages(absent_after([]), commands, tmp_path)
    assert any(c.startswith("niah ") and "matplotlib" in line for c, line in plain.items()), plain
    assert any(c.startswith("inspect ") and "matplotlib" in line for c, line in plain.items()), plain


COMMAND = re.compile(r"^\s*(\$ )?(diff-transformer|pip|python3?|torchrun|vllm|lm_eval|accelerate|hf|mkdocs)\s")


def test_no_command_example_is_in_a_block_the_docs_test_does_not_collect():
    """test_docs runs (or reads the skip reason of) the python/bash/sh/shell/console blocks; a command example in a
    `text` or unlabelled block would be neither run nor marked."""
    from tests.docs.test_docs import FENCE, PAGES, RUNNABLE

    hidden = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for match in FENCE.finditer(text):
            if match["lang"].lower() not in RUNNABLE:
                line = text.count("\n", 0, match.start()) + 1
                hidden += [f"{page.name}:{line}: {c}" for c in match["body"].splitlines() if COMMAND.match(c)]
    assert not hidden, "\n".join(hidden)
