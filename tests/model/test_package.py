"""The package root's public names: each module of `PUBLIC_MODULES` lists its own in `__all__` (the one table), and
`import diff_transformer` binds, exports and spells out for static readers exactly those; the Auto classes it
registers (`integrations.auto_classes.AUTO_CLASSES`)."""

import ast
import importlib
from pathlib import Path

import transformers

import diff_transformer


def _type_checking_imports() -> list[str]:
    """The modules the `if TYPE_CHECKING:` block of the package's `__init__.py` star-imports, in its order."""
    tree = ast.parse(Path(diff_transformer.__file__).read_text())
    block = next(n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", None) == "TYPE_CHECKING")
    assert all([alias.name for alias in node.names] == ["*"] for node in block.body), "a star import per module"
    return ["." * node.level + node.module for node in block.body]


def test_static_imports_spell_out_the_table():
    assert _type_checking_imports() == list(diff_transformer.PUBLIC_MODULES)


def test_every_public_name_is_bound_to_its_modules_object():
    modules = [importlib.import_module(module, "diff_transformer") for module in diff_transformer.PUBLIC_MODULES]
    assert diff_transformer.__all__ == [name for module in modules for name in module.__all__]
    assert len(set(diff_transformer.__all__)) == len(diff_transformer.__all__)
    assert "DiffForCausalLM" in diff_transformer.__all__ and "DiffConfig" in diff_transformer.__all__
    for module in modules:
        for name in module.__all__:
            assert getattr(diff_transformer, name) is getattr(module, name), name


def test_auto_classes_resolve_diff_to_the_tables_classes():
    config = diff_transformer.DiffConfig()
    assert type(transformers.AutoConfig.for_model("diff")) is diff_transformer.DiffConfig
    from diff_transformer.integrations.auto_classes import AUTO_CLASSES

    for auto_class, ours in AUTO_CLASSES.items():
        cls = getattr(diff_transformer, ours)
        assert cls._auto_class == auto_class
        if auto_class != "AutoConfig":
            assert getattr(transformers, auto_class)._model_mapping[type(config)] is cls
