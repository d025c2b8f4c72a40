"""What several test areas share: tiny models (`tiny`), small checkpoints on disk (`checkpoints`), reference
implementations (`reference`), child processes (`processes`), a fake Hub (`hub_server`), the server (`server`) and
`diff-transformer train` options (`training`). Imported as `tests.helpers.<module>`: the test tree is a package."""

from pathlib import Path


REPOSITORY = Path(__file__).resolve().parents[2]


def load_script(path: Path):
    """A script of the repository (benchmarks/, experiments/, scripts/) imported as a module, with its own folder
    importable while it loads, as when it runs (`python benchmarks/bench_gpu.py` imports its sibling bench_common)."""
    import importlib.util
    import sys

    folder = str(path.parent)
    added = folder not in sys.path
    if added:
        sys.path.insert(0, folder)
    try:
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = module  # dataclasses and pickling look a module up by name while it loads
        spec.loader.exec_module(module)
        return module
    finally:
        if added:
            sys.path.remove(folder)
