"""The daemon's index of prefix checkpoints held by the worker, bounded, least recently used
first among the entries that a longer entry extends, then among all.

An entry is the worker's state after exactly ``n`` tokens of some sequence (KV blocks by
reference plus the recurrent-state snapshot), so a later prompt that starts with those ``n``
tokens prefills only the rest.

Three bounds, whichever binds first: ``max_blocks`` KV blocks pinned, ``max_entries``
entries, and ``max_bytes`` (``[scheduler] prefix_cache_max_mb``) for the blocks' bytes plus
one recurrent-state snapshot per entry (``state_bytes``: the GDN states of one slot, about
79 MB on Qwen3-Next-80B, so 256 of them would be 20 GB that no budget counted).

``host_max_bytes`` (``[scheduler] prefix_cache_host_mb``; 0: none) adds a second tier in the
model worker's host memory: an entry that the GPU's bounds push out is *offloaded* there (its
KV and state copied to host RAM, its GPU blocks freed) instead of dropped, unless a longer
entry supersedes it, and a prompt that hits it gets a copy (the worker allocates the slot's
blocks and copies the entry in: a few ms over PCIe, against re-prefilling the whole prefix).
The host tier evicts by the same order (weak, then superseded, then least recently used); a
weak entry is offloaded only where weak and superseded host entries make room. On the 80B
an agent's checkpoint is ~280 MiB at 4k tokens of context: GPU memory for a few of them costs
experts on the GPU, host memory for many costs nothing the step reads.

``space``: entries are shared only within one space. A synthetic model's states depend on
the routing key of the request that computed them (docs/synthetic.md), so the scheduler
passes that key there; None (real models) is one space for everyone.

Eviction: *weak* entries go first: the state at a finished request's end (its prompt and its
answer), kept in case the conversation's next turn repeats that answer token for token (a
client that sends back other text, e.g. with the reasoning split off, never hits it); a weak
entry that a lookup hits becomes an ordinary one, and a weak entry is kept only where weak and
superseded entries make room for it (it never pushes out another: four agents' weak ends,
~200 MB each on the 80B, had evicted each other's next-turn checkpoints on an H100
machine). Then an entry whose tokens begin a longer
entry of its space is *superseded*: a prompt that continues the longer one hits the longer
one, so the shorter serves only prompts that leave it in between. Those go next (least
recently used first), then the least recently used of all. A conversation checkpoints
every ``checkpoint_interval`` tokens as it grows; with plain LRU, four agents' turns pushed
each other's deepest checkpoint out of a small cache while their own shallower ones stayed
(the 80B's 75 MiB states allow few entries).
"""

from __future__ import annotations

from collections.abc import Hashable

Key = tuple[Hashable, tuple[int, ...]]  # (space, tokens)


class PrefixCache:
    def __init__(self, max_blocks: int, block_size: int, max_entries: int = 256, *,
                 block_bytes: int = 0, state_bytes: int = 0,
                 max_bytes: int | None = None, host_max_bytes: int = 0,
                 hits: dict[str, int] | None = None) -> None:
        self.max_blocks = max_blocks
        self.block_size = block_size
        self.max_entries = max_entries
        self.block_bytes, self.state_bytes, self.max_bytes = block_bytes, state_bytes, max_bytes
        self.host_max_bytes = host_max_bytes
        self._host: set[int] = set()  # entry ids held in host memory (the second tier)
        self._offloads: list[int] = []  # moved there since take_offloads()
        # lookups that found an entry, by its tier; ``hits``: those of the cache this one
        # replaces (a worker restart), so /metrics counts them over the daemon's life
        self.hits = {"gpu": 0, "host": 0, **(hits or {})}
        # least recently used first (a plain dict: an OrderedDict's iteration hashes every
        # key again, and a key is a prompt's worth of tokens)
        self._by_tokens: dict[Key, int] = {}
        self._blocks: dict[int, int] = {}  # entry id -> blocks it may pin
        self._lengths: dict[int, int] = {}  # length -> entries of that length
        # by entry id (a key's hash walks all its tokens): the shorter entries each begins
        # with, how many longer entries begin with each, finished requests' ends not hit yet
        self._extends: dict[int, list[int]] = {}
        self._superseded: dict[int, int] = {}
        self._weak: set[int] = set()

    @property
    def used_blocks(self) -> int:
        """KV blocks the GPU tier's entries pin."""
        return sum(b for e, b in self._blocks.items() if e not in self._host)

    @property
    def used_bytes(self) -> int:
        """Bytes the GPU tier's entries hold: pinned KV blocks plus one state snapshot each."""
        return (self.used_blocks * self.block_bytes
                + (len(self._blocks) - len(self._host)) * self.state_bytes)

    @property
    def host_used_bytes(self) -> int:
        """Bytes the host tier's entries hold (their KV and state, copied)."""
        return sum(self._bytes(e) for e in self._host)

    def tiers(self) -> dict[str, tuple[int, int]]:
        """(entries, bytes) of each tier, "gpu" and "host" (for /metrics)."""
        return {"gpu": (len(self._blocks) - len(self._host), self.used_bytes),
                "host": (len(self._host), self.host_used_bytes)}

    def on_host(self, entry: int) -> bool:
        """Whether ``entry`` is held in the host tier."""
        return entry in self._host

    def take_offloads(self) -> list[int]:
        """The entries moved to the host tier since the last call, in order (the scheduler
        tells the worker to copy each out before anything else of the next step)."""
        out, self._offloads = self._offloads, []
        return out

    def _cost(self, num_tokens: int) -> tuple[int, int]:
        """(blocks, bytes) of an entry of `num_tokens`."""
        blocks = -(-num_tokens // self.block_size)
        return blocks, blocks * self.block_bytes + self.state_bytes

    def _bytes(self, entry: int) -> int:
        return self._blocks[entry] * self.block_bytes + self.state_bytes

    def _over(self, blocks: int, nbytes: int, gone: list[int] | None = None) -> bool:
        """Whether an entry of ``blocks`` and ``nbytes`` passes a bound of the GPU tier, the
        entries of ``gone`` (ids) counted as evicted."""
        gone = gone or []
        used = self.used_blocks - sum(self._blocks[e] for e in gone)  # blocks, bytes left
        entries = len(self._blocks) - len(self._host) - len(gone)
        return (used + blocks > self.max_blocks or entries >= self.max_entries
                or (self.max_bytes is not None and used * self.block_bytes
                    + entries * self.state_bytes + nbytes > self.max_bytes))

    def __len__(self) -> int:
        return len(self._by_tokens)

    def lookup(self, prompt: list[int], space: Hashable = None) -> tuple[int, int] | None:
        """(entry id, n) of the longest prefix shorter than the prompt cached in ``space``."""
        for n in sorted(self._lengths, reverse=True):
            if n < len(prompt):
                key = (space, tuple(prompt[:n]))
                if key in self._by_tokens:
                    entry = self._by_tokens[key] = self._by_tokens.pop(key)  # most recent
                    self._weak.discard(entry)  # it served a prompt: an ordinary entry now
                    self.hits["host" if entry in self._host else "gpu"] += 1
                    return entry, n
        return None

    def contains(self, tokens: list[int], space: Hashable = None) -> bool:
        return (space, tuple(tokens)) in self._by_tokens

    def add(self, tokens: list[int], entry_id: int, space: Hashable = None, *,
            weak: bool = False) -> list[int]:
        """Record a new checkpoint in ``space`` (``weak``: a finished request's end, see the
        module's note; the caller asks :meth:`admits` first); returns the ids of entries
        evicted to make room (dropped; those moved to the host tier instead come from
        :meth:`take_offloads`)."""
        blocks, nbytes = self._cost(len(tokens))
        key, n = (space, tuple(tokens)), len(tokens)
        below, above = set(), []  # ids: the entries it begins with, the longer ones that
        # begin with it
        for k, e in self._by_tokens.items():  # one pass: no tuple is built for a non-match
            if k[0] != space:
                continue
            if len(k[1]) < n and not weak and _begins(key[1], k[1]):
                below.add(e)
            elif len(k[1]) > n and e not in self._weak and _begins(k[1], key[1]):
                above.append(e)
        evicted = []
        while len(self._blocks) > len(self._host) and self._over(blocks, nbytes):
            victim = self._victim(below)
            if not self._offload(self._by_tokens[victim], below, evicted):
                evicted.append(self._pop(victim))
        if not self.fits(n):
            return evicted  # too big to keep at all; the caller must drop it
        self._by_tokens[key] = entry_id
        self._blocks[entry_id] = blocks
        self._lengths[n] = self._lengths.get(n, 0) + 1
        self._extends[entry_id] = [e for e in below if e in self._blocks]  # not evicted now
        for e in self._extends[entry_id]:
            self._superseded[e] = self._superseded.get(e, 0) + 1
        if weak:
            self._weak.add(entry_id)
        above = [e for e in above if e in self._blocks]
        for e in above:
            self._extends[e].append(entry_id)
        if above:
            self._superseded[entry_id] = len(above)
        return evicted

    def admits(self, num_tokens: int, weak: bool = False) -> bool:
        """Whether :meth:`add` would keep an entry of ``num_tokens``: it fits an empty cache,
        and a weak one fits once the weak and superseded entries are gone."""
        if not weak:
            return self.fits(num_tokens)
        spare = [e for e in self._blocks if e not in self._host
                 and (e in self._weak or e in self._superseded)]
        return self.fits(num_tokens) and not self._over(*self._cost(num_tokens), spare)

    def fits(self, num_tokens: int) -> bool:
        """Whether an entry of `num_tokens` fits an empty cache."""
        blocks, nbytes = self._cost(num_tokens)
        return blocks <= self.max_blocks and (self.max_bytes is None or nbytes <= self.max_bytes)

    def emptied(self) -> PrefixCache:
        """A new, empty cache with the same bounds and hit counts (the worker restarted)."""
        return PrefixCache(self.max_blocks, self.block_size, self.max_entries,
                           block_bytes=self.block_bytes, state_bytes=self.state_bytes,
                           max_bytes=self.max_bytes, host_max_bytes=self.host_max_bytes,
                           hits=self.hits)

    def _victim(self, below: set[int], host: bool = False) -> Key | None:
        """Of the GPU tier's entries (``host``: the host tier's), the least recently used weak
        entry, else superseded one (``below``: those the entry being added will supersede),
        else the least recently used of all; None if there is none."""
        mine = [(key, e) for key, e in self._by_tokens.items()  # least recently used first
                if (e in self._host) == host]
        for superseded in (False, True):
            for key, e in mine:
                if (e in self._superseded or e in below) if superseded else e in self._weak:
                    return key
        return mine[0][0] if mine else None

    def _offload(self, entry: int, below: set[int], evicted: list[int]) -> bool:
        """Move ``entry`` (pushed out of the GPU tier) to the host tier, evicting host entries
        into ``evicted`` as it needs (its bytes, and at most ``max_entries`` entries there
        too); False where it is not kept there (no host tier, too big, superseded, or weak
        without weak or superseded host entries to make room)."""
        need = self._bytes(entry)
        if (not self.host_max_bytes or need > self.host_max_bytes or entry in self._superseded
                or entry in below):
            return False

        def full(gone: int = 0, freed: int = 0) -> bool:
            return (self.host_used_bytes - freed + need > self.host_max_bytes
                    or len(self._host) - gone >= self.max_entries)

        if entry in self._weak:  # it never pushes out another: weak and superseded ones go
            spare = [e for e in self._host if e in self._weak or e in self._superseded]
            if full(len(spare), sum(self._bytes(e) for e in spare)):
                return False
        while full():
            evicted.append(self._pop(self._victim(below, host=True)))
        self._host.add(entry)
        self._offloads.append(entry)
        return True

    def _pop(self, key: Key) -> int:
        entry = self._by_tokens.pop(key)
        del self._blocks[entry]
        self._host.discard(entry)
        n = len(key[1])
        self._lengths[n] -= 1
        if not self._lengths[n]:
            del self._lengths[n]
        self._superseded.pop(entry, None)
        self._weak.discard(entry)
        for e in self._extends.pop(entry, []):  # no longer superseded by this one
            left = self._superseded.get(e, 0) - 1
            if left > 0:
                self._superseded[e] = left
            else:
                self._superseded.pop(e, None)
        return entry


def _begins(longer: tuple, shorter: tuple) -> bool:
    """Whether ``longer`` begins with ``shorter`` (non-empty); two tokens are looked at
    before any slice is made, which rejects almost every other entry."""
    m = len(shorter)
    return (longer[m - 1] == shorter[-1] and longer[m // 2] == shorter[m // 2]
            and longer[:m] == shorter)
