"""Suffix drafts: continue the request's own history where its latest suffix occurred before.

Agents and editors repeat themselves (code echoed from the prompt, JSON keys, tool calls), so
the tokens that followed an earlier occurrence of the last few tokens are often the next
ones. For each match length ``n`` in ``min_match..max_match`` an index maps every n-gram of
the history whose continuation is known to the end of its latest occurrence; a proposal
takes the longest current suffix found there and returns up to ``k`` tokens that followed it.
Each new token costs ``max_match - min_match + 1`` dictionary writes.
"""

from __future__ import annotations


class SuffixProposer:
    """Drafts for one request; feed it every token of the request (prompt, then generated)
    through :meth:`extend` in order."""

    def __init__(self, min_match: int = 2, max_match: int = 8) -> None:
        if not 1 <= min_match <= max_match:
            raise ValueError(f"need 1 <= min_match <= max_match, got {min_match}, {max_match}")
        self.min_match, self.max_match = min_match, max_match
        self.history: list[int] = []
        # n -> {n-gram: index just after its latest occurrence that has a continuation}
        self._index: dict[int, dict[tuple[int, ...], int]] = {
            n: {} for n in range(min_match, max_match + 1)}

    def __len__(self) -> int:
        return len(self.history)

    def extend(self, tokens: list[int]) -> None:
        h = self.history
        for token in tokens:
            end = len(h)  # the n-grams ending here get their continuation: ``token``
            for n, index in self._index.items():
                if end >= n:
                    index[tuple(h[end - n:end])] = end
            h.append(int(token))

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` draft tokens (none if no suffix of at least ``min_match`` tokens
        occurred before)."""
        h = self.history
        if k <= 0:
            return []
        for n in range(min(self.max_match, len(h)), self.min_match - 1, -1):
            end = self._index[n].get(tuple(h[len(h) - n:]))
            if end is not None:
                return h[end:end + k]
        return []
