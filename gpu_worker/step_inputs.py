"""The inputs of one forward pass that the host builds: made before the pass runs, so that the
pass itself never uploads anything (the condition for capturing it in a CUDA graph,
gpu_worker/step_graph.py; docs/gpu_step.md "What stood between the step and a CUDA graph").

:func:`host_inputs` computes them as NumPy arrays (and does the host work that goes with them:
KV blocks reserved and copied on write, the GDN per-row buffers allocated); :func:`upload`
puts them on the backend (a graph copies them into its static buffers instead);
:func:`step_inputs` wraps the device arrays for ``Model.forward``. Eager and graph passes run
the same host and wrapping code. :class:`StaticInputs` holds a graph's copies (step_graph.py,
mtp_graph.py).
"""

from __future__ import annotations

import dataclasses
import weakref

import numpy as np

from gpu_worker.kernels.enabled import enabled
from gpu_worker.model.attention import StepMeta, step_meta, step_meta_host
from gpu_worker.model.batch import RaggedBatch
from gpu_worker.model.ops import Array


@dataclasses.dataclass(frozen=True)
class DeviceRouting:
    """A synthetic model's routing of one batch, computed for every MoE layer before the pass
    (a :class:`gpu_worker.weights.routing.RowRouting` whose ids are already on the backend)."""

    by_layer: dict[int, Array]  # layer index -> int64 [R, k]

    def ids(self, layer: int) -> Array:
        return self.by_layer[layer]


@dataclasses.dataclass(frozen=True)
class StepInputs:
    """What ``Model.forward`` reads instead of uploading: every array on the backend."""

    tokens: Array  # int64 [R]
    positions: Array  # int64 [R]
    logit_rows: Array  # int64 [n]: rows whose logits the pass returns
    meta: StepMeta | None  # the paged-attention kernels' metadata (CuPy, kernel on)
    routing: DeviceRouting | KernelRouting | None  # synthetic models: each row's experts
    # bool [R]: False on a padded pass's padding rows, which pick no routed expert
    # (gpu_worker/graph_buckets.py); None: every row is live
    live: Array | None = None


def host_inputs(model, caches, batch: RaggedBatch, logit_rows: np.ndarray,
                track_buffers: tuple | None = None) -> dict[str, np.ndarray]:
    """The pass's inputs on the host, by name. Reserves the segments' KV blocks (and copies
    shared ones) where the paged kernels run, and, in a verifying pass, allocates the GDN
    per-row buffers (or reuses ``track_buffers``, the (conv, rec) pair a graph holds)."""
    host = {"tokens": np.ascontiguousarray(batch.tokens, np.int64),
            "positions": np.ascontiguousarray(batch.positions, np.int64),
            "logit_rows": np.ascontiguousarray(logit_rows, np.int64)}
    if model.xp is not np and enabled("paged_attention") and caches.kv.num_layers:
        host["attn"] = step_meta_host(caches.kv, batch)
    if caches.states is not None:
        host["gdn"] = caches.states.table_host(batch.segments, track_buffers)
    if model.routing is not None:
        bound = model.routing.bind_batch(batch)
        if model.xp is np:  # every MoE layer's picks in one vectorised call
            host["routing"] = bound.model.choose_layers(_moe_layers(model), bound.keys,
                                                        bound.positions)
        else:  # the rows' routing keys: the kernel picks on the device (KernelRouting)
            host["row_keys"] = bound.keys
    return host


def upload(xp, host: dict[str, np.ndarray]) -> dict[str, Array]:
    """``host`` on the backend, new arrays (a graph refills its own buffers instead:
    gpu_worker/step_graph.py ``StaticInputs``)."""
    return {name: xp.asarray(a) for name, a in host.items()}


def step_inputs(model, caches, batch: RaggedBatch, dev: dict[str, Array],
                max_position: int | None = None) -> StepInputs:
    """The :class:`StepInputs` over the device arrays of :func:`upload`; makes the GDN
    segment table the one the pass's layers read. ``max_position``: see
    gpu_worker/model/attention.py ``step_meta``."""
    meta = (step_meta(caches.kv, batch, dev["attn"], max_position) if "attn" in dev
            else None)
    if "gdn" in dev:
        caches.states.install_table(batch.segments, dev["gdn"])
    routing = None
    if "routing" in dev:
        routing = DeviceRouting({index: dev["routing"][i]
                                 for i, index in enumerate(_moe_layers(model))})
    elif "row_keys" in dev:
        routing = KernelRouting(_routing_tables(model), dev["row_keys"], dev["positions"])
    return StepInputs(dev["tokens"], dev["positions"], dev["logit_rows"], meta, routing,
                      dev.get("live"))


def _moe_layers(model) -> list[int]:
    return [layer.index for layer in model.layers if layer.sparse]


_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _routing_tables(model):
    """The model's routing tables on the device (made at its first pass: after the load,
    which renumbers a split placement's experts)."""
    tables = _TABLES.get(model)
    if tables is None:
        from gpu_worker.kernels.synthetic_routing import DeviceRoutingTables  # noqa: PLC0415

        tables = _TABLES[model] = DeviceRoutingTables(model.routing, _moe_layers(model))
    return tables


class KernelRouting:
    """A synthetic model's routing of one pass, computed on the device by one launch for
    every MoE layer the first time a layer asks (inside the pass: a CUDA graph captures it)."""

    def __init__(self, tables, keys: Array, positions: Array) -> None:
        self.tables, self.keys, self.positions = tables, keys, positions  # int64 [R] each
        self._ids = None

    def ids(self, layer: int) -> Array:
        if self._ids is None:
            self._ids = self.tables.choose(self.keys, self.positions)  # [L, R, k]
        return self._ids[self.tables.index[layer]]


class StaticInputs:
    """A graph's input buffers as views into one device buffer, refilled from one pinned
    staging buffer by one copy per replay (instead of one small copy per input)."""

    ALIGN = 16

    def __init__(self, cp, host: dict[str, np.ndarray]) -> None:
        self.layout, size = {}, 0
        for name, a in host.items():
            self.layout[name] = (size, a.shape, a.dtype)
            size += -(-a.nbytes // self.ALIGN) * self.ALIGN
        size = max(size, self.ALIGN)
        self.device = cp.empty(size, cp.uint8)
        self.staging = np.frombuffer(cp.cuda.alloc_pinned_memory(size), np.uint8, size)
        self.arrays = {name: self._view(self.device, name) for name in self.layout}

    def _view(self, buf, name: str):
        off, shape, dtype = self.layout[name]
        n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        return buf[off:off + n].view(dtype).reshape(shape)

    def fill(self, host: dict[str, np.ndarray], stream) -> None:
        """``host`` (the names, shapes and dtypes the buffers were made for) into the
        device buffer, one copy on ``stream``. The staging buffer is reused only after the
        replay that read it (each replay ends with a wait for its outputs)."""
        if host.keys() != self.layout.keys():
            raise ValueError(f"inputs {sorted(host)} do not match {sorted(self.layout)}")
        for name, a in host.items():
            dst = self._view(self.staging, name)
            if dst.shape != a.shape or dst.dtype != a.dtype:
                raise ValueError(f"input {name}: {a.dtype} {a.shape} into {dst.dtype} "
                                 f"{dst.shape}")
            dst[...] = a
        self.device.set(self.staging, stream=stream)
