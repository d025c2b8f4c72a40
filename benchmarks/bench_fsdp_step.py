"""One FSDP2 training step of 1B-shaped Llama, Diff V1 and Diff V2 on one GPU, tokens/s in the same run (the ratio to
Llama is the figure; absolute tokens/s depend on the card). What `train --parallelism fsdp` runs per rank: torch's
`fully_shard` on every decoder layer and the root, bf16 compute with fp32 gradient reduction
(`MixedPrecisionPolicy`, as `DistributedConfig(fsdp_mixed_precision=True)` sets it), AdamW.

    torchrun --standalone --nproc-per-node 1 benchmarks/bench_fsdp_step.py --out OUT/fsdp_step.json

transformers' `DistributedConfig(fsdp_size=1)` does not shard a 1-rank world, so the sharding is applied here with the
same torch calls on a 1-rank mesh; the shapes (hidden 2048, 16 layers, Llama 32 query / 8 KV heads, vocab 32000, the
V1/V2 head layout of bench_gpu.py) are Llama-3.2-1B's. `--tiny` runs the same code on a small model (CPU smoke test).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
import weakref
from pathlib import Path

import torch
import torch.distributed as dist

import bench_common


ONE_B = dict(vocab=32000, hidden=2048, intermediate=8192, layers=16, heads=32, kv_heads=8, head_dim=64)
TINY = dict(vocab=256, hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, head_dim=16)


def build(name: str, size: dict, device):
    from transformers import LlamaConfig, LlamaForCausalLM

    from diff_transformer import DiffConfig, DiffForCausalLM

    common = bench_common.config_kwargs(size, 4096)
    n_h, n_kv = size["heads"], size["kv_heads"]
    if name == "llama":
        cls, config = LlamaForCausalLM, LlamaConfig(num_attention_heads=n_h, num_key_value_heads=n_kv, **common)
    elif name == "v1":  # 2H = Llama's heads, 2H_kv = its KV heads: the same matrices (bench_common)
        cls, config = DiffForCausalLM, DiffConfig(diff_version=1, num_attention_heads=n_h // 2,
                                                  num_key_value_heads=n_kv // 2, **common)  # fmt: skip
    else:  # V2 as bench_gpu.py lays it out: 2H = Llama's query heads, Llama's KV heads
        cls, config = DiffForCausalLM, DiffConfig(diff_version=2, num_attention_heads=n_h // 2,
                                                  num_key_value_heads=n_kv, **common)  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        return cls(config)


def shard(model, mesh, bf16: bool):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    kwargs = {"mesh": mesh, **({"mp_policy": policy} if policy else {})}
    for layer in model.model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def measure(name, size, device, mesh, batch, seq, steps, bf16):
    """One model's steps. Its peak is its own: FSDP2's hooks put a sharded model in reference cycles, which only the
    garbage collector frees, so the previous model is collected (and checked gone) before this one is built; the
    bytes still allocated at the start are recorded beside the peak."""
    gc.collect()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    resident = torch.cuda.memory_allocated() if cuda else None
    model = shard(build(name, size, device), mesh, bf16).train()
    alive = weakref.ref(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=cuda)
    ids = torch.randint(3, size["vocab"], (batch, seq), device=device)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    times = []
    for step in range(steps + 2):  # two warm-up steps
        sync()
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        if step >= 2:
            times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() if cuda else None
    params = sum(p.numel() for p in model.parameters())
    last_loss = float(loss)
    del model, optimizer, loss
    gc.collect()
    step_s = bench_common.median(times)
    row = {"params": params, "step_s": step_s, "tokens_per_s": batch * seq / step_s, "peak_bytes": peak,
           "resident_bytes_at_start": resident, "loss": last_loss}  # fmt: skip
    if alive() is not None:  # its own figures stand; the next model's peak would not
        row["error"] = f"{name} is still referenced after its steps: the next model's peak would include it"
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tiny", action="store_true", help="a small model (CPU smoke test)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--models", default="llama,v1,v2")
    parser.add_argument("--print-json", action="store_true", help="also print the record (gpu_checks.sh's log)")
    args = parser.parse_args(argv)
    from torch.distributed.device_mesh import init_device_mesh

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    size = TINY if args.tiny else ONE_B
    results = {}
    for name in args.models.split(","):
        try:
            results[name] = measure(name, size, device, mesh, args.batch, args.seq, args.steps, bf16=cuda)
        except Exception as error:  # recorded, not raised: the other models still run
            results[name] = {"error": f"{type(error).__name__}: {error}"[:300]}
    llama = results.get("llama", {}).get("tokens_per_s")
    for row in results.values():
        if llama and "tokens_per_s" in row:
            row["ratio_llama"] = row["tokens_per_s"] / llama
    record = {"what": "one FSDP2 training step per rank (fully_shard per layer + root, bf16 MixedPrecisionPolicy)",
              "size": size, "batch": args.batch, "seq": args.seq, "world": dist.get_world_size(),
              "device": torch.cuda.get_device_name(device) if cuda else "cpu", **bench_common.provenance(),
              "results": results}  # fmt: skip
    if dist.get_rank() == 0:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1) + "\n")
        for name, row in results.items():
            print(name, {k: v for k, v in row.items() if k != "loss"})
        if args.print_json:
            print(json.dumps(record))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
