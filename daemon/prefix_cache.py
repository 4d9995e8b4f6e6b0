"""The daemon's index of prefix checkpoints held by the worker, bounded, least recently used
first among the entries that a longer entry extends, then among all.

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

Eviction: *weak* entries go first: the state at a finished request's end (its prompt and its
answer), kept in case the conversation's next turn repeats that answer token for token (a
client that sends back other text, e.g. with the reasoning split off, never hits it); a weak
entry that a lookup hits becomes an ordinary one. Then an entry whose tokens begin a longer
entry of its space is *superseded*: a prompt that continues the longer one hits the longer
one, so the shorter serves only prompts that leave it in between. Those go next (least
recently used first), then the least recently used of all. A conversation checkpoints
every ``checkpoint_interval`` tokens as it grows; with plain LRU, four agents' turns pushed
each other's deepest checkpoint out of a small cache while their own shallower ones stayed
(the 80B's 75 MiB states allow few entries).
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
        self._extends: dict[int, list[Key]] = {}  # entry id -> shorter entries it begins with
        self._superseded: dict[Key, int] = {}  # key -> longer entries that begin with it
        self._weak: set[Key] = set()  # finished requests' ends not hit yet

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
                    self._weak.discard(key)  # it served a prompt: an ordinary entry now
                    return self._by_tokens[key], n
        return None

    def contains(self, tokens: list[int], space: Hashable = None) -> bool:
        return (space, tuple(tokens)) in self._by_tokens

    def add(self, tokens: list[int], entry_id: int, space: Hashable = None, *,
            weak: bool = False) -> list[int]:
        """Record a new checkpoint in ``space`` (``weak``: a finished request's end, see the
        module's note); returns the ids of entries evicted to make room."""
        blocks, nbytes = self._cost(len(tokens))
        key = (space, tuple(tokens))
        below = set() if weak else {  # the entries it will supersede
            k for n in self._lengths if n < len(tokens)
            for k in [(space, key[1][:n])] if k in self._by_tokens}
        evicted = []
        while self._by_tokens and self._over(blocks, nbytes):
            evicted.append(self._pop(self._victim(below)))
        if not self.fits(len(tokens)):
            return evicted  # too big to keep at all; the caller must drop it
        self._by_tokens[key] = entry_id
        self._blocks[entry_id] = blocks
        self._lengths[len(tokens)] = self._lengths.get(len(tokens), 0) + 1
        self._extends[entry_id] = [k for k in below if k in self._by_tokens]
        for k in self._extends[entry_id]:
            self._superseded[k] = self._superseded.get(k, 0) + 1
        if weak:
            self._weak.add(key)
        n = len(tokens)  # longer (not weak) entries kept before this one that begin with it
        above = [e for k, e in self._by_tokens.items() if k[0] == space and len(k[1]) > n
                 and k not in self._weak and k[1][:n] == key[1]]
        for e in above:
            self._extends[e].append(key)
        if above:
            self._superseded[key] = len(above)
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

    def _victim(self, below: set[Key]) -> Key:
        """The least recently used weak entry, else superseded one (``below``: those the
        entry being added will supersede), else the least recently used of all."""
        for pick in (self._weak, self._superseded.keys() | below):
            for key in self._by_tokens:  # least recently used first
                if key in pick:
                    return key
        return next(iter(self._by_tokens))

    def _pop(self, key: Key) -> int:
        entry = self._by_tokens.pop(key)
        del self._blocks[entry]
        n = len(key[1])
        self._lengths[n] -= 1
        if not self._lengths[n]:
            del self._lengths[n]
        self._superseded.pop(key, None)
        self._weak.discard(key)
        for k in self._extends.pop(entry, []):  # no longer superseded by this one
            left = self._superseded.get(k, 0) - 1
            if left > 0:
                self._superseded[k] = left
            else:
                self._superseded.pop(k, None)
        return entry
