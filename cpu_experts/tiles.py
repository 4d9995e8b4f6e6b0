"""Exact int8 block-32 micro-kernels: one block of 32 positions x 16 output units x a few rows
(:func:`rows_block` also runs the int4 format's micro-kernels of tiles4.py, by the tiles' dtype).

Layout (shard.py): a matrix ``[units, n]`` reduced along ``n`` is stored as micro-tiles of
:data:`TU` = 16 units; micro-tile ``t`` holds, per block ``b`` of 32 positions, 576 bytes
(:data:`BLOCK_BYTES`): 512 bytes ``[8 groups][16 units][4 positions]`` (int8) then the 16
units' float32 scales. So the 4 consecutive positions of one unit fill one 32-bit lane, 64
bytes (one cache line, one zmm register) hold one group of 4 positions for all 16 units -- the
layout that int8 dot-product instructions consume, with lanes = units and no horizontal sums
-- and weights and scales are one stream.

The arithmetic, for each row ``x`` (int8 values, scale ``sx``) and unit ``u``::

    dot[u] = sum_{t < 32} w[u, t] * x[t]            exact integer (|dot| <= 32 * 127 * 127)
    out[u] += float32(dot[u]) * (s[u] * sx)         float32: two multiplies, one add, no FMA

which is reference.py's step 2 for one block. Every instruction set below computes the same
``dot`` exactly, so all of them give the same bits:

* ``ISA_AVX512VNNI``: ``vpdpbusd`` (unsigned x signed bytes, 4 per 32-bit lane, summed into
  int32). The activation enters as ``x + 128`` (unsigned; the kernels store ``x ^ 0x80``),
  and the accumulator starts at ``-128 * sum_t w[u, t]``, computed once per block and micro-
  tile by :func:`block_prologue` and shared by every row: ``sum (x+128) w - 128 sum w = sum
  x w``, all in int32.
* ``ISA_AVX2``: ``vpmaddubsw(|x|, sign(w, x))`` then ``vpmaddwd`` by ones. ``|x| * w * sign(x)
  = x * w``; a pair sum is at most ``2 * 127 * 127 = 32258``, inside int16, so the saturating
  instruction never saturates (the quantizer clamps to [-127, 127]: no -128 anywhere).
* ``ISA_PORTABLE``: generic LLVM vector IR (sign-extend, multiply, add), any CPU.

:func:`rows_block` applies one block to up to :data:`MAX_ROWS` rows per call: the weights are
loaded once and the rows' dot chains are independent, so at 16 rows the core is kept busy
with dot-product instructions rather than loads and dependent latency.

The kernels pick one by :func:`cpu_experts.isa.select`; tests run every one this CPU can
execute against the slow NumPy reference.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core.errors import TypingError
from numba.extending import intrinsic

from cpu_experts import tiles4
from cpu_experts.irhelp import (
    F32,
    GROUPS,
    I1,
    I8,
    I16,
    I32,
    I64,
    at,
    check_array,
    fn,
    isa_of,
    lanes4,
    ptr,
    row_at,
    splat,
    sum4,
    x_words,
)
from cpu_experts.isa import ISA_AVX2, ISA_AVX512VNNI, ISA_PORTABLE
from cpu_experts.quant import BLOCK

TU = 16          # output units per micro-tile (32-bit lanes of a zmm register)
TILE_BYTES = GROUPS * TU * 4  # int8 weights of one block of one micro-tile
BLOCK_BYTES = TILE_BYTES + TU * 4  # ... followed by its 16 float32 scales


def _dots_vnni(builder, wp, xps, start):
    """Per row: ``start + sum_g vpdpbusd(x_g (unsigned), w_g)``, one <16 x i32>; the 8
    weight vectors are loaded once for all rows."""
    v16 = ir.VectorType(I32, 16)
    dp = fn(builder, "llvm.x86.avx512.vpdpbusd.512", v16, [v16, v16, v16])
    wvs = [builder.load(builder.gep(wp, [ir.Constant(I32, g)]), align=1) for g in range(GROUPS)]
    dots = []
    for xp in xps:
        acc = [start, ir.Constant(v16, [0] * 16)]  # two chains: half the dependent latency
        for g, word in enumerate(x_words(builder, xp)):
            acc[g % 2] = builder.call(dp, [acc[g % 2], splat(builder, word, v16), wvs[g]])
        dots.append([builder.add(acc[0], acc[1])])
    return dots


def _dot_avx2(builder, wp, xp):
    """Two <8 x i32> (units 0-7, 8-15): ``maddwd(maddubs(|x|, sign(w, x)), 1)`` summed."""
    v32b, v16h, v8 = ir.VectorType(I8, 32), ir.VectorType(I16, 16), ir.VectorType(I32, 8)
    psign = fn(builder, "llvm.x86.avx2.psign.b", v32b, [v32b, v32b])
    maddubs = fn(builder, "llvm.x86.avx2.pmadd.ub.sw", v16h, [v32b, v32b])
    maddwd = fn(builder, "llvm.x86.avx2.pmadd.wd", v8, [v16h, v16h])
    absb = fn(builder, "llvm.abs.v32i8", v32b, [v32b, I1])
    ones = ir.Constant(v16h, [1] * 16)
    acc = [ir.Constant(v8, [0] * 8), ir.Constant(v8, [0] * 8)]
    wp32 = builder.bitcast(wp, v32b.as_pointer())
    for g, word in enumerate(x_words(builder, xp)):
        xv = builder.bitcast(splat(builder, word, v8), v32b)
        ax = builder.call(absb, [xv, ir.Constant(I1, 0)])
        for h in range(2):
            wv = builder.load(builder.gep(wp32, [ir.Constant(I32, 2 * g + h)]), align=1)
            p16 = builder.call(maddubs, [ax, builder.call(psign, [wv, xv])])
            acc[h] = builder.add(acc[h], builder.call(maddwd, [p16, ones]))
    return acc


def _dot_portable(builder, wp, xp):
    """One <16 x i32> from generic vector IR: widen, multiply, add the 4 positions of a lane."""
    v64b, v64, v16 = ir.VectorType(I8, 64), ir.VectorType(I32, 64), ir.VectorType(I32, 16)
    wp64 = builder.bitcast(wp, v64b.as_pointer())
    acc = ir.Constant(v16, [0] * 16)
    for g, word in enumerate(x_words(builder, xp)):
        wv = builder.sext(builder.load(builder.gep(wp64, [ir.Constant(I32, g)]), align=1), v64)
        acc = sum4(builder, builder.mul(wv, lanes4(builder, word, 64)), acc)
    return [acc]


# The prefetches' locality: 2 is x86's prefetcht1 (into L2, not L1). On the H200 machine int4
# at 1 row read 76.7 GB/s of weights with it against 71.6 with prefetcht0 (3), whose lines
# hold one of a core's few L1 fill buffers until they arrive; prefetchnta (0) read 38.8
# (docs/cpu_experts.md).
PREFETCH_LOCALITY = 2
MAX_ROWS = 16  # rows per rows_block call (a compile-time literal, 1..MAX_ROWS)
# Rows whose dots are taken together (sharing weight registers) before their outputs are
# stored: AVX2's dot already needs a sign per row and weight, and 16 ymm registers hold no more.
_GROUP = {ISA_AVX512VNNI: tiles4.GROUP_ROWS, ISA_AVX2: 1, ISA_PORTABLE: 1}


def _rows_of(nrows) -> int:
    if not isinstance(nrows, types.IntegerLiteral) or not 1 <= nrows.literal_value <= MAX_ROWS:
        raise TypingError(f"nrows must be a literal int in [1, {MAX_ROWS}], got {nrows}")
    return nrows.literal_value


def _weights_of(w) -> bool:
    """True for the int4 format (uint8 tiles, tiles4.py), False for int8 (int8 tiles)."""
    if isinstance(w, types.Array) and w.dtype == types.uint8:
        check_array(w, types.uint8, "w")
        return True
    check_array(w, types.int8, "w")
    return False


@intrinsic
def rows_block(typingctx, isa, nrows, w, woff, x, xs, xc, rows, j, b, o, ooff, ostride, ws):
    """One block of one micro-tile applied to ``nrows`` rows (a literal, 1..MAX_ROWS): for
    ``k < nrows``, with ``r = rows[j + k]`` (``j + k`` when rows is None)::

        o[ooff + k*ostride : +16] += float32(dot(w block, x[r, 32b:32b+32])) * (scales * xs[r, b])

    w: the micro-tile's block at byte ``woff``: int8 tiles (512 weight bytes, 16 float32
    scales) or uint8 tiles of the int4 format (256 nibble bytes, 16 fp16 scales: tiles4.py);
    x int8 [R, n] activations (int8 tiles on VNNI: stored as ``x ^ 0x80``), xs float32
    [R, n/32] their scales, xc int32 [R, n/32] (int4: ``-8 * sum`` of each block of x; int8:
    unused), rows int64 or None, o float32, ws int32[16] from :func:`block_prologue` (int8 on
    VNNI only). The weights are loaded once for all rows; every row's integer dots are taken
    before any output is stored (o is not known not to alias w), then each row gets the same
    float operations, in the same order, as a call for that row alone: the bits do not depend
    on ``nrows``.
    """
    which = isa_of(isa)
    count = _rows_of(nrows)
    int4 = _weights_of(w)
    check_array(x, types.int8, "x")
    check_array(xs, types.float32, "xs")
    check_array(xc, types.int32, "xc")
    if not isinstance(rows, types.NoneType):
        check_array(rows, types.int64, "rows")
    check_array(o, types.float32, "o")
    check_array(ws, types.int32, "ws")
    if x.ndim != 2 or xs.ndim != 2 or xc.ndim != 2:
        raise TypingError(f"x, xs and xc must be 2-D, got {x}, {xs} and {xc}")
    i64 = types.int64
    sig = types.void(isa, nrows, w, i64, x, xs, xc, rows, i64, i64, o, i64, i64, ws)

    def codegen(context, builder, signature, args):
        _, _, wv, woffv, xv, xsv, xcv, rowsv, jv, bv, ov, ooffv, ostridev, wsv = args
        aty = signature.args
        wp = at(context, builder, aty[2], wv, woffv, ir.VectorType(I32, 16))
        wp8 = builder.bitcast(wp, I8.as_pointer())
        col = builder.mul(bv, ir.Constant(I64, BLOCK))
        xps, sxs, xcs = [], [], []
        for k in range(count):
            kk = ir.Constant(I64, k)
            r = builder.add(jv, kk)
            if not isinstance(aty[7], types.NoneType):
                r = builder.load(at(context, builder, aty[7], rowsv, r, I64))
            xps.append(row_at(context, builder, aty[4], xv, r, col, I32))
            sxs.append(builder.load(row_at(context, builder, aty[5], xsv, r, bv, F32)))
            if int4:
                xcs.append(builder.load(row_at(context, builder, aty[6], xcv, r, bv, I32)))
        parts = 2 if which == ISA_AVX2 else 1  # AVX2's dot is two <8 x i32>, units 0-7, 8-15
        vf = ir.VectorType(F32, TU // parts)
        if int4:
            ws_scales = tiles4.scales(builder, wp8, parts)
        else:
            sp = builder.bitcast(builder.gep(wp8, [ir.Constant(I32, TILE_BYTES)]),
                                 vf.as_pointer())
            ws_scales = [builder.load(builder.gep(sp, [ir.Constant(I32, h)]), align=4)
                         for h in range(parts)]
        if which == ISA_AVX512VNNI and not int4:
            start = builder.load(ptr(context, builder, aty[13], wsv, None,
                                      ir.VectorType(I32, 16)), align=4)
        if int4:
            wts = tiles4.weights(builder, which, wp8)
            group = tiles4.GROUP_ROWS if which == ISA_AVX512VNNI else count
        else:
            group = _GROUP[which]
        for k0 in range(0, count, group):
            ks = range(k0, min(k0 + group, count))
            if int4:
                dots = tiles4.dots(builder, which, wts, [xps[k] for k in ks],
                                   [xcs[k] for k in ks])
            elif which == ISA_AVX512VNNI:
                dots = _dots_vnni(builder, wp, [xps[k] for k in ks], start)
            elif which == ISA_AVX2:
                dots = [_dot_avx2(builder, wp, xps[k]) for k in ks]
            else:
                dots = [_dot_portable(builder, wp, xps[k]) for k in ks]
            for k, row_dots in zip(ks, dots, strict=True):
                off = builder.add(ooffv, builder.mul(ostridev, ir.Constant(I64, k)))
                op = at(context, builder, aty[10], ov, off, vf)
                sx = splat(builder, sxs[k], vf)
                for h, dot in enumerate(row_dots):
                    scale = builder.fmul(ws_scales[h], sx)
                    prod = builder.fmul(builder.sitofp(dot, vf), scale)
                    opp = builder.gep(op, [ir.Constant(I32, h)])
                    builder.store(builder.fadd(builder.load(opp, align=4), prod), opp, align=4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def block_prologue(typingctx, isa, w, woff, ws, pf):
    """Before the rows of one block: prefetch the block's bytes (576 int8, 288 int4) at byte
    ``pf`` of w into L2 (a block read later; any offset is safe: prefetches never fault), and
    for int8 tiles on VNNI write ``ws[:16] = -128 * sum_t w[u, t]`` of the block at ``woff``
    (the unsigned-activation correction)."""
    which = isa_of(isa)
    int4 = _weights_of(w)
    check_array(ws, types.int32, "ws")
    sig = types.void(isa, w, types.int64, ws, types.int64)

    def codegen(context, builder, signature, args):
        _, wv, woffv, wsv, pfv = args
        aty = signature.args
        v16 = ir.VectorType(I32, 16)
        far = ptr(context, builder, aty[1], wv, pfv, I8)
        prefetch = fn(builder, "llvm.prefetch.p0", ir.VoidType(),
                       [I8.as_pointer(), I32, I32, I32])
        for line in range(0, tiles4.BLOCK_BYTES4 if int4 else BLOCK_BYTES, 64):
            addr = builder.gep(far, [ir.Constant(I32, line)])
            builder.call(prefetch, [addr, ir.Constant(I32, 0),
                                    ir.Constant(I32, PREFETCH_LOCALITY), ir.Constant(I32, 1)])
        if which == ISA_AVX512VNNI and not int4:
            wp = ptr(context, builder, aty[1], wv, woffv, v16)
            bias = splat(builder, ir.Constant(I32, -0x7F7F7F80), v16)  # every byte 0x80
            dp = fn(builder, "llvm.x86.avx512.vpdpbusd.512", v16, [v16, v16, v16])
            acc = ir.Constant(v16, [0] * 16)
            for g in range(GROUPS):
                wg = builder.load(builder.gep(wp, [ir.Constant(I32, g)]), align=1)
                acc = builder.call(dp, [acc, bias, wg])
            wsp = ptr(context, builder, aty[3], wsv, None, v16)
            builder.store(builder.sub(ir.Constant(v16, [0] * 16), acc), wsp, align=4)
        return context.get_dummy_value()

    return sig, codegen
