"""A suffix index shared by every request: drafts from text that other requests hold.

Coding agents re-read the same files, tools print the same outputs, many sessions share one
system prompt: a request often writes text that another request already holds, which its own
history (daemon/proposers/suffix.py) cannot propose. This index holds recent requests'
tokens, one *segment* per request, and maps every n-gram (n = min_match..max_match) whose
continuation is known to where its latest occurrence ends, like the per-request index.

Memory is bounded by ``max_tokens``: when the segments hold more, the least recently
extended segment is evicted whole, with every index entry that points into it. An entry
keeps the latest occurrence of its n-gram in each segment that holds it (an int, or a list
when several segments do, least recent first), so evicting one segment never hides the same
text in another, and a request's own segment never hides others' from it. Keys are 64-bit
hashes of the n-grams (a tuple key costs ~4x the bytes); a proposal re-checks the tokens,
so a hash collision only costs a miss. About 110 bytes per token and match length: with
the defaults (n = 2..8) ~0.8 kB a token, ~50 MB for 65536 tokens (measured, tracemalloc).
"""

from __future__ import annotations

from collections import OrderedDict

_SHIFT = 32  # an index value is (segment id << 32) | end
_MASK = (1 << _SHIFT) - 1


class GlobalSuffixIndex:
    """Segments of tokens, each fed in order through :meth:`extend` (one per request)."""

    def __init__(self, max_tokens: int, min_match: int = 2, max_match: int = 8) -> None:
        if max_tokens < 1 or not 1 <= min_match <= max_match:
            raise ValueError(f"need max_tokens >= 1 and 1 <= min_match <= max_match, got "
                             f"{max_tokens}, {min_match}, {max_match}")
        self.max_tokens, self.min_match, self.max_match = max_tokens, min_match, max_match
        self.segments: OrderedDict[int, list[int]] = OrderedDict()  # least recent first
        self.num_tokens = 0
        self.evicted_segments = 0
        self._next_id = 0
        # n -> {hash of an n-gram: (segment << 32) | index just after its latest occurrence
        # in that segment; a list of them, least recent first, when several segments hold it}
        self._index: dict[int, dict[int, int | list[int]]] = {
            n: {} for n in range(min_match, max_match + 1)}

    def new_segment(self) -> int:
        """An id for a new segment (it takes memory once :meth:`extend` feeds it)."""
        self._next_id += 1
        return self._next_id

    def extend(self, segment: int, tokens: list[int]) -> None:
        """Append ``tokens`` to ``segment`` (a new one if it was evicted) and make it the most
        recent; then evict the least recent segments until the budget holds."""
        if not tokens:
            return
        h = self.segments.get(segment)
        if h is None:
            h = self.segments[segment] = []
        self.segments.move_to_end(segment)
        base = segment << _SHIFT
        for token in tokens:
            end = len(h)  # the n-grams ending here get their continuation: ``token``
            for n, index in self._index.items():
                if end >= n:
                    _put(index, hash(tuple(h[end - n:end])), base | end)
            h.append(int(token))
        self.num_tokens += len(tokens)
        while self.num_tokens > self.max_tokens:
            self._evict()

    def propose(self, history: list[int], k: int, exclude: int | None = None) -> list[int]:
        """Up to ``k`` tokens that followed the longest suffix of ``history`` (n >= min_match)
        in a segment other than ``exclude`` (the asker's own: its own index serves it); of
        several segments, the most recently extended one."""
        if k <= 0:
            return []
        for n in range(min(self.max_match, len(history)), self.min_match - 1, -1):
            gram = tuple(history[len(history) - n:])
            found = self._index[n].get(hash(gram))
            for value in [found] if isinstance(found, int) else reversed(found or ()):
                seg = value >> _SHIFT
                if seg == exclude:
                    continue
                h, end = self.segments[seg], value & _MASK
                if tuple(h[end - n:end]) == gram:  # not a hash collision
                    return h[end:end + k]
        return []

    def num_entries(self) -> int:
        """Occurrences held (one per n-gram and segment; for tests and the estimate)."""
        return sum(1 if isinstance(v, int) else len(v)
                   for index in self._index.values() for v in index.values())

    def _evict(self) -> None:
        segment, h = self.segments.popitem(last=False)
        for end in range(len(h)):
            for n, index in self._index.items():
                if end >= n:
                    _drop(index, hash(tuple(h[end - n:end])), segment)
        self.num_tokens -= len(h)
        self.evicted_segments += 1


def _put(index: dict[int, int | list[int]], key: int, value: int) -> None:
    """Record ``value`` as its segment's latest occurrence under ``key``."""
    cur = index.get(key)
    if cur is None or (isinstance(cur, int) and cur >> _SHIFT == value >> _SHIFT):
        index[key] = value
    elif isinstance(cur, int):
        index[key] = [cur, value]
    else:  # at most one per segment, most recent last
        cur[:] = [v for v in cur if v >> _SHIFT != value >> _SHIFT] + [value]


def _drop(index: dict[int, int | list[int]], key: int, segment: int) -> None:
    """Forget ``segment``'s occurrence under ``key`` (if it still has one)."""
    cur = index.get(key)
    if isinstance(cur, int):
        if cur >> _SHIFT == segment:
            del index[key]
    elif cur is not None:
        rest = [v for v in cur if v >> _SHIFT != segment]
        if rest:
            index[key] = rest[0] if len(rest) == 1 else rest
        else:
            del index[key]
