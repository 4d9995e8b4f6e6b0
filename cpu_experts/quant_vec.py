"""The quantizer's block rule (quant.py) as vector code: the max of a block's |x| and its
quotients, rounding and clamp, 32 lanes at once. LLVM leaves the scalar loops unvectorised
(they are unrolled first), and a block then costs ~100 ns; these give the same bits (IEEE
division and round-half-even are the same per lane) in a fraction of that."""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from cpu_experts.irhelp import F32, I8, I32, at, check_array, fn, splat

BLOCK = 32


@intrinsic
def amax32(typingctx, xbits, o):
    """``max |x|`` of the 32 float32 values whose int32 bit patterns are ``xbits[o:o+32]``,
    as one vector max of the patterns with the sign cleared (for non-negative floats the
    integer order is the float order, so the max is exact); inf or nan when any x is not
    finite (their patterns are the largest)."""
    check_array(xbits, types.int32, "xbits")
    sig = types.float32(xbits, types.int64)

    def codegen(context, builder, signature, args):
        v32 = ir.VectorType(I32, BLOCK)
        p = at(context, builder, signature.args[0], args[0], args[1], v32)
        mag = builder.and_(builder.load(p, align=4), ir.Constant(v32, [0x7FFFFFFF] * BLOCK))
        red = fn(builder, "llvm.vector.reduce.smax.v32i32", I32, [v32])
        return builder.bitcast(builder.call(red, [mag]), F32)

    return sig, codegen


@intrinsic
def quantize32(typingctx, x, o, s, q, qo, mask, qmax):
    """``q[qo:qo+32] = int8(clamp(rint(x[o:o+32] / s), -qmax, qmax)) ^ mask`` as vector
    operations (IEEE division and round-half-even: the scalar rule's bits), returning the sum
    of the int8 values before the mask (int32)."""
    check_array(x, types.float32, "x")
    check_array(q, types.int8, "q")
    sig = types.int32(x, types.int64, types.float32, q, types.int64, types.int8, types.int64)

    def codegen(context, builder, signature, args):
        xv, ov, sv, qv, qov, maskv, qmaxv = args
        vf, vi, vb = (ir.VectorType(t, BLOCK) for t in (F32, I32, I8))
        v = builder.load(at(context, builder, signature.args[0], xv, ov, vf), align=4)
        r = builder.call(fn(builder, "llvm.rint.v32f32", vf, [vf]),
                         [builder.fdiv(v, splat(builder, sv, vf))])
        hi = splat(builder, builder.sitofp(qmaxv, F32), vf)
        lo = builder.fneg(hi)
        r = builder.select(builder.fcmp_ordered("<", r, lo), lo, r)
        r = builder.select(builder.fcmp_ordered(">", r, hi), hi, r)
        qi = builder.fptosi(r, vi)
        q8 = builder.xor(builder.trunc(qi, vb), splat(builder, maskv, vb))
        builder.store(q8, at(context, builder, signature.args[3], qv, qov, vb), align=1)
        return builder.call(fn(builder, "llvm.vector.reduce.add.v32i32", I32, [vi]), [qi])

    return sig, codegen
