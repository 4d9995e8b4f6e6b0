"""The (row, expert) pairs of one dispatch, numbered and grouped by expert (kernels.py)."""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def group_pairs(expert_ids, num_experts):
    """Dense pair numbering and grouping by expert.

    Returns ``pair_of [R, K]`` (pair index or -1), ``pair_row [P]``, ``active [A]`` (expert ids
    in increasing order), ``offsets [A+1]`` and ``members [P]`` (pair ids of each active expert,
    in increasing pair order), or an empty ``active`` with ``pair_of[0, 0] = -2`` on a bad id.
    """
    R, K = expert_ids.shape
    pair_of = np.full((R, K), -1, np.int64)
    counts = np.zeros(num_experts, np.int64)
    P = 0
    for r in range(R):
        for k in range(K):
            e = expert_ids[r, k]
            if e < -1 or e >= num_experts:
                pair_of[0, 0] = -2
                return pair_of, np.empty(0, np.int64), np.empty(0, np.int64), \
                    np.zeros(1, np.int64), np.empty(0, np.int64)
            if e >= 0:
                pair_of[r, k] = P
                counts[e] += 1
                P += 1
    pair_row = np.empty(P, np.int64)
    pair_exp = np.empty(P, np.int64)
    for r in range(R):
        for k in range(K):
            p = pair_of[r, k]
            if p >= 0:
                pair_row[p] = r
                pair_exp[p] = expert_ids[r, k]
    A = 0
    for e in range(num_experts):
        if counts[e] > 0:
            A += 1
    active = np.empty(A, np.int64)
    offsets = np.zeros(A + 1, np.int64)
    slot = np.full(num_experts, -1, np.int64)
    a = 0
    for e in range(num_experts):
        if counts[e] > 0:
            active[a] = e
            slot[e] = a
            offsets[a + 1] = offsets[a] + counts[e]
            a += 1
    members = np.empty(P, np.int64)
    fill = offsets[:-1].copy()
    for p in range(P):
        s = slot[pair_exp[p]]
        members[fill[s]] = p
        fill[s] += 1
    return pair_of, pair_row, active, offsets, members
