"""The fused Diff Transformer V1 attention op (diff_transformer.kernels) against an eager reference written from the
formula: two softmax maps over explicit masks, out = (A1 - λ A2) V, in float64.

CPU tensors run the Triton kernels under the Triton interpreter (fp32), CUDA tensors the compiled kernels (bf16 and
fp32) when a GPU is present. Tolerances:
  fp32 (interpreter or GPU, full-precision dots): |x - ref| <= 1e-4 + 1e-4 |ref| elementwise;
  bf16 (GPU) and fp16 (interpreter): max |x - ref| <= 2e-2 max |ref| per tensor, the reference computed from the same
  rounded inputs.
A slow test compiles the GPU kernels for sm_90 and sm_80 without a GPU (Triton's compiler and ptxas).
"""

import sys

import pytest
import torch
from transformers.masking_utils import sdpa_mask

from diff_transformer import kernels
from diff_transformer.kernels import diff_attention_v1 as op_module
from diff_transformer.kernels import triton_v1_attention
from tests.helpers import REPOSITORY, load_script
from tests.helpers.processes import run_json


needs_triton = pytest.mark.skipif(not kernels.triton_available(), reason="triton is not installed")
CUDA = torch.cuda.is_available() and kernels.triton_available()
SETUPS = [pytest.param("cpu", torch.float32, id="cpu-fp32")] + [
    pytest.param("cuda", dtype, id=f"cuda-{name}", marks=pytest.mark.skipif(not CUDA, reason="no CUDA GPU"))
    for dtype, name in ((torch.bfloat16, "bf16"), (torch.float32, "fp32"))
]
# The low-precision code paths (P and dZ cast to the input dtype for the tensor-core dots) under the interpreter: fp16,
# since the interpreter's bf16 dot is wrong (Triton 3.9); checked with the bf16 tolerance.
WITH_CPU_FP16 = SETUPS + [pytest.param("cpu", torch.float16, id="cpu-fp16")]


def reference(query, key, value, lam, scaling, causal=True, mask=None, cu_seqlens=None):
    """(B, N, H, 2d) float64. Rows that may attend nothing give 0 (what the kernel promises for left padding)."""
    if cu_seqlens is not None:  # packed: each sequence on its own
        bounds = cu_seqlens.tolist()
        pieces = [
            reference(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], lam, scaling, causal)
            for a, b in zip(bounds[:-1], bounds[1:])
        ]
        return torch.cat(pieces, dim=1)
    B, H2, N, d = query.shape
    H, H_kv, L = H2 // 2, key.shape[1] // 2, key.shape[2]
    G = H // H_kv
    q = query.double().view(B, 2, H, N, d)  # (B, 2, H, N, d)
    k = key.double().view(B, 2, H_kv, L, d).repeat_interleave(G, dim=2)  # (B, 2, H, L, d): group of each head
    v = torch.cat((value[:, :H_kv], value[:, H_kv:]), dim=-1).double().repeat_interleave(G, dim=1)  # (B, H, L, 2d)
    scores = q @ k.transpose(-1, -2) * scaling  # (B, 2, H, N, L)
    allowed = torch.ones(N, L, dtype=torch.bool, device=query.device)
    if causal:  # the queries are the last N of L positions
        positions = torch.arange(N, device=query.device)[:, None] + L - N
        allowed = torch.arange(L, device=query.device)[None, :] <= positions
    if mask is not None:
        mask = mask[..., :L].unsqueeze(1)  # (B, 1, 1|H, N, L)
        if mask.dtype == torch.bool:
            allowed = allowed & mask
        else:
            scores = scores + mask.double()
    scores = scores.masked_fill(~allowed, float("-inf"))
    any_key = torch.isfinite(scores).any(-1, keepdim=True)
    zero = torch.zeros((), dtype=scores.dtype, device=scores.device)
    # Empty rows get finite dummy scores so no NaN reaches the gradients, then a zero map.
    maps = torch.where(any_key, torch.softmax(torch.where(any_key, scores, zero), dim=-1), zero)
    out = (maps[:, 0] - lam.double() * maps[:, 1]) @ v  # (B, H, N, 2d)
    return out.transpose(1, 2)


def make_inputs(device, dtype, B, H, H_kv, N, L, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(B, 2 * H, N, d, generator=g)
    key = torch.randn(B, 2 * H_kv, L, d, generator=g)
    value = torch.randn(B, 2 * H_kv, L, d, generator=g)
    tensors = [t.to(device=device, dtype=dtype).requires_grad_() for t in (query, key, value)]
    lam = torch.tensor(0.8, device=device, requires_grad=True)  # 0-d fp32, as the model's diff_lambda()
    return (*tensors, lam)


def left_padding_mask(B, N, L, device, additive=False):
    """transformers' sdpa mask for a left-padded batch (row b has 3b pad tokens) and N queries at the end of L."""
    pad = torch.ones(B, L, dtype=torch.bool)
    for b in range(B):
        pad[b, : 3 * b] = False
    mask = sdpa_mask(batch_size=B, q_length=N, kv_length=L, q_offset=L - N, attention_mask=pad, device="cpu")
    assert mask is not None and mask.shape == (B, 1, N, L) and mask.dtype == torch.bool
    if additive:  # -inf where masked plus a finite per-position bias
        bias = torch.linspace(-1.0, 0.5, L).expand(B, 1, N, L)
        mask = torch.where(mask, bias, torch.tensor(float("-inf")))
    return mask.to(device)


def check(name, actual, expected, dtype, rounding_noise=0.0):
    """`rounding_noise`: the error a sum picks up from its terms' rounding alone, allowed on top (see dλ)."""
    assert actual.shape == expected.shape, (name, actual.shape, expected.shape)
    actual, expected = actual.double(), expected.double()
    assert torch.isfinite(actual).all(), f"{name}: non-finite values"
    if dtype == torch.float32:  # bf16 and fp16 share the low-precision tolerance
        torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4, msg=lambda m: f"{name}: {m}")
    else:
        error = (actual - expected).abs().max().item()
        scale = expected.abs().max().item()
        allowed = max(2e-2 * scale, rounding_noise)
        assert error <= allowed, (
            f"{name}: max error {error:.3g} > max(2e-2 x max |ref| {scale:.3g}, {rounding_noise:.3g})"
        )


def lambda_rounding_noise(query, key, value, grad, scaling, causal, mask, dtype):
    """dλ = -Σ dO ∘ (A2 V) sums B·N·H·2d signed terms whose result can be far smaller than the terms (random dO): each
    term carries A2 V rounded to `dtype` (relative error up to the unit roundoff u = eps/2, independent from term to
    term), so the sum's error is about u·‖terms‖₂; 4u·‖terms‖₂ is allowed (measured on an H200 in bf16: 0.0125 against
    a sum of 0.164, 0.12 allowed). A2 V = out(λ=0) - out(λ=1) (out is linear in λ)."""
    if dtype == torch.float32:
        return 0.0
    with torch.no_grad():
        second = reference(query, key, value, torch.tensor(0.0), scaling, causal, mask)
        second = second - reference(query, key, value, torch.tensor(1.0), scaling, causal, mask)
        terms = grad.double() * second
    return 2 * torch.finfo(dtype).eps * terms.norm().item()


def run_and_compare(device, dtype, B, H, H_kv, N, L, d, causal=True, mask=None, seed=0, **options):
    query, key, value, lam = make_inputs(device, dtype, B, H, H_kv, N, L, d, seed)
    scaling = d**-0.5
    out = triton_v1_attention(query, key, value, lam, scaling=scaling, causal=causal, attention_mask=mask, **options)
    assert out.shape == (B, N, H, 2 * d) and out.dtype == dtype
    expected = reference(query, key, value, lam, scaling, causal, mask)
    check("out", out, expected, dtype)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1)).to(device=device, dtype=dtype)
    grads = torch.autograd.grad(out, (query, key, value, lam), grad)
    expected_grads = torch.autograd.grad(expected, (query, key, value, lam), grad.double())
    noise = lambda_rounding_noise(query, key, value, grad, scaling, causal, mask, dtype)
    for name, actual, want in zip(("dquery", "dkey", "dvalue", "dlambda"), grads, expected_grads):
        check(name, actual, want, dtype, rounding_noise=noise if name == "dlambda" else 0.0)
    return out, grads


CASES = {  # B, H, H_kv, N, L, d, causal, mask
    "gqa1-causal-37": (1, 2, 2, 37, 37, 16, True, None),
    "gqa2-causal-61": (1, 4, 2, 61, 61, 16, True, None),
    "gqa3-causal-37-d24": (1, 3, 1, 37, 37, 24, True, None),
    "gqa4-bidirectional-20": (2, 4, 1, 20, 20, 16, False, None),
    "left-padding-29": (3, 4, 2, 29, 29, 16, True, "bool"),
    "left-padding-additive-23": (2, 2, 1, 23, 23, 32, True, "additive"),
    "chunk-5-against-cache-40": (2, 4, 2, 5, 40, 16, True, None),
    "chunk-19-against-cache-45-padded": (2, 2, 2, 19, 45, 16, True, "bool"),
    "decode-1-against-53-padded": (2, 4, 2, 1, 53, 16, True, "bool"),
    "decode-1-against-70-gqa3": (1, 6, 2, 1, 70, 24, True, None),
}
GPU_SIZED = {  # several 64/128-wide tiles; slow under the interpreter
    "gqa4-causal-300-d128": (1, 4, 1, 300, 300, 128, True, None),
    "chunk-7-against-900-d64": (2, 4, 4, 7, 900, 64, True, None),
}
GPU_ONLY = {  # a minute each under the interpreter, which the cases above already cover in kind: CUDA only
    "gqa2-causal-333-d64-padded": (2, 4, 2, 333, 333, 64, True, "bool"),
    "decode-1-against-1000-d64": (3, 8, 2, 1, 1000, 64, True, "bool"),
}


def _case_params():
    """(device, dtype, case) combinations; the GPU-sized cases are `slow` under the interpreter."""
    for setup in SETUPS:
        device, dtype = setup.values
        for table in (CASES, GPU_SIZED, GPU_ONLY):
            if table is GPU_ONLY and device == "cpu":
                continue
            for name, case in table.items():
                marks = list(setup.marks) + ([pytest.mark.slow] if table is GPU_SIZED and device == "cpu" else [])
                yield pytest.param(device, dtype, case, id=f"{setup.id}-{name}", marks=marks)


@needs_triton
@pytest.mark.parametrize("device,dtype,case", list(_case_params()))
def test_matches_reference(device, dtype, case):
    B, H, H_kv, N, L, d, causal, mask_kind = case
    mask = None if mask_kind is None else left_padding_mask(B, N, L, device, additive=mask_kind == "additive")
    out, grads = run_and_compare(device, dtype, B, H, H_kv, N, L, d, causal, mask)
    if mask_kind is not None and N == L:  # left-padded query rows attend nothing: exact zeros, no gradient
        padded = ~mask.isfinite() if mask_kind == "additive" else ~mask
        empty = padded.all(-1)[:, 0]  # (B, N)
        assert empty.any()
        assert (out[empty] == 0).all()
        dquery = grads[0].transpose(1, 2)  # (B, N, 2H, d)
        assert (dquery[empty] == 0).all()


@needs_triton
@pytest.mark.parametrize("device,dtype", WITH_CPU_FP16)
@pytest.mark.parametrize("path", ["prefill", "decode"])
def test_both_paths_for_a_few_queries(device, dtype, path):
    """Either kernel may serve a short chunk; both agree with the reference (the decode forward feeds the FA2
    backward through the log-sum-exps it writes)."""
    mask = left_padding_mask(2, 3, 41, device)
    run_and_compare(device, dtype, 2, 4, 2, 3, 41, 16, True, mask, path=path)


@needs_triton
@pytest.mark.parametrize("device,dtype", WITH_CPU_FP16)
def test_atomic_dq_backward(device, dtype):
    mask = left_padding_mask(2, 33, 33, device)
    run_and_compare(device, dtype, 2, 4, 2, 33, 33, 16, True, mask, atomic_dq=True)


@needs_triton
@pytest.mark.parametrize("device,dtype", WITH_CPU_FP16)
def test_packed_sequences(device, dtype):
    lengths = [13, 1, 17, 6]
    cu_seqlens = torch.tensor([0, 13, 14, 31, 37], dtype=torch.int32, device=device)
    assert cu_seqlens[-1] == sum(lengths)
    query, key, value, lam = make_inputs(device, dtype, 1, 4, 2, 37, 37, 16)
    out = triton_v1_attention(query, key, value, lam, scaling=0.25, cu_seqlens=cu_seqlens)
    expected = reference(query, key, value, lam, 0.25, cu_seqlens=cu_seqlens)
    check("out", out, expected, dtype)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(device=device, dtype=dtype)
    grads = torch.autograd.grad(out, (query, key, value, lam), grad)
    for name, actual, want in zip(
        ("dquery", "dkey", "dvalue", "dlambda"),
        grads,
        torch.autograd.grad(expected, (query, key, value, lam), grad.double()),
    ):
        check(name, actual, want, dtype)


class _Launches:
    """Wraps a Triton kernel and counts its launches."""

    def __init__(self, kernel):
        self.kernel, self.count = kernel, 0

    def __getitem__(self, grid):
        self.count += 1
        return self.kernel[grid]


@needs_triton
@pytest.mark.parametrize("device,dtype", SETUPS)
def test_single_query_uses_the_decode_kernel(device, dtype, monkeypatch):
    module = op_module._kernels(torch.device(device))
    launches = {}
    for name in ("_fwd_kernel", "_decode_split_kernel", "_decode_combine_kernel"):
        launches[name] = _Launches(getattr(module, name))
        monkeypatch.setattr(module, name, launches[name])
    query, key, value, lam = make_inputs(device, dtype, 2, 4, 2, 1, 50, 16)
    with torch.no_grad():
        out = triton_v1_attention(query, key, value, lam, scaling=0.25)
    check("out", out, reference(query, key, value, lam, 0.25), dtype)
    assert launches["_decode_split_kernel"].count == 1 and launches["_decode_combine_kernel"].count == 1
    assert launches["_fwd_kernel"].count == 0
    # A prefill-sized query block goes to the FlashAttention kernel.
    query, key, value, lam = make_inputs(device, dtype, 1, 2, 1, 20, 20, 16)
    with torch.no_grad():
        triton_v1_attention(query, key, value, lam, scaling=0.25)
    assert launches["_fwd_kernel"].count == 1 and launches["_decode_split_kernel"].count == 1


@needs_triton
def test_interpreted_kernels_run_the_compiled_kernels_code():
    """CPU tensors run the very code objects GPU tensors compile, interpreted (not a second import of the kernel
    files), and an interpreted kernel calls the interpreted twins of the package's helpers."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    compiled = op_module._kernels(torch.device("cuda"))  # only imports: no GPU needed
    interpreted = op_module._kernels(torch.device("cpu"))
    assert interpreted is op_module._kernels(torch.device("cpu"))  # built once
    names = ("_fwd_kernel", "_decode_split_kernel", "_decode_combine_kernel")
    names += ("_bwd_preprocess_kernel", "_bwd_dkdv_kernel", "_bwd_dq_kernel")
    for name in names:
        jitted, twin = getattr(compiled, name), getattr(interpreted, name)
        assert isinstance(jitted, JITFunction) and isinstance(twin, InterpretedFunction)
        assert twin.fn.__code__ is jitted.fn.__code__
    helpers = interpreted._fwd_kernel.fn.__globals__
    assert isinstance(helpers["_load_rows"], InterpretedFunction)
    assert helpers["_load_rows"].fn.__code__ is compiled._fwd_kernel.fn.__globals__["_load_rows"].fn.__code__
    assert not [m for m in sys.modules if m.startswith("diff_transformer.kernels") and "interpret" in m]


def test_select_path():
    assert kernels.is_available("cpu") is False  # CPU tensors only ever run under the (slow) interpreter
    assert kernels.select_path(1, 16, 4) == "decode"
    assert kernels.select_path(8, 16, 4) == "decode"  # 32 rows per KV group
    assert kernels.select_path(32, 16, 4) == "prefill"
    assert kernels.select_path(1, 16, 4, packed=True) == "prefill"


@pytest.mark.parametrize("kind", sorted(op_module.CUDA_CONFIGS))
def test_the_launch_configuration_traces_under_a_fullgraph_compile(kind):
    """generate --compile compiles the decoding step with fullgraph=True, so everything the op runs in Python must
    trace; the launch table lookup once did not (min(..., default=) under dynamo; found on an H200). Head dims below,
    between, at and above the table's keys, for a CUDA device (the CPU returns before the table)."""
    cuda = torch.device("cuda")  # a device object only: no GPU is needed to trace the lookup
    block_ds = [op_module._block_d(head_dim) for head_dim in (16, 64, 100, 128, 256, 512)]

    def launch_configs(x):
        return x + 1, [op_module._config(kind, cuda, block_d, torch.bfloat16) for block_d in block_ds]

    _, traced = torch.compile(launch_configs, fullgraph=True, backend="eager")(torch.zeros(1))
    table = op_module.CUDA_CONFIGS[kind]  # the smallest tile class that holds the head, else the largest
    expected = [table[min([k for k in table if k >= block_d] or [max(table)])] for block_d in block_ds]
    assert traced == launch_configs(torch.zeros(1))[1] == expected


def test_a_bool_mask_reaches_the_kernels_as_the_same_bytes_eager_or_compiled():
    """The kernels read a bool mask as bytes at the strides the op passes. Eager reinterprets it in place; a compiled
    graph converts it (inductor could not lower the view on CUDA: the traced graph is checked for the conversion).
    Both must give the kernel the same bytes at the strides it is told, an expanded (stride 0) batch included."""
    torch.manual_seed(0)
    q, k = torch.zeros(2, 4, 8, 16), torch.zeros(2, 2, 8, 16)
    mask = (torch.rand(1, 1, 8, 8) > 0.5).expand(2, 1, 8, 8)  # (B, 1, N, L), batch stride 0 as from sdpa_mask

    def as_the_kernel_reads_it(m):
        p = op_module._Problem(q, k, k, 1.0, False, m, None, None)
        return p.mask.as_strided((2, 1, 8, 8), p.mask_strides) + 0, p.mask.dtype  # base pointer + the strides

    eager, eager_dtype = as_the_kernel_reads_it(mask)
    from torch._dynamo.testing import EagerAndRecordGraphs

    recorder = EagerAndRecordGraphs()
    compiled, compiled_dtype = torch.compile(as_the_kernel_reads_it, fullgraph=True, backend=recorder)(mask)
    assert eager_dtype == compiled_dtype == torch.uint8
    assert torch.equal(eager, mask.to(torch.uint8)) and torch.equal(compiled, mask.to(torch.uint8))
    # the traced graph converts (`.to(torch.uint8)`) and never reinterprets the bool bytes (`.view(torch.uint8)`)
    calls = [(node.target, node.args[1:]) for node in recorder.graphs[0].graph.nodes if node.op == "call_method"]
    assert ("to", (torch.uint8,)) in calls and ("view", (torch.uint8,)) not in calls, calls


@needs_triton
@pytest.mark.parametrize(
    "change,message",
    [
        (dict(value=torch.zeros(1, 4, 6, 16)), "value must have key's shape"),
        (dict(query=torch.zeros(1, 6, 5, 16)), "multiple of the H_kv=2"),
        (dict(query=torch.zeros(1, 5, 5, 16)), "even head count"),
        (
            dict(
                key=torch.zeros(1, 4, 7, 16, dtype=torch.float64), value=torch.zeros(1, 4, 7, 16, dtype=torch.float64)
            ),
            "share one dtype",
        ),
        (dict(attention_mask=torch.ones(1, 1, 5, 3, dtype=torch.bool)), "attention_mask must be"),
        (dict(cu_seqlens=torch.tensor([0, 5], dtype=torch.int32)), "N == L"),
    ],
)
def test_bad_input_is_named(change, message):
    args = dict(
        query=torch.zeros(1, 4, 5, 16),
        key=torch.zeros(1, 4, 7, 16),
        value=torch.zeros(1, 4, 7, 16),
        lam=torch.tensor(0.5),
    )
    options = {k: change.pop(k) for k in ("attention_mask", "cu_seqlens") if k in change}
    args.update(change)
    with pytest.raises(ValueError, match=message) as error:
        triton_v1_attention(**args, scaling=0.25, **options)
    assert "\n" not in str(error.value)


def test_imports_without_triton():
    """The package (and the model's optional import of it) must work where triton is missing."""
    script = """
import importlib.abc, json, sys
class NoTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ImportError("no triton here")
sys.meta_path.insert(0, NoTriton())
import torch
from diff_transformer import kernels
try:
    kernels.triton_v1_attention(torch.zeros(1, 2, 1, 16), torch.zeros(1, 2, 1, 16), torch.zeros(1, 2, 1, 16),
                                torch.tensor(0.5), scaling=0.25)
    error = None
except RuntimeError as e:
    error = str(e)
print(json.dumps([kernels.triton_available(), kernels.is_available(), kernels.is_available("cpu"), error]))
"""
    triton_ok, available, available_cpu, error = run_json(script, env={}, block_diff_transformer=False)
    assert (triton_ok, available, available_cpu) == (False, False, False)
    assert "needs triton" in error and "is_available" in error


def test_the_op_still_imports_under_its_old_name():
    from diff_transformer.kernels import differential_attention_v1

    assert differential_attention_v1 is triton_v1_attention


def _has_nvidia_backend():
    try:
        import triton.backends.nvidia  # noqa: F401
        from triton.backends.compiler import GPUTarget  # noqa: F401
    except Exception:
        return False
    return True


@needs_triton
@pytest.mark.slow
@pytest.mark.skipif(not _has_nvidia_backend(), reason="triton without its CUDA backend")
@pytest.mark.parametrize(
    "arch,dtype,head_dim",
    [(90, torch.bfloat16, 64), (90, torch.bfloat16, 128), (80, torch.bfloat16, 64), (90, torch.float32, 64)],
    ids=["sm90-bf16-d64", "sm90-bf16-d128", "sm80-bf16-d64", "sm90-fp32-d64"],
)
def test_kernels_compile_for_gpus(arch, dtype, head_dim):
    """Every launch the op makes on a GPU (configured tiles, masked, packed, atomic dQ, decode) compiles for the
    architecture and fits its shared memory, so a CPU-only CI catches what the interpreter cannot."""
    kernel_registers = load_script(REPOSITORY / "benchmarks" / "kernel_registers.py")  # a development tool

    shared_limit = {90: 227 * 1024, 80: 163 * 1024}[arch]
    compiled = 0
    for name, constexprs, num_warps, num_stages in kernel_registers.variants(dtype, head_dim):
        compiled_kernel = kernel_registers.compile_kernel(name, constexprs, num_warps, num_stages, dtype, arch)
        usage = kernel_registers.resource_usage(compiled_kernel)
        assert usage["shared_bytes"] <= shared_limit, (name, constexprs, usage)
        compiled += 1
    assert compiled == 9
