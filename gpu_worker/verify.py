"""Sample-and-match (ARCHITECTURE.md section 4): the tokens one slot commits from its logits.

Row j of a slot picks the token at absolute position start + num_tokens + j exactly as plain
decoding would (Gumbel noise keyed by the request's seed and that position); draft j is
accepted while it equals that pick. So speculative and plain decoding emit identical tokens
given identical logits.
"""

from __future__ import annotations

import numpy as np

from gpu_worker.sampling import SamplingParams, sample
from protocol.messages import SlotWork


def sample_and_match(w: SlotWork, logits: np.ndarray, row: int | None
                     ) -> tuple[list[int], int]:
    """``logits`` [n, V] of the pass; ``row``: the slot's first logits row (None: the slot
    asked for none). Returns (accepted drafts + one sampled token, drafts accepted)."""
    if row is None:
        return [], 0
    params = _sampling(w)
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


def _sampling(w: SlotWork) -> SamplingParams:
    # NOTE: the runner checked that the seed is set (PlanError otherwise)
    s = w.sampling
    return SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                          min_p=s.min_p, seed=s.seed % (2**63))
