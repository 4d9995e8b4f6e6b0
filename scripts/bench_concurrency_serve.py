"""What one run of the concurrency benchmark serves and what it reads back
(scripts/bench_concurrency.py): the config of each run, the server process, and the figures
taken from its ``/metrics``.

Every run gets its own TOML config, written from a base: ``--config FILE`` (paths resolved
against the file's directory) or ``--model NAME --gpu-budget GIB|whole`` (a synthetic model
directory and a split placement, as scripts/bench_load.py serves it), then ``--set KEY=VALUE``
overrides, then the run's own ``[server]`` port and run directory and its ``[speculation]``
section (the arm, the replay file, the record file). Under a GPU budget the split is fixed
once for all arms (``pin_placement``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tomllib
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from daemon.metrics import GRAPH_OUTCOMES
from daemon.proposers.replay import expected_accepted
from protocol.messages import WorkKind
from scripts.bench_common import REPO, Samples, delta, wait_ready
from scripts.bench_concurrency_arms import parse_set, run_config, set_keys
from scripts.procs import descendants, stop_server


def base_config(args: argparse.Namespace, work: Path) -> tuple[dict, dict]:
    """(the config every run starts from, facts for the summary: model, gpu_budget_gb)."""
    from daemon.config import _PATH_KEYS  # noqa: PLC0415 (the keys whose values are paths)

    if args.model:
        cfg, budget = synthetic_config(args, work)
    else:
        path = Path(args.config)
        cfg = tomllib.loads(path.read_text())
        for key in _PATH_KEYS:
            section, _, name = key.partition(".")
            value = cfg.get(section, {}).get(name)
            if isinstance(value, str) and value:
                cfg[section][name] = str((path.resolve().parent / value).resolve())
        budget = cfg.get("experts", {}).get("gpu_memory_gb")
    set_keys(cfg, parse_set(args.set))
    model = cfg.get("model", {})
    name = f"synthetic:{args.model}" if args.model else None
    facts = {"model": name or model.get("name") or Path(model.get("path", "")).name,
             "model_path": model.get("path"), "gpu_budget_gb": budget,
             "backend": model.get("backend"), "dtype": model.get("dtype"),
             "placement": cfg.get("experts", {}).get("placement", "gpu"),
             "prefix_cache_max_mb": cfg.get("scheduler", {}).get("prefix_cache_max_mb"),
             "checkpoint_interval": cfg.get("scheduler", {}).get("checkpoint_interval")}
    return cfg, facts


def pin_placement(cfg: dict, specs: list[dict], work: Path) -> int | None:
    """A split placement under a GPU budget, made the same in every arm: the memory plan
    keeps the speculation headroom off the budget (none with mode ``off``), so each arm would
    put a different number of experts on the GPU, and a request's tokens would differ
    between arms (GPU experts in the model's dtype, CPU ones in int8) as well as its speed.
    Sets ``experts.cpu_experts_per_layer`` to the plan of the arm (``specs``: their
    ``[speculation]`` keys) that leaves the fewest experts on the GPU, and returns it (None
    where the config has no budget, or fixes the split already)."""
    from daemon.config import load_config  # noqa: PLC0415
    from daemon.lifecycle import worker_config  # noqa: PLC0415
    from gpu_worker.loader import load_config as model_config  # noqa: PLC0415
    from gpu_worker.memory_plan import plan_for_worker  # noqa: PLC0415

    experts = cfg.get("experts", {})
    if (experts.get("placement") != "split" or experts.get("gpu_memory_gb") is None
            or experts.get("cpu_experts_per_layer")):
        return None
    cpu = 0
    for i, spec in enumerate(specs):  # (the proposer does not change the plan)
        spec = {**spec, "proposer": "suffix"} if spec["proposer"] == "replay" else spec
        config = load_config(write_toml(work / f"plan-{i}.toml", run_config(
            cfg, port=8000, run_dir=work, speculation=spec)))
        backend = "numpy" if config.model.backend == "numpy" else "cupy"
        plan = plan_for_worker(worker_config(config), model_config(config.model.path),
                               backend=backend, host_available_bytes=None)
        cpu = max(cpu, plan.experts_cpu_per_layer)
    experts["cpu_experts_per_layer"] = cpu
    return cpu


def synthetic_config(args: argparse.Namespace, work: Path) -> tuple[dict, float | str]:
    """A synthetic model's config at a GPU budget (GiB, or "whole": the device's size)."""
    from scripts.bench_load import model_dir  # noqa: PLC0415
    from scripts.bench_load_probe import nvidia_smi  # noqa: PLC0415

    budget: float | str = args.gpu_budget or "whole"
    if budget == "whole":
        device = nvidia_smi("memory.total")
        if device is None:
            raise SystemExit("--gpu-budget whole needs nvidia-smi (the device's size)")
        gb = device // 2**20 / 1024  # whole MiB, as nvidia-smi counts them
    else:
        gb = float(budget)
    cfg = {"model": {"path": str(model_dir(args.model, work)), "dtype": "bfloat16",
                     "backend": "cupy"},
           "limits": {"max_queue": 8, "request_timeout_s": 1800, "step_timeout_s": 300,
                      "worker_ready_timeout_s": 900},
           # the prefix cache of configs/qwen3-next-80b.toml: a checkpoint of the 80B holds
           # a 75 MiB copy of its GDN states, so 256 MB (bench_load's) kept ~3 for four
           # agents and every coding turn read its whole conversation again; 1024 MB keeps
           # ~13, and a checkpoint every 1024 tokens (not 256) makes 2-3 a turn, so each
           # agent's last one outlives the other three agents' turns
           "scheduler": {"max_slots": 4, "max_context": args.max_context,
                         "prefill_chunk": 512, "prefix_cache": True,
                         "prefix_cache_max_mb": 1024, "checkpoint_interval": 1024},
           "experts": {"placement": "split", "gpu_memory_gb": gb},
           "logging": {"level": "info", "json": True}, "systemd": {"watchdog": False}}
    return cfg, (gb if budget == "whole" else float(budget))


def write_toml(path: Path, cfg: dict) -> Path:
    """``cfg`` ({section: {key: scalar or list}}) as TOML (JSON scalars are TOML's)."""
    lines = ["# written by scripts/bench_concurrency.py"]
    for section, values in cfg.items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in values.items() if v is not None]
    path.write_text("\n".join(lines) + "\n")
    return path


BLAS_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


@contextlib.contextmanager
def serving(config: Path, port: int, log: Path, ready_timeout: float,
            blas_threads: int | None = None) -> Iterator[tuple[str, str]]:
    """A fresh ``tandem serve --config config``, ready: yields (base URL, model id); its
    output goes to ``log``; terminated on exit, and the exit waits until every process of
    its tree has ended: the next run's server needs the memory they hold (the 80B at a
    32 GiB budget: ~74 GiB of /dev/shm, 110 GiB on the H200, and ~28 GiB of the GPU).
    ``blas_threads``: the BLAS pool's threads in the server's processes (None: the
    environment's)."""
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ)
    if blas_threads:
        env.update({v: str(blas_threads) for v in BLAS_VARS})
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "daemon.cli", "serve", "--config",
                                 str(config)], stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                env=env)
        try:
            wait_ready(url, proc, ready_timeout)
            with urllib.request.urlopen(url + "/v1/models") as r:
                model = json.load(r)["data"][0]["id"]
            yield url, model
        finally:
            tree = descendants(proc.pid)
            left = stop_server(proc, tree)
            if left:
                print(f"server processes {left} of {config.name} did not end", flush=True)
            drop_shared_files(tree)


def start_facts(log: Path) -> dict[str, Any]:
    """What a server's start did, from its GPU worker's JSON log lines: the CUDA graphs
    captured before it was ready (layouts, graphs, seconds, the device's free GiB after) and
    whether the CPU experts' shards came from the shard cache."""
    out: dict[str, Any] = {}
    for line in log.read_text(errors="replace").splitlines() if log.is_file() else []:
        if not line.startswith("{"):
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("event") == "cuda graphs":
            out["graph_warm_up"] = {k: rec[k] for k in ("active", "warm_up", "buckets",
                                                        "layouts", "graphs", "refused",
                                                        "seconds", "device_free_gib")
                                    if k in rec}
        elif rec.get("event") == "load plan" and "cpu_shards_cached" in rec:
            out["cpu_shards_cached"] = rec["cpu_shards_cached"]
    return out


def drop_shared_files(pids: list[int]) -> None:
    """Unlink the shared-memory files (``tandem-<tag>-<pid>-<id>``, cpu_experts/rings.py)
    that these ended processes made: a server stopped before it was ready leaves its CPU
    experts' shard there (~73 GiB for the 80B at 32 GiB), and the next server would not fit."""
    from cpu_experts.rings import shm_dir  # noqa: PLC0415

    for pid in pids:
        for f in Path(shm_dir()).glob(f"tandem-*-{pid}-*"):
            print(f"removing {f}, left by a stopped server", flush=True)
            f.unlink(missing_ok=True)


def cpu_bytes_per_expert(config: Path) -> float | None:
    """One CPU expert's weight bytes in the CPU workers' format (the memory plan's figure;
    None where no plan is made here)."""
    from scripts.bench_load import plan_of  # noqa: PLC0415

    try:
        plan = plan_of(config)
    except Exception as exc:  # a figure of the report, not a reason to stop the run
        print(f"no memory plan for {config}: {exc}", flush=True)
        return None
    return None if plan is None else float(plan.cpu_bytes_per_expert)


def step_figures(after: Samples, before: Samples, per_expert: float | None,
                 dram_gbs: float) -> dict[str, float | None]:
    """Per step of the run (all steps, prompt work included): wall ms, CPU expert bytes,
    distinct CPU experts (bytes / one expert's bytes; each distinct expert of a layer is read
    once per step), and the CPU floor (bytes / ``dram_gbs``) beside the step time."""
    steps = delta(after, before, "tandem_step_seconds_count")
    if not steps:
        return {"steps": 0}
    step_ms = delta(after, before, "tandem_step_seconds_sum") / steps * 1e3
    cpu_bytes = delta(after, before, "tandem_cpu_expert_weight_bytes_total") / steps
    moe_steps = delta(after, before, "tandem_cpu_experts_seconds_per_layer_count")
    out: dict[str, float | None] = {
        "steps": steps, "step_ms": step_ms, "cpu_expert_bytes_per_step": cpu_bytes,
        "cpu_bytes_per_expert": per_expert, "dram_gbs": dram_gbs,
        "cpu_experts_per_step": (cpu_bytes * steps / moe_steps / per_expert
                                 if per_expert and moe_steps else None),
        **_cpu_floor(step_ms, cpu_bytes, dram_gbs),
        # the CPU workers' kernel time per step (the slowest worker's, summed over layers):
        # step_ms minus it is the round trips, the GPU's work and the host's
        "cpu_kernel_ms": delta(after, before, "tandem_cpu_experts_seconds_total") / steps * 1e3}
    out["cuda_graph_passes"] = {  # how the run's decode/verify passes ran (graphs or eager)
        o: delta(after, before, "tandem_cuda_graph_passes_total", outcome=o)
        for o in GRAPH_OUTCOMES}
    out["four_stream"] = steady_figures(after, before, per_expert, dram_gbs)
    return out


def steady_figures(after: Samples, before: Samples, per_expert: float | None,
                   dram_gbs: float, slots: int = 4) -> dict[str, float | None]:
    """The same figures for the steps of the four-stream decode windows alone (every slot
    decoding, no prompt work: the steps the decode TPS counts), from the daemon's
    ``steady_decode_*{slots}`` counters. Its step time runs from planning to commit (the
    decode TPS's clock), so it includes the host's planning that ``step_ms`` leaves out."""
    label = str(slots)
    steps = delta(after, before, "tandem_steady_decode_steps_total", slots=label)
    if not steps:
        return {"steps": 0}
    cpu_bytes = delta(after, before, "tandem_steady_decode_cpu_expert_weight_bytes_total",
                      slots=label) / steps
    step_ms = delta(after, before, "tandem_steady_decode_seconds_total", slots=label) / steps * 1e3
    parts = {part: delta(after, before, "tandem_steady_decode_part_seconds_total", slots=label,
                         part=part) / steps * 1e3 for part in ("worker", "forward", "slot_routing")}
    return {
        "steps": steps, "step_ms": step_ms,
        "tokens_per_step": delta(after, before, "tandem_steady_decode_tokens_total",
                                 slots=label) / steps,
        "cpu_expert_bytes_per_step": cpu_bytes,
        "cpu_experts_per_step": cpu_bytes / per_expert if per_expert else None,
        **_cpu_floor(step_ms, cpu_bytes, dram_gbs),
        "cpu_kernel_ms": delta(after, before, "tandem_steady_decode_cpu_experts_seconds_total",
                               slots=label) / steps * 1e3,
        # where the step went: the daemon's planning and commit (step_ms - worker), the
        # worker's passes, its per-slot experts (adaptive budget) and the rest of the
        # worker's round trip (transport, cache commands)
        "daemon_ms": step_ms - parts["worker"] if parts["worker"] else None,
        **{f"{part}_ms": ms for part, ms in parts.items()}}


def _cpu_floor(step_ms: float, cpu_bytes: float, dram_gbs: float) -> dict[str, float | None]:
    """A step's CPU floor (its CPU expert bytes at ``dram_gbs``) and the step over it."""
    floor = cpu_bytes / (dram_gbs * 1e9) * 1e3
    return {"cpu_floor_ms": floor, "step_over_cpu_floor": step_ms / floor if floor else None}


def budget_figures(after: Samples, before: Samples) -> dict | None:
    """The adaptive draft budget's estimates at the run's end and the draft counts it chose
    during the run (daemon/metrics_budget.py); None for another arm."""
    figures = {dict(labels)["figure"]: v for (name, labels), v in after.items()
               if name == "tandem_draft_budget"}
    if not figures:
        return None
    chosen = {dict(labels)["drafts"]: v - before.get((name, labels), 0.0)
              for (name, labels), v in after.items()
              if name == "tandem_draft_budget_choices_total"}
    return {"figures": figures, "drafts_chosen": {k: v for k, v in chosen.items() if v}}


def draft_figures(after: Samples, before: Samples) -> dict[str, dict[str, float]]:
    """Per draft source: slot verifications and mean accepted drafts per verification."""
    out = {}
    for source in ("mtp", "suffix", "global_suffix"):
        verifies = delta(after, before, "tandem_spec_verifies_total", source=source)
        if verifies:
            accepted = delta(after, before, "tandem_spec_accepted_by_source_tokens_total",
                             source=source)
            out[source] = {"verifies": verifies, "accepted": accepted,
                           "accepted_per_verify": accepted / verifies}
    return out


def replay_reference(path: Path) -> dict[str, list[int]]:
    """prompt key -> the plain run's continuation, from a replay file."""
    from daemon.proposers.replay import prompt_key  # noqa: PLC0415

    data = json.loads(path.read_text())
    return {prompt_key(r["prompt_ids"]): r["continuation"] for r in data["records"]}


def exactness(records: list[dict], reference: dict[str, list[int]]) -> dict[str, int]:
    """How a run's recorded requests compare with the plain run's (prompt key -> ids):
    ``equal`` (same prompt, same tokens), ``differ`` (same prompt, other tokens),
    ``unknown`` (a prompt the plain run never saw: an earlier turn differed)."""
    from daemon.proposers.replay import prompt_key  # noqa: PLC0415

    out = {"requests": len(records), "equal": 0, "differ": 0, "unknown": 0}
    for r in records:
        ref = reference.get(prompt_key(r["prompt_ids"]))
        out["unknown" if ref is None else "equal" if ref == r["continuation"] else "differ"] += 1
    return out


def acceptance_luck(trace: Path, skip: int, rate: float, slots: int | None = 4) -> dict | None:
    """How the replay's draws fell in a run's decode-only steps of ``slots`` slots (the
    four-stream kind; None: every decode slot of every step), from its step trace
    (daemon/step_trace.py) past its first ``skip`` lines (the warm-up): the tokens they gave
    (each decode slot's 1 + accepted drafts) against those the profile's ``rate`` makes
    expected of the drafts verified (1 + rate + ... + rate^k), and their ratio (``luck``:
    above 1, the draws the run met accepted more than the rate does on average). The replay
    draws by request and position, so arms that visit other positions meet other draws, the
    same ones every run (docs/benchmarks.md; scripts/replay_luck.py, offline)."""
    if not trace.is_file():
        return None
    lines = [json.loads(x) for x in trace.read_text().splitlines()[skip:] if x.strip()]
    decode = int(WorkKind.DECODE)
    verifies = [s for line in lines if slots is None or (len(line["slots"]) == slots and all(
        x[0] == decode for x in line["slots"])) for s in line["slots"] if s[0] == decode]
    if not verifies:
        return None
    got = sum(1 + s[3] for s in verifies)
    expected = sum(1 + expected_accepted(rate, s[2]) for s in verifies)
    return {"slot_steps": len(verifies), "tokens": got, "expected_tokens": round(expected, 3),
            "luck": round(got / expected, 5)}

