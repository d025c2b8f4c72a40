"""docs/design.md's "Code organisation" against the code: its tree names every module and subpackage of the package
(and nothing that is not there), and its "Who imports whom" list is exactly the import graph between the package's
parts, read from every import statement (those inside functions too). The parts have no cycle."""

import ast
import re

from tests.helpers import REPOSITORY


PACKAGE = REPOSITORY / "src" / "diff_transformer"
DESIGN = REPOSITORY / "docs" / "design.md"


def _module(path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _exists(name: str) -> bool:
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def part(module: str) -> str:
    """The part of the package a module belongs to: its subpackage (vllm apart: it imports vLLM), or itself."""
    parts = module.split(".")[1:]
    if not parts:
        return "diff_transformer"
    return "integrations.vllm" if parts[:2] == ["integrations", "vllm"] else parts[0]


def imported_modules(path) -> set[str]:
    """The package's modules that PATH imports (`from . import x` imports x, not the package that holds it)."""
    module, found = _module(path), set()
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            stem = ".".join(base + ([node.module] if node.module else []))
            submodules = {f"{stem}.{alias.name}" for alias in node.names if _exists(f"{stem}.{alias.name}")}
            found |= submodules or {stem}
    return {name for name in found if name.split(".")[0] == "diff_transformer"}


def import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        source = part(_module(path))
        for name in imported_modules(path):
            while not _exists(name):
                name = name.rsplit(".", 1)[0]
            if part(name) != source:
                graph.setdefault(source, set()).add(part(name))
    return graph


def _code_block(after: str) -> str:
    """The first fenced block of docs/design.md that starts after the text AFTER (or that holds it)."""
    text = DESIGN.read_text(encoding="utf-8")
    start = text.index(after)
    if text.count("```", 0, start) % 2 == 0:  # AFTER is outside a block: skip to the next one
        start = text.index("```\n", start) + 4
    return text[start : text.index("```", start)]


def test_the_import_list_is_the_code():
    documented = {}
    for line in _code_block("Who imports whom").strip().splitlines():
        source, _, targets = line.partition(" -> ")
        documented[source.strip()] = {target.strip() for target in targets.split(",")}
    assert documented == import_graph()


def test_the_parts_have_no_cycle():
    graph, done, path = import_graph(), set(), []

    def visit(node):
        assert node not in path, " -> ".join([*path[path.index(node) :], node])
        if node in done:
            return
        path.append(node)
        for target in graph.get(node, ()):
            visit(target)
        path.pop()
        done.add(node)

    for node in graph:
        visit(node)


def test_the_tree_names_every_module():
    block = _code_block("src/diff_transformer/\n")
    named = set(re.findall(r"[\w/]+(?:\.py|/)(?=[\s,()]|$)", block))
    on_disk = {p.name for p in PACKAGE.glob("*.py")} | {
        f"{p.name}/" for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()
    }
    assert on_disk <= named, sorted(on_disk - named)
    for name in named - {"src/diff_transformer/"}:
        assert (PACKAGE / name).exists() or (REPOSITORY / name).exists() or any(PACKAGE.rglob(name.rstrip("/"))), name
