"""The floor of one decode/verify step: the bytes it must read and the time they take.

    floor = max(GPU bytes / HBM rate, distinct CPU-expert bytes / DRAM rate)

(the definition every step-time figure of Tandem stands next to, docs/benchmarks.md "Step
time vs floor"). GPU bytes: the resident weights the step reads once (every layer's
attention / GDN projections, norms, routers, shared experts, dense MLPs, the final norm, the
lm_head and the embedding rows it looks up; not the MTP head, which a step without MTP
drafts does not run), the KV positions and GDN states it reads, and each distinct GPU expert
the step routes to, once. CPU bytes: each distinct CPU expert, once, in the CPU workers'
format. Writes (KV rows, new states) and host<->device transfers are not counted.

Everything here is counted from the model's own arrays (what the worker actually holds, in
its storage dtype), so the floor follows the placement and the weight format in use.
:class:`StepRouting` records the expert ids a step routes to, per MoE layer; :func:`table`
and :func:`merge` are the report of scripts/bench_step.py's records.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from gpu_worker.model.model import is_stack

HBM_TBS = 4.2  # H200 HBM, TB/s (BENCHMARKS: 4.23 TB/s device-to-device copy)
CPU_BENCH = Path(__file__).resolve().parents[1] / "docs" / "bench" / "cpu_experts_h200.json"
FALLBACK_DRAM_GBS = 101.8  # that file's int8 1-row kernel rate at the 80B's expert shape
T = TypeVar("T")


def _nbytes(arrays: dict[str, Any], experts: bool) -> int:
    """Bytes of a layer dict's arrays: the routed expert stacks (``experts.*``) or the rest
    (an input stack counted once, through its parts' views: model.stack_inputs)."""
    return sum(int(a.nbytes) for k, a in arrays.items()
               if k.startswith("experts.") == experts and hasattr(a, "nbytes")
               and not is_stack(k))


def dense_read_bytes(model: Any, rows: int) -> int:
    """Resident non-expert weight bytes a step of ``rows`` rows reads: every layer's
    attention or GDN and MLP arrays but the routed experts, both norms, the final norm, the
    lm_head, and ``rows`` rows of the embedding (a tied lm_head already reads the table)."""
    total = sum(_nbytes(layer.attn, False) + _nbytes(layer.mlp, False)
                + int(layer.input_norm.nbytes) + int(layer.post_norm.nbytes)
                for layer in model.layers)
    total += int(model.final_norm.nbytes) + int(model.lm_head.nbytes)
    if model.lm_head is not model.embed:
        total += rows * int(model.embed.nbytes) // int(model.embed.shape[0])
    return total


def gpu_expert_bytes(model: Any) -> dict[int, float]:
    """Per MoE layer: bytes of one expert the backend holds (all arrays of its stacks, scales
    included, over the stack's experts); 0 where the backend holds none."""
    out = {}
    for i, layer in enumerate(model.layers):
        if not layer.sparse:
            continue
        stacks = [a for k, a in layer.mlp.items() if k.startswith("experts.")]
        held = int(stacks[0].shape[0]) if stacks else 0  # every stack is [held experts, ...]
        out[i] = _nbytes(layer.mlp, True) / held if held else 0.0
    return out


def kv_state_read_bytes(caches: Any, full_layers: int, slots: list[tuple[int, int]]) -> int:
    """KV and GDN-state bytes the step reads: per slot of ``(context, rows)``, K and V of
    ``context + rows`` positions in each of the ``full_layers`` full-attention layers (the
    union of what its rows attend to), and the slot's GDN states once (conv windows and
    delta-rule states of every GDN layer)."""
    kv = caches.kv
    per_position_layer = kv.nbytes / (kv.num_layers * kv.num_blocks * kv.block_size)
    positions = sum(c + r for c, r in slots)
    state = caches.states.bytes_per_slot if caches.states is not None else 0
    return int(round(positions * full_layers * per_position_layer)) + len(slots) * state


def floor_ms(gpu_bytes: float, cpu_bytes: float, hbm_tbs: float = HBM_TBS,
             dram_gbs: float = FALLBACK_DRAM_GBS) -> dict[str, float]:
    """``gpu_floor_ms`` = GPU bytes / HBM rate, ``cpu_floor_ms`` = CPU bytes / DRAM rate,
    ``floor_ms`` the larger (decimal units: TB/s = 1e12 B/s, GB/s = 1e9 B/s)."""
    gpu = gpu_bytes / (hbm_tbs * 1e12) * 1e3
    cpu = cpu_bytes / (dram_gbs * 1e9) * 1e3
    return {"gpu_floor_ms": gpu, "cpu_floor_ms": cpu, "floor_ms": max(gpu, cpu)}


def default_dram_gbs(path: Path = CPU_BENCH) -> tuple[float, str]:
    """The CPU experts' DRAM rate for the floor and where it comes from: the kernel rate
    (``kernel_gbps``) of ``path``'s in-process int8 pool run at the 80B's expert shape
    (H 2048, I 512, 512 experts, top-10), one row, random routing; FALLBACK_DRAM_GBS when the
    file lacks that record."""
    return _file_rate(path) or (FALLBACK_DRAM_GBS,
                                "built-in default (cpu_experts_h200.json record not found)")


def _file_rate(path: Path) -> tuple[float, str] | None:
    """:func:`default_dram_gbs`'s record of ``path`` and its source, or None."""
    try:
        records = json.loads(path.read_text())
    except (OSError, ValueError):
        records = []
    for r in records if isinstance(records, list) else []:
        if (r.get("H"), r.get("I"), r.get("E"), r.get("topk"), r.get("rows"),
                r.get("routing"), r.get("path")) == (2048, 512, 512, 10, 1, "random", None) \
                and r.get("weight_format", r.get("format", "int8")) == "int8" \
                and r.get("kernel_gbps"):
            return float(r["kernel_gbps"]), (
                f"{path.name}: int8, H 2048 I 512 E 512 top-10, 1 row, random routing, "
                f"kernel_gbps (machine DRAM read {r.get('dram_read_gbps')} GB/s)")
    return None


def dram_rate(value: str | None) -> tuple[float, str]:
    """``--dram-gbs``: a rate in GB/s, a bench_cpu_experts JSON holding the int8 1-row
    random record of this machine (:func:`default_dram_gbs` reads it), or None for the H200's
    file; the rate and where it comes from."""
    if value is None:
        return default_dram_gbs()
    try:
        return float(value), "--dram-gbs"
    except ValueError:
        pass
    found = _file_rate(Path(value))
    if found is None:
        raise SystemExit(f"--dram-gbs {value}: no int8, H 2048 I 512 E 512 top-10, 1 row, "
                         "random routing record with kernel_gbps there")
    return found


# one pass over an array: each thread issues 8 independent 8-byte loads (a block's loads
# coalesced), and a store that never happens keeps them
READ_KERNEL = r"""
extern "C" __global__ void read_all(const unsigned long long* a, long long n,
                                    unsigned long long* out) {
    long long base = (long long)blockIdx.x * blockDim.x * 8 + threadIdx.x;
    unsigned long long acc = 0;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        long long i = base + (long long)k * blockDim.x;
        if (i < n) acc ^= a[i];
    }
    if (acc == 0x9e3779b97f4a7c15ull) out[0] = acc;
}
"""


def hbm_rate(value: str, backend: str, nbytes: int = 1 << 32) -> tuple[float, str]:
    """``--hbm-tbs``: a rate in TB/s, or ``measure``: the best of five passes of a read
    kernel over an ``nbytes`` device array on this GPU, its memory given back to the device
    before the model is planned; the rate and its source."""
    if value != "measure":
        return float(value), "--hbm-tbs"
    if backend != "cupy":
        raise SystemExit("--hbm-tbs measure needs the cupy backend")
    try:
        return _measure_hbm(nbytes)
    except Exception as e:  # noqa: BLE001 (a lost table costs a whole lent call; say why)
        return HBM_TBS, f"measure failed ({type(e).__name__}: {e}); the H200's {HBM_TBS}"


def _measure_hbm(nbytes: int) -> tuple[float, str]:
    import cupy  # noqa: PLC0415 (a GPU machine's)

    n = nbytes // 8
    a = cupy.zeros(n, dtype=cupy.uint64)
    out = cupy.zeros(1, dtype=cupy.uint64)
    kernel = cupy.RawKernel(READ_KERNEL, "read_all")
    threads = 256
    blocks = -(-n // (threads * 8))
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    best = float("inf")
    try:
        for i in range(6):  # the first loads the kernel: not timed
            start.record()
            kernel((blocks,), (threads,), (a, cupy.int64(n), out))
            stop.record()
            stop.synchronize()
            if i:
                best = min(best, cupy.cuda.get_elapsed_time(start, stop))
    finally:  # the model's memory plan sees the device as before, whatever happened
        del a, out
        cupy.get_default_memory_pool().free_all_blocks()
    tbs = nbytes / (best * 1e-3) / 1e12
    return round(tbs, 3), (f"measured: best of 5 read passes over {nbytes / 2**30:g} GiB, "
                           f"{best:.3f} ms")


def distinct_per_layer(ids: dict[int, np.ndarray], on_cpu: dict[int, np.ndarray] | None
                       ) -> dict[int, tuple[int, int]]:
    """Per MoE layer: (distinct GPU experts, distinct CPU experts) among the step's picks
    ``ids[layer]`` (int [R, k]); ``on_cpu[layer]`` bool [E] marks the CPU's ids (None: all on
    the GPU)."""
    out = {}
    for layer, picks in ids.items():
        uniq = np.unique(np.asarray(picks).reshape(-1))
        cpu = on_cpu[layer][uniq] if on_cpu is not None and layer in on_cpu \
            else np.zeros(uniq.size, bool)
        out[layer] = (int((~cpu).sum()), int(cpu.sum()))
    return out


class StepRouting:
    """A :class:`gpu_worker.routed_experts.RoutedExperts` that records each MoE layer's
    expert ids (host copies, ``ids[layer]`` [R, k]) and otherwise is ``inner`` (an
    ExpertPlacement), or, with ``inner`` None, the model's own all-backend experts. The
    copies synchronize the device: use it for an untimed step only."""

    def __init__(self, model: Any, inner: Any = None) -> None:
        self.model, self.inner = model, inner
        self.ids: dict[int, np.ndarray] = {}

    def moe_norm(self, x, weight, eps: float, zero_centered: bool):
        if self.inner is not None:
            return self.inner.moe_norm(x, weight, eps, zero_centered)
        return self.model.ops.rms_norm(x, weight, eps, zero_centered=zero_centered), None

    def __call__(self, layer: int, x, ids, weights, quant, during=None):
        from gpu_worker.backend import to_numpy  # noqa: PLC0415

        self.ids[layer] = np.array(to_numpy(ids))
        if self.inner is not None:
            return self.inner(layer, x, ids, weights, quant, during)
        from gpu_worker.model.moe import expert_stacks, experts_local  # noqa: PLC0415

        if during is not None:
            during()

        return experts_local(self.model.ops, *expert_stacks(self.model.layers[layer].mlp), x,
                             ids, weights)

    def run_step(self, forward: Callable[[], T]) -> T:
        return forward() if self.inner is None else self.inner.run_step(forward)

    def take_stats(self) -> dict[str, float]:
        """The inner placement's counters; without one, no CPU expert time."""
        return {"cpu_experts_ms": 0.0} if self.inner is None else self.inner.take_stats()


# --------------------------------------------------------------------------- records


def table(records: list[dict[str, Any]]) -> str:
    """The records as a markdown table (docs/benchmarks.md's format)."""
    lines = ["| model | GPU budget | graphs | slots x rows | step ms | floor ms (GPU / CPU) | "
             "step / floor | host ms | experts / layer GPU / CPU |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in records:
        budget = "whole" if r["gpu_budget_gb"] is None else f"{r['gpu_budget_gb']:g} GiB"
        host = f"{r['host_ms']:.3g}" + ("" if r["host_exact"] else " (bound)")
        lines.append(
            f"| {r['model']} | {budget} | {'yes' if r['graphs'] else 'no'} | "
            f"{r['slots']} x {r['rows_per_slot']} | {r['step_ms']:.3g} | {r['floor_ms']:.3g} "
            f"({r['gpu_floor_ms']:.3g} / {r['cpu_floor_ms']:.3g}) | {r['ratio']:.3g}x | "
            f"{host} | {r['distinct_experts_gpu']:.1f} / {r['distinct_experts_cpu']:.1f} |")
    return "\n".join(lines)


def _key(r: dict[str, Any]) -> tuple:
    return (r["model"], r["gpu_budget_gb"], r["graphs"], r.get("cpu_format"),
            r.get("experts_cpu_per_layer"), r["slots"], r["rows_per_slot"])


def merge(old: dict[str, Any] | None, result: dict[str, Any]) -> dict[str, Any]:
    """``result`` after the records of ``old`` (an earlier --out) that it does not measure
    again; ``runs`` lists both runs' settings, each record's ``run`` indexes them."""
    if not old:
        return result
    base, new_keys = len(old.get("runs", [])), {_key(r) for r in result["records"]}
    return {**result, "runs": old.get("runs", []) + result["runs"],
            "records": [r for r in old.get("records", []) if _key(r) not in new_keys]
            + [{**r, "run": r["run"] + base} for r in result["records"]]}


# ---- the benchmark's command line (scripts/bench_step.py) ------------------------------
ALL_LAYOUTS = [(s, r) for s in range(1, 5) for r in range(1, 6)]
NAMED = Path(__file__).resolve().parents[1] / "configs" / "models"


def model_spec(text: str) -> str:
    """A configs/models name becomes ``synthetic:NAME`` (the synthetic real-shape source with
    its routing model); a config.json ``synthetic:PATH``; anything else is given to the
    worker as is (``synthetic:...?skew=..``, a checkpoint or synthetic model directory)."""
    if (NAMED / f"{text}.json").is_file():
        return f"synthetic:{text}"
    if text.endswith(".json") and Path(text).is_file():
        return f"synthetic:{Path(text).resolve()}"
    return text


def parse_layouts(text: str | None) -> list[tuple[int, int]]:
    """``"1x1,4x5"`` -> [(1, 1), (4, 5)] (slots x rows per slot); None: 1-4 x 1-5."""
    if not text:
        return list(ALL_LAYOUTS)
    out = []
    for part in text.split(","):
        s, _, r = part.strip().partition("x")
        if not (s.isdigit() and r.isdigit() and int(s) >= 1 and int(r) >= 1):
            raise argparse.ArgumentTypeError(f"a layout is SLOTSxROWS, e.g. 4x5, got {part!r}")
        out.append((int(s), int(r)))
    return out
