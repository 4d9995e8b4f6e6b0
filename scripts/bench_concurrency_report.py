"""The concurrency benchmark's summary and table (scripts/bench_concurrency.py): medians per
arm, per-pair ratios over a base arm, and the replay arms' figures (accepted drafts per
verify per source, distinct CPU experts per step, step time against its CPU floor, whether
the tokens equal the plain run's).

The lent machines' CPU memory is not equally fast from run to run (a CPU expert took
0.032-0.048 ms of kernel time on one H100 machine within a call), and a four-stream step
waits mostly on the CPU experts, so one arm's four-stream tok/s spread 20 % and more. Beside
them the summary gives ``four_stream_tps_at_common_expert_cost``: each run's four-stream
tokens per step over its step time with its CPU experts costing the workload's median cost
per expert over all runs (``common_expert_ms``): (step ms - CPU kernel ms) + CPU experts x
common cost. It keeps what the arms choose (tokens per step, CPU experts per step, the time
outside the CPU experts) and drops how fast the machine's memory happened to be. A derived
figure, not a measured speed: the measured one stays the comparison the method names.

With the replay proposer the draws are fixed per request and position, so an arm meets the
same draws every run and arms that visit other positions meet other ones: one arm's
accepted drafts may run a few percent above the profile's rate in every run (the replay's
luck, ``acceptance_luck`` of a run: its four-slot decode steps' tokens over those the rate
makes expected of the drafts it verified). ``four_stream_tps_at_common_cost_expected_
acceptance`` divides the common-cost figure by the run's luck as well: each arm's choices at
the same memory speed and the same acceptance. Derived too; an arm with a run that has no
step trace (before it existed) gets None there.

A benchmark resumed over several calls (``--resume``) can run one pair's arms on two lent
machines, which differ as much: a pair whose runs name two boot ids (``machine.boot_id``) is
no paired comparison, so it is left out of the per-pair ratios and listed under
``pairs_across_machines`` (so is a pair of a run with a boot id and one from before they
were recorded); the summary's ``runs_by_machine`` says which machine ran which run. Runs from
before the boot id stand for their machine by the tree they ran (``machine.git``): a session
commits between its calls and no lent machine outlives its session, so runs of two trees
(sessions 40 and 41's coding matrix: two H100 machines) are no pair, and runs of one tree
pair as they did."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

RATIO_KEYS = ("four_stream_decode_tps", "whole_run_tps")
STEP_KEYS = ("step_ms", "cpu_floor_ms", "step_over_cpu_floor", "cpu_experts_per_step",
             "cpu_kernel_ms")
# the four-stream steps' parts (bench_concurrency_serve.steady_figures; absent in older runs)
PART_KEYS = ("daemon_ms", "worker_ms", "forward_ms", "slot_routing_ms")


def _pairs(runs: list[dict], arm: str, base: str) -> list[tuple[dict, dict]]:
    """(``arm``'s run, ``base``'s run) of each pair that has both."""
    return [(x, y) for x in runs for y in runs
            if x["arm"] == arm and y["arm"] == base and x["pair"] == y["pair"]]


def _one_machine(x: dict, y: dict) -> bool:
    """Whether two runs ran on one machine (one boot of it): the module doc's rule."""
    return _machine_id(x.get("machine")) == _machine_id(y.get("machine"))


def _machine_id(machine: dict | str | None) -> str:
    """A run's machine (one boot of it) as a key: its boot id, else (before boot ids) what
    ``bench_common.machine`` says of it and the tree it ran."""
    if not isinstance(machine, dict):  # the oldest runs named their machine in words
        return json.dumps(machine)
    if machine.get("boot_id"):
        return machine["boot_id"]
    return json.dumps({k: machine.get(k) for k in ("host", "cpu", "gpu", "git")})


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(runs: list[dict], arms: list[str], base: str | None = None) -> dict:
    """Per workload: each figure's median per arm; for the TPS figures the per-pair ratios of
    each arm over ``base`` (default the first arm) too."""
    base = base or arms[0]
    out = {}
    for name in sorted({r["workload"] for r in runs}):
        mine = [r for r in runs if r["workload"] == name]
        entry: dict = {}
        for key in RATIO_KEYS:
            entry[key] = {a: _median([r[key] for r in mine if r["arm"] == a]) for a in arms}
            entry[key + "_pair_ratios"] = {
                a: [round(x[key] / y[key], 3) for x, y in _pairs(mine, a, base)
                    if _one_machine(x, y) and x[key] and y[key]]
                for a in arms if a != base}
        across = {a: [x["pair"] for x, y in _pairs(mine, a, base) if not _one_machine(x, y)]
                  for a in arms if a != base}
        if any(across.values()):  # not paired figures: left out of the ratios above
            entry["pairs_across_machines"] = {a: p for a, p in across.items() if p}
        _common(entry, mine, arms)
        if any("steps" in r for r in mine):
            for key in STEP_KEYS + PART_KEYS:
                if key in STEP_KEYS:
                    entry[key] = {a: _median([r.get("steps", {}).get(key) for r in mine
                                              if r["arm"] == a]) for a in arms}
                # the four-stream decode windows' steps alone (no prompt chunks among them)
                entry["four_stream_" + key] = {
                    a: _median([r.get("steps", {}).get("four_stream", {}).get(key)
                                for r in mine if r["arm"] == a]) for a in arms}
            sources = sorted({s for r in mine for s in r.get("drafts", {})})
            entry["accepted_per_verify"] = {
                a: {s: _median([r["drafts"][s]["accepted_per_verify"] for r in mine
                                if r["arm"] == a and s in r.get("drafts", {})])
                    for s in sources} for a in arms}
            entry["tokens_equal_plain"] = {
                a: [r["exact"]["equal"] == r["exact"]["requests"] if r.get("exact") else None
                    for r in sorted(mine, key=lambda r: r["pair"]) if r["arm"] == a]
                for a in arms}
        out[name] = entry
    return out


def _common(entry: dict, runs: list[dict], arms: list[str]) -> None:
    """``entry``'s figures at a common cost per CPU expert (module doc), where the runs have
    four-stream steps with CPU experts."""
    keys = ("tokens_per_step", "step_ms", "cpu_kernel_ms", "cpu_experts_per_step")
    usable = [(r["arm"], f, (r.get("acceptance_luck") or {}).get("luck")) for r in runs
              if all((f := r.get("steps", {}).get("four_stream", {})).get(k) for k in keys)]
    if not usable:
        return
    cost = statistics.median(f["cpu_kernel_ms"] / f["cpu_experts_per_step"]
                             for _, f, _ in usable)
    at = [(arm, 1e3 * f["tokens_per_step"] / (f["step_ms"] - f["cpu_kernel_ms"]
                                              + f["cpu_experts_per_step"] * cost), luck)
          for arm, f, luck in usable]
    entry["common_expert_ms"] = round(cost, 5)
    entry["four_stream_tps_at_common_expert_cost"] = {
        a: _median([v for arm, v, _ in at if arm == a]) for a in arms}
    # per arm whose drafting runs all measured their luck (off: none to measure); others None
    even = {a: [v / (luck or 1.0) for arm, v, luck in at if arm == a] for a in arms
            if a == "off" or all(luck for arm, _, luck in at if arm == a)}
    if any(a != "off" and v for a, v in even.items()):
        entry["acceptance_luck"] = {a: _median([luck for arm, _, luck in at if arm == a])
                                    for a in arms}
        entry["four_stream_tps_at_common_cost_expected_acceptance"] = {
            a: _median(even.get(a, [])) for a in arms}


def best_fixed(entry: dict, arms: list[str]) -> dict | None:
    """The adaptive budget against the best fixed draft length (wide arms), four-stream; and
    at a common cost per CPU expert (module doc), where the runs give it."""
    measured = _over_best_fixed(entry["four_stream_decode_tps"], arms)
    if measured is None:
        return None
    arm, tps, ratio = measured
    out = {"best_fixed_arm": arm, "best_fixed_tps": tps, "adaptive": ratio}
    common = _over_best_fixed(entry.get("four_stream_tps_at_common_expert_cost", {}), arms)
    if common is not None:
        out["at_common_expert_cost"] = {"best_fixed_arm": common[0], "adaptive": common[2]}
    even = _over_best_fixed(entry.get("four_stream_tps_at_common_cost_expected_acceptance",
                                      {}), arms)
    if even is not None:
        out["at_common_cost_expected_acceptance"] = {"best_fixed_arm": even[0],
                                                     "adaptive": even[2]}
    return out


def _over_best_fixed(tps: dict, arms: list[str]) -> tuple[str, float, dict] | None:
    """(the best fixed-length wide arm, its figure, each adaptive arm's over it) of a figure
    per arm; None without both kinds of arm. Arms with a "+VARIANT" (other config keys)
    are left out: their figures stand beside their twins' in the per-arm tables."""
    arms = [a for a in arms if "+" not in a]
    fixed = {a: tps[a] for a in arms if a.partition("@")[0] == "wide" and tps.get(a)}
    adaptive = {a: tps[a] for a in arms if a.startswith("adaptive") and tps.get(a)}
    if not fixed or not adaptive:
        return None
    arm = max(fixed, key=fixed.get)
    return arm, fixed[arm], {a: round(v / fixed[arm], 3) for a, v in adaptive.items()}


def table(summary: dict) -> str:
    """The markdown table of a summary (one row per workload and arm)."""
    arms, base = summary["arms"], summary.get("base", summary["arms"][0])
    rows = ["| workload | arm | four-stream decode tok/s | ratio over " + base + " (pairs) "
            "| whole-run tok/s | accepted per verify | CPU experts / step | step ms "
            "(CPU floor ms) | four-stream steps: CPU experts | ms (CPU floor ms) "
            "| tokens = plain |", "|" + "---|" * 11]
    for name, e in summary["by_workload"].items():
        for a in arms:
            ratios = e["four_stream_decode_tps_pair_ratios"].get(a)
            acc = e.get("accepted_per_verify", {}).get(a, {})
            exact = e.get("tokens_equal_plain", {}).get(a, [])
            rows.append("| " + " | ".join([
                name, a, _fmt(e["four_stream_decode_tps"][a]),
                ", ".join(f"{x:.2f}" for x in ratios) if ratios else "-",
                _fmt(e["whole_run_tps"][a]),
                ", ".join(f"{s} {v:.2f}" for s, v in acc.items() if v is not None) or "-",
                _fmt(e.get("cpu_experts_per_step", {}).get(a)),
                f"{_fmt(e.get('step_ms', {}).get(a))} "
                f"({_fmt(e.get('cpu_floor_ms', {}).get(a), 2)})",
                _fmt(e.get("four_stream_cpu_experts_per_step", {}).get(a)),
                f"{_fmt(e.get('four_stream_step_ms', {}).get(a))} "
                f"({_fmt(e.get('four_stream_cpu_floor_ms', {}).get(a), 2)})",
                "yes" if exact and all(exact) else "no" if exact else "-"]) + " |")
    return "\n".join(rows)


def _fmt(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def write_summary(out_dir: Path, head: dict, workloads: list[str], arms: list[str],
                  base: str) -> dict:
    """``out_dir/summary.json`` from every run file there (rewritten after each run, so a
    command cut by a time limit leaves the summary of what it ran). ``head``: the command,
    this machine and the model's facts; the summary's ``machine`` is the runs' own where they
    all ran on one (a summary of a device's runs made elsewhere with ``--pairs 0``)."""
    runs = load_runs(out_dir, workloads, arms)
    by_workload = summarize(runs, arms, base)
    machines: dict[str, list[dict]] = {}  # the runs of each machine, in the runs' order
    for r in runs:
        if r.get("machine"):
            machines.setdefault(_machine_id(r["machine"]), []).append(r)
    summary = {**head, "arms": arms, "base": base, "runs": len(runs),
               "by_workload": by_workload,
               "adaptive_vs_best_fixed": {n: best_fixed(e, arms)
                                          for n, e in by_workload.items()}}
    if len(machines) == 1 and set(machines) != {_machine_id(head["machine"])}:
        summary["machine"], summary["summarized_on"] = runs[-1]["machine"], head["machine"]
    elif len(machines) > 1:  # a benchmark resumed on other machines: which ran what
        summary["runs_by_machine"] = [
            {"machine": mine[0]["machine"],
             "runs": [f"{r['workload']}_{r['arm']}_{r['pair']}" for r in mine]}
            for mine in machines.values()]
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def load_runs(out_dir: Path, workloads: list[str], arms: list[str]) -> list[dict]:
    """Every run file of ``out_dir`` of these workloads and arms, whatever its pair (a
    command with ``--pairs 0 --resume`` summarizes what earlier commands ran)."""
    runs = []
    for name in workloads:
        for arm in arms:
            for f in sorted(out_dir.glob(f"{name}_{arm}_*.json")):
                if f.stem.rpartition("_")[2].isdigit():
                    runs.append(json.loads(f.read_text()))
    return runs
