"""Exact int4 x int8 block-32 micro-kernels (the ``int4`` format; tiles.py has the int8 one).

Layout of one block of 32 positions of one micro-tile of 16 units (288 bytes, shard.py
writes it): 256 bytes of nibbles, 4 chunks ``j`` of ``[16 units][4 positions]`` bytes whose
low nibble is the weight of position ``4j + c`` and high nibble that of ``16 + 4j + c``, each
stored as ``v + 8`` (``v`` in [-8, 7], a Q4_0 value); then the 16 units' fp16 scales. So a
64-byte chunk gives two groups of 4 positions for 16 units -- the low nibbles group ``j``,
the high ones group ``j + 4`` -- in the lane order int8 dot-product instructions consume.

The weights enter the dot products as the unsigned bytes ``n = v + 8`` (0..15), the
activations as signed bytes, and each row's ``xc = -8 * sum_t x[t]`` for the block (made
once per row and block by the caller) corrects the offset: ``sum n x - 8 sum x = sum v x``,
exact in int32. Per instruction set:

* ``ISA_AVX512VNNI``: ``vpdpbusd(acc, n, x)``, the accumulator starting at ``xc``; the 64-byte
  chunks are loaded without split loads (:func:`_chunks64`, portable too).
* ``ISA_AVX2``: ``vpmaddubsw(n, x)`` (pair sums ``|.| <= 2 * 15 * 128``) summed over the 8
  groups in int16 (``|.| <= 30720``: never wraps), one ``vpmaddwd`` by ones, plus ``xc``.
* ``ISA_PORTABLE``: generic vector IR (zero-extend, multiply, add), plus ``xc``.

All give the same int32 dot; the float epilogue (tiles.py) is the int8 format's. The fp16
scales become float32 by integer operations only (exact, no F16C, no denormal arithmetic).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from cpu_experts.irhelp import (
    F32,
    GROUPS,
    I8,
    I16,
    I32,
    I64,
    at,
    check_array,
    fn,
    isa_of,
    lanes4,
    splat,
    sum4,
    x_words,
)
from cpu_experts.isa import ISA_AVX2, ISA_AVX512VNNI

TU = 16
NIBBLE_BYTES = 256  # the nibbles of one block of one micro-tile
BLOCK_BYTES4 = NIBBLE_BYTES + TU * 2  # ... followed by its 16 fp16 scales
CHUNKS = 4  # 64-byte chunks of nibbles, two groups each
# Rows per micro-kernel call of int4 tiles on VNNI (kernels._block_rows; int8 tiles and the
# other instruction sets take 4): the nibbles are unpacked and the scales widened once per
# call, so 16 rows pay for them a quarter as often as 4. The rows go in groups of GROUP_ROWS,
# each group's dots taken and its outputs stored before the next group's: 8 row accumulators
# + 8 weight vectors fit the 32 zmm registers (all 16 rows' dots at once spilled).
WIDE_ROWS = 16
GROUP_ROWS = 8


def _nibbles(builder, chunk, count: int):
    """(low, high) nibbles of a ``<count x i8>`` vector: groups ``j`` and ``j + 4``."""
    vt = ir.VectorType(I8, count)
    lo = builder.and_(chunk, ir.Constant(vt, [15] * count))
    hi = builder.lshr(chunk, ir.Constant(vt, [4] * count))
    return lo, hi


def _groups(builder, wp8, count: int, byte0: int, stride: int = 64):
    """The 8 groups' weight vectors (``<count x i8>``, unsigned nibbles), group order, read
    from chunks at ``byte0 + j * stride``."""
    chunks = (_chunks64(builder, wp8) if count == 64 and (byte0, stride) == (0, 64) else
              [_load(builder, wp8, byte0 + j * stride, count) for j in range(CHUNKS)])
    lows, highs = [], []
    for chunk in chunks:
        lo, hi = _nibbles(builder, chunk, count)
        lows.append(lo)
        highs.append(hi)
    return lows + highs


def _load(builder, wp8, byte: int, count: int, align: int = 1):
    vt = ir.VectorType(I8, count)
    p = builder.bitcast(builder.gep(wp8, [ir.Constant(I32, byte)]), vt.as_pointer())
    return builder.load(p, align=align)


def _chunks64(builder, wp8):
    """The 4 chunks of nibbles as ``<64 x i8>``, loaded without split loads.

    NOTE: a block is 288 bytes, so every other block of a tile starts 32 bytes into a cache
    line, and 64-byte loads of its chunks would each straddle two lines (split loads; int8
    blocks, 576 bytes, and AVX2's 32-byte loads never split). Intel cores serve split loads
    through a few split buffers, which limits how many misses a thread streaming from DRAM
    keeps in flight: the suspected reason int4 read DRAM at half int8's rate on the H200
    (issue 17; ``bench_cpu_kernels_inprocess --diag`` times tiles placed 16 bytes past a
    line, where every chunk load splits). A block 32 bytes past a line is read as its 5
    lines (the first begins 32 bytes before the block, in the same line: no fault), each
    chunk the upper half of one and the lower half of the next (one ``vshufi64x2``); any
    other start loads the chunks directly. The bytes, hence the bits, are the same."""
    v64 = ir.VectorType(I8, 64)
    addr = builder.ptrtoint(wp8, I64)
    mid = builder.icmp_unsigned("==", builder.and_(addr, ir.Constant(I64, 63)),
                                ir.Constant(I64, 32))
    with builder.if_else(mid) as (then, otherwise):
        with then:
            lines = [_load(builder, wp8, 64 * j - 32, 64, align=64) for j in range(CHUNKS + 1)]
            mask = ir.Constant(ir.VectorType(I32, 64), list(range(32, 96)))
            split = [builder.shuffle_vector(lines[j], lines[j + 1], mask) for j in range(CHUNKS)]
            from_split = builder.basic_block
        with otherwise:
            direct = [_load(builder, wp8, 64 * j, 64) for j in range(CHUNKS)]
            from_direct = builder.basic_block
    out = []
    for a, b in zip(split, direct, strict=True):
        phi = builder.phi(v64)
        phi.add_incoming(a, from_split)
        phi.add_incoming(b, from_direct)
        out.append(phi)
    return out


def weights_vnni(builder, wp8):
    """The block's 8 groups of unsigned nibbles as ``<16 x i32>`` (the dot instructions'
    operand), unpacked once for every row of a call."""
    v16 = ir.VectorType(I32, 16)
    return [builder.bitcast(v, v16) for v in _groups(builder, wp8, 64, 0)]


def dots_vnni(builder, wvs, xps, xcs):
    """Per row: one <16 x i32> ``xc + sum_g vpdpbusd(n_g, x_g)`` from :func:`weights_vnni`.
    Below :data:`GROUP_ROWS` rows each row runs two dependent chains (half the latency); from
    GROUP_ROWS on the rows' chains are independent enough, and one chain saves the add that
    joins two (an integer sum: the same dot either way)."""
    v16 = ir.VectorType(I32, 16)
    dp = fn(builder, "llvm.x86.avx512.vpdpbusd.512", v16, [v16, v16, v16])
    chains = 1 if len(xps) >= GROUP_ROWS else 2
    out = []
    for xp, xc in zip(xps, xcs, strict=True):
        acc = [splat(builder, xc, v16), ir.Constant(v16, [0] * 16)][:chains]
        for g, word in enumerate(x_words(builder, xp)):
            c = g % chains
            acc[c] = builder.call(dp, [acc[c], wvs[g], splat(builder, word, v16)])
        out.append([acc[0] if chains == 1 else builder.add(acc[0], acc[1])])
    return out


def dots_avx2(builder, wp8, xps, xcs):
    """Per row: two <8 x i32> (units 0-7, 8-15); each half's weights unpacked once."""
    v32b, v16h, v8 = ir.VectorType(I8, 32), ir.VectorType(I16, 16), ir.VectorType(I32, 8)
    maddubs = fn(builder, "llvm.x86.avx2.pmadd.ub.sw", v16h, [v32b, v32b])
    maddwd = fn(builder, "llvm.x86.avx2.pmadd.wd", v8, [v16h, v16h])
    ones = ir.Constant(v16h, [1] * 16)
    out = [[None, None] for _ in xps]
    for h in range(2):
        wvs = _groups(builder, wp8, 32, 32 * h)
        for k, (xp, xc) in enumerate(zip(xps, xcs, strict=True)):
            s16 = None
            for g, word in enumerate(x_words(builder, xp)):
                xv = builder.bitcast(splat(builder, word, v8), v32b)
                p = builder.call(maddubs, [wvs[g], xv])
                s16 = p if s16 is None else builder.add(s16, p)
            out[k][h] = builder.add(builder.call(maddwd, [s16, ones]), splat(builder, xc, v8))
    return out


def dots_portable(builder, wp8, xps, xcs):
    """Per row: one <16 x i32> from generic vector IR."""
    v64, v16 = ir.VectorType(I32, 64), ir.VectorType(I32, 16)
    wvs = [builder.zext(v, v64) for v in _groups(builder, wp8, 64, 0)]
    out = []
    for xp, xc in zip(xps, xcs, strict=True):
        acc = splat(builder, xc, v16)
        for g, word in enumerate(x_words(builder, xp)):
            acc = sum4(builder, builder.mul(wvs[g], lanes4(builder, word, 64)), acc)
        out.append([acc])
    return out


def weights(builder, which: int, wp8):
    """What :func:`dots` takes as the block's weights: the unpacked nibbles on VNNI (shared by
    every group of rows of a call), else the block's address (AVX2 and portable unpack per
    call, their registers being fewer)."""
    return weights_vnni(builder, wp8) if which == ISA_AVX512VNNI else wp8


def dots(builder, which: int, wts, xps, xcs):
    """Per row, the block's int32 dots (a list of vectors: one <16 x i32>, or AVX2's two
    <8 x i32>); ``wts`` from :func:`weights`."""
    if which == ISA_AVX512VNNI:
        return dots_vnni(builder, wts, xps, xcs)
    return (dots_avx2 if which == ISA_AVX2 else dots_portable)(builder, wts, xps, xcs)


def half_to_float(builder, bits16):
    """Exact float32 values of a ``<N x i16>`` of finite IEEE half bit patterns."""
    n = bits16.type.count
    vi, vf = ir.VectorType(I32, n), ir.VectorType(F32, n)

    def const(v):
        return ir.Constant(vi, [v] * n)

    h = builder.zext(bits16, vi)
    sign = builder.shl(builder.and_(h, const(0x8000)), const(16))
    em = builder.and_(h, const(0x7FFF))
    normal = builder.add(builder.shl(em, const(13)), const(112 << 23))  # rebias 15 -> 127
    sub = builder.fmul(builder.sitofp(em, vf), ir.Constant(vf, [2.0**-24] * n))  # m * 2**-24
    is_sub = builder.icmp_unsigned("<", em, const(0x400))
    mag = builder.select(is_sub, builder.bitcast(sub, vi), normal)
    return builder.bitcast(builder.or_(mag, sign), vf)


def scales(builder, wp8, parts: int):
    """The block's 16 scales as ``parts`` float32 vectors (units 0-15, or 0-7 and 8-15)."""
    vt = ir.VectorType(I16, TU // parts)
    base = builder.bitcast(builder.gep(wp8, [ir.Constant(I32, NIBBLE_BYTES)]), vt.as_pointer())
    return [half_to_float(builder, builder.load(builder.gep(base, [ir.Constant(I32, h)]),
                                                align=2)) for h in range(parts)]


@intrinsic
def rows_per_call(typingctx, isa, w):
    """The most rows one ``tiles.rows_block`` call of the stages takes for tiles ``w`` on
    instruction set ``isa`` (a literal): :data:`WIDE_ROWS` for int4 (uint8) tiles on VNNI,
    else 4. A constant in the compiled code, so the stages' branch on it folds away."""
    wide = (isa_of(isa) == ISA_AVX512VNNI and isinstance(w, types.Array)
            and w.dtype == types.uint8)
    sig = types.int64(isa, w)

    def codegen(context, builder, signature, args):
        return ir.Constant(I64, WIDE_ROWS if wide else 4)

    return sig, codegen


@intrinsic
def block_sum(typingctx, x, off):
    """``sum(x[off:off+32])`` of a C-contiguous int8 array as an int32, exactly (the int4
    kernels' ``xc = -8 * sum``): one vector load, the bytes made unsigned (``x ^ 0x80 = x +
    128``) and widened, an add reduction (x86 makes it ``psadbw``), minus ``32 * 128``."""
    check_array(x, types.int8, "x")
    sig = types.int32(x, types.int64)

    def codegen(context, builder, signature, args):
        v32b, v32i = ir.VectorType(I8, 32), ir.VectorType(I32, 32)
        p = at(context, builder, signature.args[0], args[0], args[1], v32b)
        u = builder.xor(builder.load(p, align=1), ir.Constant(v32b, [-128] * 32))
        red = fn(builder, "llvm.vector.reduce.add.v32i32", I32, [v32i])
        total = builder.call(red, [builder.zext(u, v32i)])
        return builder.sub(total, ir.Constant(I32, 32 * 128))

    return sig, codegen


assert GROUPS == 2 * CHUNKS
