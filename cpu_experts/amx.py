"""AMX tiles for 16 rows of one int4 block (the ``amx`` instruction set, isa.py).

One ``tdpbsud`` (signed bytes times unsigned bytes, summed into int32) computes what 128
``vpdpbusd`` do in tiles4.dots_vnni: the int32 dots of 16 rows x 16 units x 32 positions.

* A (``tmm1``): 16 rows x 32 bytes, each row's 32 activation bytes of the block (signed),
  gathered into a scratch (the rows of a call are not evenly spaced);
* B (``tmm2``): 8 rows x 64 bytes, the block's unpacked nibbles in the tile layout, row g
  = group g: ``[16 units][4 positions]`` (tiles4.py's order is already AMX's);
* C (``tmm0``): 16 rows x 16 int32, stored to a scratch and read back per row.

C[m][u] = sum_t x[m, t] * n[u, t] with ``n = v + 8`` (unsigned nibbles), the same integer as
VNNI's; each row then adds its ``xc = -8 * sum x`` and takes the format's float epilogue, so
the bits are VNNI's. The tile configuration (palette 1: tmm0 16 x 64, tmm1 16 x 32, tmm2 8 x
64 bytes) is loaded per item by :func:`tile_begin` and released by :func:`tile_end`; both are
no-ops for other instruction sets. The process must have Linux's permission for the tile data
(isa.amx_permitted), or the first tile instruction faults.
"""

from __future__ import annotations

import llvmlite.binding as llvm
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from cpu_experts.irhelp import I8, I32, I64, is_amx, splat

# Numba sets up LLVM's code generator but not its assembler parser, which inline asm needs.
llvm.initialize_native_asmparser()

ROWS = 16  # rows of A and C: one call of tiles.rows_block with tiles4.WIDE_ROWS rows
A_BYTES = 32  # a row of A: one block's 32 activation bytes
B_ROWS, B_BYTES = 8, 64  # groups of 4 positions, 16 units x 4 bytes
C_BYTES = 64  # a row of C: 16 int32


def _config() -> list[int]:
    cfg = [0] * 64
    cfg[0] = 1  # palette 1
    for tmm, (rows, colsb) in enumerate(((ROWS, C_BYTES), (ROWS, A_BYTES), (B_ROWS, B_BYTES))):
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


@intrinsic
def tile_begin(typingctx, isa):
    """Load the tile configuration (``ldtilecfg``) when ``isa`` is AMX; nothing otherwise."""
    amx = is_amx(isa)

    def codegen(context, builder, signature, args):
        if amx:
            cfg = _scratch(builder, 64)
            vt = ir.VectorType(I8, 64)
            builder.store(ir.Constant(vt, _config()), builder.bitcast(cfg, vt.as_pointer()),
                          align=64)
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


def dots_amx(builder, wvs, xps, xcs):
    """Per row, the block's ``<16 x i32>`` dot plus its ``xc`` (the list tiles4.dots_vnni
    returns), for :data:`ROWS` rows: ``wvs`` are tiles4.weights_vnni's 8 groups, ``xps`` the
    rows' i32 pointers to their 32 activation bytes."""
    assert len(xps) == ROWS and len(wvs) == B_ROWS
    v16, v32b = ir.VectorType(I32, 16), ir.VectorType(I8, A_BYTES)
    a, b, c = (_scratch(builder, n) for n in (ROWS * A_BYTES, B_ROWS * B_BYTES, ROWS * C_BYTES))
    for k, xp in enumerate(xps):
        row = builder.load(builder.bitcast(xp, v32b.as_pointer()), align=1)
        dst = builder.gep(a, [ir.Constant(I32, k * A_BYTES)])
        builder.store(row, builder.bitcast(dst, v32b.as_pointer()), align=32)
    bp = builder.bitcast(b, v16.as_pointer())
    for g, w in enumerate(wvs):
        builder.store(w, builder.gep(bp, [ir.Constant(I32, g)]), align=64)
    _asm(builder, "tilezero %tmm0\n\t"
                  "tileloadd ($0,$1,1), %tmm1\n\t"
                  "tileloadd ($2,$3,1), %tmm2\n\t"
                  "tdpbsud %tmm2, %tmm1, %tmm0\n\t"
                  "tilestored %tmm0, ($4,$3,1)",
         [a, ir.Constant(I64, A_BYTES), b, ir.Constant(I64, B_BYTES), c], "r,r,r,r,r")
    cp = builder.bitcast(c, v16.as_pointer())
    out = []
    for k, xc in enumerate(xcs):
        dot = builder.load(builder.gep(cp, [ir.Constant(I32, k)]), align=64)
        out.append([builder.add(dot, splat(builder, xc, v16))])
    return out

