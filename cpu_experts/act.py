"""SiLU * up and the re-quantization of h, one block of 32 units of one pair at a time (the math
of reference.py, bit for bit).

The kernels (kernels.py) run no stage of their own for it: in the gate/up stage the item that
writes the last of the four 16-unit tiles a block of 32 needs (gate and up, two tiles each)
computes that block for every row of its expert (:func:`act_block`), while the other threads
go on with their tiles. So there is no parallel region between gate/up and down (one costs
~7 us on the GPU machine) and the SiLU work spreads over the threads as their tiles finish.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from cpu_experts.irhelp import F32, at, check_array, fn
from cpu_experts.quant import BLOCK, QMAX, f16_round
from cpu_experts.quant_vec import amax32, quantize32
from cpu_experts.reference import EXP_COEF, EXP_MAX, EXP_MIN, INV_LN2, LN2_HI, LN2_LO

_C = EXP_COEF  # exp64's Taylor coefficients, a compile-time constant tuple
TWO_K_BIAS = 2.0**52 + 1023.0  # k + this is exact, with k + 1023 in its low mantissa bits


@intrinsic
def _silu32(typingctx, g, o, u, h, ho):
    """``h[ho:ho+32] = float32(silu64(g[o:o+32])) * u[o:o+32]``: reference.exp64's operations
    on vectors of 32 doubles, in the same order and with no fused multiply-add, so each lane
    rounds as the scalar code does. exp64 ends with ``ldexp(p, k)``; over the clamped range k
    lies in [-1021, 1023], where ``2**k`` is a normal double and ``p * 2**k`` is exact, so
    ``2**k`` is built from its exponent bits: ``bits(k + 2**52 + 1023) << 52`` (k + 2**52 +
    1023 is exact, with k + 1023 in its low mantissa bits)."""
    for name, arr in (("g", g), ("u", u), ("h", h)):
        check_array(arr, types.float32, name)
    sig = types.void(g, types.int64, u, h, types.int64)

    def codegen(context, builder, signature, args):
        gv, ov, uv, hv, hov = args
        aty = signature.args
        vf, vd, vi = (ir.VectorType(t, BLOCK) for t in (F32, ir.DoubleType(), ir.IntType(64)))

        def c(value: float):
            return ir.Constant(vd, [value] * BLOCK)

        g64 = builder.fpext(builder.load(at(context, builder, aty[0], gv, ov, vf), align=4), vd)
        x = builder.fneg(g64)
        xc = builder.select(builder.fcmp_ordered("<", x, c(EXP_MIN)), c(EXP_MIN), x)
        xc = builder.select(builder.fcmp_ordered(">", xc, c(EXP_MAX)), c(EXP_MAX), xc)
        k = builder.call(fn(builder, "llvm.rint.v32f64", vd, [vd]),
                         [builder.fmul(xc, c(INV_LN2))])
        r = builder.fsub(builder.fsub(xc, builder.fmul(k, c(LN2_HI))), builder.fmul(k, c(LN2_LO)))
        q = c(_C[13])
        for i in range(12, -1, -1):
            q = builder.fadd(builder.fmul(q, r), c(_C[i]))
        bits = builder.shl(builder.bitcast(builder.fadd(k, c(TWO_K_BIAS)), vi),
                           ir.Constant(vi, [52] * BLOCK))
        e = builder.fmul(q, builder.bitcast(bits, vd))
        e = builder.select(builder.fcmp_ordered(">", x, c(EXP_MAX)), c(float("inf")), e)
        e = builder.select(builder.fcmp_ordered("<", x, c(EXP_MIN)), c(0.0), e)
        s32 = builder.fptrunc(builder.fdiv(g64, builder.fadd(c(1.0), e)), vf)
        uvec = builder.load(at(context, builder, aty[2], uv, ov, vf), align=4)
        builder.store(builder.fmul(s32, uvec), at(context, builder, aty[3], hv, hov, vf),
                      align=4)
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True, nogil=True)
def silu_mul_block(g, u, o: int, h, ho: int) -> None:
    """``h[ho:ho+32] = float32(silu64(g[o:o+32])) * u[o:o+32]`` (reference.silu_mul's bits)."""
    _silu32(g, o, u, h, ho)


@njit(cache=True, nogil=True)
def scratch(threads: int):
    """Per-thread scratch of :func:`act_block` for ``threads`` threads: thread ``t`` uses
    ``32 t : 32 t + 32`` of ``(h f32, h's int32 view)``. Made once per layer, outside the
    parallel loop (a view or an allocation per block costs an atomic or a contended malloc)."""
    h = np.empty(threads * BLOCK, np.float32)
    return h, h.view(np.int32)


@njit(cache=True, nogil=True, inline="always")
def quantize_h(h, hbits, so: int, q, qo: int, mask) -> tuple[float, int, bool]:
    """quant.py's rule for the 32 values ``h[so:so+32]`` (``hbits``: their int32 view):
    ``q[qo:qo+32]`` (int8, ``^ mask``), and returns (the scale's value, the sum of the q
    before the mask, finite). Vector code for the max and the quotients; the scale's rounding
    to a half is quant.f16_round's. Nothing is written when a value is not finite."""
    amax = amax32(hbits, so)
    if not amax < np.float32(np.inf):  # inf or nan
        return 0.0, 0, False
    s = f16_round(np.float64(amax / np.float32(QMAX)))
    if s == 0.0:
        for i in range(BLOCK):
            q[np.uintp(qo + i)] = mask
        return 0.0, 0, True
    return s, quantize32(h, so, np.float32(s), q, qo, mask, QMAX), True


@njit(cache=True, nogil=True, inline="always")
def act_block(gf, uf, Is: int, p: int, b: int, flip, hkf, hs, hc, sc, so: int) -> bool:
    """Block ``b`` (32 units) of pair row ``p``: ``h = float32(silu64(g)) * u`` from the flat
    ``gf``/``uf`` (``[P, Is]`` each), re-quantized into the flat ``hkf`` at ``p * Is + 32b``
    (int8, tiles.py form: ``^ 0x80`` when ``flip``), ``hs[p, b]`` (the scale's float32
    value) and ``hc[p, b]`` (``-8 *`` the block's sum of q: the int4 kernels' offset
    correction). ``sc``: :func:`scratch`, at ``so``. False if h is not finite."""
    hbuf, hbits = sc
    o = p * Is + b * BLOCK
    _silu32(gf, o, uf, hbuf, so)
    s, total, fine = quantize_h(hbuf, hbits, so, hkf, o, np.int8(-128) if flip else np.int8(0))
    hs[p, b] = np.float32(s)
    hc[p, b] = np.int32(-8) * np.int32(total)
    return fine


@njit(cache=True, nogil=True)
def act_rows(g, u, flip, hk, hs, hc) -> bool:
    """Every block of every row of ``g``/``u`` ``[P, Is]`` on the calling thread (tests and
    benchmarks; the kernels call :func:`act_block` from the gate/up stage). False if any h is
    not finite."""
    P, Is = g.shape
    sc = scratch(1)
    ok = True
    gf, uf, hkf = g.reshape(g.size), u.reshape(u.size), hk.reshape(hk.size)
    for p in range(P):
        for b in range(Is // BLOCK):
            ok = act_block(gf, uf, Is, p, b, flip, hkf, hs, hc, sc, 0) and ok
    return ok

