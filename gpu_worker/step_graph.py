"""CUDA graphs of the decode and verify passes (CuPy): the forward and the device sampler of a
pass replayed as one launch instead of thousands from Python.

A graph is captured per *layout* (rows of each segment, logits rows, drafts per slot: what
fixes every launch's shape; with capacity buckets, a pass between two buckets is padded up
to the larger one and keyed by it, gpu_worker/graph_buckets.py) the second time the layout
runs; the first run is eager (padded where the graph will be) and compiles whatever kernel
the layout needs (the decode layouts run both before serving:
``Runner.warm_graphs``). What varies between steps of one layout (token ids, positions,
slots, block tables, sampling parameters, drafts, a synthetic model's rows) lives in static
device buffers filled from :mod:`gpu_worker.step_inputs`'s host arrays before each replay;
the paged-attention grid covers the context limit, which does not change any row's bits
(gpu_worker/model/attention.py). Everything a graph allocates comes from a memory pool of its
own, shared by the graphs (they never run at the same time); a graph keeps its input buffers
and sampled tokens, and all graphs share one set of logits, hidden rows and GDN per-row
buffers (the memory plan counts them: memory_parts.graph_bytes). Eager passes stay
available: ``[model] cuda_graphs = false``.

CPU experts on the launched path are captured too: their ring kernels are stream work, and
their sequence numbers and distinct-expert tags become offsets from bases the replay writes
(gpu_worker/experts/pinned_ring.py); the workers' device session opens before the replay
and closes after it, as around an eager forward. With per-slot expert tracking (the adaptive
draft budget) the routes a capture copies stay the graph's buffers, read after each replay
(gpu_worker/experts/counters.py).

Not taken (eager, the reason logged once at start or counted per pass): CPU experts on the
host path, draft overlap, prompt rows, segments over the paged kernel's 16 rows, the kernels
switched off, vocabularies the device sampler does not take. The MTP head's drafting after a
pass has graphs of its own (gpu_worker/mtp_graph.py, ``StepGraphs.mtp``).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from gpu_worker import graph_buckets
from gpu_worker.graph_table import FIRST, REFUSED, GraphTable
from gpu_worker.kernels import sampler
from gpu_worker.kernels.enabled import enabled
from gpu_worker.memory_parts import (
    GRAPH_OUTPUT_ROWS_PER_SLOT,
    GRAPH_POOL_RESERVE,
    graph_output_rows,
)
from gpu_worker.model.attention import PAGED_MAX_ROWS
from gpu_worker.model.batch import RaggedBatch
from gpu_worker.model.model import Caches, ForwardOut, Model
from gpu_worker.mtp_graph import MtpGraphs
from gpu_worker.step_inputs import StaticInputs, host_inputs, step_inputs, upload
from gpu_worker.verify import picks, sampling_inputs
from protocol.messages import SlotWork, WorkKind
from protocol.worker_config import MAX_WIDE_SLOTS, WIDE_CAPACITIES

MAX_GRAPHS = 48  # layouts kept; the least recently used one goes first
MODEL_INPUTS = ("tokens", "positions", "logit_rows", "attn", "gdn", "routing", "row_keys",
                "live")


def graphs_status(wanted: bool, model: Model, experts) -> tuple[bool, str]:
    """Whether passes may take CUDA graphs, and why (logged once by the worker)."""
    if not wanted:
        return False, "model.cuda_graphs = false"
    if model.xp is np:
        return False, "the numpy backend has no CUDA graphs"
    if model.ops.dtype != np.float32:
        return False, f"compute dtype {model.ops.dtype} (graphs: float32 or bfloat16)"
    off = [k for k in ("rowtile", "paged_attention", "gdn") if not enabled(k)]
    if off:
        return False, f"GPU kernels switched off: {', '.join(off)}"
    reason = None if experts is None else getattr(
        experts, "graph_reason", lambda: f"routed experts {type(experts).__name__} (no graphs)")()
    if reason is not None:
        return False, reason
    if model.cfg.vocab_size > sampler.MAX_VOCAB:
        return False, (f"vocabulary {model.cfg.vocab_size} > the device sampler's "
                       f"{sampler.MAX_VOCAB}")
    return True, "decode and verify passes"


def layout_key(work: list[SlotWork], batch: RaggedBatch, rows, first: dict[int, int]) -> tuple:
    """What fixes every launch's shape of a pass (a graph is captured per key): its rows,
    slots (segments), logits rows, drafts in all and which slots sample. Not how the rows
    split among the slots: every per-row and per-segment fact (slot, position, segment
    starts and lengths, each slot's first logits row and drafts) is an input the kernels
    read on the device, so a graph replays for any split of its rows (for 4 slots of 1-5
    rows, 40 layouts instead of the 118 multisets of slot shapes)."""
    return (batch.num_rows, len(batch.segments), len(rows),
            sum(len(w.draft_ids) for w in work), tuple(w.slot in first for w in work))


def pass_key(work: list[SlotWork], batch: RaggedBatch, rows, first: dict[int, int],
             buckets: bool) -> tuple:
    """A pass's graph key: with ``buckets``, its capacity bucket's where the pass is padded
    up to one (gpu_worker/graph_buckets.py), else :func:`layout_key`."""
    if buckets and graph_buckets.padding(batch, rows):
        return graph_buckets.key(batch.num_rows, len(batch.segments))
    return layout_key(work, batch, rows, first)


def takes(work: list[SlotWork], batch: RaggedBatch) -> bool:
    """Whether one pass can replay a graph: decode (and verify) rows only, short segments."""
    return all(w.kind == WorkKind.DECODE for w in work) and all(
        s.num <= PAGED_MAX_ROWS for s in batch.segments)


@dataclasses.dataclass
class _Graph:
    graph: object  # cupy.cuda.Graph
    inputs: StaticInputs  # the buffers each replay refills
    out: object  # int32 [n + S]: sampled tokens, accepted drafts per sampled slot
    logits: object
    hidden: object
    experts: tuple | None  # the placement's token (ExpertPlacement.before_replay)


class StepGraphs:
    """The graphs of one runner's caches; :meth:`run` executes a pass through one, or
    returns None for the caller to run it eagerly."""

    def __init__(self, model: Model, caches: Caches, *, max_slots: int, max_context: int,
                 experts=None, max_graphs: int = MAX_GRAPHS, max_drafts: int = 0,
                 wide: bool = True, scratch: int | None = None) -> None:
        import cupy as cp  # noqa: PLC0415

        self.cp, self.model, self.caches = cp, model, caches
        self.experts = experts  # an ExpertPlacement on the launched path, or None
        self.max_position = max_context - 1
        self.max_slots = max_slots
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.pool = cp.cuda.MemoryPool()
        with cp.cuda.using_allocator(self.pool.malloc):
            cp.empty(GRAPH_POOL_RESERVE, cp.uint8)  # freed at once: the pool keeps it
        # the capacity buckets' padding rows (graph_buckets.py): this slot's, never the
        # daemon's; its KV blocks taken now (the highest ids), no GDN state
        self.scratch = scratch
        if scratch is not None:
            caches.kv.ensure(scratch, graph_buckets.MAX_PAD, last=True)
        # fixed rows: the address never moves
        caches.kv.device_tables(min_rows=max_slots if scratch is None else scratch + 1)
        # since start (benchmarks diff them); take_counts gives the part since its last call
        self.totals = {"graph_captures": 0, "graph_replays": 0, "graph_refused": 0,
                       "graph_first_runs": 0, "graph_capture_ms": 0.0,
                       "mtp_graph_captures": 0, "mtp_graph_replays": 0,
                       "mtp_graph_refused": 0, "mtp_graph_first_runs": 0,
                       "padding_rows": 0}  # rows padded passes ran past their own
        self._taken = dict(self.totals)
        self.table = GraphTable(self.totals, "graph_", max_graphs)
        self.graphs, self.refused = self.table.graphs, self.table.refused
        # the GDN per-row buffers of verifying passes, one pair for every graph (a verify
        # step's rows x 75 MiB each for the 80B: a pair per graph would not fit); when a
        # pass needs more rows they grow and the graphs that hold the old ones are dropped
        self.track: tuple | None = None
        # the passes' logits and final hidden rows, one pair for every graph too (a graph
        # copies its outputs there; read before the next pass runs); grown like track
        self.outputs: tuple | None = None
        self.on_launch = None  # called right after each graph launch (benchmarks' host time)
        self.mtp = MtpGraphs(self)  # the MTP head's drafting (gpu_worker/mtp_graph.py)
        # both made as big as the daemon's passes can need (the memory plan counts them):
        # growing them later would drop every graph, the ones captured at start-up too
        self._make_outputs(graph_output_rows(max_slots, max_drafts, scratch is not None))
        states = caches.states
        if max_drafts and states is not None and states.num_layers:
            tracked = 1 + max_drafts  # narrow: a drafted slot alone
            if wide:
                tracked = min(min(max_slots, MAX_WIDE_SLOTS) * tracked, WIDE_CAPACITIES[-1])
            self.track = states.track_buffers(tracked)

    def take_counts(self) -> tuple[dict[str, int], dict[str, float]]:
        """Since the last call: (captures, replays and refusals, with the graphs held now;
        ``{"graph_capture": ms}``), the step result's counters (ints: the wire checks) and
        timings."""
        out = {k: v - self._taken[k] for k, v in self.totals.items()}
        self._taken = dict(self.totals)
        ms = out.pop("graph_capture_ms")
        return ({k: int(v) for k, v in out.items()} | {"graphs": len(self.graphs)},
                {"graph_capture": float(ms)})

    def run(self, work: list[SlotWork], batch: RaggedBatch, rows: np.ndarray,
            first: dict[int, int]) -> tuple[ForwardOut, list[tuple[list[int], int]]] | None:
        """The pass (forward, sampling, draft matching) through its layout's graph, captured
        now if the layout ran before; None: run it eagerly (nothing was done)."""
        key = pass_key(work, batch, rows, first, self.scratch is not None)
        padded = key[0] == "bucket"
        if padded:  # the bucket's graph, the padding on the scratch slot
            batch, rows, live = graph_buckets.pad(batch, rows, self.scratch,
                                                  key[1] - batch.num_rows)
        state, g = self.table.lookup(key)
        if state == REFUSED or (state == FIRST and not padded):
            return None  # eager; a first run compiles what the layout needs
        model, caches = self.model, self.caches
        if self._grow_shared(batch):
            g = None  # dropped with the others: captured again below
        host = host_inputs(model, caches, batch, rows, self.track)
        host.update(sampling_inputs(work, len(rows), first))
        if padded:
            host["live"] = live
            self.totals["padding_rows"] += int((~live).sum())  # this pass runs them
            graph_buckets.pad_drafts(host, batch.num_rows)
            if self.experts is not None:  # the padding rows: no slot's
                self.experts.track_padding(batch.num_rows)
        if state == FIRST:  # a padded pass's first run: eager, padded, as its graph will run
            return self._eager(work, batch, rows, first, host)
        caches.kv.device_tables()  # table rows that changed: before the graph reads them
        if g is None:
            g = self._capture(key, host, batch)
            if g is None:  # refused: this pass eagerly, from the inputs made above
                return self._eager(work, batch, rows, first, host)
        if self.experts is not None:  # the ring's session and this replay's bases
            self.experts.before_replay(g.experts, self.stream)
        self.follow_main()
        g.inputs.fill(host, self.stream)
        step_inputs(model, caches, batch, _model_part(g.inputs.arrays), self.max_position)
        try:
            g.graph.launch(stream=self.stream)
            if self.on_launch is not None:
                self.on_launch()
            out = g.out.get(stream=self.stream)  # waits for the graph
        finally:
            if self.experts is not None:  # raises what a worker reported, as run_step does
                self.experts.end_step()
        self.totals["graph_replays"] += 1
        return ForwardOut(g.logits, g.hidden), picks(work, first, out, len(rows))

    def follow_main(self) -> None:
        """The graph stream waits for the main stream's work so far (cache commands, table
        rows, the pass a drafting graph reads)."""
        ready = self.cp.cuda.Event(disable_timing=True)
        ready.record(self.cp.cuda.get_current_stream())
        self.stream.wait_event(ready)

    def _grow_shared(self, batch: RaggedBatch) -> bool:
        """Make the shared buffers big enough for ``batch`` (outputs for its rows, GDN
        per-row buffers for its tracked rows); growing one drops every graph, which holds
        the old addresses. Whether that happened."""
        caches = self.caches
        R = batch.num_rows  # >= its logits rows
        need = 0 if caches.states is None else caches.states.tracked_rows(batch.segments)
        grow_track = need and (self.track is None or self.track[0].shape[1] < need)
        grow_out = self.outputs is None or self.outputs[0].shape[0] < R
        if not (grow_track or grow_out):
            return False
        self.graphs.clear()
        if grow_track:
            self.track = None  # freed before the bigger pair is made
            self.track = caches.states.track_buffers(need)
        if grow_out:
            self._make_outputs(max(R, GRAPH_OUTPUT_ROWS_PER_SLOT * self.max_slots))
        return True

    def _make_outputs(self, rows: int) -> None:
        cp, cfg = self.cp, self.model.cfg
        self.outputs = None  # freed before the bigger pair is made
        with cp.cuda.using_allocator(self.pool.malloc):
            self.outputs = (cp.empty((rows, cfg.vocab_size), cp.float32),
                            cp.empty((rows, cfg.hidden_size), cp.float32))

    def _capture(self, key: tuple, host: dict[str, np.ndarray], batch: RaggedBatch
                 ) -> _Graph | None:
        cp, model, caches, experts = self.cp, self.model, self.caches, self.experts
        t0 = time.perf_counter()
        token = None
        try:
            if experts is not None:
                experts.begin_capture()
            with cp.cuda.using_allocator(self.pool.malloc):
                packed = StaticInputs(cp, host)
                static = packed.arrays
                n, S = host["logit_rows"].size, host["row0"].size
                out = cp.empty(n + S, cp.int32)
                packed.fill(host, self.stream)  # this step's: see _record

                logits_out = self.outputs[0][:n]
                hidden_out = self.outputs[1][:batch.num_rows]

                def body() -> tuple:
                    # the inputs as views of the static buffers (host objects, no launch)
                    inputs = step_inputs(model, caches, batch, _model_part(static),
                                         self.max_position)
                    fwd = model.forward(batch, caches, None, experts, inputs=inputs)
                    sampler.sample_and_match_device(fwd.logits, static["fp"], static["ip"],
                                                    static, out)
                    logits_out[...] = fwd.logits  # the shared outputs: the pass's own are
                    hidden_out[...] = fwd.hidden  # temporaries of the graphs' pool
                    return logits_out, hidden_out, out

                graph, (logits, hidden, _) = self._record(body)
        except Exception as e:  # noqa: BLE001 -- any failure: this layout stays eager
            self.table.refuse(key, e)
            return None
        finally:
            if experts is not None:  # nothing ran: close the capture's ring session
                token = experts.end_capture()
        return self.table.keep(key, _Graph(graph, packed, out, logits, hidden, token), t0)

    def _record(self, body):
        """``body()`` captured on the graph stream: (the graph, what body returned). Nothing
        runs. The static inputs hold this step's values already, so a stand-in that runs
        ``body`` instead (tests on the CPU emulator, which has no graphs) computes this step;
        it must then undo that run, as capture leaves memory untouched."""
        cp = self.cp
        relaxed = getattr(cp.cuda.runtime, "streamCaptureModeRelaxed", None)
        with self.stream:
            if relaxed is None:
                self.stream.begin_capture()
            else:
                self.stream.begin_capture(mode=relaxed)
            try:
                outs = body()
            finally:
                graph = self.stream.end_capture()
        return graph, outs

    def _eager(self, work, batch, rows, first, host):
        """A pass whose capture was refused, from the inputs already made for it."""
        cp, model, caches = self.cp, self.model, self.caches
        dev = upload(cp, host)

        def forward() -> ForwardOut:
            return model.forward(batch, caches, None, self.experts,
                                 inputs=step_inputs(model, caches, batch, _model_part(dev)))

        fwd = forward() if self.experts is None else self.experts.run_step(forward)
        out = cp.empty(len(rows) + dev["row0"].size, cp.int32)
        sampler.sample_and_match_device(fwd.logits, dev["fp"], dev["ip"], dev, out)
        return fwd, picks(work, first, out.get(), len(rows))


def _model_part(arrays: dict) -> dict:
    return {k: v for k, v in arrays.items() if k in MODEL_INPUTS}
