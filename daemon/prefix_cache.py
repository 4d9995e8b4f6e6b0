"""The daemon's index of prefix checkpoints held by the worker, LRU-bounded.

An entry is the worker's state after exactly ``n`` tokens of some sequence (KV blocks by
reference plus the recurrent-state snapshot), so a later prompt that starts with those ``n``
tokens prefills only the rest.
"""

from __future__ import annotations

from collections import OrderedDict


class PrefixCache:
    def __init__(self, max_blocks: int, block_size: int, max_entries: int = 256) -> None:
        self.max_blocks = max_blocks
        self.block_size = block_size
        self.max_entries = max_entries
        self._by_tokens: OrderedDict[tuple[int, ...], int] = OrderedDict()  # LRU order
        self._blocks: dict[int, int] = {}  # entry id -> blocks it may pin
        self._lengths: dict[int, int] = {}  # length -> entries of that length

    @property
    def used_blocks(self) -> int:
        return sum(self._blocks.values())

    def __len__(self) -> int:
        return len(self._by_tokens)

    def lookup(self, prompt: list[int]) -> tuple[int, int] | None:
        """(entry id, n) of the longest cached prefix shorter than the prompt."""
        for n in sorted(self._lengths, reverse=True):
            if n < len(prompt):
                key = tuple(prompt[:n])
                if key in self._by_tokens:
                    self._by_tokens.move_to_end(key)
                    return self._by_tokens[key], n
        return None

    def contains(self, tokens: list[int]) -> bool:
        return tuple(tokens) in self._by_tokens

    def add(self, tokens: list[int], entry_id: int) -> list[int]:
        """Record a new checkpoint; returns the ids of entries evicted to make room."""
        blocks = -(-len(tokens) // self.block_size)
        evicted = []
        while self._by_tokens and (self.used_blocks + blocks > self.max_blocks
                                   or len(self._by_tokens) >= self.max_entries):
            evicted.append(self._pop_oldest())
        if blocks > self.max_blocks:
            return evicted  # too big to keep at all; the caller must drop it
        self._by_tokens[tuple(tokens)] = entry_id
        self._blocks[entry_id] = blocks
        self._lengths[len(tokens)] = self._lengths.get(len(tokens), 0) + 1
        return evicted

    def fits(self, num_tokens: int) -> bool:
        return -(-num_tokens // self.block_size) <= self.max_blocks

    def _pop_oldest(self) -> int:
        key, entry = self._by_tokens.popitem(last=False)
        del self._blocks[entry]
        self._lengths[len(key)] -= 1
        if not self._lengths[len(key)]:
            del self._lengths[len(key)]
        return entry
