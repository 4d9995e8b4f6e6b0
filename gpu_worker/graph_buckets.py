"""Capacity buckets of the CUDA graphs (``[model] cuda_graph_buckets``): a decode or verify
pass whose rows fall between two buckets is padded up to the larger, so one graph serves
every pass of that many slots and rows up to the bucket.

The padding rows are one more segment, on a scratch slot the daemon never sees (the slot
after the daemon's, ``StepGraphs(scratch=...)``, with KV blocks of its own, the highest ids),
at positions 0, 1, ... of it. Every kernel of a step computes a row from that row's own
inputs (batch invariance), so the real rows' bits are what they are without the padding;
what keeps the padding cheap and harmless is that

* its rows pick no routed expert: the pass's ``live`` mask (False on padding rows) turns
  their router picks into -1, which the GPU expert kernels and the CPU workers skip, so a
  padded pass reads no expert weight more than the unpadded one (gpu_worker/model/moe.py
  ``sparse_moe``);
* they sample nothing that is read: their sampling parameters are greedy, no slot's first
  logits row or drafts point at them, and only the real slots' tokens come back;
* they write only the scratch slot's KV blocks; it has no Gated DeltaNet state: its
  segment starts from a zero state and keeps nothing (``RecurrentStates.has_state``), so
  the padding reads and writes no state memory (one slot's is 75 MiB for the 80B).

Only passes where every row is a logits row are padded (decode and verify rows: every
slot samples, a verifying slot's every row), so a bucket's graph has one input shape.
"""

from __future__ import annotations

import numpy as np

from gpu_worker.model.batch import RaggedBatch, Segment
from protocol.worker_config import GRAPH_BUCKETS, padded_rows  # the daemon's budget's too

# padding rows a pass can get: the largest gap between two buckets, less one
MAX_PAD = max(b - a for a, b in zip(GRAPH_BUCKETS, GRAPH_BUCKETS[1:], strict=False)) - 1


def bucket(rows: int) -> int | None:
    """The smallest bucket holding ``rows`` rows; None: more than the largest."""
    return next((b for b in GRAPH_BUCKETS if b >= rows), None)


def key(rows: int, slots: int) -> tuple:
    """The graph key of a padded pass of ``rows`` rows (before padding) and ``slots`` slots:
    its bucket and slots; its rows, logits rows and drafts are then all the bucket's."""
    return ("bucket", bucket(rows), slots)


def shape_key(rows: int, slots: int) -> tuple:
    """What one graph serves, for a decode or verify pass of ``rows`` rows and ``slots``
    slots (every row a logits row): its bucket where it is padded, else its rows."""
    b = bucket(rows)
    return key(rows, slots) if b is not None and b != rows else ("rows", rows, slots)


def padding(batch: RaggedBatch, logit_rows: np.ndarray) -> int:
    """How many rows to add to a pass (0: run it as it is): up to its bucket, where there
    is one and every row is a logits row."""
    R = batch.num_rows
    if len(logit_rows) != R or not np.array_equal(logit_rows, np.arange(R)):
        return 0
    return padded_rows(R) - R


def pad(batch: RaggedBatch, logit_rows: np.ndarray, scratch: int, n: int
        ) -> tuple[RaggedBatch, np.ndarray, np.ndarray]:
    """``batch`` with ``n`` rows of token 0 on slot ``scratch`` at positions 0..n-1 after its
    own rows, the logits rows with them, and the live-row mask (bool [rows], False on the
    padding)."""
    R = batch.num_rows
    seg = Segment(scratch, 0, n, R, scratch)
    padded = RaggedBatch(np.concatenate([batch.tokens, np.zeros(n, np.int64)]),
                         np.concatenate([batch.positions, np.arange(n, dtype=np.int64)]),
                         (*batch.segments, seg))
    live = np.arange(R + n) < R
    return padded, np.arange(R + n, dtype=np.int64), live


def pad_drafts(host: dict[str, np.ndarray], rows: int) -> None:
    """The flat draft ids of the sampler's inputs to ``rows + 1`` entries (a bucket's graph
    has one shape whatever its drafts; the kernel reads each slot's by offset and count)."""
    flat = host["drafts"]
    host["drafts"] = np.concatenate([flat, np.zeros(rows + 1 - flat.size, flat.dtype)])
