"""Shared by every test area: the environment-bound areas (`bare/` needs `--bare-python`, `vllm/` needs vLLM installed)
skipped cleanly where their environment is absent, one-thread and version fixtures, and the one-line refusal
assertion of the command line (`refused`). Helpers to import live in `tests/helpers/`."""

import os
from pathlib import Path

import pytest
import torch

import diff_transformer  # noqa: F401  (registers the Auto classes)
from diff_transformer import cli


HERE = Path(__file__).resolve().parent


def pytest_configure(config):
    """Under pytest-xdist (`-n 2`) each worker computes with one intra-op thread, and so do the processes its tests
    start: the workers already share the cores, and two threads per process on a busy 2-core machine spend their time
    handing tiny kernels to the thread pool (see `one_torch_thread`)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


def pytest_addoption(parser):
    parser.addoption(
        "--bare-python",
        action="append",
        default=[],
        help="interpreter of a venv holding only torch and transformers, for tests/bare (may be repeated)",
    )


def pytest_collection_modifyitems(config, items):
    """The tests of bare/ and vllm/ carry their area's marker (`-m "not vllm"`); bare/ without --bare-python is
    skipped with the reason (vllm/'s modules skip themselves where vLLM cannot be imported)."""
    bare_skip = pytest.mark.skip(reason="needs --bare-python PATH (a venv with only torch and transformers)")
    for item in items:
        area = item.path.resolve().relative_to(HERE).parts[0]
        if area in ("bare", "vllm"):
            item.add_marker(getattr(pytest.mark, area))
        if area == "bare" and not config.getoption("--bare-python"):
            item.add_marker(bare_skip)


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread for a module, restored afterwards. On a loaded 2-core machine two threads made
    test_serving's greedy decoding 5.1 s instead of 0.21 s and test_lm_eval's three runs 65 s instead of 3 s."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(params=[1, 2], ids=["v1", "v2"])
def diff_version(request):
    return request.param


@pytest.fixture
def refused(capsys):
    """`refused(argv, *words)`: `diff-transformer ARGV` exits 2 and its stderr is one `error:` line naming every word;
    returns that line. With `notes=True`, notes may come first (e.g. what a killed run left and was recovered), but
    no traceback and no other error."""

    def check(argv, *words, notes=False):
        capsys.readouterr()
        assert cli.main([str(a) for a in argv]) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert err and err[-1].startswith("error: "), err
        assert notes or len(err) == 1, err
        assert not any(line.startswith(("Traceback", "error: ")) for line in err[:-1]), err
        for word in words:
            assert str(word) in err[-1], (word, err[-1])
        return err[-1]

    return check


try:  # Hypothesis profiles (tests/cli/test_option_values.py): short by default, `--hypothesis-profile long` for more
    from hypothesis import settings as _hypothesis_settings

    _hypothesis_settings.register_profile("default", max_examples=12, derandomize=True)
    _hypothesis_settings.register_profile("long", max_examples=400)
    _hypothesis_settings.load_profile("default")
except ImportError:
    pass
