"""LLVM IR helpers shared by the micro-kernels of both weight formats (tiles.py, tiles4.py)."""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.errors import TypingError

from cpu_experts.isa import ISA_AMX, ISA_AVX2, ISA_AVX512VNNI, ISA_PORTABLE

GROUPS = 8  # groups of 4 positions in a block of 32

I1 = ir.IntType(1)
I8 = ir.IntType(8)
I16 = ir.IntType(16)
I32 = ir.IntType(32)
I64 = ir.IntType(64)
F32 = ir.FloatType()


def isa_of(isa) -> int:
    """The instruction set of a literal: AMX is AVX-512 VNNI to every micro-kernel but the
    int4 16-row one (:func:`is_amx`)."""
    if not isinstance(isa, types.IntegerLiteral):
        raise TypingError(f"the instruction set must be a literal int, got {isa}")
    value = isa.literal_value
    if value not in (ISA_PORTABLE, ISA_AVX2, ISA_AVX512VNNI, ISA_AMX):
        raise TypingError(f"unknown instruction set {value}")
    return ISA_AVX512VNNI if value == ISA_AMX else value


def is_amx(isa) -> bool:
    isa_of(isa)
    return isa.literal_value == ISA_AMX


def check_array(ty, dtype, name: str) -> None:
    if not isinstance(ty, types.Array) or ty.dtype != dtype or ty.layout != "C":
        raise TypingError(f"{name} must be a C-contiguous {dtype} array, got {ty}")


def ptr(context, builder, aryty, ary, offset, vecty):
    """Pointer to element ``offset`` of a C-contiguous array, as a pointer to ``vecty``."""
    data = context.make_array(aryty)(context, builder, ary).data
    off = context.cast(builder, offset, types.int64, types.intp) if offset is not None else None
    p = builder.gep(data, [off]) if off is not None else data
    return builder.bitcast(p, vecty.as_pointer())


def at(context, builder, aryty, ary, offset, ty):
    """Pointer to element ``offset`` (an i64 value) of a C-contiguous array, as ``ty*``."""
    data = context.make_array(aryty)(context, builder, ary).data
    return builder.bitcast(builder.gep(data, [offset]), ty.as_pointer())


def row_at(context, builder, aryty, ary, row, col, ty):
    """Pointer to element ``[row, col]`` of a C-contiguous 2-D array, as ``ty*``."""
    arr = context.make_array(aryty)(context, builder, ary)
    width = cgutils.unpack_tuple(builder, arr.shape, 2)[1]
    return at(context, builder, aryty, ary, builder.add(builder.mul(row, width), col), ty)


def splat(builder, value, vecty):
    """Broadcast a scalar to every lane of ``vecty``."""
    undef = ir.Constant(vecty, ir.Undefined)
    one = builder.insert_element(undef, value, ir.Constant(I32, 0))
    mask = ir.Constant(ir.VectorType(I32, vecty.count), [0] * vecty.count)
    return builder.shuffle_vector(one, undef, mask)


def fn(builder, name: str, ret, args):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)


def x_words(builder, xp):
    """The 8 groups of 4 activation bytes of a block, each as one int32."""
    return [builder.load(builder.gep(xp, [ir.Constant(I32, g)]), align=1) for g in range(GROUPS)]


def lanes4(builder, word, count: int):
    """One group's 4 activation bytes (an i32) sign-extended and repeated over ``count`` lanes:
    lane ``4u + c`` holds byte c (the portable kernels' multiplier)."""
    x4 = builder.sext(builder.bitcast(word, ir.VectorType(I8, 4)), ir.VectorType(I32, 4))
    mask = ir.Constant(ir.VectorType(I32, count), list(range(4)) * (count // 4))
    return builder.shuffle_vector(x4, ir.Constant(ir.VectorType(I32, 4), ir.Undefined), mask)


def sum4(builder, prod, acc):
    """``acc [16 x i32] += `` the sums of the 4 consecutive lanes of each unit of ``prod``."""
    for c in range(4):
        lane = ir.Constant(ir.VectorType(I32, 16), [4 * u + c for u in range(16)])
        acc = builder.add(acc, builder.shuffle_vector(prod, prod, lane))
    return acc
