"""Paged KV cache for the full-attention layers, with reference-counted blocks.

Each slot owns a block table (list of block ids); a block holds ``block_size`` consecutive
positions for every full-attention layer. Blocks are reference counted so a prefix can be
shared by several slots; writing into a shared block copies it first (copy-on-write).
Values are stored in the model dtype, or (``quant=True``, docs/architecture.md §6) as int8 with
one fp16 scale per 32 values along head_dim: a quarter of float32's bytes plus 1/16. A row is
quantized on its own when written (``d = fp16(amax / 127)``, ``q = rint(x / d)``), so what a
row reads back never depends on the batch it was written in.
"""

from __future__ import annotations

import dataclasses

import numpy as np

QBLOCK = 32  # int8 KV: values per fp16 scale along head_dim


def block_bytes(num_layers: int, block_size: int, kv_heads: int, head_dim: int,
                itemsize: int, quant: bool = False) -> int:
    """Bytes of one KV block (K and V, every layer): values of ``itemsize`` bytes, or int8
    values plus an fp16 scale per QBLOCK."""
    per_value = (QBLOCK + 2) / QBLOCK if quant else itemsize
    return int(2 * num_layers * block_size * kv_heads * head_dim * per_value)


class CacheFull(RuntimeError):
    """Not enough free KV blocks for the requested length."""


class BlockAllocator:
    """Free list plus reference counts over ``num_blocks`` block ids."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int, *, last: bool = False) -> list[int]:
        """``n`` free blocks: the lowest ids free (``last``: the highest, for blocks held for
        good, so that the others are handed out as without them)."""
        if not self.can_allocate(n):
            raise CacheFull(f"need {n} KV blocks, {len(self._free)} free")
        if last:
            self._free.sort(reverse=True)  # the highest first
            ids, self._free[:n] = self._free[:n], []
        else:
            ids = [self._free.pop() for _ in range(n)]
        for i in ids:
            self._refs[i] = 1
        return ids

    def incref(self, ids: list[int]) -> None:
        for i in ids:
            assert self._refs[i] > 0, f"incref of free block {i}"
            self._refs[i] += 1

    def free(self, ids: list[int]) -> None:
        for i in ids:
            assert self._refs[i] > 0, f"double free of block {i}"
            self._refs[i] -= 1
            if self._refs[i] == 0:
                self._free.append(i)

    def refcount(self, block: int) -> int:
        return self._refs[block]


@dataclasses.dataclass
class KVCache:
    """K/V pools [layers, blocks, block_size, kv_heads, head_dim] and per-slot block tables;
    with ``quant`` int8 pools plus fp16 scales [..., head_dim / 32] (``ks``, ``vs``)."""

    xp: object
    num_layers: int
    num_blocks: int
    block_size: int
    kv_heads: int
    head_dim: int
    dtype: object
    quant: bool = False

    def __post_init__(self) -> None:
        xp = self.xp
        shape = (self.num_layers, self.num_blocks, self.block_size, self.kv_heads, self.head_dim)
        self.ks = self.vs = None
        if self.quant:
            if self.head_dim % QBLOCK:
                raise ValueError(f"int8 KV needs head_dim to be a multiple of {QBLOCK}, got "
                                 f"{self.head_dim}")
            self.k = xp.zeros(shape, dtype=xp.int8)
            self.v = xp.zeros(shape, dtype=xp.int8)
            scales = (*shape[:-1], self.head_dim // QBLOCK)
            self.ks = xp.zeros(scales, dtype=xp.float16)
            self.vs = xp.zeros(scales, dtype=xp.float16)
        else:
            self.k = xp.zeros(shape, dtype=self.dtype)
            self.v = xp.zeros(shape, dtype=self.dtype)
        self.allocator = BlockAllocator(self.num_blocks)
        self.tables: dict[int, list[int]] = {}
        # table changes: ``version`` counts them, ``_dirty`` names the slots whose device row
        # (:meth:`device_tables`) is stale; ``paged_meta`` is the paged-attention kernels'
        # per-batch device metadata (gpu_worker/kernels/paged_attention.py)
        self.version = 0
        self._dirty: set[int] = set()
        self._device_tables = None
        self.paged_meta = None

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self._pools())

    def blocks_for(self, length: int) -> int:
        return -(-length // self.block_size)

    def can_grow(self, slot: int, length: int) -> bool:
        have = len(self.tables.get(slot, ()))
        return self.allocator.can_allocate(max(0, self.blocks_for(length) - have))

    def ensure(self, slot: int, length: int, *, last: bool = False) -> None:
        """Make the slot's table cover positions [0, length) (``last``: with the highest free
        block ids, BlockAllocator.allocate)."""
        table = self.tables.setdefault(slot, [])
        need = self.blocks_for(length) - len(table)
        if need > 0:
            table.extend(self.allocator.allocate(need, last=last))
            self._changed(slot)

    def share(self, dst: int, src_blocks: list[int]) -> None:
        """Start slot ``dst`` with a reference to ``src_blocks`` (a cached prefix)."""
        if self.tables.get(dst):
            raise ValueError(f"slot {dst} already holds KV blocks")
        self.allocator.incref(src_blocks)
        self.tables[dst] = list(src_blocks)
        self._changed(dst)

    def free_slot(self, slot: int) -> None:
        self.allocator.free(self.tables.pop(slot, []))
        self._changed(slot)

    def truncate(self, slot: int, length: int) -> None:
        """Drop whole blocks past ``length`` (rejected drafts need no truncation: kv_len rules)."""
        table = self.tables.get(slot, [])
        keep = self.blocks_for(length)
        if table[keep:]:
            self.allocator.free(table[keep:])
            del table[keep:]
            self._changed(slot)

    def write(self, layer: int, slot: int, start: int, k, v) -> None:
        """Store k, v [n, kv_heads, head_dim] at positions start..start+n of ``slot``."""
        n = k.shape[0]
        self.reserve(slot, start, n)
        table = self.tables[slot]
        xp = self.xp
        pos = xp.arange(start, start + n)
        blocks = xp.asarray(table)[pos // self.block_size]
        offs = pos % self.block_size
        if self.quant:
            (self.k[layer, blocks, offs], self.ks[layer, blocks, offs]) = self._quantize(k)
            (self.v[layer, blocks, offs], self.vs[layer, blocks, offs]) = self._quantize(v)
        else:
            self.k[layer, blocks, offs] = k
            self.v[layer, blocks, offs] = v

    def reserve(self, slot: int, start: int, n: int) -> None:
        """Make positions start..start+n of ``slot`` writable: blocks allocated, and private
        copies of shared ones among them (copy-on-write)."""
        self.ensure(slot, start + n)
        for bi in range(start // self.block_size, (start + n - 1) // self.block_size + 1):
            self._own_block(slot, bi)

    def device_tables(self, min_rows: int = 0):
        """Every slot's block table as one int32 array [rows > max slot id, num_blocks] on the
        backend (row = slot id; entries past a table's length are stale, never read). Rows are
        uploaded only for slots whose table changed since the last call. ``min_rows``: at
        least that many rows (a CUDA graph needs the array to keep its address)."""
        xp, dev = self.xp, self._device_tables
        rows = max(max(self.tables, default=-1) + 1, min_rows)
        if dev is None or dev.shape[0] < rows:
            grown = xp.zeros((max(rows, 4), self.num_blocks), dtype=xp.int32)
            if dev is not None:
                grown[: dev.shape[0]] = dev
            self._device_tables = dev = grown
        for slot in self._dirty:
            table = self.tables.get(slot)
            if table:
                dev[slot, : len(table)] = xp.asarray(np.asarray(table, dtype=np.int32))
        self._dirty.clear()
        return dev

    def read(self, layer: int, slot: int, length: int):
        """K, V [length, kv_heads, head_dim] of the slot's first ``length`` positions."""
        table = self.xp.asarray(self.tables[slot][: self.blocks_for(length)])
        shape = (-1, self.kv_heads, self.head_dim)
        k, v = self.k[layer, table], self.v[layer, table]
        if self.quant:
            k = self._dequantize(k, self.ks[layer, table])
            v = self._dequantize(v, self.vs[layer, table])
        return k.reshape(shape)[:length], v.reshape(shape)[:length]

    def gather(self, blocks: list[int]) -> tuple:
        """Every pool's rows of ``blocks`` (all layers): what a swap-out keeps."""
        table = self.xp.asarray(blocks, dtype=self.xp.int64)
        return tuple(a[:, table] for a in self._pools())

    def scatter(self, blocks: list[int], arrays: tuple) -> None:
        """Write back what :meth:`gather` returned into ``blocks``."""
        table = self.xp.asarray(blocks, dtype=self.xp.int64)
        for pool, src in zip(self._pools(), arrays, strict=True):
            pool[:, table] = self.xp.asarray(src)

    def _pools(self) -> list:
        return [self.k, self.v] + ([self.ks, self.vs] if self.quant else [])

    def _quantize(self, x):
        """[n, kv_heads, head_dim] -> int8 values and fp16 scales per 32 along head_dim."""
        xp = self.xp
        blocks = x.astype(xp.float32).reshape(*x.shape[:-1], -1, QBLOCK)
        d16 = (xp.abs(blocks).max(axis=-1) / xp.float32(127)).astype(xp.float16)
        d = d16.astype(xp.float32)[..., None]
        q = xp.rint(blocks / xp.where(d > 0, d, xp.float32(1)))
        return xp.clip(q, -127, 127).astype(xp.int8).reshape(x.shape), d16

    def _dequantize(self, q, d16):
        blocks = q.reshape(*q.shape[:-1], -1, QBLOCK).astype(self.dtype)
        return (blocks * d16.astype(self.dtype)[..., None]).reshape(q.shape)

    def _own_block(self, slot: int, index: int) -> None:
        """Copy-on-write: give the slot a private copy of a shared block before writing."""
        table = self.tables[slot]
        block = table[index]
        if self.allocator.refcount(block) > 1:
            (fresh,) = self.allocator.allocate(1)
            for pool in self._pools():
                pool[:, fresh] = pool[:, block]
            self.allocator.free([block])
            table[index] = fresh
            self._changed(slot)

    def _changed(self, slot: int) -> None:
        self.version += 1
        self._dirty.add(slot)
