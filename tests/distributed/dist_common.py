"""Shared by the torchrun scripts: the tiny model, the fixed data, and what each rank writes down."""

import json
import os
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from diff_transformer import DiffForCausalLM
from tests.helpers.tiny import tiny_config  # 4 heads over 2 KV groups: GQA, both counts split over 2 ranks


SEQ_LEN = 16


def launch_environment() -> dict[str, str]:
    """This process's environment for a torchrun launch from a test: one thread a rank, and none of the variables of a
    torchrun the test itself may run under."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    return {k: v for k, v in env.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_"))}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(launch: list[str], args: list[str], env: dict | None = None) -> subprocess.Popen:
    """`diff-transformer train ARGS` under torchrun with LAUNCH's options, started (stdout and stderr together; ENV:
    `launch_environment()` by default)."""
    from tests.helpers import REPOSITORY

    command = [sys.executable, "-m", "torch.distributed.run", *launch, "-m", "diff_transformer.cli", "train", *args]
    return subprocess.Popen(
        command,
        cwd=REPOSITORY,
        env=env or launch_environment(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def two_nodes(args: list[str], env: dict | None = None) -> list[subprocess.Popen]:
    """The launch of docs/training.md's multi-node template, node 0 and node 1 on this machine."""
    port = free_port()
    return [
        torchrun(
            [
                "--nnodes",
                "2",
                "--node-rank",
                str(node),
                "--nproc-per-node",
                "2",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-id",
                f"test{port}",
            ],
            args,
            env,
        )  # fmt: skip
        for node in (0, 1)
    ]


def finish(processes, timeout=240) -> list[tuple[int, str]]:
    """(status, output) of each process, all read at once: a node whose pipe fills while another is waited for would
    block its ranks, and so every rank, in the next collective. One still running after TIMEOUT is killed."""

    def wait(process):
        try:
            output, _ = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            output, _ = process.communicate()
        return process.returncode, output

    with ThreadPoolExecutor(len(processes)) as pool:
        return list(pool.map(wait, processes))


def succeed(processes) -> list[str]:
    """Each process finished with status 0 (else its output's end): their outputs."""
    outputs = []
    for status, output in finish(processes):
        assert status == 0, output[-6000:]
        outputs.append(output)
    return outputs


TRAIN_STEPS = 3
# `diff-transformer train` options of the sharded-against-one-process tests: 3 logged steps, no evaluation, no
# checkpoint, a fixed seed.
TRAIN_OPTIONS = [
    "--quiet", "--report-to", "none", "--block-size", "32", "--eval-fraction", "0", "--max-steps", str(TRAIN_STEPS),
    "--logging-steps", "1", "--lr", "1e-3", "--seed", "3", "--save-steps", "100",
]  # fmt: skip


def torchrun_fsdp_train(data: list[str], output: Path, *options: str, env: dict | None = None):
    """`diff-transformer train DATA --output OUTPUT --batch-size 1 --parallelism fsdp OPTIONS` under torchrun, 2 ranks
    on this machine (ENV: `launch_environment()` by default), asserted to succeed; the finished process."""
    from tests.helpers import REPOSITORY

    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += ["-m", "diff_transformer.cli", "train", *data, "--output", str(output), "--batch-size", "1"]
    command += ["--parallelism", "fsdp", *options]
    result = subprocess.run(
        command, cwd=REPOSITORY, env=env or launch_environment(), capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    return result


def train_losses(output: Path) -> list[float]:
    """The training losses a `diff-transformer train` run logged (its trainer_state.json), step by step."""
    history = json.loads((Path(output) / "trainer_state.json").read_text())["log_history"]
    return [entry["loss"] for entry in history if "loss" in entry]


def tiny_model(diff_version: int, seed: int = 0, **overrides) -> DiffForCausalLM:
    torch.manual_seed(seed)
    model = DiffForCausalLM(tiny_config(diff_version, **overrides))
    with torch.no_grad():  # sharper attention maps and λ than the 0.02-std init: mixed-up heads show in the logits
        for name, param in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight", "diff_lambda.proj.weight")):
                param.mul_(8.0)
    return model


def save_train_checkpoint(path, text_path, diff_version: int = 2, **overrides) -> None:
    """A tiny Diff model (OVERRIDES: its config's) with the shipped tokenizer, and some held-out text: input for
    `diff-transformer train`."""
    from importlib.resources import files

    from transformers import AutoTokenizer

    assets = files("diff_transformer") / "assets"
    tokenizer = AutoTokenizer.from_pretrained(str(assets / "tiny-llama"))
    special = {name: getattr(tokenizer, name) for name in ("bos_token_id", "eos_token_id", "pad_token_id")}
    tiny_model(diff_version, vocab_size=len(tokenizer), **special, **overrides).save_pretrained(path)
    tokenizer.save_pretrained(path)
    with open(text_path, "w", encoding="utf-8") as f:
        f.write((assets / "heldout.txt").read_text(encoding="utf-8")[:3000])  # ~26 blocks of 32 tokens


def token_batches(num_sequences: int, seed: int = 1) -> torch.Tensor:
    """Fixed-length random token sequences (no padding: every sequence carries the same number of loss tokens)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 97, (num_sequences, SEQ_LEN), generator=generator)


def rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def write_rank_record(out_dir: str, record: dict, tensors: dict[str, torch.Tensor] | None = None) -> None:
    """rank{r}.json (+ rank{r}.safetensors): every rank reports what it saw, so the test can compare the ranks."""
    rank, world_size = rank_and_world()
    record = {"rank": rank, "world_size": world_size, "env_world_size": int(os.environ.get("WORLD_SIZE", 1)), **record}
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    if tensors is not None:
        tensors = {name: t.detach().to("cpu", torch.float32).contiguous() for name, t in tensors.items()}
        save_file(tensors, os.path.join(out_dir, f"rank{rank}.safetensors"))
