"""AMX tiles for int4 experts with 16 or more rows (the ``amx`` instruction set, isa.py).

One ``tdpbssd`` (signed bytes times signed bytes, summed into int32) computes what 128
``vpdpbusd`` do in tiles4.dots_vnni: the int32 dots of 16 rows x 16 units x the 32 positions
of one block. :func:`run16` applies all blocks of one micro-tile to 16 rows whose activations
are consecutive rows of ``x`` (the stages gather them once per expert) as a software pipeline
over chunks of ``n`` blocks, because AMX loads and stores are not forwarded to and from the
core's ordinary stores and loads (a tile load right after the vector stores of its data, or a
vector load right after the tile store of its data, waits for the stores to reach L1). At
chunk ``c`` (scratch buffers double-buffered by chunk parity):

1. :func:`unpack_b`: chunk c's nibbles unpacked as the signed values ``v = n - 8``
   (tiles4.weights_vnni: per block 8 rows of 64 bytes ``[16 units][4 positions]``; tiles4.py's
   order is already AMX's) into B scratch, its A rows prefetched (:func:`prefetch_a`);
2. :func:`tile_dots`: chunk c-1's C = A . B per block (A loaded straight from x, B from the
   scratch chunk c-1 wrote), in two alternating sets of tile registers (C, A, B = tmm0-2,
   tmm3-5) so two blocks are in flight: ``tilezero; tileloadd; tileloadd; tdpbssd;
   tilestored`` into C scratch;
3. :func:`epilogue16`: chunk c-2's dots through the format's float epilogue, each row's output
   loaded and stored once per chunk, blocks in order.

C[m][u] = sum_t x[m, t] * v[u, t], the integer VNNI reaches as ``sum n x + xc`` (unsigned
nibbles ``n = v + 8`` and ``xc = -8 * sum x``); signed weights spare the epilogue that add per
row and block, and each row takes tiles.rows_block's float operations in the same order, so
the bits are every other instruction set's. The tile configuration
(palette 1) is loaded by :func:`tile_begin` and released by :func:`tile_end` around each
group of run16 calls (kernels._wide_rows); both are no-ops for other instruction sets. The
process must have Linux's permission for the tile data (isa.amx_permitted), or the first
tile instruction faults.

``mode = EMULATED`` computes step 2 with generic vector IR from the same buffers (any CPU):
the tests check the pipeline's addressing and order on machines without AMX.
"""

from __future__ import annotations

import llvmlite.binding as llvm
import numba
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.core.errors import TypingError
from numba.extending import intrinsic

from cpu_experts import tiles4
from cpu_experts.irhelp import (
    F32,
    GROUPS,
    I8,
    I32,
    I64,
    at,
    check_array,
    fn,
    is_amx,
    lanes4,
    row_at,
    splat,
    sum4,
)

# Numba sets up LLVM's code generator but not its assembler parser, which inline asm needs.
llvm.initialize_native_asmparser()

ROWS = 16  # rows of A and C
CHUNK = 8  # blocks per pipeline step (fewer when a run's block count is not a multiple)
A_BYTES = 32  # a row of A: one block's 32 activation bytes
B_ROWS, B_BYTES = GROUPS, 64  # groups of 4 positions, 16 units x 4 bytes
C_BYTES = 64  # a row of C: 16 int32
B_CHUNK = CHUNK * B_ROWS * B_BYTES  # bytes of one half of the B buffer
C_CHUNK = CHUNK * ROWS * C_BYTES // 4  # int32 of one half of the C buffer
TILES, EMULATED = 1, 0  # run16's mode
_SETS = ((0, 1, 2), (3, 4, 5))  # (C, A, B) tile registers of even and odd blocks


def _config() -> list[int]:
    cfg = [0] * 64
    cfg[0] = 1  # palette 1
    shapes = ((ROWS, C_BYTES), (ROWS, A_BYTES), (B_ROWS, B_BYTES))
    for tmm in range(2 * len(shapes)):
        rows, colsb = shapes[tmm % len(shapes)]
        cfg[16 + 2 * tmm], cfg[17 + 2 * tmm] = colsb & 0xFF, colsb >> 8
        cfg[48 + tmm] = rows
    return cfg


def _asm(builder, text: str, args: list, constraints: str) -> None:
    fnty = ir.FunctionType(ir.VoidType(), [a.type for a in args])
    clobbers = "~{memory}" if not constraints else constraints + ",~{memory}"
    builder.call(ir.InlineAsm(fnty, text, clobbers, side_effect=True), args)


def _scratch(builder, nbytes: int):
    """A 64-byte aligned stack buffer of the function (allocated once, in its entry block)."""
    buf = cgutils.alloca_once(builder, ir.ArrayType(I8, nbytes))
    buf.align = 64
    return builder.bitcast(buf, I8.as_pointer())


def _off(builder, p, nbytes: int):
    return builder.gep(p, [ir.Constant(I32, nbytes)])


def _vec(builder, p, vt):
    return builder.bitcast(p, vt.as_pointer())


@intrinsic
def tile_begin(typingctx, isa):
    """Load the tile configuration (``ldtilecfg``) when ``isa`` is AMX; nothing otherwise."""
    amx = is_amx(isa)

    def codegen(context, builder, signature, args):
        if amx:
            cfg = _scratch(builder, 64)
            vt = ir.VectorType(I8, 64)
            builder.store(ir.Constant(vt, _config()), _vec(builder, cfg, vt), align=64)
            _asm(builder, "ldtilecfg ($0)", [cfg], "r")
        return context.get_dummy_value()

    return types.void(isa), codegen


@intrinsic
def tile_end(typingctx, isa):
    """``tilerelease`` when ``isa`` is AMX (the tile state back to its initial, cheap to save
    state); nothing otherwise."""
    amx = is_amx(isa)

    def codegen(context, builder, signature, args):
        if amx:
            _asm(builder, "tilerelease", [], "")
        return context.get_dummy_value()

    return types.void(isa), codegen


@intrinsic
def wide_tiles(typingctx, isa, w):
    """True (a constant) when 16-row groups of tiles ``w`` go through :func:`rows16_blocks`:
    AMX and int4 (uint8) tiles."""
    wide = is_amx(isa) and isinstance(w, types.Array) and w.dtype == types.uint8

    def codegen(context, builder, signature, args):
        return ir.Constant(ir.IntType(1), int(wide))

    return types.boolean(isa, w), codegen


def _tile_dot(builder, a, a_stride, b, c, regs) -> None:
    """C (16 x 16 int32 at ``c``) = A (16 x 32 bytes, row stride ``a_stride``, an i64 value)
    . B (8 x 64)."""
    tc, ta, tb = regs
    _asm(builder, f"tilezero %tmm{tc}\n\t"
                  f"tileloadd ($0,$1,1), %tmm{ta}\n\t"
                  f"tileloadd ($2,$3,1), %tmm{tb}\n\t"
                  f"tdpbssd %tmm{tb}, %tmm{ta}, %tmm{tc}\n\t"
                  f"tilestored %tmm{tc}, ($4,$3,1)",
         [a, a_stride, b, ir.Constant(I64, B_BYTES), c], "r,r,r,r,r")


def _emulated_dot(builder, a, a_stride, b, c) -> None:
    """What :func:`_tile_dot` computes, in generic vector IR (loops: little code to compile)."""
    v16, v64b, v64 = ir.VectorType(I32, 16), ir.VectorType(I8, 64), ir.VectorType(I32, 64)
    with cgutils.for_range(builder, ir.Constant(I64, ROWS)) as rows:
        crow = _vec(builder, builder.gep(c, [builder.mul(rows.index, ir.Constant(I64, C_BYTES))]),
                    v16)
        builder.store(ir.Constant(v16, [0] * 16), crow, align=64)
        arow = builder.gep(a, [builder.mul(rows.index, a_stride)])
        with cgutils.for_range(builder, ir.Constant(I64, B_ROWS)) as groups:
            g = groups.index
            wg = builder.load(_vec(builder, builder.gep(b, [builder.mul(
                g, ir.Constant(I64, B_BYTES))]), v64b), align=64)
            word = builder.load(_vec(builder, builder.gep(arow, [builder.mul(
                g, ir.Constant(I64, 4))]), I32), align=4)
            prod = builder.mul(builder.sext(wg, v64), lanes4(builder, word, 64))
            builder.store(sum4(builder, prod, builder.load(crow, align=64)), crow, align=64)


def _int4(w) -> bool:
    """int4 (uint8) tiles; int8 tiles type too (the stages' calls sit in a branch wide_tiles
    makes dead) but their intrinsics emit nothing."""
    check_array(w, w.dtype if isinstance(w, types.Array) else types.uint8, "w")
    return w.dtype == types.uint8


def _literal(name: str, lit, lo: int, hi: int) -> int:
    if not isinstance(lit, types.IntegerLiteral) or not lo <= lit.literal_value <= hi:
        raise TypingError(f"{name} must be a literal int in [{lo}, {hi}], got {lit}")
    return lit.literal_value


@intrinsic
def unpack_b(typingctx, nblocks, w, woff, pf, bbuf, boff):
    """B of ``nblocks`` (a literal) consecutive int4 blocks from byte ``woff`` of w, into
    ``bbuf`` (uint8) at byte ``boff``, 512 bytes per block, as the signed bytes ``v = n - 8``;
    first each block's lines at byte
    ``pf + 288 i`` of w are prefetched into L2 (tiles.PREFETCH_LOCALITY)."""
    n = _literal("nblocks", nblocks, 1, CHUNK)
    live = _int4(w)
    check_array(bbuf, types.uint8, "bbuf")
    i64 = types.int64
    sig = types.void(nblocks, w, i64, i64, bbuf, i64)

    def codegen(context, builder, signature, args):
        if not live:
            return context.get_dummy_value()
        _, wv, woffv, pfv, bv, boffv = args
        aty = signature.args
        v64b = ir.VectorType(I8, 64)
        eight = ir.Constant(v64b, [8] * 64)
        wp8 = at(context, builder, aty[1], wv, woffv, I8)
        far = at(context, builder, aty[1], wv, pfv, I8)
        dst = at(context, builder, aty[4], bv, boffv, I8)
        prefetch = fn(builder, "llvm.prefetch.p0", ir.VoidType(),
                      [I8.as_pointer(), I32, I32, I32])
        for i in range(n):
            for line in range(0, tiles4.BLOCK_BYTES4, 64):
                builder.call(prefetch, [_off(builder, far, tiles4.BLOCK_BYTES4 * i + line),
                                        ir.Constant(I32, 0), ir.Constant(I32, 2),
                                        ir.Constant(I32, 1)])
            wpi = _off(builder, wp8, tiles4.BLOCK_BYTES4 * i)
            for g, wg in enumerate(tiles4.weights_vnni(builder, wpi)):
                p = _off(builder, dst, (i * B_ROWS + g) * B_BYTES)
                signed = builder.sub(builder.bitcast(wg, v64b), eight)
                builder.store(signed, _vec(builder, p, v64b), align=1)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def prefetch_a(typingctx, nblocks, w, x, xoff):
    """Prefetch into L1 the A rows of ``nblocks`` (a literal) blocks: 16 rows of x (int8,
    2-D, row stride x's width) from element ``xoff``, ``32 * nblocks`` bytes each. The
    pipeline asks one step before :func:`tile_dots` loads them: tile loads of rows 2 KiB
    apart find no hardware prefetch, and the rows were written by another thread."""
    n = _literal("nblocks", nblocks, 1, CHUNK)
    live = _int4(w)
    check_array(x, types.int8, "x")
    sig = types.void(nblocks, w, x, types.int64)

    def codegen(context, builder, signature, args):
        if not live:
            return context.get_dummy_value()
        _, _, xv, xoffv = args
        aty = signature.args
        arr = context.make_array(aty[2])(context, builder, xv)
        ld = cgutils.unpack_tuple(builder, arr.shape, 2)[1]
        a0 = at(context, builder, aty[2], xv, xoffv, I8)
        prefetch = fn(builder, "llvm.prefetch.p0", ir.VoidType(),
                      [I8.as_pointer(), I32, I32, I32])
        for k in range(ROWS):
            row = builder.gep(a0, [builder.mul(ld, ir.Constant(I64, k))])
            for byte in range(0, max(A_BYTES * n, 64), 64):
                builder.call(prefetch, [_off(builder, row, byte), ir.Constant(I32, 0),
                                        ir.Constant(I32, 3), ir.Constant(I32, 1)])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def tile_dots(typingctx, isa, mode, nblocks, w, x, xoff, bbuf, boff, cbuf, coff):
    """C of ``nblocks`` blocks into ``cbuf`` (int32) from element ``coff`` (256 per block):
    A = 16 rows of x (int8, 2-D) from element ``xoff`` + 32 per block, row stride x's width;
    B from ``bbuf`` at byte ``boff`` (:func:`unpack_b`). ``mode``: :data:`TILES` (nothing
    unless ``isa`` is AMX) or :data:`EMULATED`; ``w`` only says the format."""
    n = _literal("nblocks", nblocks, 1, CHUNK)
    emulate = _literal("mode", mode, EMULATED, TILES) == EMULATED
    live = _int4(w) and (emulate or is_amx(isa))
    check_array(x, types.int8, "x")
    check_array(bbuf, types.uint8, "bbuf")
    check_array(cbuf, types.int32, "cbuf")
    i64 = types.int64
    sig = types.void(isa, mode, nblocks, w, x, i64, bbuf, i64, cbuf, i64)

    def codegen(context, builder, signature, args):
        if not live:
            return context.get_dummy_value()
        _, _, _, _, xv, xoffv, bv, boffv, cv, coffv = args
        aty = signature.args
        arr = context.make_array(aty[4])(context, builder, xv)
        ld = cgutils.unpack_tuple(builder, arr.shape, 2)[1]
        a0 = at(context, builder, aty[4], xv, xoffv, I8)
        b0 = at(context, builder, aty[6], bv, boffv, I8)
        c0 = builder.bitcast(at(context, builder, aty[8], cv, coffv, I32), I8.as_pointer())
        for i in range(n):
            ai = _off(builder, a0, A_BYTES * i)
            bi = _off(builder, b0, i * B_ROWS * B_BYTES)
            ci = _off(builder, c0, i * ROWS * C_BYTES)
            if emulate:
                _emulated_dot(builder, ai, ld, bi, ci)
            else:
                _tile_dot(builder, ai, ld, bi, ci, _SETS[i % 2])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def epilogue16(typingctx, nblocks, w, woff, xs, j, b, cbuf, coff, o, ooff, ostride):
    """For ``k < 16`` and the ``nblocks`` blocks ``c = b..`` (weights from byte ``woff`` of w,
    their dots in ``cbuf`` from element ``coff``) in order::

        o[ooff + k*ostride : +16] += float32(C[c][k]) * (scales * xs[j+k, c])

    (tiles.rows_block's float operations), each row's 16 outputs loaded and stored once."""
    n = _literal("nblocks", nblocks, 1, CHUNK)
    live = _int4(w)
    check_array(xs, types.float32, "xs")
    check_array(cbuf, types.int32, "cbuf")
    check_array(o, types.float32, "o")
    i64 = types.int64
    sig = types.void(nblocks, w, i64, xs, i64, i64, cbuf, i64, o, i64, i64)

    def codegen(context, builder, signature, args):
        if not live:
            return context.get_dummy_value()
        _, wv, woffv, xsv, jv, bv, cv, coffv, ov, ooffv, ostridev = args
        aty = signature.args
        v16, vf = ir.VectorType(I32, 16), ir.VectorType(F32, 16)
        wp8 = at(context, builder, aty[1], wv, woffv, I8)
        scales = [tiles4.scales(builder, _off(builder, wp8, tiles4.BLOCK_BYTES4 * i), 1)[0]
                  for i in range(n)]
        c0 = at(context, builder, aty[6], cv, coffv, v16)
        for k in range(ROWS):
            r = builder.add(jv, ir.Constant(I64, k))
            sxp = row_at(context, builder, aty[3], xsv, r, bv, F32)
            op = at(context, builder, aty[8], ov,
                    builder.add(ooffv, builder.mul(ostridev, ir.Constant(I64, k))), vf)
            acc = builder.load(op, align=4)
            for i in range(n):
                dot = builder.load(builder.gep(c0, [ir.Constant(I32, i * ROWS + k)]), align=4)
                sx = builder.load(builder.gep(sxp, [ir.Constant(I32, i)]), align=4)
                scale = builder.fmul(scales[i], splat(builder, sx, vf))
                prod = builder.fmul(builder.sitofp(dot, vf), scale)
                acc = builder.fadd(acc, prod)
            builder.store(acc, op, align=4)
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True, nogil=True)
def _pipeline(isa, mode, n, w, woff, bb, nb, pf, x, xs, j, o, ooff, ostride, bbuf, cbuf):
    numba.literally(isa)
    numba.literally(mode)
    numba.literally(n)
    steps = nb // n
    for c in range(steps + 2):
        if c < steps:
            h = (c & 1) * B_CHUNK
            prefetch_a(n, w, x, j * x.shape[1] + c * n * A_BYTES)
            unpack_b(n, w, woff + c * n * bb, pf + c * n * bb, bbuf, h)
        d = c - 1
        if 0 <= d < steps:
            tile_dots(isa, mode, n, w, x, j * x.shape[1] + d * n * A_BYTES, bbuf,
                      (d & 1) * B_CHUNK, cbuf, (d & 1) * C_CHUNK)
        e = c - 2
        if e >= 0:
            epilogue16(n, w, woff + e * n * bb, xs, j, e * n, cbuf,
                       (e & 1) * C_CHUNK, o, ooff, ostride)


@njit(cache=True, nogil=True)
def run16(isa, mode, w, woff, bb, nb, pf, x, xs, j, o, ooff, ostride, bbuf, cbuf) -> None:
    """All ``nb`` blocks (``bb`` bytes each, the first at byte ``woff`` of w, flat) of one int4
    micro-tile applied to rows ``j .. j+15`` of x/xs (int8 [R, n], float32 [R, n/32]), adding
    into ``o[ooff + k*ostride:][:16]``, as the module's pipeline with chunks of CHUNK blocks
    (or 4, 2, 1 when nb is not a multiple); prefetching from byte ``pf`` on.
    ``bbuf``/``cbuf``: :func:`buffers`. The bits of tiles.rows_block per block and row."""
    numba.literally(isa)
    numba.literally(mode)
    if nb % CHUNK == 0:
        _pipeline(isa, mode, CHUNK, w, woff, bb, nb, pf, x, xs, j, o, ooff, ostride, bbuf,
                  cbuf)
    elif nb % 4 == 0:
        _pipeline(isa, mode, 4, w, woff, bb, nb, pf, x, xs, j, o, ooff, ostride, bbuf, cbuf)
    elif nb % 2 == 0:
        _pipeline(isa, mode, 2, w, woff, bb, nb, pf, x, xs, j, o, ooff, ostride, bbuf, cbuf)
    else:
        _pipeline(isa, mode, 1, w, woff, bb, nb, pf, x, xs, j, o, ooff, ostride, bbuf, cbuf)


@njit(cache=True, nogil=True)
def buffers():
    """run16's scratch: B and C, two halves each, starting on 64-byte boundaries (Numba
    aligns to 32 bytes: every 64-byte tile row would straddle two cache lines, and the
    emulation's aligned vector stores would fault)."""
    b = np.empty(2 * B_CHUNK + 64, np.uint8)
    c = np.empty(2 * C_CHUNK + 16, np.int32)
    bo = (-b.ctypes.data) & 63
    co = ((-c.ctypes.data) & 63) >> 2
    return b[bo:bo + 2 * B_CHUNK], c[co:co + 2 * C_CHUNK]
