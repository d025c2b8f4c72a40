"""Every code example in README.md and docs/ runs.

Each Markdown file is one session, run like a notebook from a fresh directory laid out as the repository root: the
shipped tiny Llama at src/diff_transformer/assets/tiny-llama and the corpus at data/. Its fenced blocks run in
order: ```python blocks share one namespace, ```bash blocks whose every command is `diff-transformer ...` run through
the CLI's `main` (exit status 0 required). Any other block must say why it cannot run here, in an HTML comment on
the line before it, which the test reports as the skip reason:

    <!-- docs-test: skip needs a GPU -->        not run (GPU, Hub, vLLM, a server, a long run, installs)
    <!-- docs-test: slow -->                    run, but only in the full suite (marked `slow`); later blocks
                                                must not depend on what it makes
    <!-- docs-test: fails -->                   every command must exit 2, printing the `# error: ...` lines shown
                                                (`...` stands for any text)
    <!-- docs-test: partial reason -->           only the block's `diff-transformer` commands run, `serve` aside
    <!-- docs-test: hub -->                     run against tests/helpers/hub_server.py's fake Hub (started for the
                                                page)
    <!-- docs-test: needs trl -->               run where every module named is installed, else skipped (an optional
                                                library the package does not depend on); never a prerequisite

Blocks in other languages (text, yaml, output listings) are not code and are not collected.
"""

import contextlib
import io
import re
import shlex
import shutil
from pathlib import Path

import pytest
import torch

from diff_transformer.errors import installed
from tests.helpers import REPOSITORY


ROOT = REPOSITORY
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
RUNNABLE = {"python", "bash", "sh", "shell", "console"}
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.M | re.S)
MARKER = re.compile(r"<!--\s*docs-test:\s*(?P<kind>skip|slow|fails|partial|hub|needs)\b\s*(?P<reason>.*?)\s*-->\s*$")


class Block:
    def __init__(self, page: Path, index: int, lang: str, code: str, line: int, marker):
        self.page, self.index, self.lang, self.code, self.line = page, index, lang, code, line
        self.kind = marker["kind"] if marker else None
        self.reason = marker["reason"] if marker else ""

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def extract(page: Path) -> list[Block]:
    """The runnable fenced blocks of a page, each with the docs-test marker on the line before it (if any)."""
    text = page.read_text(encoding="utf-8")
    blocks = []
    for match in FENCE.finditer(text):
        lang = match["lang"].lower()
        if lang not in RUNNABLE:
            continue
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = MARKER.search(before)
        indent = len(match["indent"])
        code = "\n".join(line[indent:] for line in match["body"].splitlines())
        line = text.count("\n", 0, match.start()) + 1
        blocks.append(Block(page, len(blocks), lang, code, line, marker))
    return blocks


BLOCKS = {page: extract(page) for page in PAGES}


def shell_commands(code: str, partial: bool = False) -> list[list[str]] | None:
    """The block's commands as argument lists, or None if any command is not `diff-transformer ...`. `partial`: only
    the `diff-transformer` commands, `serve` (a server that runs until stopped) aside."""
    commands = []
    for line in code.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        if not words:
            continue
        if words[0] != "diff-transformer":
            if partial:
                continue
            return None
        if not (partial and words[1:2] == ["serve"]):
            commands.append(words[1:])
    return commands


class Session:
    """One page's working directory and Python namespace; blocks run in order, each once."""

    def __init__(self, directory: Path):
        self.directory = directory
        tiny = "src/diff_transformer/assets/tiny-llama"
        shutil.copytree(ROOT / tiny, directory / tiny)
        (directory / "data").mkdir()
        for name in ("corpus.txt", "heldout.txt", "chat.jsonl"):
            shutil.copy(ROOT / "data" / name, directory / "data" / name)
        self.namespace = {"__name__": "__docs__"}
        self.done = -1
        self.hub = None
        self.resources = contextlib.ExitStack()

    def close(self) -> None:
        """Stop the page's fake Hub (and undo its patches), if it started one."""
        self.resources.close()
        hub, self.hub = self.hub, None
        if hub is not None:  # a route the fake lacks, or a crash in it, would otherwise go unseen
            assert not hub.problems, hub.problems

    def run(self, block: Block) -> None:
        if block.kind == "hub" and self.hub is None:
            from tests.helpers.hub_server import running_hub

            self.hub = self.resources.enter_context(running_hub(self.directory / ".hf"))
        if block.lang == "python":
            exec(compile(block.code, block.id, "exec"), self.namespace)
            return
        from diff_transformer.cli import main

        commands = shell_commands(block.code, partial=block.kind == "partial")
        assert commands is not None, f"{block.id}: runs commands other than diff-transformer: mark it skip, say why"
        stderr = io.StringIO()
        for argv in commands:
            with contextlib.redirect_stderr(stderr):
                try:
                    status = main(argv)
                except SystemExit as exit:  # argparse's --help / --version
                    status = exit.code
            expected = (2,) if block.kind == "fails" else (0, None)
            assert status in expected, f"{block.id}: diff-transformer {shlex.join(argv)} exited with {status}"
        if block.kind == "fails":
            for line in re.findall(r"^# (error: .*)$", block.code, re.M):
                pattern = ".*?".join(re.escape(part) for part in line.split("..."))
                assert re.search(pattern, stderr.getvalue()), f"{block.id}: {line!r} not in {stderr.getvalue()!r}"


SESSIONS: dict[Path, Session] = {}


@pytest.fixture(scope="module", autouse=True)
def close_sessions():
    yield
    while SESSIONS:
        SESSIONS.popitem()[1].close()


def cases():
    seen = {}  # code of each block -> its id
    for blocks in BLOCKS.values():
        for block in blocks:
            marks = [pytest.mark.slow] if block.kind == "slow" else []
            # The journey is in README.md and in docs/long_description.md, word for word (tests/cli/test_journey.py).
            if block.kind == "partial" and block.code in seen:
                block.kind, block.reason = "skip", f"the same block as {seen[block.code]}, run there"
            seen.setdefault(block.code, block.id)
            yield pytest.param(block, id=block.id, marks=marks)


@pytest.fixture
def session_for(tmp_path_factory, monkeypatch):
    def get(block: Block) -> Session:
        for page, other in SESSIONS.items():
            if page != block.page:
                other.close()  # the fake Hub serves its own page only: the others stay offline
        if block.page not in SESSIONS:
            SESSIONS[block.page] = Session(tmp_path_factory.mktemp(block.page.stem))
        session = SESSIONS[block.page]
        monkeypatch.chdir(session.directory)
        return session

    return get


def test_every_block_is_runnable_or_says_why_not():
    """A block the test cannot run (any command other than diff-transformer) must carry a skip reason, and a skip
    marker must give one."""
    problems = []
    for blocks in BLOCKS.values():
        for block in blocks:
            if block.kind == "skip" and not block.reason:
                problems.append(f"{block.id}: skip marker without a reason")
            if block.kind in ("partial", "needs") and not block.reason:
                problems.append(f"{block.id}: {block.kind} marker without a reason")
            runnable = shell_commands(block.code, partial=block.kind == "partial") is not None
            if block.kind != "skip" and block.lang != "python" and not runnable:
                problems.append(f"{block.id}: commands other than diff-transformer, and no skip reason")
    assert not problems, "\n".join(problems)
    assert sum(len(blocks) for blocks in BLOCKS.values()) > 20


@pytest.mark.parametrize("block", list(cases()))
def test_block(block: Block, session_for, one_torch_thread):
    if block.kind == "skip":
        pytest.skip(block.reason)
    absent = [name for name in block.reason.split() if block.kind == "needs" and not installed(name)]
    if absent:
        pytest.skip(f"needs {', '.join(absent)}, which is not installed")
    session = session_for(block)
    # Run the earlier blocks of the page this one builds on that have not run yet (under -k). Slow blocks are never
    # prerequisites: later blocks must not need what they make, so the quick loop can leave them out.
    for earlier in BLOCKS[block.page][session.done + 1 : block.index]:
        if earlier.kind in (None, "partial", "hub"):  # an unmarked shell block is runnable: checked above
            session.run(earlier)
    session.done = block.index
    torch.manual_seed(0)
    session.run(block)


def test_extract_finds_markers_and_nested_fences(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "text\n\n<!-- docs-test: skip needs a GPU -->\n```python\nimport torch\n```\n\n"
        "* item\n\n  ```bash\n  diff-transformer convert a b \\\n    --verify  # exact\n  ```\n\n"
        "```text\nnot code\n```\n<!-- docs-test: slow -->\n```bash\npip install x\n```\n"
        "<!-- docs-test: fails -->\n```bash\ndiff-transformer generate nowhere hi\n# error: MODEL ...\n```\n"
        "<!-- docs-test: partial pip is not run -->\n```bash\npip install x\ndiff-transformer merge a b\n"
        "diff-transformer serve --port 1\n```\n<!-- docs-test: hub -->\n```python\npass\n```\n",
        encoding="utf-8",
    )
    blocks = extract(page)
    assert [(b.lang, b.kind, b.reason) for b in blocks] == [
        ("python", "skip", "needs a GPU"),
        ("bash", None, ""),
        ("bash", "slow", ""),
        ("bash", "fails", ""),
        ("bash", "partial", "pip is not run"),
        ("python", "hub", ""),
    ]
    assert shell_commands(blocks[4].code, partial=True) == [["merge", "a", "b"]]
    assert shell_commands(blocks[1].code) == [["convert", "a", "b", "--verify"]]
    assert shell_commands(blocks[2].code) is None


def test_readme_is_short_and_its_links_resolve():
    """The README stays an entry point (issue 25: at most 200 lines); its relative links name files that exist (the
    site's links are checked by `mkdocs build --strict`)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 200
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [t for t in targets if "://" not in t]
    assert len(local) > 10
    missing = [t for t in local if not (ROOT / t).exists()]
    assert not missing, missing


@pytest.mark.parametrize("page", ["README.md", "docs/long_description.md"])
def test_the_quickstart_runs_in_the_environment_the_page_made(page):
    """Issue 32: the Quickstart's bare `pip` / `diff-transformer` after a README block that used `.venv/bin/...`
    installed into another Python (and could pull the CUDA torch). The page's first command makes `.venv`; the
    journey activates it before anything else, and every pip in either carries the constraints (torch stays the
    CPU build the first command installed)."""
    text = (ROOT / page).read_text(encoding="utf-8")
    first = next(block for block in extract(ROOT / page) if block.lang == "bash")
    assert "python3 -m venv .venv" in first.code
    journey = text.split("<!-- journey -->", 1)[1].split("<!-- /journey -->", 1)[0]
    lines = [
        shlex.split(line, comments=True) for line in journey.split("```bash", 1)[1].split("```", 1)[0].splitlines()
    ]
    commands = [words for words in lines if words]
    assert commands[0] == ["source", ".venv/bin/activate"], commands[0]
    assert {words[0] for words in commands[1:]} <= {"pip", "diff-transformer"}, commands
    pips = [
        words
        for line in (first.code + journey).replace("\\\n", " ").splitlines()
        for part in line.split("&&")
        if (words := shlex.split(part, comments=True))[:1] in (["pip"], [".venv/bin/pip"])
    ]
    assert len(pips) >= 3, pips
    for words in pips:  # torch first, pinned; everything else within the constraints
        pinned = words[words.index("constraints.txt") - 1] == "-c" if "constraints.txt" in words else False
        assert "torch==2.13.0" in words or pinned, words


def test_the_server_s_limits_table_states_the_code_s_values():
    """Issue 56 item 6: docs/serving.md holds the server's limits in one table (body size, queue, loaded models,
    render bounds); each row is held to the constant the server uses, so the table cannot drift from the code."""
    from diff_transformer.generation import chat_templates
    from diff_transformer.serving import patches, render_pool, requests, server

    text = (ROOT / "docs" / "serving.md").read_text(encoding="utf-8")
    table = text.split("### The server's limits", 1)[1].split("\n\n", 2)[1]
    rows = {line.split("|")[1].strip(): line for line in table.splitlines() if line.startswith("| ")}
    assert f"| {patches.MAX_REQUEST_BYTES >> 20} MiB |" in rows["request body"]
    assert (
        f"| {patches.MAX_QUEUED_REQUESTS} |"
        in rows["requests in the server (POST, from arrival to the answer's last byte)"]
    )
    assert f"1 to {server.RETRY_AFTER_MAX_S} s" in rows["Retry-After"]
    settings = patches.ServeSettings()
    assert f"| {patches.MAX_LOADED_MODELS}, at least the MODELs named |" in rows["loaded models"]
    assert f"at most {settings.model_wait_s:g} s, then `503`" in rows["loaded models"]
    render = rows["chat template render"]
    assert f"{chat_templates.RENDER_SECONDS:g} s, {chat_templates.RENDER_STEPS:,} Python steps" in render
    assert f"{chat_templates.RENDER_CHARS >> 20} Mi characters built" in render
    assert f"{chat_templates.MAX_INPUT_CHARS >> 20} Mi characters given" in render
    workers = rows["render processes"]
    assert (
        f"{patches.RENDER_WORKERS} workers" in workers
        and f"+ {chat_templates.WORKER_MEMORY_BYTES >> 20} MiB" in workers
    )
    assert f"killed {render_pool.KILL_MARGIN_S:g} s past the {chat_templates.RENDER_SECONDS:g} s bound" in workers
    assert f"{requests.MAX_STOP_STRINGS} strings of 1 to {requests.MAX_STOP_CHARS} characters" in rows["`stop`"]
    assert f"{requests.MAX_LOGIT_BIAS:,} entries" in rows["`logit_bias`"]
    assert f"{patches.GRACEFUL_SHUTDOWN_S} s" in rows["shutdown (SIGTERM)"]
