"""Exact int8 block-32 micro-kernels: one block of 32 positions x 16 output units x a few rows.

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
from numba.core import cgutils
from numba.core.errors import TypingError
from numba.extending import intrinsic

from cpu_experts.isa import ISA_AVX2, ISA_AVX512VNNI, ISA_PORTABLE
from cpu_experts.quant import BLOCK

TU = 16          # output units per micro-tile (32-bit lanes of a zmm register)
GROUPS = 8       # groups of 4 positions in a block of 32
TILE_BYTES = GROUPS * TU * 4  # int8 weights of one block of one micro-tile
BLOCK_BYTES = TILE_BYTES + TU * 4  # ... followed by its 16 float32 scales

_I1 = ir.IntType(1)
_I8 = ir.IntType(8)
_I16 = ir.IntType(16)
_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
_F32 = ir.FloatType()


def _isa_of(isa) -> int:
    if not isinstance(isa, types.IntegerLiteral):
        raise TypingError(f"the instruction set must be a literal int, got {isa}")
    value = isa.literal_value
    if value not in (ISA_PORTABLE, ISA_AVX2, ISA_AVX512VNNI):
        raise TypingError(f"unknown instruction set {value}")
    return value


def _check_array(ty, dtype, name: str) -> None:
    if not isinstance(ty, types.Array) or ty.dtype != dtype or ty.layout != "C":
        raise TypingError(f"{name} must be a C-contiguous {dtype} array, got {ty}")


def _ptr(context, builder, aryty, ary, offset, vecty):
    """Pointer to element ``offset`` of a C-contiguous array, as a pointer to ``vecty``."""
    data = context.make_array(aryty)(context, builder, ary).data
    off = context.cast(builder, offset, types.int64, types.intp) if offset is not None else None
    ptr = builder.gep(data, [off]) if off is not None else data
    return builder.bitcast(ptr, vecty.as_pointer())


def _splat(builder, value, vecty):
    """Broadcast a scalar to every lane of ``vecty``."""
    undef = ir.Constant(vecty, ir.Undefined)
    one = builder.insert_element(undef, value, ir.Constant(_I32, 0))
    mask = ir.Constant(ir.VectorType(_I32, vecty.count), [0] * vecty.count)
    return builder.shuffle_vector(one, undef, mask)


def _fn(builder, name: str, ret, args):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)


def _x_words(builder, xp):
    """The 8 groups of 4 activation bytes of a block, each as one int32."""
    return [builder.load(builder.gep(xp, [ir.Constant(_I32, g)]), align=1) for g in range(GROUPS)]


def _dots_vnni(builder, wp, xps, start):
    """Per row: ``start + sum_g vpdpbusd(x_g (unsigned), w_g)``, one <16 x i32>; the 8
    weight vectors are loaded once for all rows."""
    v16 = ir.VectorType(_I32, 16)
    dp = _fn(builder, "llvm.x86.avx512.vpdpbusd.512", v16, [v16, v16, v16])
    wvs = [builder.load(builder.gep(wp, [ir.Constant(_I32, g)]), align=1) for g in range(GROUPS)]
    dots = []
    for xp in xps:
        acc = [start, ir.Constant(v16, [0] * 16)]  # two chains: half the dependent latency
        for g, word in enumerate(_x_words(builder, xp)):
            acc[g % 2] = builder.call(dp, [acc[g % 2], _splat(builder, word, v16), wvs[g]])
        dots.append([builder.add(acc[0], acc[1])])
    return dots


def _dot_avx2(builder, wp, xp):
    """Two <8 x i32> (units 0-7, 8-15): ``maddwd(maddubs(|x|, sign(w, x)), 1)`` summed."""
    v32b, v16h, v8 = ir.VectorType(_I8, 32), ir.VectorType(_I16, 16), ir.VectorType(_I32, 8)
    psign = _fn(builder, "llvm.x86.avx2.psign.b", v32b, [v32b, v32b])
    maddubs = _fn(builder, "llvm.x86.avx2.pmadd.ub.sw", v16h, [v32b, v32b])
    maddwd = _fn(builder, "llvm.x86.avx2.pmadd.wd", v8, [v16h, v16h])
    absb = _fn(builder, "llvm.abs.v32i8", v32b, [v32b, _I1])
    ones = ir.Constant(v16h, [1] * 16)
    acc = [ir.Constant(v8, [0] * 8), ir.Constant(v8, [0] * 8)]
    wp32 = builder.bitcast(wp, v32b.as_pointer())
    for g, word in enumerate(_x_words(builder, xp)):
        xv = builder.bitcast(_splat(builder, word, v8), v32b)
        ax = builder.call(absb, [xv, ir.Constant(_I1, 0)])
        for h in range(2):
            wv = builder.load(builder.gep(wp32, [ir.Constant(_I32, 2 * g + h)]), align=1)
            p16 = builder.call(maddubs, [ax, builder.call(psign, [wv, xv])])
            acc[h] = builder.add(acc[h], builder.call(maddwd, [p16, ones]))
    return acc


def _dot_portable(builder, wp, xp):
    """One <16 x i32> from generic vector IR: widen, multiply, add the 4 positions of a lane."""
    v64b, v64, v16 = ir.VectorType(_I8, 64), ir.VectorType(_I32, 64), ir.VectorType(_I32, 16)
    wp64 = builder.bitcast(wp, v64b.as_pointer())
    acc = ir.Constant(v16, [0] * 16)
    for g, word in enumerate(_x_words(builder, xp)):
        wv = builder.sext(builder.load(builder.gep(wp64, [ir.Constant(_I32, g)]), align=1), v64)
        x4 = builder.sext(builder.bitcast(word, ir.VectorType(_I8, 4)), ir.VectorType(_I32, 4))
        xv = builder.shuffle_vector(x4, ir.Constant(ir.VectorType(_I32, 4), ir.Undefined),
                                    ir.Constant(ir.VectorType(_I32, 64), list(range(4)) * 16))
        prod = builder.mul(wv, xv)
        for c in range(4):
            lane = ir.Constant(ir.VectorType(_I32, 16), [4 * u + c for u in range(16)])
            acc = builder.add(acc, builder.shuffle_vector(prod, prod, lane))
    return [acc]


MAX_ROWS = 8  # rows per rows_block call (a compile-time literal, 1..MAX_ROWS)
# Rows whose dots are taken together (sharing weight registers) before their outputs are
# stored: AVX2's dot already needs a sign per row and weight, and 16 ymm registers hold no more.
_GROUP = {ISA_AVX512VNNI: MAX_ROWS, ISA_AVX2: 1, ISA_PORTABLE: 1}


def _rows_of(nrows) -> int:
    if not isinstance(nrows, types.IntegerLiteral) or not 1 <= nrows.literal_value <= MAX_ROWS:
        raise TypingError(f"nrows must be a literal int in [1, {MAX_ROWS}], got {nrows}")
    return nrows.literal_value


def _at(context, builder, aryty, ary, offset, ty):
    """Pointer to element ``offset`` (an i64 value) of a C-contiguous array, as ``ty*``."""
    data = context.make_array(aryty)(context, builder, ary).data
    return builder.bitcast(builder.gep(data, [offset]), ty.as_pointer())


def _row_at(context, builder, aryty, ary, row, col, ty):
    """Pointer to element ``[row, col]`` of a C-contiguous 2-D array, as ``ty*``."""
    arr = context.make_array(aryty)(context, builder, ary)
    width = cgutils.unpack_tuple(builder, arr.shape, 2)[1]
    return _at(context, builder, aryty, ary, builder.add(builder.mul(row, width), col), ty)


@intrinsic
def rows_block(typingctx, isa, nrows, w, woff, x, xs, rows, j, b, o, ooff, ostride, ws):
    """One block of one micro-tile applied to ``nrows`` rows (a literal, 1..MAX_ROWS): for
    ``k < nrows``, with ``r = rows[j + k]`` (``j + k`` when rows is None)::

        o[ooff + k*ostride : +16] += float32(dot(w block, x[r, 32b:32b+32])) * (scales * xs[r, b])

    w int8: the micro-tile's block at byte ``woff`` (512 weight bytes, 16 float32 scales);
    x int8 [R, n] activations (for VNNI stored as ``x ^ 0x80``), xs float32 [R, n/32] their
    scales, rows int64 or None, o float32, ws int32[16] from :func:`block_prologue` (read by
    VNNI only). The weights are loaded once for all rows; every row's integer dots are taken
    before any output is stored (o is not known not to alias w), then each row gets the same
    float operations, in the same order, as a call for that row alone: the bits do not depend
    on ``nrows``.
    """
    which = _isa_of(isa)
    count = _rows_of(nrows)
    _check_array(w, types.int8, "w")
    _check_array(x, types.int8, "x")
    _check_array(xs, types.float32, "xs")
    if not isinstance(rows, types.NoneType):
        _check_array(rows, types.int64, "rows")
    _check_array(o, types.float32, "o")
    _check_array(ws, types.int32, "ws")
    if x.ndim != 2 or xs.ndim != 2:
        raise TypingError(f"x and xs must be 2-D, got {x} and {xs}")
    i64 = types.int64
    sig = types.void(isa, nrows, w, i64, x, xs, rows, i64, i64, o, i64, i64, ws)

    def codegen(context, builder, signature, args):
        _, _, wv, woffv, xv, xsv, rowsv, jv, bv, ov, ooffv, ostridev, wsv = args
        aty = signature.args
        wp = _at(context, builder, aty[2], wv, woffv, ir.VectorType(_I32, 16))
        col = builder.mul(bv, ir.Constant(_I64, BLOCK))
        xps, sxs = [], []
        for k in range(count):
            kk = ir.Constant(_I64, k)
            r = builder.add(jv, kk)
            if not isinstance(aty[6], types.NoneType):
                r = builder.load(_at(context, builder, aty[6], rowsv, r, _I64))
            xps.append(_row_at(context, builder, aty[4], xv, r, col, _I32))
            sxs.append(builder.load(_row_at(context, builder, aty[5], xsv, r, bv, _F32)))
        parts = 2 if which == ISA_AVX2 else 1  # AVX2's dot is two <8 x i32>, units 0-7, 8-15
        vf = ir.VectorType(_F32, TU // parts)
        scales = builder.gep(builder.bitcast(wp, _I8.as_pointer()), [ir.Constant(_I32, TILE_BYTES)])
        sp = builder.bitcast(scales, vf.as_pointer())
        ws_scales = [builder.load(builder.gep(sp, [ir.Constant(_I32, h)]), align=4)
                     for h in range(parts)]
        if which == ISA_AVX512VNNI:
            start = builder.load(_ptr(context, builder, aty[12], wsv, None,
                                      ir.VectorType(_I32, 16)), align=4)
        group = _GROUP[which]
        for k0 in range(0, count, group):
            ks = range(k0, min(k0 + group, count))
            if which == ISA_AVX512VNNI:
                dots = _dots_vnni(builder, wp, [xps[k] for k in ks], start)
            elif which == ISA_AVX2:
                dots = [_dot_avx2(builder, wp, xps[k]) for k in ks]
            else:
                dots = [_dot_portable(builder, wp, xps[k]) for k in ks]
            for k, row_dots in zip(ks, dots, strict=True):
                off = builder.add(ooffv, builder.mul(ostridev, ir.Constant(_I64, k)))
                op = _at(context, builder, aty[9], ov, off, vf)
                sx = _splat(builder, sxs[k], vf)
                for h, dot in enumerate(row_dots):
                    scale = builder.fmul(ws_scales[h], sx)
                    prod = builder.fmul(builder.sitofp(dot, vf), scale)
                    opp = builder.gep(op, [ir.Constant(_I32, h)])
                    builder.store(builder.fadd(builder.load(opp, align=4), prod), opp, align=4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def block_prologue(typingctx, isa, w, woff, ws, pf):
    """Before the rows of one block: prefetch the 576 bytes at byte ``pf`` of w (a block read
    later; any offset is safe: prefetches never fault), and for VNNI write
    ``ws[:16] = -128 * sum_t w[u, t]`` of the block at ``woff`` (the unsigned-activation
    correction)."""
    which = _isa_of(isa)
    _check_array(w, types.int8, "w")
    _check_array(ws, types.int32, "ws")
    sig = types.void(isa, w, types.int64, ws, types.int64)

    def codegen(context, builder, signature, args):
        _, wv, woffv, wsv, pfv = args
        aty = signature.args
        v16 = ir.VectorType(_I32, 16)
        far = _ptr(context, builder, aty[1], wv, pfv, _I8)
        prefetch = _fn(builder, "llvm.prefetch.p0", ir.VoidType(),
                       [_I8.as_pointer(), _I32, _I32, _I32])
        for line in range(0, BLOCK_BYTES, 64):
            addr = builder.gep(far, [ir.Constant(_I32, line)])
            builder.call(prefetch, [addr, ir.Constant(_I32, 0), ir.Constant(_I32, 3),
                                    ir.Constant(_I32, 1)])
        if which == ISA_AVX512VNNI:
            wp = _ptr(context, builder, aty[1], wv, woffv, v16)
            bias = _splat(builder, ir.Constant(_I32, -0x7F7F7F80), v16)  # every byte 0x80
            dp = _fn(builder, "llvm.x86.avx512.vpdpbusd.512", v16, [v16, v16, v16])
            acc = ir.Constant(v16, [0] * 16)
            for g in range(GROUPS):
                wg = builder.load(builder.gep(wp, [ir.Constant(_I32, g)]), align=1)
                acc = builder.call(dp, [acc, bias, wg])
            wsp = _ptr(context, builder, aty[3], wsv, None, v16)
            builder.store(builder.sub(ir.Constant(v16, [0] * 16), acc), wsp, align=4)
        return context.get_dummy_value()

    return sig, codegen
