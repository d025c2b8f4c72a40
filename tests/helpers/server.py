"""`diff-transformer serve` as a test starts it: a subprocess on a free loopback port, its output in a log file."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import openai
import pytest


class Server:
    """`diff-transformer serve` in a subprocess on a free loopback port; its output goes to a log file."""

    def __init__(self, log: Path, *options):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
        # One intra-op thread: the two servers share the (small, busy) CI machine, and with more threads the many
        # tiny kernels of a decode step spend most of their time handing work to the thread pool (V1 continuous
        # batching measured 3-30 s vs 0.8 s per 24-token request on 2 loaded cores).
        env.update(HF_HUB_OFFLINE="1", HF_HOME=str(log.parent / "hf-home"), OMP_NUM_THREADS="1")
        command = [
            sys.executable,
            "-m",
            "diff_transformer.cli",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]
        with open(log, "wb") as out:
            self.process = subprocess.Popen(
                [*command, *options], stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
            )

    def wait_healthy(self, timeout=240):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"the server exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                    if response.status == 200 and json.load(response) == {"status": "ok"}:
                        return
            except OSError:
                pass
            time.sleep(0.25)
        pytest.fail(f"the server did not answer /health within {timeout} s:\n{self.log_tail()}")

    def log_tail(self):
        return self.log.read_text(errors="replace")[-4000:]

    def stop(self):
        self.process.terminate()
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def client(self):
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="not-needed", max_retries=0, timeout=120)
