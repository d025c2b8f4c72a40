"""Tests of Hub custom code where only torch and transformers are installed: what someone who pulls a Diff
checkpoint has. Run by `.ci/run` from the main environment (which builds the checkpoints and the references with the
package), each checkpoint loaded by the interpreters given with `--bare-python` (venvs holding torch and transformers,
nothing else): `pytest tests_bare --bare-python .venv-bare/bin/python --bare-python .venv-bare-min/bin/python`."""

import sys
from pathlib import Path

import pytest


sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))  # tests/matrix: the checkpoints every integration walks


def pytest_addoption(parser):
    parser.addoption("--bare-python", action="append", default=[], help="interpreter of a torch+transformers venv")


def pytest_generate_tests(metafunc):
    if "bare_python" in metafunc.fixturenames:
        pythons = metafunc.config.getoption("--bare-python")
        if not pythons:  # never a silent pass: these tests mean nothing without a bare interpreter
            raise pytest.UsageError("tests_bare needs --bare-python PATH (a venv with only torch and transformers)")
        metafunc.parametrize("bare_python", pythons, ids=[Path(p).parents[1].name for p in pythons], scope="module")
