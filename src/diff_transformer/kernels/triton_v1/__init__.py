"""Triton kernels of Diff Transformer V1 attention, one file per role (as FlashAttention's flash_fwd, flash_bwd,
flash_fwd_combine, mask, softmax and seqlen_info):

    common.py    layouts, the prologue (program ids, base pointers, causal tile bounds), tile loads, masking, online
                 softmax, sequence bounds: the @triton.jit helpers
    forward.py   _fwd_kernel: FlashAttention-2 forward of both maps (prefill, training)
    decode.py    _decode_split_kernel, _decode_combine_kernel: flash-decoding, split-K over the cache
    backward.py  _bwd_preprocess_kernel, _bwd_dkdv_kernel, _bwd_dq_kernel

The torch side (validation, launch configurations, autograd) is ../diff_attention_v1.py. Importing this package needs
triton. This module holds the compiled kernels (GPU tensors); interpreted() gives the same kernels under the Triton
interpreter (CPU tensors, for tests).
"""

import functools
import sys
import types

from .backward import _bwd_dkdv_kernel, _bwd_dq_kernel, _bwd_preprocess_kernel
from .decode import _decode_combine_kernel, _decode_split_kernel
from .forward import _fwd_kernel


__all__ = [
    "interpreted",
    "_fwd_kernel",
    "_decode_split_kernel",
    "_decode_combine_kernel",
    "_bwd_preprocess_kernel",
    "_bwd_dkdv_kernel",
    "_bwd_dq_kernel",
]
KERNELS = tuple(__all__[1:])  # what diff_attention_v1.py launches


@functools.cache
def interpreted() -> types.SimpleNamespace:
    """The kernels of KERNELS under the Triton interpreter, next to the compiled ones in one process.

    triton.jit picks compiled or interpreted once, at decoration (TRITON_INTERPRET), and a kernel finds the helpers it
    calls through its module's globals. So every @triton.jit function of this package is rebuilt from its code object
    as an InterpretedFunction whose globals are a copy of its module's in which each of the package's @triton.jit
    functions is replaced by its interpreted twin. The source files are imported once; both modes run the same code.
    """
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    modules = [module for name, module in sys.modules.items() if name.startswith(f"{__name__}.")]
    namespaces = {module.__name__: dict(vars(module)) for module in modules}
    twins = {}  # id of a JITFunction -> its InterpretedFunction (a helper imported by several modules gets one twin)

    def twin(jitted: JITFunction) -> InterpretedFunction:
        if id(jitted) not in twins:
            fn = jitted.fn
            code = types.FunctionType(fn.__code__, namespaces[fn.__module__], fn.__name__, fn.__defaults__)
            twins[id(jitted)] = InterpretedFunction(code)
        return twins[id(jitted)]

    for namespace in namespaces.values():
        for name, value in namespace.items():
            if isinstance(value, JITFunction) and value.fn.__module__ in namespaces:
                namespace[name] = twin(value)
    return types.SimpleNamespace(**{name: twin(globals()[name]) for name in KERNELS})
