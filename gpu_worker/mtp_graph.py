"""The MTP head's drafting as one CUDA graph (CuPy): the head's pass over a step's committed
rows and every chained draft pass after it, with the argmax between them on the device, so a
step's k drafts cost one launch and one copy of k x slots ids instead of k eager passes of
Python-launched kernels and k waits for the host (gpu_worker/mtp_drafter.py is the eager
drafter; its bits are these).

A graph is kept per (first pass's rows, slots, drafts per slot); with capacity buckets the
first pass is padded up to its bucket on the scratch slot (gpu_worker/graph_buckets.py: rows
that pick no routed expert and write only the scratch slot's KV blocks), so its rows are the
bucket's. Every input the host knows (positions, the paged-attention metadata of each pass,
with its KV blocks reserved, the tokens of the first pass and its logits rows) is packed into
static buffers and copied in one go before the replay; the first pass's hidden rows are
copied on the device; the chained passes' tokens are the previous pass's argmax, never on the
host. A synthetic model's head routes by the routing kernel (the host's routing model, bit for
bit: gpu_worker/kernels/synthetic_routing.py) from each row's key and position. A layout runs
eagerly the first time (that compiles its kernels) and is captured the second. Not taken
(eager): slots whose draft counts differ or are 0, a slot that drafts nothing after its rows
(a prompt chunk), a first pass past the largest bucket, draft overlap.
"""

from __future__ import annotations

import dataclasses
import time
import weakref

import numpy as np

from gpu_worker import graph_buckets
from gpu_worker.graph_table import FIRST, REFUSED, GraphTable
from gpu_worker.model.attention import step_meta, step_meta_host
from gpu_worker.model.batch import RaggedBatch
from gpu_worker.mtp_drafter import Drafts, HeadWork
from gpu_worker.step_inputs import KernelRouting, StaticInputs, StepInputs

MAX_MTP_GRAPHS = 64  # layouts kept (the warm-up makes <= 40); the least recently used goes first
_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _routing_tables(model):
    """A synthetic model's routing tables of its MTP layer on the device (None: the model
    routes by its routers)."""
    if model.routing is None:
        return None
    tables = _TABLES.get(model)
    if tables is None:
        from gpu_worker.kernels.synthetic_routing import DeviceRoutingTables  # noqa: PLC0415

        tables = _TABLES[model] = DeviceRoutingTables(model.routing, [model.mtp_layer.index])
    return tables


@dataclasses.dataclass
class _MtpGraph:
    graph: object  # cupy.cuda.Graph
    inputs: object  # step_graph.StaticInputs
    hidden: object  # [rows, H]: the first pass's hidden rows, copied in before each replay
    drafts: object  # int64 [slots, k]


class MtpGraphs:
    """The MTP graphs of one :class:`gpu_worker.step_graph.StepGraphs` (its memory pool,
    stream, scratch slot and counters)."""

    def __init__(self, owner) -> None:
        self.owner = owner
        self.table = GraphTable(owner.totals, "mtp_graph_", MAX_MTP_GRAPHS)
        self.enabled = True  # False: every drafting eager (benchmarks compare the two)

    def run(self, head: HeadWork) -> Drafts | None:
        """The drafts of ``head`` through its layout's graph (captured now if the layout
        ran before); None: run it eagerly (nothing was done)."""
        owner = self.owner
        layout = self._layout(head) if self.enabled else None
        if layout is None:
            return None
        key, batch, live, k = layout
        state, g = self.table.lookup(key)
        if state in (REFUSED, FIRST):
            return None  # eager; a first run compiles what the layout needs
        host, chain = self._host(head, batch, live, k)
        owner.caches.kv.device_tables()  # table rows that changed: before the graph reads them
        if g is None:
            g = self._capture(key, host, batch, chain, k, head.hidden.shape[1])
            if g is None:
                return None
        owner.follow_main()  # the pass's hidden rows, table rows
        g.inputs.fill(host, owner.stream)
        with owner.stream:
            g.hidden[:head.hidden.shape[0]] = head.hidden
        g.graph.launch(stream=owner.stream)
        drafts = g.drafts.get(stream=owner.stream)  # waits for the graph
        owner.totals["mtp_graph_replays"] += 1
        return {s: [int(t) for t in drafts[i]] for i, s in enumerate(head.want)}

    def _layout(self, head: HeadWork) -> tuple | None:
        """(key, the first pass's batch as the graph runs it, its live mask or None, drafts
        per slot), or None where the graph does not take ``head``."""
        owner = self.owner
        batch = head.batch
        limits = set(head.limit.values())
        if (len(limits) != 1 or min(limits) < 1
                or head.want != [seg.slot for seg in batch.segments]):
            return None
        k, R, S = limits.pop(), batch.num_rows, len(batch.segments)
        b = graph_buckets.bucket(R)  # at most the largest bucket's rows, padded or not
        if b is None:
            return None
        live = None
        if owner.scratch is not None and b > R:
            batch, _, live = graph_buckets.pad(batch, np.arange(R), owner.scratch, b - R)
        return ("mtp", batch.num_rows, S, k), batch, live, k

    def _host(self, head: HeadWork, batch: RaggedBatch, live, k: int
              ) -> tuple[dict[str, np.ndarray], list[RaggedBatch]]:
        """The graph's host inputs (reserving the passes' KV blocks, as eager passes do) and
        the chained passes' batches (their tokens are the graph's, not these zeros)."""
        kv, routing = self.owner.caches.kv, self.owner.model.routing
        host = {"tokens": np.ascontiguousarray(batch.tokens, np.int64),
                "positions": np.ascontiguousarray(batch.positions, np.int64),
                "logit_rows": np.ascontiguousarray(head.last_rows, np.int64),
                "attn": step_meta_host(kv, batch),
                "chain_rows": np.arange(len(head.want), dtype=np.int64)}
        if live is not None:
            host["live"] = live
        if routing is not None:  # each row's routing key (its segment's)
            host["row_keys"] = routing.bind_batch(batch).keys
        chain = []
        for j in range(1, k):
            step = RaggedBatch.build([(s, head.last_pos[s] + j, [0]) for s in head.want],
                                     head.keys)
            host[f"positions{j}"] = np.ascontiguousarray(step.positions, np.int64)
            host[f"attn{j}"] = step_meta_host(kv, step)
            if routing is not None:
                host[f"row_keys{j}"] = routing.bind_batch(step).keys
            chain.append(step)
        return host, chain

    def _capture(self, key: tuple, host: dict[str, np.ndarray], batch: RaggedBatch,
                 chain: list[RaggedBatch], k: int, width: int) -> _MtpGraph | None:
        owner = self.owner
        cp, model, caches = owner.cp, owner.model, owner.caches
        kv, top = caches.kv, owner.max_position
        tables = _routing_tables(model)
        t0 = time.perf_counter()
        try:
            with cp.cuda.using_allocator(owner.pool.malloc):
                packed = StaticInputs(cp, host)
                a = packed.arrays
                hidden = cp.zeros((batch.num_rows, width), cp.float32)
                drafts = cp.empty((host["logit_rows"].size, k), cp.int64)
                packed.fill(host, owner.stream)  # this step's: see StepGraphs._record

                def routing(keys: str, positions: str):
                    return (None if tables is None else
                            KernelRouting(tables, a[keys], a[positions]))

                def body() -> tuple:
                    first = StepInputs(a["tokens"], a["positions"], a["logit_rows"],
                                       step_meta(kv, batch, a["attn"], top),
                                       routing("row_keys", "positions"), a.get("live"))
                    out = model.mtp_forward(batch, hidden, caches, inputs=first)
                    tokens = out.logits.argmax(axis=-1)
                    drafts[:, 0] = tokens
                    h = out.hidden[a["logit_rows"]]
                    for j, step in enumerate(chain, start=1):
                        inputs = StepInputs(tokens, a[f"positions{j}"], a["chain_rows"],
                                            step_meta(kv, step, a[f"attn{j}"], top),
                                            routing(f"row_keys{j}", f"positions{j}"))
                        out = model.mtp_forward(step, h, caches, inputs=inputs)
                        tokens = out.logits.argmax(axis=-1)
                        drafts[:, j] = tokens
                        h = out.hidden
                    return (drafts,)

                graph, _ = owner._record(body)
        except Exception as e:  # noqa: BLE001 -- any failure: this layout stays eager
            self.table.refuse(key, e)
            return None
        return self.table.keep(key, _MtpGraph(graph, packed, hidden, drafts), t0)
