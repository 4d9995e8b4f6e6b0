"""What `scripts/bench_load.py` makes of one run: the plan's figures checked against the
worker's log, the streaming load's two memory rules, the printed table, and runs merged into an
earlier result file (``--append``)."""

from __future__ import annotations

from typing import Any

GIB = 2**30
HOST_SLACK = 4 * GIB  # the rule's "+ 4 GB", taken as GiB like every budget here
HOST_FACTOR = 1.1


def run_facts(plan: Any, logged: dict[str, Any]) -> dict[str, Any]:
    """Experts per layer and resident bytes of one run. ``plan``: the memory plan made here
    from the same config (a MemoryPlan, or None where none could be made); ``logged``:
    :func:`scripts.bench_load_probe.load_facts` of the server's log.

    ``gpu_resident_bytes``: everything the plan puts on the GPU (weights, KV cache, states,
    work space, allocator slack, CUDA context); ``cpu_resident_bytes``: the CPU experts'
    shared memory plus their ring. Without a plan, the worker's own "model loaded" figures
    (weights only). ``plan_matches_worker``: the worker's "load plan" line has the plan's
    experts per layer."""
    ev = logged["events"]
    lp, loaded = ev.get("load plan", {}), ev.get("model loaded", {})
    gpu_n, cpu_n = lp.get("experts_gpu_per_layer"), lp.get("experts_cpu_per_layer")
    out: dict[str, Any] = {
        "experts_gpu_per_layer": gpu_n[0] if gpu_n and len(gpu_n) == 1 else gpu_n,
        "experts_cpu_per_layer": cpu_n[0] if cpu_n and len(cpu_n) == 1 else cpu_n,
        "gpu_weight_bytes": loaded.get("backend_bytes"),
        "cpu_shard_bytes": loaded.get("cpu_bytes"),
        "load_phases": {k: v for k, v in ev.items() if k != "kv cache"},
        "kv_cache": ev.get("kv cache"), "memory_plan_lines": logged["memory_plan"]}
    if plan is None:
        out.update(gpu_resident_bytes=loaded.get("backend_bytes"),
                   cpu_resident_bytes=loaded.get("cpu_bytes"), plan_matches_worker=None)
        return out
    out.update(gpu_resident_bytes=plan.gpu_total_bytes,
               cpu_resident_bytes=plan.cpu_resident_bytes,
               plan_matches_worker=None if cpu_n is None
               else cpu_n == [plan.experts_cpu_per_layer])
    if cpu_n is None:  # the worker did not get as far as its load plan
        out["experts_gpu_per_layer"] = plan.experts_gpu_per_layer
        out["experts_cpu_per_layer"] = plan.experts_cpu_per_layer
    return out


def checks(rec: dict[str, Any], budget_bytes: int | None, numpy_backend: bool
           ) -> dict[str, Any]:
    """The streaming load's memory rules for one run record (``ok`` None: not measured):
    peak host RSS <= host-resident bytes x 1.1 + 4 GiB, where host-resident is the CPU
    experts' bytes plus, on the NumPy backend, the "GPU" side (which lives in host RAM
    there); peak GPU <= budget."""
    host_resident = rec.get("cpu_resident_bytes") or 0
    if numpy_backend:
        host_resident += rec.get("gpu_resident_bytes") or 0
    limit = int(host_resident * HOST_FACTOR + HOST_SLACK)
    peak, gpu = rec.get("peak_host_rss_bytes"), rec.get("peak_gpu_bytes")
    return {"host_rss": {"rule": "peak_host_rss <= host_resident x 1.1 + 4 GiB",
                         "host_resident_bytes": host_resident, "limit_bytes": limit,
                         "ok": None if not peak else peak <= limit},
            "gpu": {"rule": "peak_gpu (nvidia-smi memory.used) <= budget",
                    "budget_bytes": budget_bytes,
                    "ok": None if gpu is None or budget_bytes is None else gpu <= budget_bytes}}


def table(runs: list[dict[str, Any]]) -> str:
    """The runs as a markdown table (GiB, seconds, tokens/s, the two rules)."""
    def gib(v: Any) -> str:
        return "-" if v is None else f"{v / GIB:.1f}"

    rows = ["budget | experts GPU/CPU per layer | GPU resident GiB | CPU resident GiB | "
            "peak host GiB | peak GPU GiB | load s | decode tok/s | host rule | GPU rule",
            "--- | --- | --- | --- | --- | --- | --- | --- | --- | ---"]
    for r in runs:
        c = r["checks"]
        rate, load = r.get("decode_tokens_per_s_1_stream"), r.get("load_seconds")
        rows.append(" | ".join([
            r["gpu_budget"] + (" (error)" if "error" in r else ""),
            f"{r.get('experts_gpu_per_layer')}/{r.get('experts_cpu_per_layer')}",
            gib(r.get("gpu_resident_bytes")), gib(r.get("cpu_resident_bytes")),
            gib(r.get("peak_host_rss_bytes")), gib(r.get("peak_gpu_bytes")),
            "-" if load is None else f"{load:.1f}", "-" if rate is None else f"{rate:.2f}",
            _ok(c["host_rss"]["ok"]), _ok(c["gpu"]["ok"])]))
    return "\n".join(rows)


def _ok(v: bool | None) -> str:
    return "n/a" if v is None else "ok" if v else "FAIL"


def merge(old: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
    """``new`` with the runs of ``old`` (an earlier result of the same model) kept for every
    budget ``new`` did not run; a budget run again replaces its old run."""
    if not old or old.get("model") != new.get("model"):
        return new
    ran = {r["gpu_budget"] for r in new["runs"]}
    kept = [r for r in old.get("runs", []) if r["gpu_budget"] not in ran]
    return {**new, "runs": kept + new["runs"]}
