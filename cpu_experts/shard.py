"""Expert weights: quantize to blocks of 32 + fp16 scales, shard by intermediate dim, tile.

Canonical form (``QuantizedLayer``): ``gate_q/up_q [E, I, H]``, ``down_q [E, H, I]`` int8 with
fp16 scales per block of 32 along the reduction axis (H for gate/up, I for down), quantized
by the canonical quantizer of quant.py (or quant4.py's for the int4 format: the same arrays,
values in [-8, 7]). A shard is a contiguous range of whole I-blocks, so
the re-quantization of ``h`` inside a shard equals that of the whole expert. The kernel form
(``tile``) reorders a shard for kernels.py; a manifest lays all of a worker's tiled layers
out in one flat shared-memory buffer.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from cpu_experts.formats import Blocks, check_format
from cpu_experts.quant import BLOCK
from cpu_experts.quant4 import to_format
from cpu_experts.tiles import BLOCK_BYTES, GROUPS, TILE_BYTES, TU
from cpu_experts.tiles4 import BLOCK_BYTES4, CHUNKS, NIBBLE_BYTES

ALIGN = 64
NAMES = ("gu", "down")


@dataclass(frozen=True, slots=True)
class QuantizedLayer:
    """One MoE layer's CPU experts in canonical quantized form."""

    gate_q: np.ndarray  # [E, I, H] int8
    gate_s: np.ndarray  # [E, I, H/32] float16
    up_q: np.ndarray    # [E, I, H] int8
    up_s: np.ndarray    # [E, I, H/32] float16
    down_q: np.ndarray  # [E, H, I] int8
    down_s: np.ndarray  # [E, H, I/32] float16

    @property
    def num_experts(self) -> int:
        return self.gate_q.shape[0]

    @property
    def intermediate(self) -> int:
        return self.gate_q.shape[1]

    @property
    def hidden(self) -> int:
        return self.gate_q.shape[2]

    def shard(self, lo: int, hi: int) -> tuple[np.ndarray, ...]:
        """Canonical arrays of intermediate range [lo, hi) (whole blocks): reference.py's shard."""
        return (self.gate_q[:, lo:hi], self.gate_s[:, lo:hi], self.up_q[:, lo:hi],
                self.up_s[:, lo:hi], self.down_q[:, :, lo:hi],
                self.down_s[:, :, lo // BLOCK:hi // BLOCK])


@dataclass(frozen=True, slots=True)
class LayerShape:
    """A MoE layer's CPU experts before their weights exist: a pool made from these sizes its
    shards at once and is filled expert by expert (CpuExpertPool.fill)."""

    num_experts: int
    intermediate: int
    hidden: int


def layer_shape(v: LayerShape | QuantizedLayer | tuple[np.ndarray, ...]) -> LayerShape:
    """The sizes of one layer given as a LayerShape, a QuantizedLayer or float stacks
    (gate, up, down); ValueError unless I and H are whole blocks of 32."""
    if isinstance(v, (LayerShape, QuantizedLayer)):
        E, I, H = v.num_experts, v.intermediate, v.hidden
    else:
        E, I, H = np.shape(v[0])
    if H % BLOCK or I % BLOCK:
        raise ValueError(f"H={H} and I={I} must be multiples of {BLOCK}")
    return LayerShape(int(E), int(I), int(H))


def quantize_layer(gate: np.ndarray | Blocks, up: np.ndarray | Blocks,
                   down: np.ndarray | Blocks, fmt: str = "int8") -> QuantizedLayer:
    """Float (or :class:`Blocks`) ``gate/up [E, I, H]``, ``down [E, H, I]`` -> canonical blocks
    of 32 of format ``fmt`` (quant4.to_format)."""
    E, I, H = gate.shape
    if up.shape != (E, I, H) or down.shape != (E, H, I):
        raise ValueError(f"expert shapes disagree: gate {gate.shape}, up {up.shape}, "
                         f"down {down.shape} (want [E,I,H], [E,I,H], [E,H,I])")
    if H % BLOCK or I % BLOCK:
        raise ValueError(f"H={H} and I={I} must be multiples of {BLOCK}")
    gq, gs = to_format(gate, fmt)
    uq, us = to_format(up, fmt)
    dq, ds = to_format(down, fmt)
    return QuantizedLayer(gq, gs, uq, us, dq, ds)


def shard_bounds(intermediate: int, num_shards: int) -> list[tuple[int, int]]:
    """Split I into ``num_shards`` ranges of whole 32-blocks (sizes differ by <= 1 block)."""
    nb = intermediate // BLOCK
    if num_shards < 1 or num_shards > nb:
        raise ValueError(f"cannot split I={intermediate} ({nb} blocks) into {num_shards} shards")
    base, extra = divmod(nb, num_shards)
    bounds, lo = [], 0
    for s in range(num_shards):
        hi = lo + (base + (1 if s < extra else 0)) * BLOCK
        bounds.append((lo, hi))
        lo = hi
    return bounds


def tiled_shape(E: int, mats: int, units: int, n: int, fmt: str = "int8") -> tuple[int, ...]:
    """Kernel shape of ``mats`` matrices per expert, each ``[units, n]`` reduced along n:
    micro-tiles of 16 units; per block of 32 positions, 512 int8 weight bytes then 16 float32
    scales (tiles.py), or for int4 256 bytes of nibbles then 16 fp16 scales (tiles4.py)."""
    return (E, mats, units // TU, n // BLOCK, BLOCK_BYTES4 if fmt == "int4" else BLOCK_BYTES)


def tile_into(q: np.ndarray, s: np.ndarray, out: np.ndarray) -> None:
    """``q [E, U, n] int8, s [E, U, n/32] f16`` -> ``out [E, U/16, n/32, 576]`` int8: per block,
    the weights ``[8 groups][16 units][4 positions]`` then the 16 scales as float32 bytes.
    (``out`` is one matrix's slice ``[:, m]`` of the kernel array.) A uint8 ``out`` is an int4
    tile: :func:`tile_into4`.
    """
    if out.dtype == np.uint8:
        tile_into4(q, s, out)
        return
    E, U, n = q.shape
    nb = n // BLOCK
    if q.size and int(q.min()) == -128:  # the AVX2 kernel's |x| * sign(w, x) needs w != -128
        raise ValueError("int8 expert weights must lie in [-127, 127] (the canonical "
                         "quantizer's range); -128 found")
    out[..., :TILE_BYTES] = (q.reshape(E, U // TU, TU, nb, GROUPS, 4).transpose(0, 1, 3, 4, 2, 5)
                             .reshape(E, U // TU, nb, TILE_BYTES))
    scales = s.astype(np.float32).reshape(E, U // TU, TU, nb).transpose(0, 1, 3, 2)
    out[..., TILE_BYTES:] = np.ascontiguousarray(scales).view(np.int8).reshape(
        E, U // TU, nb, BLOCK_BYTES - TILE_BYTES)


def tile_into4(q: np.ndarray, s: np.ndarray, out: np.ndarray) -> None:
    """int4 tiles (tiles4.py): ``q [E, U, n]`` int8 in [-8, 7], ``s [E, U, n/32] f16`` -> ``out
    [E, U/16, n/32, 288]`` uint8: per block 4 chunks ``[16 units][4 positions]`` of bytes
    ``(q[4j + c] + 8) | (q[16 + 4j + c] + 8) << 4``, then the 16 scales' fp16 bytes."""
    E, U, n = q.shape
    nb = n // BLOCK
    if q.size and (int(q.min()) < -8 or int(q.max()) > 7):
        raise ValueError("int4 expert weights must lie in [-8, 7]")
    nib = (q.astype(np.int16) + 8).astype(np.uint8).reshape(E, U // TU, TU, nb, 2, CHUNKS, 4)
    packed = nib[..., 0, :, :] | (nib[..., 1, :, :] << 4)      # [E, T, u, nb, j, c]
    out[..., :NIBBLE_BYTES] = packed.transpose(0, 1, 3, 4, 2, 5).reshape(E, U // TU, nb,
                                                                          NIBBLE_BYTES)
    scales = s.astype(np.float16).reshape(E, U // TU, TU, nb).transpose(0, 1, 3, 2)
    out[..., NIBBLE_BYTES:] = np.ascontiguousarray(scales).view(np.uint8).reshape(
        E, U // TU, nb, BLOCK_BYTES4 - NIBBLE_BYTES)


def untile4(t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of :func:`tile_into4`."""
    E, ut, nb, _ = t.shape
    b = t[..., :NIBBLE_BYTES].reshape(E, ut, nb, CHUNKS, TU, 4)
    nib = np.stack([b & 15, b >> 4], axis=3)                    # [E, T, nb, 2, j, u, c]
    q = (nib.astype(np.int8) - np.int8(8)).transpose(0, 1, 5, 2, 3, 4, 6).reshape(
        E, ut * TU, nb * BLOCK)
    scales = np.ascontiguousarray(t[..., NIBBLE_BYTES:]).view(np.float16).reshape(E, ut, nb, TU)
    return q, scales.transpose(0, 1, 3, 2).reshape(E, ut * TU, nb)


def plan_shard(layers: Mapping[int, LayerShape | QuantizedLayer],
               bounds: dict[int, tuple[int, int]], fmt: str = "int8") -> tuple[list, int]:
    """Manifest ``[(layer, name, shape, dtype, offset), ...]`` and byte size of one worker's
    shard, which holds the intermediate range ``bounds[layer]`` of every layer (sizes only:
    ``layers`` may be :class:`LayerShape` s) in format ``fmt`` (int8 tiles: dtype int8; int4:
    uint8)."""
    check_format(fmt)
    manifest, off = [], 0
    for layer, ql in sorted(layers.items()):
        lo, hi = bounds[layer]
        E, H, Is = ql.num_experts, ql.hidden, hi - lo
        for name, shape in zip(NAMES, (tiled_shape(E, 2, Is, H, fmt),
                                       tiled_shape(E, 1, H, Is, fmt)), strict=True):
            dt = "uint8" if fmt == "int4" else "int8"
            manifest.append((layer, name, shape, dt, off))
            off += -(-int(np.prod(shape)) * np.dtype(dt).itemsize // ALIGN) * ALIGN
    return manifest, off


def views(buf, manifest: list) -> dict[int, tuple[np.ndarray, ...]]:
    """Arrays of a manifest over a flat buffer: ``{layer: (gu, down)}``."""
    out: dict[int, list[np.ndarray]] = {}
    for layer, _name, shape, dt, off in manifest:
        count = int(np.prod(shape))
        arr = np.frombuffer(buf, dtype=dt, count=count, offset=off).reshape(shape)
        out.setdefault(int(layer), []).append(arr)
    return {k: tuple(v) for k, v in out.items()}


def write_shard(buf, manifest: list, layers: dict[int, QuantizedLayer],
                bounds: dict[int, tuple[int, int]]) -> None:
    """Tile range ``bounds[layer]`` of every layer into ``buf`` as laid out by ``manifest``."""
    dst = views(buf, manifest)
    for layer, ql in layers.items():
        write_experts(dst[layer], ql, bounds[layer], 0)


def write_experts(dst: tuple[np.ndarray, np.ndarray], ql: QuantizedLayer,
                  bounds: tuple[int, int], first: int) -> None:
    """Tile the intermediate range ``bounds`` of experts ``ql`` (canonical, a run of a
    layer's experts) into one shard's ``(gu, down)`` arrays, as experts ``first..``."""
    gq, gs, uq, us, dq, ds = ql.shard(*bounds)
    gu, down = dst
    n = ql.num_experts
    tile_into(gq, gs, gu[first:first + n, 0])
    tile_into(uq, us, gu[first:first + n, 1])
    tile_into(dq, ds, down[first:first + n, 0])


def run_bytes(entries: list, n: int) -> int:
    """Bytes of ``n`` experts' tiles of one layer's manifest ``entries`` (gu, down)."""
    return sum(n * int(np.prod(shape[1:])) * np.dtype(dt).itemsize
               for _layer, _name, shape, dt, _off in entries)


def pwrite_experts(fd: int, entries: list, ql: QuantizedLayer, bounds: tuple[int, int],
                   first: int, scratch: np.ndarray) -> None:
    """:func:`write_experts` into a shard file, without mapping it: experts ``ql`` are tiled
    into ``scratch`` (uint8, at least :func:`run_bytes`) and written with ``pwrite`` at
    experts ``first..`` of the layer's manifest ``entries`` ``[(layer, "gu", ...), (layer,
    "down", ...)]``. A run's tiles are one contiguous range of each array (experts lead)."""
    n, pos, spans, dst = ql.num_experts, 0, [], []
    for _layer, _name, shape, dt, off in entries:
        per = int(np.prod(shape[1:])) * np.dtype(dt).itemsize  # one expert's tile bytes
        dst.append(scratch[pos:pos + n * per].view(dt).reshape(n, *shape[1:]))
        spans.append((pos, n * per, off + first * per))
        pos += n * per
    write_experts((dst[0], dst[1]), ql, bounds, 0)
    for pos, size, at in spans:
        view = memoryview(scratch[pos:pos + size])
        while view.nbytes:  # a write stops short past 2 GiB (or on a signal)
            done = os.pwrite(fd, view, at)
            view, at = view[done:], at + done


def untile(t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of :func:`tile_into`: ``[E, U/16, n/32, 576]`` int8 -> ``q [E, U, n] int8,
    s [E, U, n/32] float16`` (uint8 int4 tiles: :func:`untile4`)."""
    if t.dtype == np.uint8:
        return untile4(t)
    E, ut, nb, _ = t.shape
    q = (t[..., :TILE_BYTES].reshape(E, ut, nb, GROUPS, TU, 4).transpose(0, 1, 4, 2, 3, 5)
         .reshape(E, ut * TU, nb * BLOCK))
    scales = np.ascontiguousarray(t[..., TILE_BYTES:]).view(np.float32).reshape(E, ut, nb, TU)
    return q, scales.transpose(0, 1, 3, 2).reshape(E, ut * TU, nb).astype(np.float16)


class TiledLayer:
    """One MoE layer's CPU experts as the workers hold them: worker w has the intermediate
    range ``bounds[w]``, tiled in its shard; ``read(w)`` returns a copy of that worker's
    ``(gu, down)``. The canonical arrays (``gate_q`` ... ``down_s``, :meth:`shard`) are put
    back together by untiling, on demand (tests, diagnostics): only the shards hold them."""

    def __init__(self, shape: LayerShape, bounds: list[tuple[int, int]],
                 read: Callable[[int], tuple[np.ndarray, np.ndarray]]) -> None:
        self.num_experts, self.intermediate = shape.num_experts, shape.intermediate
        self.hidden = shape.hidden
        self.bounds, self._read = bounds, read

    def canonical(self) -> QuantizedLayer:
        """The whole layer in canonical form (a new copy, put together from every shard)."""
        gate, up, down = [], [], []  # per worker (q, s)
        for w in range(len(self.bounds)):
            gu, dn = self._read(w)
            gate.append(untile(gu[:, 0]))
            up.append(untile(gu[:, 1]))
            down.append(untile(dn[:, 0]))

        def cat(pieces: list, k: int, axis: int) -> np.ndarray:
            return np.concatenate([p[k] for p in pieces], axis=axis)

        return QuantizedLayer(cat(gate, 0, 1), cat(gate, 1, 1), cat(up, 0, 1), cat(up, 1, 1),
                              cat(down, 0, 2), cat(down, 1, 2))

    def __getattr__(self, name: str) -> np.ndarray:
        # gate_q, gate_s, up_q, up_s, down_q, down_s as QuantizedLayer has them
        if name in ("gate_q", "gate_s", "up_q", "up_s", "down_q", "down_s"):
            return getattr(self.canonical(), name)
        raise AttributeError(name)

    def shard(self, lo: int, hi: int) -> tuple[np.ndarray, ...]:
        return self.canonical().shard(lo, hi)
