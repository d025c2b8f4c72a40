"""A safetensors file that cannot be *written* (a full disk, a file-size limit) is reported as the output's problem,
never as a corrupt input to "restore or re-download" (issue 56 item 5). The failures are real: the writes run in a
child process under RLIMIT_FSIZE (EFBIG), and on a 64 KiB tmpfs in a private mount namespace (ENOSPC) where
`unshare` is allowed."""

import shutil
import subprocess
import sys

import pytest


# In the child: safetensors' own save_file (Rust) writes 1 MiB into DIRECTORY; the one line the CLI would print.
CHILD = """
import resource, signal, sys
import torch
from safetensors.torch import save_file
from diff_transformer.errors import library_failure
if sys.argv[2] == "fsize":
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write then fails with EFBIG instead of killing us
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
try:
    save_file({"w": torch.zeros(1 << 18)}, sys.argv[1] + "/model.safetensors")
except Exception as exc:
    print(type(exc).__name__)
    print(library_failure(exc, sys.argv[1]))  # the command's output directory, as the CLI passes it
"""


def _run(argv):
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()


def test_a_write_past_the_file_size_limit_names_the_write_not_the_input(tmp_path):
    kind, line = _run([sys.executable, "-c", CHILD, str(tmp_path), "fsize"])
    assert kind == "SafetensorError"
    assert line.startswith(f"writing a safetensors file in {tmp_path} failed (") and "File too large" in line, line
    assert "re-download" not in line and "corrupt" not in line


def test_a_full_disk_names_the_output_directory_and_its_free_space(tmp_path):
    unshare = shutil.which("unshare")
    probe = unshare and subprocess.run([unshare, "-rm", "true"], capture_output=True).returncode == 0
    if not probe:
        pytest.skip("no private mount namespace here (unshare -rm refused): the RLIMIT_FSIZE test covers writes")
    mount = tmp_path / "small"
    mount.mkdir()
    script = 'mount -t tmpfs -o size=64k tmpfs "$1" && exec "$2" -c "$3" "$1" enospc'
    kind, line = _run([unshare, "-rm", "sh", "-c", script, "sh", str(mount), sys.executable, CHILD])
    assert kind == "SafetensorError"
    assert line.startswith(f"no space left on the device writing a safetensors file in {mount} ("), line
    assert "MiB free there): free some space or choose an output on another disk." in line
    assert "re-download" not in line
