"""Atomic operations on int32 array elements for the kernels' parallel stages (Numba has none
on the CPU): a hand-off between the threads of one ``prange`` without a second parallel region.

``fetch_add(a, i, v)`` returns the old value of ``a[i]`` and adds ``v`` (sequentially
consistent: every store the calling thread made before it is visible to a thread whose later
``fetch_add`` on the same element sees its result, and the caller sees theirs). On x86 this is
one ``lock xadd``; LLVM also keeps the compiler from moving loads or stores across it.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.errors import TypingError
from numba.extending import intrinsic
from numba.np.ufunc.parallel import _launch_threads

from cpu_experts.irhelp import I32, I64, ptr


@intrinsic
def fetch_add(typingctx, a, i, v):
    """``old = a[i]; a[i] += v; return old``, atomically; ``a`` a C-contiguous int32 array,
    ``i`` an index in range (not checked)."""
    if not isinstance(a, types.Array) or a.dtype != types.int32 or a.layout != "C":
        raise TypingError(f"a must be a C-contiguous int32 array, got {a}")
    sig = types.int32(a, types.int64, types.int32)

    def codegen(context, builder, signature, args):
        av, iv, vv = args
        p = ptr(context, builder, signature.args[0], av, iv, I32)
        return builder.atomic_rmw("add", p, vv, "seq_cst")

    return sig, codegen


@intrinsic
def num_threads(typingctx):
    """``numba.get_num_threads()`` in compiled code, as a call of the threading layer's own
    ``get_num_threads`` (the symbol parallel loops call). Numba's overload calls it through a
    ctypes pointer, which stops ``cache=True`` from caching the function."""
    _launch_threads()  # registers the threading layer's symbols, as Numba's own intrinsic does

    def codegen(context, builder, signature, args):
        f = cgutils.get_or_insert_function(builder.module, ir.FunctionType(I64, []),
                                           "get_num_threads")
        return builder.call(f, [])

    return types.int64(), codegen
