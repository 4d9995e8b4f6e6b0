"""Sample-and-match (docs/architecture.md §4): the tokens one slot commits from its logits.

Row j of a slot picks the token at absolute position start + num_tokens + j exactly as plain
decoding would (docs/sampling.md: keyed by the request's seed and that position); draft j is
accepted while it equals that pick. So speculative and plain decoding emit identical tokens
given identical logits. :func:`sample_and_match_all` does every slot of a pass: on the
device for CuPy logits (gpu_worker/kernels/sampler.py; only token ids come back), by the
NumPy reference otherwise -- the same tokens either way.
"""

from __future__ import annotations

import numpy as np

from gpu_worker.kernels import sampler
from gpu_worker.sampling import sample
from protocol.messages import SamplingParams, SlotWork


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


def sample_and_match_all(work: list[SlotWork], logits, first: dict[int, int]
                         ) -> list[tuple[list[int], int]]:
    """:func:`sample_and_match` of every slot of ``work``; ``logits`` [n, V] (NumPy or CuPy)
    holds each slot's rows from ``first[slot]`` on (slots not in ``first`` get none)."""
    if isinstance(logits, np.ndarray) or logits.shape[1] > sampler.MAX_VOCAB:
        host = logits if isinstance(logits, np.ndarray) else logits.get()
        return [sample_and_match(w, host, first.get(w.slot)) for w in work]
    sampled = [w for w in work if w.slot in first]
    params = [SamplingParams(temperature=0)] * logits.shape[0]  # rows of no slot: unused
    positions = [0] * logits.shape[0]
    for w in sampled:
        pos = w.start_pos + w.num_tokens
        for j in range(len(w.draft_ids) + 1):
            params[first[w.slot] + j], positions[first[w.slot] + j] = w.sampling, pos + j
    fp, ip = sampler.params_rows(params, positions)
    out = sampler.sample_and_match_rows(logits, fp, ip, [first[w.slot] for w in sampled],
                                        [w.draft_ids for w in sampled]).get()
    n = logits.shape[0]
    picks = {}
    for s, w in enumerate(sampled):
        accepted = int(out[n + s])
        row = first[w.slot]
        picks[w.slot] = ([int(t) for t in out[row:row + accepted + 1]], accepted)
    return [picks.get(w.slot, ([], 0)) for w in work]
