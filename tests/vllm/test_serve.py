"""`vllm serve` on loopback answers /v1/chat/completions with the transformers model's greedy text, 8 requests at
once."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers import AutoTokenizer


pytest.importorskip("vllm", reason="needs vLLM (the environment .ci/run builds from constraints-vllm.txt)")

from diff_transformer import DiffForCausalLM  # noqa: E402
from tests.vllm.helpers import HERE, vllm_env  # noqa: E402


MAX_TOKENS = 24
QUESTIONS = [
    "Tell me a story.",
    "What did the cat do?",
    "Who is Lily?",
    "Good morning, sir.",
    "Why is the sky blue?",
    "Can you sing a song?",
    "What is in the box?",
    "How did Tom feel?",
]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url, body, timeout=120):
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    """`vllm serve` on the converted tiny Llama (V2), with no plugin flag; killed with its children at the end."""
    model = models["tiny-llama-v2"]
    port = free_port()
    log = open(tmp_path_factory.mktemp("serve") / "serve.log", "w+")
    command = [sys.executable, str(HERE / "vllm_cli.py"), "serve", str(model), "--host", "127.0.0.1"]  # `vllm serve`
    command += ["--port", str(port), "--dtype", "float32", "--enforce-eager", "--max-model-len", "256"]
    command += ["--max-num-seqs", "8"]
    process = subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=vllm_env(), start_new_session=True
    )
    try:
        deadline = time.monotonic() + 300
        while True:
            assert process.poll() is None, f"vllm serve exited with {process.returncode}:\n{_tail(log)}"
            assert time.monotonic() < deadline, f"vllm serve not ready after 300 s:\n{_tail(log)}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(1)
        yield model, f"http://127.0.0.1:{port}"
    finally:
        os.killpg(process.pid, signal.SIGTERM)  # the engine core and workers are in the server's session
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
        log.close()


def _tail(log):
    log.flush()
    log.seek(0)
    return log.read()[-5000:]


def reference_replies(model_dir, questions):
    """The transformers model's greedy reply to each question under the checkpoint's chat template and generation
    config (the tiny Llama's has repetition_penalty=1.3 and stops at EOS; vLLM applies the same defaults)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = DiffForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    replies = []
    for question in questions:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
        out = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False)
        replies.append(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    return replies


def ask(url, model, question):
    """The content of the server's greedy chat reply to QUESTION."""
    body = {
        "model": str(model),
        "messages": [{"role": "user", "content": question}],
        "temperature": 0.0,
        "max_tokens": MAX_TOKENS,
    }
    return post(f"{url}/v1/chat/completions", body)["choices"][0]["message"]["content"]


def test_chat_completion_matches_transformers(server):
    model, url = server
    assert ask(url, model, QUESTIONS[0]) == reference_replies(model, QUESTIONS[:1])[0]


def test_eight_concurrent_requests_get_their_own_text(server):
    model, url = server
    expected = reference_replies(model, QUESTIONS)
    assert len(set(expected)) == len(QUESTIONS)  # a reply given to the wrong request would be seen
    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        replies = list(pool.map(lambda question: ask(url, model, question), QUESTIONS))
    assert replies == expected
