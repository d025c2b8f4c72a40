"""Compiles the V1 kernels for a GPU architecture on a machine without a GPU (Triton's own compiler and ptxas): a
compile check for CPU-only CI (tests/kernels/test_kernels.py), and register/spill/shared-memory figures for tuning
the launch configurations (bench_kernel.py --registers). A development tool, so it lives here and not in the package.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import torch

from diff_transformer.kernels.diff_attention_v1 import _block_d, _config


_POINTERS = {"Q", "K", "V", "DO", "Out", "O2", "DK", "DV", "DQ"}  # in the input dtype (DQ: fp32 with ATOMIC_DQ)
_FP32_POINTERS = {"Lam", "Lse1", "Lse2", "Delta1", "Delta2", "PartAcc", "PartML"}
_FLOATS = {"qk_scale", "sm_scale"}
_TYPE = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def variants(dtype: torch.dtype = torch.bfloat16, head_dim: int = 64):
    """(kernel name, constexprs, num_warps, num_stages) of what one training step and one decoding step launch with
    the configured launch configurations, plus the masked, packed and atomic-dQ forms."""
    block_d = _block_d(head_dim)
    prec = "ieee" if dtype == torch.float32 else "tf32"

    def config(kind):  # what the op launches on a GPU
        return _config(kind, torch.device("cuda"), block_d, dtype)

    shape = dict(HEAD_DIM=head_dim, BLOCK_D=block_d)
    bm, bn, w, s = config("fwd")
    yield (
        "_fwd_kernel",
        dict(CAUSAL=True, MASK_KIND=0, VARLEN=False, SAVE_O2=True, BLOCK_M=bm, BLOCK_N=bn, DOT_PREC=prec, **shape),
        w,
        s,
    )
    yield (
        "_fwd_kernel",
        dict(CAUSAL=True, MASK_KIND=1, VARLEN=False, SAVE_O2=False, BLOCK_M=bm, BLOCK_N=bn, DOT_PREC=prec, **shape),
        w,
        s,
    )
    yield (
        "_fwd_kernel",
        dict(CAUSAL=True, MASK_KIND=0, VARLEN=True, SAVE_O2=True, BLOCK_M=bm, BLOCK_N=bn, DOT_PREC=prec, **shape),
        w,
        s,
    )
    yield "_bwd_preprocess_kernel", dict(BLOCK_M=max(16, 4096 // block_d), **shape), 4, 1
    bm, bn, w, s = config("bwd_dkdv")
    for atomic in (False, True):
        yield (
            "_bwd_dkdv_kernel",
            dict(
                CAUSAL=True,
                MASK_KIND=0,
                VARLEN=False,
                ATOMIC_DQ=atomic,
                BLOCK_M=bm,
                BLOCK_N=bn,
                DOT_PREC=prec,
                **shape,
            ),
            w,
            s,
        )
    bm, bn, w, s = config("bwd_dq")
    yield (
        "_bwd_dq_kernel",
        dict(CAUSAL=True, MASK_KIND=0, VARLEN=False, BLOCK_M=bm, BLOCK_N=bn, DOT_PREC=prec, **shape),
        w,
        s,
    )
    _, bn, w, s = config("decode")
    yield "_decode_split_kernel", dict(CAUSAL=True, MASK_KIND=1, BLOCK_R=16, BLOCK_N=bn, DOT_PREC=prec, **shape), w, s
    yield "_decode_combine_kernel", dict(SAVE_O2=False, BLOCK_R=16, **shape), 2, 1


def compile_kernel(name: str, constexprs: dict, num_warps: int, num_stages: int, dtype=torch.bfloat16, arch: int = 90):
    """Triton's CompiledKernel of kernel `name` (kernels/triton_v1/) for sm_<arch>; raises what the compiler raises."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from diff_transformer.kernels import triton_v1

    fn = getattr(triton_v1, name)
    signature = {}
    for arg in fn.arg_names:
        if arg in constexprs:
            signature[arg] = "constexpr"
        elif arg in _FP32_POINTERS or (arg == "DQ" and constexprs.get("ATOMIC_DQ")):
            signature[arg] = "*fp32"
        elif arg in _POINTERS:
            signature[arg] = "*" + _TYPE[dtype]
        elif arg == "Mask":
            signature[arg] = "*u8"
        elif arg == "CuSeqlens":
            signature[arg] = "*i32"
        else:
            signature[arg] = "fp32" if arg in _FLOATS else "i32"
    source = ASTSource(fn, signature, constexprs)
    return triton.compile(
        source, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=num_warps, num_stages=num_stages)
    )


def resource_usage(compiled) -> dict:
    """Registers per thread, stack bytes per thread (register spills) and shared memory of a compiled kernel, read
    from its cubin with the cuobjdump that ships with Triton."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        report = subprocess.run([tool, "-res-usage", cubin.name], capture_output=True, text=True, check=True).stdout
    registers = re.search(r"REG:(\d+)", report)
    stack = re.search(r"STACK:(\d+)", report)
    return {
        "registers": int(registers.group(1)) if registers else None,
        "stack_bytes": int(stack.group(1)) if stack else None,
        "shared_bytes": compiled.metadata.shared,
    }
