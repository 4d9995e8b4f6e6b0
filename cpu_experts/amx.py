"""AMX tiles for int4 experts with 16 or more rows (the ``amx`` instruction set, isa.py).

One ``tdpbsud`` (signed bytes times unsigned bytes, summed into int32) computes what 128
``vpdpbusd`` do in tiles4.dots_vnni: the int32 dots of 16 rows x 16 units x the 32 positions
of one block. :func:`rows16_blocks` applies ``n`` consecutive blocks of one micro-tile to 16
rows in four phases, so that no tile instruction waits on the stores just before it and no
vector load on the tile store just before it (AMX loads and stores are not forwarded to and
from the core's ordinary stores and loads: each such pair costs a round trip through L1):

1. A: the 16 rows' ``32 n`` activation bytes gathered into a scratch (row stride ``32 n``),
   since the rows of a call are not evenly spaced;
2. B: each block's nibbles unpacked (tiles4.weights_vnni: 8 rows of 64 bytes ``[16 units]
   [4 positions]``, tiles4.py's order is already AMX's) into a scratch;
3. per block, in two alternating sets of tile registers (C, A, B = tmm0-2, tmm3-5, so two
   blocks are in flight): ``tilezero C; tileloadd A; tileloadd B; tdpbsud; tilestored C``;
4. per row, its output vector loaded once, the n blocks' dots (``C + xc``) taken through the
   format's float epilogue in block order, stored once.

C[m][u] = sum_t x[m, t] * n[u, t] with ``n = v + 8`` (unsigned nibbles), the same integer as
VNNI's; each row adds its ``xc = -8 * sum x`` and takes tiles.rows_block's float operations in
the same order, so the bits are every other instruction set's. The tile configuration
(palette 1) is loaded per item by :func:`tile_begin` and released by :func:`tile_end`; both
are no-ops for other instruction sets. The process must have Linux's permission for the tile
data (isa.amx_permitted), or the first tile instruction faults.

``mode = EMULATED`` computes phase 3 with generic vector IR from the same scratch buffers
(any CPU): the tests check the phases' addressing and order on machines without AMX.
"""

from __future__ import annotations

import llvmlite.binding as llvm
from llvmlite import ir
from numba import types
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
    is_amx,
    lanes4,
    row_at,
    splat,
    sum4,
)

# Numba sets up LLVM's code generator but not its assembler parser, which inline asm needs.
llvm.initialize_native_asmparser()

ROWS = 16  # rows of A and C: one call of rows16_blocks
CHUNK = 8  # blocks per call while that many are left (then 1)
A_BYTES = 32  # a row of A: one block's 32 activation bytes
B_ROWS, B_BYTES = GROUPS, 64  # groups of 4 positions, 16 units x 4 bytes
C_BYTES = 64  # a row of C: 16 int32
TILES, EMULATED = 1, 0  # rows16_blocks' mode
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


def _tile_dot(builder, a, a_stride: int, b, c, regs) -> None:
    """C (16 x 16 int32 at ``c``) = A (16 x 32 bytes, row stride ``a_stride``) . B (8 x 64)."""
    tc, ta, tb = regs
    _asm(builder, f"tilezero %tmm{tc}\n\t"
                  f"tileloadd ($0,$1,1), %tmm{ta}\n\t"
                  f"tileloadd ($2,$3,1), %tmm{tb}\n\t"
                  f"tdpbsud %tmm{tb}, %tmm{ta}, %tmm{tc}\n\t"
                  f"tilestored %tmm{tc}, ($4,$3,1)",
         [a, ir.Constant(I64, a_stride), b, ir.Constant(I64, B_BYTES), c], "r,r,r,r,r")


def _emulated_dot(builder, a, a_stride: int, b, c) -> None:
    """What :func:`_tile_dot` computes, in generic vector IR (loops: little code to compile)."""
    v16, v64b, v64 = ir.VectorType(I32, 16), ir.VectorType(I8, 64), ir.VectorType(I32, 64)
    with cgutils.for_range(builder, ir.Constant(I64, ROWS)) as rows:
        crow = _vec(builder, builder.gep(c, [builder.mul(rows.index, ir.Constant(I64, C_BYTES))]),
                    v16)
        builder.store(ir.Constant(v16, [0] * 16), crow, align=64)
        arow = builder.gep(a, [builder.mul(rows.index, ir.Constant(I64, a_stride))])
        with cgutils.for_range(builder, ir.Constant(I64, B_ROWS)) as groups:
            g = groups.index
            wg = builder.load(_vec(builder, builder.gep(b, [builder.mul(
                g, ir.Constant(I64, B_BYTES))]), v64b), align=64)
            word = builder.load(_vec(builder, builder.gep(arow, [builder.mul(
                g, ir.Constant(I64, 4))]), I32), align=4)
            prod = builder.mul(builder.zext(wg, v64), lanes4(builder, word, 64))
            builder.store(sum4(builder, prod, builder.load(crow, align=64)), crow, align=64)


@intrinsic
def rows16_blocks(typingctx, isa, mode, nblocks, w, woff, x, xs, xc, rows, j, b, o, ooff,
                  ostride):
    """Blocks ``b .. b + nblocks - 1`` (a literal, 1..CHUNK) of one int4 micro-tile, the first
    at byte ``woff`` of w, applied to 16 rows: for ``k < 16``, ``r = rows[j + k]`` (``j + k``
    when rows is None), block ``c`` by block::

    o[ooff + k*ostride : +16] += float32(dot(w block c, x[r, 32c:32c+32])) * (scales * xs[r, c])

    (tiles.rows_block's arguments and float operations). ``mode``: :data:`TILES` (nothing
    unless ``isa`` is AMX) or :data:`EMULATED`."""
    for name, lit in (("mode", mode), ("nblocks", nblocks)):
        if not isinstance(lit, types.IntegerLiteral):
            raise TypingError(f"{name} must be a literal int, got {lit}")
    n = nblocks.literal_value
    if not 1 <= n <= CHUNK:
        raise TypingError(f"nblocks must be in [1, {CHUNK}], got {n}")
    emulate = mode.literal_value == EMULATED
    # int8 tiles type (the stages' calls sit in a branch wide_tiles makes dead) but emit nothing
    int4 = isinstance(w, types.Array) and w.dtype == types.uint8
    if emulate and not int4:
        raise TypingError(f"w must be int4 (uint8) tiles, got {w}")
    live = int4 and (emulate or is_amx(isa))
    check_array(w, w.dtype if isinstance(w, types.Array) else types.uint8, "w")
    check_array(x, types.int8, "x")
    check_array(xs, types.float32, "xs")
    check_array(xc, types.int32, "xc")
    check_array(o, types.float32, "o")
    if not isinstance(rows, types.NoneType):
        check_array(rows, types.int64, "rows")
    i64 = types.int64
    sig = types.void(isa, mode, nblocks, w, i64, x, xs, xc, rows, i64, i64, o, i64, i64)

    def codegen(context, builder, signature, args):
        if not live:
            return context.get_dummy_value()
        _, _, _, wv, woffv, xv, xsv, xcv, rowsv, jv, bv, ov, ooffv, ostridev = args
        aty = signature.args
        v32b, v16, vf = ir.VectorType(I8, 32), ir.VectorType(I32, 16), ir.VectorType(F32, 16)
        wp8 = at(context, builder, aty[3], wv, woffv, I8)
        col = builder.mul(bv, ir.Constant(I64, A_BYTES))
        a_stride = A_BYTES * n
        a, bs, c = (_scratch(builder, size) for size in
                    (ROWS * a_stride, n * B_ROWS * B_BYTES, n * ROWS * C_BYTES))
        sxp, xcp = [], []
        for k in range(ROWS):  # phase 1: A
            r = builder.add(jv, ir.Constant(I64, k))
            if not isinstance(aty[8], types.NoneType):
                r = builder.load(at(context, builder, aty[8], rowsv, r, I64))
            xp = row_at(context, builder, aty[5], xv, r, col, I8)
            sxp.append(row_at(context, builder, aty[6], xsv, r, bv, F32))
            xcp.append(row_at(context, builder, aty[7], xcv, r, bv, I32))
            for i in range(n):
                piece = builder.load(_vec(builder, _off(builder, xp, A_BYTES * i), v32b),
                                     align=1)
                dst = _off(builder, a, k * a_stride + A_BYTES * i)
                builder.store(piece, _vec(builder, dst, v32b), align=32)
        scales = []
        for i in range(n):  # phase 2: B, and the blocks' weight scales
            wpi = _off(builder, wp8, tiles4.BLOCK_BYTES4 * i)
            for g, wg in enumerate(tiles4.weights_vnni(builder, wpi)):
                dst = _off(builder, bs, (i * B_ROWS + g) * B_BYTES)
                builder.store(wg, _vec(builder, dst, v16), align=64)
            scales.append(tiles4.scales(builder, wpi, 1)[0])
        for i in range(n):  # phase 3: C of each block
            ai = _off(builder, a, A_BYTES * i)
            bi = _off(builder, bs, i * B_ROWS * B_BYTES)
            ci = _off(builder, c, i * ROWS * C_BYTES)
            if emulate:
                _emulated_dot(builder, ai, a_stride, bi, ci)
            else:
                _tile_dot(builder, ai, a_stride, bi, ci, _SETS[i % 2])
        for k in range(ROWS):  # phase 4: each row's epilogue, blocks in order
            off = builder.add(ooffv, builder.mul(ostridev, ir.Constant(I64, k)))
            op = at(context, builder, aty[11], ov, off, vf)
            acc = builder.load(op, align=4)
            for i in range(n):
                dot = builder.load(_vec(builder, _off(builder, c, (i * ROWS + k) * C_BYTES),
                                        v16), align=64)
                xci = builder.load(builder.gep(xcp[k], [ir.Constant(I32, i)]), align=4)
                sx = builder.load(builder.gep(sxp[k], [ir.Constant(I32, i)]), align=4)
                scale = builder.fmul(scales[i], splat(builder, sx, vf))
                prod = builder.fmul(builder.sitofp(builder.add(dot, splat(builder, xci, v16)),
                                                   vf), scale)
                acc = builder.fadd(acc, prod)
            builder.store(acc, op, align=4)
        return context.get_dummy_value()

    return sig, codegen
