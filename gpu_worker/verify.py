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
    n = logits.shape[0]
    host = sampling_inputs(work, n, first)
    sampled = [w for w in work if w.slot in first]
    out = sampler.sample_and_match_rows(logits, host["fp"], host["ip"],
                                        [first[w.slot] for w in sampled],
                                        [w.draft_ids for w in sampled])
    return picks(work, first, out.get(), n)


def sampling_inputs(work: list[SlotWork], n: int, first: dict[int, int]
                    ) -> dict[str, np.ndarray]:
    """The device sampler's host arrays for ``n`` logits rows: packed per-row parameters
    ``fp``/``ip`` (gpu_worker/kernels/sampler.py ``pack_rows``) and the draft matching's
    arrays (``match_inputs``) of the slots in ``first``, in ``work`` order."""
    sampled = [w for w in work if w.slot in first]
    params = [SamplingParams(temperature=0)] * n  # rows of no slot: unused
    positions = [0] * n
    for w in sampled:
        pos = w.start_pos + w.num_tokens
        for j in range(len(w.draft_ids) + 1):
            params[first[w.slot] + j], positions[first[w.slot] + j] = w.sampling, pos + j
    fp, ip = sampler.params_rows(params, positions)
    return {"fp": fp, "ip": ip, **sampler.match_inputs([first[w.slot] for w in sampled],
                                                       [w.draft_ids for w in sampled])}


def picks(work: list[SlotWork], first: dict[int, int], out: np.ndarray, n: int
          ) -> list[tuple[list[int], int]]:
    """Each slot's (tokens, accepted drafts) from the sampler's int32 output [n + S]: n
    sampled tokens, then the accepted count of each slot in ``first`` (``work`` order)."""
    sampled = [w for w in work if w.slot in first]
    chosen = {}
    for s, w in enumerate(sampled):
        accepted = int(out[n + s])
        row = first[w.slot]
        chosen[w.slot] = ([int(t) for t in out[row:row + accepted + 1]], accepted)
    return [chosen.get(w.slot, ([], 0)) for w in work]
