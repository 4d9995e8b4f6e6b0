"""Sample-and-match (docs/architecture.md §4): the tokens one slot commits from its logits.

Row j of a slot picks the token at absolute position start + num_tokens + j exactly as plain
decoding would (Gumbel noise keyed by the request's seed and that position); draft j is
accepted while it equals that pick. So speculative and plain decoding emit identical tokens
given identical logits.
"""

from __future__ import annotations

import numpy as np

from gpu_worker.sampling import sample
from protocol.messages import SlotWork


def sample_and_match(w: SlotWork, logits: np.ndarray, row: int | None
                     ) -> tuple[list[int], int]:
    """``logits`` [n, V] of the pass; ``row``: the slot's first logits row (None: the slot
    asked for none). Returns (accepted drafts + one sampled token, drafts accepted)."""
    if row is None:
        return [], 0
    params = w.sampling  # NOTE: its seed is set (the runner checked: PlanError otherwise)
    pos = w.start_pos + w.num_tokens
    tokens: list[int] = []
    for j, draft in enumerate(w.draft_ids):
        token = sample(logits[row + j], params, pos + j)
        tokens.append(token)
        if token != int(draft):
            return tokens, j
    k = len(w.draft_ids)
    tokens.append(sample(logits[row + k], params, pos + k))
    return tokens, k

