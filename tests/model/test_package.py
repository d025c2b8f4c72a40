"""The package root's one table of public names (`PUBLIC_NAMES`): what `import diff_transformer` binds, exports and
spells out for static readers, and the Auto classes it registers (`integrations.auto_classes.AUTO_CLASSES`)."""

import ast
import importlib
from pathlib import Path

import transformers

import diff_transformer


def _type_checking_imports() -> dict[str, tuple[str, ...]]:
    """The `if TYPE_CHECKING:` block of the package's `__init__.py`, as {module: names} in its order."""
    tree = ast.parse(Path(diff_transformer.__file__).read_text())
    block = next(n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", None) == "TYPE_CHECKING")
    found: dict[str, list[str]] = {}
    for node in block.body:
        assert all(alias.asname == alias.name for alias in node.names), "a re-export is spelled `X as X`"
        found.setdefault("." * node.level + node.module, []).extend(alias.name for alias in node.names)
    return {module: tuple(names) for module, names in found.items()}


def test_static_imports_spell_out_the_table():
    table = diff_transformer.PUBLIC_NAMES
    assert {m: sorted(n) for m, n in _type_checking_imports().items()} == {m: sorted(n) for m, n in table.items()}


def test_every_public_name_is_bound_to_its_modules_object():
    assert diff_transformer.__all__ == [n for names in diff_transformer.PUBLIC_NAMES.values() for n in names]
    assert len(set(diff_transformer.__all__)) == len(diff_transformer.__all__)
    for module, names in diff_transformer.PUBLIC_NAMES.items():
        defining = importlib.import_module(module, "diff_transformer")
        for name in names:
            assert getattr(diff_transformer, name) is getattr(defining, name), name


def test_auto_classes_resolve_diff_to_the_tables_classes():
    config = diff_transformer.DiffConfig()
    assert type(transformers.AutoConfig.for_model("diff")) is diff_transformer.DiffConfig
    from diff_transformer.integrations.auto_classes import AUTO_CLASSES

    for auto_class, ours in AUTO_CLASSES.items():
        cls = getattr(diff_transformer, ours)
        assert cls._auto_class == auto_class
        if auto_class != "AutoConfig":
            assert getattr(transformers, auto_class)._model_mapping[type(config)] is cls
