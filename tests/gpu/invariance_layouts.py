"""Helpers of tests/gpu/test_batch_invariance_cupy.py: the layouts of a step (1-4 slots in any
order x 1-5 rows each), the env var that samples them, a failure collector whose report says
where rows differ, and a probe that records the output of every block and op of a pass (to
name the first op whose rows depend on their batch). NumPy only: no CuPy import here."""

from __future__ import annotations

import collections
import itertools
import os

import numpy as np

import gpu_worker.model.model as model_module
from gpu_worker.backend import to_numpy
from gpu_worker.kernels import gdn_recurrent
from gpu_worker.model import attention, moe
from gpu_worker.model.ops import Ops

SLOTS = 4  # decode slots of a layout
CHAIN = 5  # rows per slot at most: a decode token plus up to 4 drafts
ENV = "TANDEM_INVARIANCE_LAYOUTS"
SEED = 14
BLOCKS = ("full_attention", "gated_deltanet", "sparse_moe", "dense_mlp")  # in model.py

Layout = tuple[tuple[int, int], ...]  # (slot, rows) per segment, in batch order


def all_layouts() -> list[Layout]:
    """Every choice of 1..SLOTS slots, in every order, with 1..CHAIN rows each (18,320)."""
    out = []
    for k in range(1, SLOTS + 1):
        for order in itertools.permutations(range(SLOTS), k):
            for rows in itertools.product(range(1, CHAIN + 1), repeat=k):
                out.append(tuple(zip(order, rows, strict=True)))
    return out


def layouts_from_env() -> tuple[list[Layout], str]:
    """``all`` (default) or ``sample:N``: N layouts (at most all) drawn with a fixed seed, an
    equal share from each slot count where it has that many (the 1-slot stratum has only 20,
    the 2-slot one 300; the larger ones take the rest). Returns (layouts, description)."""
    every = all_layouts()
    raw = os.environ.get(ENV, "all").strip()
    if raw == "all":
        return every, f"all {len(every)}"
    kind, _, n = raw.partition(":")
    if kind != "sample" or not n.isdigit() or int(n) < 1:
        raise ValueError(f"{ENV}={raw!r}: expected 'all' or 'sample:N'")
    rng = np.random.default_rng(SEED)
    strata = [[lay for lay in every if len(lay) == k] for k in range(1, SLOTS + 1)]
    picked, left = [], int(n)
    for i, stratum in enumerate(strata):  # smallest first: what a stratum lacks goes on
        share = min(len(stratum), left // (SLOTS - i))
        picked += [stratum[j] for j in sorted(rng.choice(len(stratum), share, replace=False))]
        left -= share
    return picked, f"sample of {len(picked)} of {len(every)}, seed {SEED}"


def first_difference(got: np.ndarray, want: np.ndarray) -> str:
    """How two same-shape float arrays differ bitwise: count, first index, max |diff|."""
    g, w = got.reshape(-1), want.reshape(-1)
    bad = np.nonzero(g.view(f"u{g.itemsize}") != w.view(f"u{w.itemsize}"))[0]
    if not bad.size:
        return f"shape {got.shape}: equal"
    diff = np.abs(g.astype(np.float64) - w.astype(np.float64))
    i = np.unravel_index(bad[0], got.shape)
    return (f"{bad.size}/{g.size} values differ, first at {tuple(map(int, i))}: got "
            f"{got[i]!r} want {want[i]!r}; max |diff| {np.nanmax(diff):.3g}")


class Failures:
    """Rows whose logits differ from their reference, collected over a whole run so one run
    says which layouts, slots and chain rows fail (and how much they differ)."""

    def __init__(self, arch: str, layouts: list[Layout]) -> None:
        self.arch = arch
        self.total = collections.Counter(len(lay) for lay in layouts)
        self.bad_layouts = collections.Counter()  # slot count -> failing layouts
        self.rows: list[tuple[str, int, int, int, int, float]] = []  # label, slot, j, row..
        self.first: tuple | None = None  # (label, layout) of the first failure

    def add(self, layout: Layout, got: np.ndarray, want: np.ndarray, label: str = "") -> bool:
        """``got``/``want`` [rows of the layout, V]; True when some row differs."""
        label = label or str(layout)
        row0, failed = 0, False
        for s, n in layout:
            for j in range(n):
                g, w = got[row0 + j], want[row0 + j]
                if g.tobytes() != w.tobytes():
                    differ = int((g.view(np.uint32) != w.view(np.uint32)).sum())
                    most = float(np.nanmax(np.abs(g.astype(np.float64) - w)))
                    self.rows.append((label, s, j, row0 + j, differ, most))
                    failed = True
            row0 += n
        if failed:
            self.bad_layouts[len(layout)] += 1
            self.first = self.first or (label, layout)
        return failed

    def __bool__(self) -> bool:
        return bool(self.rows)

    def report(self, limit: int = 12) -> str:
        by_k = ", ".join(f"{k} slots {self.bad_layouts[k]}/{self.total[k]}"
                         for k in sorted(self.total))
        by_j = collections.Counter(j for _, _, j, _, _, _ in self.rows)
        by_slot = collections.Counter(s for _, s, _, _, _, _ in self.rows)
        lines = [f"{self.arch}: {sum(self.bad_layouts.values())} layouts, {len(self.rows)} rows "
                 f"with logits that differ from the slot's row decoded alone",
                 f"  failing layouts by slot count: {by_k}",
                 f"  failing rows by chain row (0 = the decode token): {dict(sorted(by_j.items()))}"
                 f"; by slot: {dict(sorted(by_slot.items()))}",
                 f"  largest |diff| {max(r[5] for r in self.rows):.3g}; first {limit}:"]
        lines += [f"    {label}: slot {s} row {j} (batch row {r}): {d} logits differ, "
                  f"max |diff| {m:.3g}" for label, s, j, r, d, m in self.rows[:limit]]
        return "\n".join(lines)


class Probe:
    """``with Probe() as p:`` the model's blocks (attention / GDN and MLP of every layer) and
    the ops inside them (products, norms, paged attention, the GDN kernels, routing, routed
    experts) append (name, host output) to ``p.records`` in call order. Every record's first
    axis is the pass's rows, so one row's records alone line up with its rows in a batch."""

    def __init__(self) -> None:
        self.records: list[tuple[str, np.ndarray]] = []
        self._saved: list[tuple[object, str, object]] = []

    def __enter__(self) -> Probe:
        targets = [(model_module, name, name) for name in BLOCKS]
        targets += [(Ops, "linear", "linear"), (Ops, "rms_norm", "rms_norm"),
                    (Ops, "gated_rms_norm", "gated rms_norm"),
                    (attention, "_paged", "paged attention"),
                    (gdn_recurrent, "conv_silu", "GDN conv"),
                    (gdn_recurrent, "recurrence", "GDN recurrence"),
                    (moe, "route", "router"), (moe, "experts_local", "routed experts")]
        for owner, attr, label in targets:
            fn = owner.__dict__[attr]
            self._saved.append((owner, attr, fn))
            setattr(owner, attr, self._wrap(label, fn))
        return self

    def __exit__(self, *exc) -> None:
        for owner, attr, fn in reversed(self._saved):
            setattr(owner, attr, fn)

    def _wrap(self, name: str, fn):
        def recorded(*args, **kwargs):
            out = fn(*args, **kwargs)
            parts = out if isinstance(out, tuple) else (out,)
            for i, part in enumerate(parts):  # the router: ids, then weights
                self.records.append((name + (f"[{i}]" if len(parts) > 1 else ""),
                                     to_numpy(part).copy()))
            return out

        return recorded


def first_differing_record(layout_records: list[tuple[str, np.ndarray]], rows: slice,
                           alone: list[list[tuple[str, np.ndarray]]]) -> str:
    """The first op or block whose output rows ``rows`` (a slot's rows in the layout's pass)
    differ from its output when each row ran alone (``alone[j]``: the records of row j's own
    pass). Everything recorded before it was equal, so this op depends on the batch."""
    blocks, total = 0, sum(name in BLOCKS for name, _ in layout_records)
    for c, (name, out) in enumerate(layout_records):
        names = {rec[c][0] if c < len(rec) else None for rec in alone}
        if names != {name}:
            return f"record #{c}: {name} in the batch but {names} alone (different op sequence)"
        want = np.stack([rec[c][1][0] for rec in alone])
        got = out[rows]
        if got.tobytes() != want.tobytes():
            bad = [j for j in range(len(alone)) if got[j].tobytes() != want[j].tobytes()]
            where = (f"in layer {blocks // 2}'s {'MLP' if blocks % 2 else 'attention / GDN'}"
                     if blocks < total else "after the last layer: final norm / lm_head")
            return (f"first differing output: record #{c} {name} ({where}), chain rows {bad}: "
                    f"{first_difference(got, want)}")
        blocks += name in BLOCKS
    return "every recorded output is equal: the difference is in the logit row gather"
