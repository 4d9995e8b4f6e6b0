"""The markdown tables of docs/cpu_experts.md from a result JSON of ``bench_cpu_experts``
(``python -m scripts.bench_cpu_experts --table FILE``)."""

from __future__ import annotations

from scripts.bench_cpu_workload import ROWS


def markdown_tables(records: list[dict]) -> str:
    """The tables of docs/cpu_experts.md: layers at top-k 8, the cost of rows per expert (one
    expert; top-k experts every row shares: us per layer / k), and the dispatch overhead with
    no CPU work."""
    gpu = [r for r in records if "path" in r]
    records = [r for r in records if "path" not in r]
    lines = ["| format | I | E | routing | rows | distinct experts | weight MB | us/layer | "
             "kernel us | eff. GB/s | dispatch us (wake / notice / client / pre) |",
             "|" + "---|" * 11]
    for r in records:
        if r["topk"] == 8 and r["routing"] in ("random", "skewed") and r["rows"] in (1, 4, 16):
            lines.append(
                f"| {r.get('format', 'int8')} | {r['I']} | {r['E']} | {r['routing']} | "
                f"{r['rows']} | "
                f"{r['distinct_experts']:.1f} | {r['weight_bytes'] / 1e6:.0f} | "
                f"{r['us_per_layer']:.0f} | {r['kernel_us']:.0f} | {r['effective_gbps']:.1f} | "
                f"{r['dispatch_us']:.0f} ({r.get('wake_us', 0):.0f} / "
                f"{r.get('notice_us', 0):.0f} / {r.get('client_us', 0):.0f} / "
                f"{r.get('pre_us', 0):.0f}) |")
    lines += ["", "| format | I | E | routing | " +
              " | ".join(f"{n} row{'s' * (n > 1)}" for n in ROWS) + " | 16 / 1 |",
              "|" + "---|" * (len(ROWS) + 5)]
    one: dict[tuple[str, int, int, str], dict[int, float]] = {}
    for r in records:  # us per layer; shared: per expert of the layer's top-k
        if r["routing"] in ("one_expert", "shared"):
            key = (r.get("format", "int8"), r["I"], r["E"], f"{r['routing']} (k={r['topk']})")
            one.setdefault(key, {})[r["rows"]] = r["us_per_layer"] / r["topk"]
    for (f, i, e, kind), by_rows in one.items():
        cells = " | ".join(f"{by_rows.get(n, float('nan')):.0f}" for n in ROWS)
        ratio = by_rows.get(16, float("nan")) / by_rows.get(1, float("nan"))
        lines.append(f"| {f} | {i} | {e} | {kind} | {cells} | {ratio:.2f} |")
    lines += ["", "| format | I | E | no CPU pair, 16 rows: us/layer | kernel us | dispatch us |",
              "|---|---|---|---|---|---|"]
    for r in records:
        if r["routing"] == "none":
            lines.append(f"| {r.get('format', 'int8')} | {r['I']} | {r['E']} | "
                         f"{r['us_per_layer']:.0f} | "
                         f"{r['kernel_us']:.0f} | {r['dispatch_us']:.0f} |")
    launched = [r for r in gpu if r["path"].startswith("gpu_launch")]
    synced = [r for r in gpu if not r["path"].startswith("gpu_launch")]
    if launched:
        lines += ["", "| I | E | routing | rows | path | us/layer | kernel us | dispatch + "
                  "transfer us | host enqueue us | GPU clock: latency / gap us |",
                  "|" + "---|" * 10]
        for r in launched:
            lines.append(f"| {r['I']} | {r['E']} | {r['routing']} | {r['rows']} | "
                         f"{r['path']} | {r['us_per_layer']:.0f} | {r['kernel_us']:.0f} | "
                         f"{r['dispatch_us']:.0f} | {r['enqueue_us']:.0f} | "
                         f"{r['latency_us']:.0f} / {r['gap_us']:.0f} |")
    if synced:
        lines += ["", "| I | E | routing | rows | path | us/layer | kernel us | dispatch + "
                  "transfer us |", "|" + "---|" * 8]
        for r in synced:
            lines.append(f"| {r['I']} | {r['E']} | {r['routing']} | {r['rows']} | {r['path']} | "
                         f"{r['us_per_layer']:.0f} | {r['kernel_us']:.0f} | "
                         f"{r['dispatch_us']:.0f} |")
    return "\n".join(lines)

