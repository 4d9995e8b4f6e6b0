"""The daemon's index of prefix checkpoints held by the worker, LRU-bounded.

An entry is the worker's state after exactly ``n`` tokens of some sequence (KV blocks by
reference plus the recurrent-state snapshot), so a later prompt that starts with those ``n``
tokens prefills only the rest.

Three bounds, whichever binds first: ``max_blocks`` KV blocks pinned, ``max_entries``
entries, and ``max_bytes`` (``[scheduler] prefix_cache_max_mb``) for the blocks' bytes plus
one recurrent-state snapshot per entry (``state_bytes``: the GDN states of one slot, about
79 MB on Qwen3-Next-80B, so 256 of them would be 20 GB that no budget counted).

``space``: entries are shared only within one space. A synthetic model's states depend on
the routing key of the request that computed them (docs/synthetic.md), so the scheduler
passes that key there; None (real models) is one space for everyone.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

Key = tuple[Hashable, tuple[int, ...]]  # (space, tokens)


class PrefixCache:
    def __init__(self, max_blocks: int, block_size: int, max_entries: int = 256, *,
                 block_bytes: int = 0, state_bytes: int = 0,
                 max_bytes: int | None = None) -> None:
        self.max_blocks = max_blocks
        self.block_size = block_size
        self.max_entries = max_entries
        self.block_bytes, self.state_bytes, self.max_bytes = block_bytes, state_bytes, max_bytes
        self._by_tokens: OrderedDict[Key, int] = OrderedDict()  # LRU order
        self._blocks: dict[int, int] = {}  # entry id -> blocks it may pin
        self._lengths: dict[int, int] = {}  # length -> entries of that length

    @property
    def used_blocks(self) -> int:
        return sum(self._blocks.values())

    @property
    def used_bytes(self) -> int:
        """Bytes the entries hold: pinned KV blocks plus one state snapshot each."""
        return self.used_blocks * self.block_bytes + len(self._blocks) * self.state_bytes

    def _cost(self, num_tokens: int) -> tuple[int, int]:
        """(blocks, bytes) of an entry of `num_tokens`."""
        blocks = -(-num_tokens // self.block_size)
        return blocks, blocks * self.block_bytes + self.state_bytes

    def _over(self, blocks: int, nbytes: int) -> bool:
        return (self.used_blocks + blocks > self.max_blocks
                or len(self._by_tokens) >= self.max_entries
                or (self.max_bytes is not None and self.used_bytes + nbytes > self.max_bytes))

    def __len__(self) -> int:
        return len(self._by_tokens)

    def lookup(self, prompt: list[int], space: Hashable = None) -> tuple[int, int] | None:
        """(entry id, n) of the longest prefix shorter than the prompt cached in ``space``."""
        for n in sorted(self._lengths, reverse=True):
            if n < len(prompt):
                key = (space, tuple(prompt[:n]))
                if key in self._by_tokens:
                    self._by_tokens.move_to_end(key)
                    return self._by_tokens[key], n
        return None

    def contains(self, tokens: list[int], space: Hashable = None) -> bool:
        return (space, tuple(tokens)) in self._by_tokens

    def add(self, tokens: list[int], entry_id: int, space: Hashable = None) -> list[int]:
        """Record a new checkpoint in ``space``; returns the ids of entries evicted to make
        room."""
        blocks, nbytes = self._cost(len(tokens))
        evicted = []
        while self._by_tokens and self._over(blocks, nbytes):
            evicted.append(self._pop_oldest())
        if not self.fits(len(tokens)):
            return evicted  # too big to keep at all; the caller must drop it
        self._by_tokens[(space, tuple(tokens))] = entry_id
        self._blocks[entry_id] = blocks
        self._lengths[len(tokens)] = self._lengths.get(len(tokens), 0) + 1
        return evicted

    def fits(self, num_tokens: int) -> bool:
        """Whether an entry of `num_tokens` fits an empty cache."""
        blocks, nbytes = self._cost(num_tokens)
        return blocks <= self.max_blocks and (self.max_bytes is None or nbytes <= self.max_bytes)

    def emptied(self) -> PrefixCache:
        """A new, empty cache with the same bounds (the worker restarted)."""
        return PrefixCache(self.max_blocks, self.block_size, self.max_entries,
                           block_bytes=self.block_bytes, state_bytes=self.state_bytes,
                           max_bytes=self.max_bytes)

    def _pop_oldest(self) -> int:
        (_, tokens), entry = self._by_tokens.popitem(last=False)
        del self._blocks[entry]
        self._lengths[len(tokens)] -= 1
        if not self._lengths[len(tokens)]:
            del self._lengths[len(tokens)]
        return entry
