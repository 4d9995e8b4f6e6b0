"""Decode/verify step time of the worker's model next to its floor, per layout of slots x rows.

    python -m scripts.bench_step --model qwen3-next-80b-a3b --gpu-budget 32 \\
        --out docs/bench/step_h200.json
    python -m scripts.bench_step --model qwen3-next-80b-a3b --gpu-budget whole \\
        --out docs/bench/step_h200.json --append

The model is built in this process exactly as ``python -m gpu_worker.server`` builds it
(``gpu_worker.server.build_runner`` of a WorkerConfig: the same memory plan, expert placement
and CPU expert pool). Each slot gets ``--context`` prefilled tokens; a step gives every slot
one token plus ``rows - 1`` random drafts (acceptance does not change a step's cost) and runs
through ``Runner.execute`` like a served step (forward, sampling, verification). Before each
step the slots' lengths and GDN states are restored, so every step sees the same context.
Per layout the record holds the median synchronized wall time of ``--steps`` steps, the floor
(scripts/step_floor.py), the host time (:meth:`Bench.host_ms`) and the distinct experts per
MoE layer on each side. docs/benchmarks.md "Step time vs floor" explains every field.
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

import protocol.worker_config as wcfg
from protocol.messages import (
    CacheOp,
    CacheOpKind,
    DraftSource,
    SamplingParams,
    SlotWork,
    StepPlan,
    WorkKind,
)
from protocol.worker_config import CPU_FORMATS, GPU_FORMATS, KV_CACHE_DTYPES, WorkerConfig
from scripts.bench_common import SPIN_KERNEL, command_line, machine
from scripts.bench_load import parse_budget
from scripts.step_floor import (
    ALL_LAYOUTS,
    HBM_TBS,
    StepRouting,
    dense_read_bytes,
    distinct_per_layer,
    dram_rate,
    floor_ms,
    gpu_expert_bytes,
    hbm_rate,
    kv_state_read_bytes,
    merge,
    model_spec,
    parse_layouts,
    table,
)

GREEDY = SamplingParams(temperature=0.0, seed=0)


def worker_config(args: argparse.Namespace, spec: str) -> WorkerConfig:
    """The worker's config: configs/synthetic-80b.toml's settings (4 slots, 256 MB prefix
    cache, split placement) with room for the largest layout's drafts."""
    dtype = args.dtype or ("bfloat16" if args.backend == "cupy" else "float32")
    return WorkerConfig(
        run_dir=tempfile.gettempdir(), model=spec, dtype=dtype, backend=args.backend,
        max_slots=max(4, max(s for s, _ in args.layouts)), max_context=args.max_context,
        kv_cache_dtype=args.kv_cache_dtype, prefix_cache=True, prefix_cache_max_mb=256,
        placement="split", cpu_experts_per_layer=args.cpu_experts_per_layer,
        cpu_workers=args.cpu_workers, cpu_format=args.cpu_format, gpu_format=args.gpu_format,
        gpu_memory_gb=args.gpu_budget, prefill_chunk=512,
        max_drafts=max(4, max(r for _, r in args.layouts) - 1), cuda_graphs=args.graphs,
        graph_buckets=not args.no_graph_buckets)


class Bench:
    """The runner of one WorkerConfig with ``context`` tokens prefilled in its slots."""

    def __init__(self, cfg: WorkerConfig, context: int, seed: int = 0) -> None:
        from gpu_worker.server import build_runner  # noqa: PLC0415 (loads numba, cupy)

        t0 = time.perf_counter()
        self.runner, self.placement, self.info = build_runner(cfg)
        self.load_seconds = time.perf_counter() - t0
        self.model, self.context, self.xp = self.runner.model, context, self.runner.model.xp
        self.rng, self.cupy = np.random.default_rng(seed), self.xp.__name__ == "cupy"
        self.spin = self.xp.RawKernel(SPIN_KERNEL, "spin") if self.cupy else None
        self.snaps: dict[int, Any] = {}  # slot -> its GDN states after the prefill
        self.steps = 0
        try:
            for slot in range(cfg.max_slots):
                self._prefill(slot, cfg.prefill_chunk)
        except BaseException:
            self.close()
            raise

    def sync(self) -> None:
        if self.cupy:
            self.xp.cuda.Device().synchronize()

    def _tokens(self, n: int) -> np.ndarray:
        return self.rng.integers(0, self.model.cfg.vocab_size, n).astype(np.int32)

    def _execute(self, slots: list[SlotWork], ops: list[CacheOp] | None = None) -> Any:
        self.steps += 1
        return self.runner.execute(StepPlan(step_id=self.steps, slots=slots,
                                            cache_ops=ops or []))

    def _prefill(self, slot: int, chunk: int) -> None:
        ids = self._tokens(self.context)
        for start in range(0, self.context, chunk):
            part = ids[start:start + chunk]
            self._execute([SlotWork(
                slot=slot, request_id=f"r{slot}", kind=WorkKind.PREFILL, input_ids=part,
                start_pos=start, num_tokens=len(part), prompt_len=self.context,
                needs_logits=start + chunk >= self.context, sampling=GREEDY)],
                [CacheOp(op=CacheOpKind.ALLOCATE, slot=slot)] if start == 0 else None)
        states = self.runner.caches.states
        self.snaps[slot] = states.snapshot(slot) if states is not None else None

    def work(self, slots: int, rows: int) -> list[SlotWork]:
        """One decode token plus ``rows - 1`` random drafts per slot, at the context's end."""
        return [SlotWork(slot=s, request_id=f"r{s}", kind=WorkKind.DECODE,
                         input_ids=self._tokens(1), start_pos=self.context, num_tokens=1,
                         needs_logits=True, sampling=GREEDY, draft_ids=self._tokens(rows - 1),
                         draft_sources=np.full(rows - 1, DraftSource.SUFFIX, np.uint8),
                         prompt_len=self.context, cached_len=0) for s in range(slots)]

    def restore(self, work: list[SlotWork]) -> None:
        """Every slot of ``work`` back to its prefilled context (length and GDN states; the
        KV rows a step wrote past it are never read and are overwritten by the next)."""
        states = self.runner.caches.states
        for w in work:
            self.runner.lengths[w.slot] = self.context
            if states is not None:
                states.restore(w.slot, self.snaps[w.slot])
        self.sync()

    def step_ms(self, work: list[SlotWork], warmup: int, steps: int) -> tuple[list[float], Any]:
        """Wall milliseconds of ``steps`` steps after ``warmup`` untimed ones (the device
        synchronized before the clock starts and before it stops), and the last result."""
        times, res = [], None
        for i in range(warmup + steps):
            self.restore(work)
            t0 = time.perf_counter()
            res = self._execute(work)
            self.sync()
            if i >= warmup:
                times.append((time.perf_counter() - t0) * 1e3)
        return times, res

    def host_ms(self, work: list[SlotWork], runs: int, spin_ms: float) -> tuple[float, bool]:
        """Host milliseconds from the start of a step until its forward pass has enqueued
        its last launch (Model.forward returns), median of ``runs``, and whether that is
        exact. CuPy: a one-thread kernel keeps the device busy for ``spin_ms`` before the
        step, so no launch waits for the GPU; if a CUDA event recorded behind that kernel is
        still pending when the forward returns, the host never waited on the device and the
        time is pure Python + launch (exact). Else (a sync inside the forward, or a full
        launch queue) the runs are repeated without the kernel and the time, which then
        includes the device waits, is an upper bound (not exact). NumPy: the forward's wall
        time, all of it host work."""
        model, mark = self.model, {}
        inner = model.forward

        def launched() -> None:
            mark["t"] = time.perf_counter()
            mark["pending"] = mark.get("event") is not None and not mark["event"].done

        def forward(*a: Any, **k: Any) -> Any:
            out = inner(*a, **k)
            launched()
            return out

        model.forward = forward  # the runner calls self.model.forward
        graphs = self.runner.graphs  # a replayed pass ends its launches at the graph's launch
        if graphs is not None:
            graphs.on_launch = launched
        try:
            spun = self._host_runs(work, runs, spin_ms, mark) if self.cupy else None
            if spun is not None and all(p for _, p in spun):
                return statistics.median(t for t, _ in spun), True
            plain = self._host_runs(work, runs, 0.0, mark)
            return statistics.median(t for t, _ in plain), not self.cupy
        finally:
            del model.forward
            if graphs is not None:
                graphs.on_launch = None

    def _host_runs(self, work: list[SlotWork], runs: int, spin_ms: float, mark: dict
                   ) -> list[tuple[float, bool]]:
        out = []
        for _ in range(runs):
            self.restore(work)
            mark.clear()
            if spin_ms > 0:
                self.spin((1,), (1,), (np.uint64(spin_ms * 1e6),))
                mark["event"] = self.xp.cuda.Event()
                mark["event"].record()
            t0 = time.perf_counter()
            self._execute(work)
            self.sync()
            out.append(((mark["t"] - t0) * 1e3, bool(mark.get("pending"))))
            if spin_ms > 0 and not out[-1][1]:
                break  # the host waited on the device: these runs cannot be exact
        return out

    def routing(self, work: list[SlotWork]) -> dict[int, tuple[int, int]]:
        """Per MoE layer (distinct GPU, distinct CPU) experts of one more, untimed step,
        from the expert ids it routes to (StepRouting)."""
        rec = StepRouting(self.model, self.runner.experts)
        saved, self.runner.experts = self.runner.experts, rec
        try:
            self.restore(work)
            self._execute(work)
        finally:
            self.runner.experts = saved
        on_cpu = self.placement.on_cpu if self.placement is not None else None
        return distinct_per_layer(rec.ids, on_cpu)

    def close(self) -> None:
        if self.placement is not None:
            self.placement.close()


def preflight(cfg: WorkerConfig) -> str | None:
    """Why the worker's plan cannot be loaded here (refused, or its CPU experts do not fit
    the free shared memory), else None; the plan's lines are printed."""
    import shutil  # noqa: PLC0415

    from cpu_experts.rings import shm_dir  # noqa: PLC0415
    from gpu_worker.backend import get_xp  # noqa: PLC0415
    from gpu_worker.memory_plan import PlanError, describe, plan_for_worker  # noqa: PLC0415
    from gpu_worker.weights.resolve import open_source  # noqa: PLC0415

    backend = "cupy" if get_xp(cfg.backend).__name__ == "cupy" else "numpy"
    try:
        plan = plan_for_worker(cfg, open_source(cfg.model).config, backend=backend)
    except PlanError as exc:
        return f"memory plan refused: {exc}"
    for line in describe(plan):
        print(f"plan: {line}", flush=True)
    shm = shm_dir()
    need, free = plan.cpu_resident_bytes, shutil.disk_usage(shm).free
    if need > free:
        return (f"the CPU experts need {need / 2**30:.1f} GiB of shared memory, {shm} has "
                f"{free / 2**30:.1f} GiB free: enlarge it (mount -o remount,size="
                f"{int(need / 2**30) + 8}G {shm}), use --cpu-format int4 or raise the budget")
    return None


def measure(bench: Bench, slots: int, rows: int, args: argparse.Namespace) -> dict[str, Any]:
    """One layout's record."""
    work = bench.work(slots, rows)
    times, res = bench.step_ms(work, args.warmup, args.steps)
    step = statistics.median(times)
    host, exact = bench.host_ms(work, args.host_runs, spin_ms=2 * step + 5)
    per_layer = bench.routing(work)
    model, placement, n = bench.model, bench.placement, max(len(per_layer), 1)
    expert_bytes = gpu_expert_bytes(model)
    cpu_per_expert = placement.counters.bytes_per_expert if placement is not None else 0.0
    dense = dense_read_bytes(model, slots * rows)
    kv_state = kv_state_read_bytes(bench.runner.caches, len(model.cfg.full_attention_layers),
                                   [(bench.context, rows)] * slots)
    experts_gpu = sum(g * expert_bytes[layer] for layer, (g, _) in per_layer.items())
    cpu_bytes = sum(c for _, c in per_layer.values()) * cpu_per_expert
    gpu_bytes = dense + kv_state + experts_gpu
    floor = floor_ms(gpu_bytes, cpu_bytes, args.hbm_tbs, args.dram_gbs)
    c = res.counters if res is not None else {}  # the placement's, of the last timed step
    from_counters = [c["gpu_experts"] / c["moe_layers"], c["cpu_experts"] / c["moe_layers"]] \
        if c.get("moe_layers") else None
    buckets = getattr(bench.runner.graphs, "scratch", None) is not None
    return {
        "model": args.model, "gpu_budget_gb": args.gpu_budget,
        "graphs": bench.runner.graphs is not None, "graph_buckets": buckets,
        # the rows the pass ran with: its own, or padded up to its capacity bucket
        "rows_run": wcfg.padded_rows(slots * rows) if buckets else slots * rows,
        "slots": slots, "rows_per_slot": rows, "step_ms": step, **floor,
        "ratio": step / floor["floor_ms"], "host_ms": host, "host_exact": exact,
        "distinct_experts_gpu": sum(g for g, _ in per_layer.values()) / n,
        "distinct_experts_cpu": sum(c for _, c in per_layer.values()) / n,
        "distinct_from_counters": from_counters,
        # the last timed step's: the CPU workers' kernel time (the slowest worker's sum over
        # layers) against the step, so the rest of the CPU experts' share is the round trips
        "cpu_kernel_ms": res.timings_ms.get("cpu_experts") if res is not None else None,
        "step_ms_min": min(times), "step_ms_max": max(times), "steps": len(times),
        "context": bench.context, "gpu_bytes": gpu_bytes, "gpu_dense_bytes": dense,
        "gpu_kv_state_bytes": kv_state, "gpu_expert_bytes": experts_gpu,
        "cpu_bytes": cpu_bytes, "cpu_bytes_per_expert": cpu_per_expert,
        "gpu_bytes_per_expert": max(expert_bytes.values(), default=0.0),
        "accepted_drafts": [r.num_accepted for r in res.slots] if res is not None else [],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-next-80b-a3b",
                   help="a configs/models name or config.json (synthetic, with the routing "
                        "model), a synthetic: spec, or a model directory")
    p.add_argument("--gpu-budget", type=parse_budget, default=None,
                   help="GiB, or 'whole' (the default): the device (CuPy), no limit (NumPy)")
    p.add_argument("--backend", choices=("cupy", "numpy"), default="cupy")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cupy, else float32")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="model")
    p.add_argument("--cpu-format", choices=CPU_FORMATS, default="int8")
    p.add_argument("--gpu-format", choices=GPU_FORMATS, default="model",
                   help="the GPU's routed experts: the model dtype or int8 blocks of 32")
    p.add_argument("--graphs", action="store_true",
                   help="decode/verify passes as CUDA graphs where the runner can (cupy)")
    p.add_argument("--no-graph-buckets", action="store_true",
                   help="with --graphs: a graph per rows and slots, no capacity buckets")
    p.add_argument("--cpu-experts-per-layer", type=int, default=0,
                   help="fix the split instead of letting the memory plan choose (0: plan)")
    p.add_argument("--cpu-workers", type=int, default=0, help="0: one per NUMA node")
    p.add_argument("--layouts", type=parse_layouts, default=None,
                   help="SLOTSxROWS,... (default: 1-4 slots x 1-5 rows)")
    p.add_argument("--context", type=int, default=512, help="prefilled tokens per slot")
    p.add_argument("--max-context", type=int, default=4096)
    p.add_argument("--steps", type=int, default=10, help="timed steps per layout")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--host-runs", type=int, default=5, help="steps per host-time measure")
    p.add_argument("--hbm-tbs", default=str(HBM_TBS), help="TB/s, or 'measure' (this GPU)")
    p.add_argument("--dram-gbs", default=None,
                   help="CPU experts' rate: GB/s, or this machine's bench_cpu_experts JSON "
                        "(default: docs/bench/cpu_experts_h200.json's int8 1-row kernel rate)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--append", action="store_true",
                   help="keep --out's records of other budgets and layouts (one budget per "
                        "command: each builds its model)")
    args = p.parse_args(argv)
    args.command = command_line() if argv is None else shlex.join(
        ["python", "-m", "scripts.bench_step", *argv])  # main() called in process
    args.layouts = args.layouts or list(ALL_LAYOUTS)
    if args.context < 1 or args.context + max(r for _, r in args.layouts) > args.max_context:
        p.error("need 1 <= --context and --context + rows <= --max-context")
    args.dram_gbs, dram_source = dram_rate(args.dram_gbs)
    args.hbm_tbs, args.hbm_source = hbm_rate(args.hbm_tbs, args.backend)
    cfg = worker_config(args, model_spec(args.model))
    problem = preflight(cfg)
    if problem:
        print(f"bench_step: {problem}", file=sys.stderr)
        return 2
    # a `timeout` still closes the CPU workers (and frees their shared memory)
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        result = run(args, cfg, dram_source)
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(table(result["records"]))
    if args.out:
        print(f"wrote {args.out}")
    return 0


def run(args: argparse.Namespace, cfg: WorkerConfig, dram_source: str) -> dict[str, Any]:
    """Build the model, measure every layout, write ``--out`` after each; the result."""
    old = json.loads(args.out.read_text()) if args.append and args.out and \
        args.out.is_file() else None
    bench = Bench(cfg, args.context)
    try:
        held = bench.placement.on_cpu if bench.placement is not None else {}
        cpu_held = sorted({int(m.sum()) for m in held.values()})  # one count unless per layer
        where = machine()
        command = args.command
        result = {"benchmark": "bench_step", "machine": where, "command": command,
                  "runs": [{"machine": where, "command": command,
                            "worker_config": json.loads(cfg.to_json()),
                            "load_seconds": bench.load_seconds, "hbm_tbs": args.hbm_tbs,
                            "hbm_source": args.hbm_source, "dram_gbs": args.dram_gbs,
                            "dram_source": dram_source, "experts_cpu_per_layer": cpu_held,
                            "num_experts": bench.model.cfg.num_experts}],
                  "records": []}
        seen: dict[str, int] = {}
        for slots, rows in args.layouts:
            rec = measure(bench, slots, rows, args)
            rec.update(run=0, cpu_format=args.cpu_format, gpu_format=args.gpu_format,
                       dtype=cfg.dtype, backend=args.backend,
                       experts_cpu_per_layer=max(cpu_held, default=0))
            graphs = bench.runner.graphs
            if graphs is not None:  # what the graphs did for this layout
                rec["graph_counts"] = {k: v - seen.get(k, 0) for k, v in graphs.totals.items()}
                rec["graph_refused"] = sorted(set(graphs.refused.values()))
                seen = dict(graphs.totals)
            result["records"].append(rec)
            print(table([rec]).splitlines()[-1], rec.get("graph_counts", ""),
                  rec.get("graph_refused", ""), flush=True)
            if args.out:  # after every layout: a time limit keeps what was measured
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(merge(old, result), indent=2) + "\n")
    finally:
        bench.close()
    return result

if __name__ == "__main__":
    sys.exit(main())
