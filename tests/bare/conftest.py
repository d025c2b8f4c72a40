"""Tests of Hub custom code where only torch and transformers are installed: what someone who pulls a Diff
checkpoint has. Run by `.ci/run` from the main environment (which builds the checkpoints and the references with the
package), each checkpoint loaded by the interpreters given with `--bare-python` (venvs holding torch and transformers,
nothing else): `pytest tests/bare --bare-python .venv-bare/bin/python --bare-python .venv-bare-min/bin/python`."""

from pathlib import Path


def pytest_generate_tests(metafunc):
    if "bare_python" in metafunc.fixturenames:
        pythons = metafunc.config.getoption("--bare-python")
        if not pythons:  # skipped by tests/conftest.py, with the reason: never a silent pass
            metafunc.parametrize("bare_python", [None], ids=["no-bare-python"], scope="module")
            return
        metafunc.parametrize("bare_python", pythons, ids=[Path(p).parents[1].name for p in pythons], scope="module")
