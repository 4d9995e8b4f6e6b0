"""The interpreter of a StepPlan's cache commands (protocol ``CacheOp``) over the caches of
every slot: KV blocks (gpu_worker/kv_cache.py) and GDN recurrent states (states.py).

It owns how many tokens each allocated slot's cache holds (``lengths``) and the saved slot
states the daemon names by entry id (``entries``): prefix checkpoints, which hold device KV
blocks by reference (or, offloaded, copies of their KV and state in host memory: the prefix
cache's host tier), and swapped-out slots, whose KV and states wait in host memory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from gpu_worker.backend import to_numpy
from gpu_worker.model.model import Caches
from protocol.messages import CacheOp, CacheOpKind


class PlanError(ValueError):
    """A StepPlan that names an unknown slot or entry or breaks a cache invariant."""


@dataclasses.dataclass
class Entry:
    """A saved slot state: a prefix checkpoint (KV block refs on the device) or a swapped-out
    slot (KV copied to host memory, blocks freed)."""

    num_tokens: int
    blocks: list[int]  # device KV blocks held by reference (checkpoints)
    state: tuple | None  # recurrent-state snapshot at exactly num_tokens
    host_kv: tuple | None = None  # swapped-out pools (KVCache.gather), on the host


class CacheOps:
    """Applies cache commands to ``caches``; ``on_release(slot)`` hears of every slot whose
    cache is emptied or replaced (so per-slot state kept elsewhere can be dropped)."""

    def __init__(self, caches: Caches, max_slots: int,
                 on_release: Callable[[int], None] | None = None) -> None:
        self.caches = caches
        self.kv = caches.kv
        self.states = caches.states
        self.max_slots = max_slots
        self.on_release = on_release
        self.entries: dict[int, Entry] = {}
        self.lengths: dict[int, int] = {}  # tokens in each allocated slot's cache

    def apply(self, op: CacheOp) -> None:
        """One command; a wire kind removed from CacheOpKind is one branch deleted here."""
        kind = op.op
        if op.slot is not None and not 0 <= op.slot < self.max_slots:
            raise PlanError(f"{kind.name}: slot {op.slot} out of range")
        if kind == CacheOpKind.ALLOCATE:
            self.release(op.slot)
            self.lengths[op.slot] = 0
        elif kind == CacheOpKind.FREE:
            self.release(op.slot)
        elif kind == CacheOpKind.CHECKPOINT:
            self.entries[op.entry_id] = self.checkpoint(op.slot, op.num_tokens)
        elif kind == CacheOpKind.SHARE_PREFIX:
            self.share(op)
        elif kind == CacheOpKind.SWAP_OUT:
            self.entries[op.entry_id] = self.swap_out(op.slot)
        elif kind == CacheOpKind.SWAP_IN:
            self.swap_in(op.slot, self.entries.pop(self._check_entry(op.entry_id)))
        elif kind == CacheOpKind.DROP_CHECKPOINT:
            self.kv.allocator.free(self.entries.pop(self._check_entry(op.entry_id)).blocks)
        elif kind == CacheOpKind.OFFLOAD:
            self.offload(op.entry_id)
        else:
            raise PlanError(f"unknown cache command {kind!r}")

    def release(self, slot: int) -> None:
        self.caches.reset_slot(slot)
        self.lengths.pop(slot, None)
        if self.on_release is not None:
            self.on_release(slot)

    def entry(self, entry_id: int) -> Entry:
        return self.entries[self._check_entry(entry_id)]

    def _check_entry(self, entry_id: int) -> int:
        if entry_id not in self.entries:
            raise PlanError(f"unknown cache entry {entry_id}")
        return entry_id

    def _snapshot(self, slot: int) -> tuple | None:
        return self.states.snapshot(slot) if self.states is not None else None

    def checkpoint(self, slot: int, num_tokens: int) -> Entry:
        if self.lengths.get(slot) != num_tokens:
            raise PlanError(f"CHECKPOINT slot {slot} at {num_tokens} tokens, but it holds "
                            f"{self.lengths.get(slot)}")
        blocks = self.kv.tables.get(slot, [])[: self.kv.blocks_for(num_tokens)]
        self.kv.allocator.incref(blocks)
        return Entry(num_tokens, list(blocks), self._snapshot(slot))

    def share(self, op: CacheOp) -> None:
        """slot <- the first num_tokens of an entry (with its recurrent state): its device
        blocks by reference, or an offloaded entry's copies written into new blocks."""
        n = op.num_tokens
        entry = self.entry(op.entry_id)
        if n > entry.num_tokens or (entry.state is not None and n != entry.num_tokens):
            raise PlanError(f"SHARE_PREFIX of {n} tokens from entry {op.entry_id} holding "
                            f"{entry.num_tokens}")
        self.release(op.slot)
        if entry.host_kv is None:
            self.kv.share(op.slot, entry.blocks[: self.kv.blocks_for(n)])
        else:
            self._copy_in(op.slot, n, entry)
        if entry.state is not None:
            self.states.restore(op.slot, self._on_device(entry.state))
        self.lengths[op.slot] = n

    def offload(self, entry_id: int) -> None:
        """A prefix checkpoint -> host memory: its KV rows and state copied there, its device
        blocks freed (a slot sharing them keeps its own references). Entry.host_kv marks it."""
        entry = self.entry(entry_id)
        if entry.host_kv is not None:
            raise PlanError(f"OFFLOAD of entry {entry_id}, which is in host memory already")
        kv, state = self._host_copy(entry.blocks, entry.state)
        self.kv.allocator.free(entry.blocks)
        self.entries[entry_id] = Entry(entry.num_tokens, [], state, kv)

    def _host_copy(self, blocks: list[int], state: tuple | None) -> tuple[tuple, tuple | None]:
        """Host-memory copies of ``blocks``' KV rows (KVCache.gather) and of ``state``."""
        kv = tuple(to_numpy(a).copy() for a in self.kv.gather(blocks))
        return kv, None if state is None else tuple(to_numpy(s).copy() for s in state)

    def _copy_in(self, slot: int, n: int, entry: Entry) -> None:
        """The first ``n`` tokens' KV of a host-memory entry into the slot's new blocks."""
        self.kv.ensure(slot, n)
        keep = self.kv.blocks_for(n)
        if keep:
            self.kv.scatter(self.kv.tables[slot][:keep], tuple(a[:, :keep] for a in entry.host_kv))

    def _on_device(self, state: tuple) -> tuple:
        xp = self.states.xp
        return tuple(xp.asarray(s) for s in state)

    def swap_out(self, slot: int) -> Entry:
        """The slot's committed KV and its states -> host memory; the slot is freed."""
        n = self.lengths.get(slot)
        if n is None:
            raise PlanError(f"SWAP_OUT of unallocated slot {slot}")
        # NOTE: only the blocks of the committed tokens: rejected drafts may have grown the
        # table past them (their rows are never read)
        blocks = self.kv.tables.get(slot, [])[: self.kv.blocks_for(n)]
        host, state = self._host_copy(blocks, self._snapshot(slot))
        self.release(slot)
        return Entry(n, [], state, host)

    def swap_in(self, slot: int, entry: Entry) -> None:
        if entry.host_kv is None:
            raise PlanError("SWAP_IN of an entry that was not swapped out")
        self.release(slot)
        self._copy_in(slot, entry.num_tokens, entry)
        if entry.state is not None:
            self.states.restore(slot, self._on_device(entry.state))
        self.lengths[slot] = entry.num_tokens
