"""Load a model with `tandem serve` under GPU budgets: memory, load time, one chat stream.

    python -m scripts.bench_load --model qwen3-next-80b-a3b --gpu-budget 32 \\
        --gpu-budget whole --out docs/bench/load_h200.json

``--model``: a name under configs/models, a config.json, or a model directory (a synthetic
one, made by ``python -m scripts.make_synthetic_model``, or a checkpoint). A name or a
config.json becomes a synthetic model directory under ``--work-dir`` once. For each
``--gpu-budget`` (GiB, or ``whole``: the device's size from nvidia-smi; no limit where it is
unknown) the script writes a config (split placement, bf16 on CuPy, 4 slots, speculation off,
a small prefix cache, the CPU workers' default cores), starts a fresh ``tandem serve`` on a free
loopback port with a private run dir, and records: experts per layer on each side and the
resident bytes (the memory plan, checked against the worker's "load plan" log line), the peak
host memory of the server's process tree and the GPU's peak (scripts/bench_load_probe.py),
seconds from start to /ready, and the decode rate of one greedy streaming chat. Each run is
checked against the streaming load's memory rules: peak host RSS <= host-resident bytes x
1.1 + 4 GiB (on NumPy the "GPU" weights live in host RAM and count as host-resident), peak
GPU <= budget.

Before any server starts, it prints ``df -h /dev/shm`` and MemAvailable and refuses (status
2) when a plan's CPU experts do not fit the shared memory or the plan does not fit host RAM.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from scripts.bench_common import command_line, machine, sse_chunks, wait_ready
from scripts.bench_load_probe import (
    GpuMemory,
    TreeMemory,
    load_facts,
    meminfo,
    nvidia_smi,
)
from scripts.bench_load_report import GIB, checks, merge, run_facts, table
from scripts.procs import free_port, process_tree, stop_server

PROMPT = "Write a Python function that reverses a string."


def parse_budget(text: str) -> float | None:
    """GiB as a float, or None for ``whole``."""
    if text == "whole":
        return None
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"a budget must be > 0 GiB or 'whole', got {text}")
    return value


def model_dir(spec: str, work: Path) -> Path:
    """The model directory to serve: ``spec`` itself when it is a directory, else a
    synthetic one made from the named config (once: reused when already there)."""
    path = Path(spec)
    if path.is_dir():
        return path.resolve()
    out = work / f"model-{path.parent.name if path.name == 'config.json' else path.stem}"
    if not (out / "synthetic.json").is_file():
        from scripts.make_synthetic_model import main as make  # noqa: PLC0415

        if make([spec, "--out", str(out)]) != 0:
            raise SystemExit(f"cannot make a synthetic model of {spec!r}")
    return out.resolve()




@dataclasses.dataclass
class Arm:
    """One budget's settings: ``budget_gib`` None is the whole device."""

    label: str
    budget_gib: float | None
    gpu_memory_gb: float | None  # what the TOML says (None: no key)
    placement: str


def arms(budgets: list[float | None], device_bytes: int | None) -> list[Arm]:
    """A split arm per budget. ``whole`` writes the device's size as the budget (the config
    needs a budget or a fixed split for placement 'split'); where no device size is known it
    means no limit, every expert on the backend (placement 'gpu')."""
    out = []
    for b in budgets:
        if b is not None:
            out.append(Arm(f"{b:g}", b, b, "split"))
        elif device_bytes is not None:
            gb = device_bytes // 2**20 / 1024  # whole MiB, as nvidia-smi counts them
            out.append(Arm("whole", gb, gb, "split"))
        else:
            out.append(Arm("whole", None, None, "gpu"))
    return out


def write_config(path: Path, *, model: Path, run_dir: Path, port: int, arm: Arm,
                 args: argparse.Namespace) -> Path:
    """The serve config of one arm (TOML)."""
    dtype = args.dtype or ("bfloat16" if args.backend == "cupy" else "float32")
    experts = [f'placement = "{arm.placement}"']
    if arm.gpu_memory_gb is not None:
        experts.append(f"gpu_memory_gb = {arm.gpu_memory_gb!r}")
    if args.cpu_experts_per_layer and arm.placement == "split":
        experts.append(f"cpu_experts_per_layer = {args.cpu_experts_per_layer}")
    path.write_text("\n".join([
        "# written by scripts/bench_load.py", "[model]", f"path = {json.dumps(str(model))}",
        f'dtype = "{dtype}"', f'backend = "{args.backend}"', "", "[server]",
        'host = "127.0.0.1"', f"port = {port}", f"run_dir = {json.dumps(str(run_dir))}", "",
        "[limits]", "max_queue = 8", "request_timeout_s = 900", "step_timeout_s = 300",
        f"worker_ready_timeout_s = {max(900.0, args.ready_timeout):g}", "",
        "[scheduler]", "max_slots = 4", f"max_context = {args.max_context}",
        "prefill_chunk = 512", "prefix_cache = true", "prefix_cache_max_mb = 256", "",
        "[experts]", *experts, "", "[speculation]", 'mode = "off"', "",
        "[logging]", 'level = "info"', "json = true", "", "[systemd]", "watchdog = false", ""]))
    return path


def plan_of(config_file: Path) -> Any:
    """The worker's memory plan for a written config (gpu_worker/memory_plan.py; PlanError
    when it does not fit the budget or host RAM). A config without a budget on CuPy is not
    planned here: that would open a CUDA context in this process."""
    from daemon.config import load_config  # noqa: PLC0415
    from daemon.lifecycle import worker_config  # noqa: PLC0415
    from gpu_worker.loader import load_config as model_config  # noqa: PLC0415
    from gpu_worker.memory_plan import plan_for_worker  # noqa: PLC0415

    config = load_config(config_file)
    worker = worker_config(config)
    backend = "numpy" if config.model.backend == "numpy" else "cupy"
    if backend == "cupy" and worker.gpu_memory_gb is None:
        return None
    return plan_for_worker(worker, model_config(config.model.path), backend=backend)


def preflight(todo: list[Arm], args: argparse.Namespace, model: Path, work: Path, shm: str
              ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Print the shared memory and MemAvailable, then each budget's memory plan; SystemExit
    when a plan does not fit host RAM (PlanError) or its CPU experts do not fit ``shm``.
    Returns what was found and the plans by budget label."""
    from gpu_worker.memory_plan import PlanError, describe  # noqa: PLC0415

    df = subprocess.run(["df", "-h", shm], capture_output=True, text=True).stdout.strip()
    avail = meminfo().get("MemAvailable")
    free = shutil.disk_usage(shm).free
    print(df)
    print(f"MemAvailable: {avail / GIB:.1f} GiB" if avail else "MemAvailable: unknown",
          flush=True)
    plans = {}
    for arm in todo:  # every plan checked before the first server starts
        cfg = write_config(work / f"plan-{arm.label}.toml", model=model,
                           run_dir=Path("/tmp/tbl-plan"), port=8000, arm=arm, args=args)
        try:
            plan = plans[arm.label] = plan_of(cfg)
        except PlanError as exc:
            for line in describe(exc.plan) if exc.plan is not None else []:
                print(f"  budget {arm.label}: {line}")
            raise SystemExit(f"bench_load: budget {arm.label}: memory plan refused: {exc}"
                             ) from None
        for line in describe(plan) if plan is not None else ["no plan made here"]:
            print(f"  budget {arm.label}: {line}")
        need = plan.cpu_resident_bytes if plan is not None else 0
        print(f"budget {arm.label}: CPU experts + ring {need / GIB:.1f} GiB of shared memory, "
              f"{free / GIB:.1f} GiB free in {shm}")
        if need > free:
            raise SystemExit(f"bench_load: budget {arm.label} puts {need / GIB:.1f} GiB of "
                             f"CPU experts in {shm}, which has {free / GIB:.1f} GiB free: "
                             f"enlarge it (sudo mount -o remount,size={int(need / GIB) + 8}G "
                             f"{shm}) or raise the GPU budget")
    return {"shm_dir": shm, "shm_df": df, "shm_free_bytes": free,
            "mem_available_bytes": avail}, plans


async def _chat(url: str, model: str, max_tokens: int) -> dict[str, Any]:
    import aiohttp  # noqa: PLC0415

    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    text, tokens, first, last = [], 0, None, None
    timeout = aiohttp.ClientTimeout(total=900)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        t0 = time.monotonic()
        async with s.post(url + "/v1/chat/completions", json=body) as r:
            r.raise_for_status()
            async for chunk in sse_chunks(r):
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta") or {}
                    piece = (delta.get("content") or "") + (delta.get("reasoning_content") or "")
                    if piece and first is None:  # not the role-only opening chunk
                        first = time.monotonic()
                    text.append(piece)
                    last = time.monotonic()
    rate = None
    if first is not None and last is not None and tokens > 1 and last > first:
        rate = (tokens - 1) / (last - first)  # the tokens after the first, over their time
    return {"decode_tokens_per_s_1_stream": rate, "completion_tokens": tokens,
            "ttft_s": None if first is None else first - t0, "answer_head": "".join(text)[:200]}


def one_run(arm: Arm, plan: Any, args: argparse.Namespace, model: Path, work: Path
            ) -> dict[str, Any]:
    """Serve ``model`` under one arm; everything measured, or ``error`` and the log's tail."""
    port = free_port()
    run_dir = Path(tempfile.mkdtemp(prefix="tbl-", dir="/tmp")) / "run"  # short ipc paths
    here = work / f"budget-{arm.label}"
    here.mkdir(parents=True, exist_ok=True)
    config = write_config(here / "tandem.toml", model=model, run_dir=run_dir, port=port,
                          arm=arm, args=args)
    log_file = here / "serve.log"
    url = f"http://127.0.0.1:{port}"
    rec: dict[str, Any] = {"model": args.model, "gpu_budget": arm.label,
                           "gpu_budget_gb": arm.budget_gib, "placement": arm.placement,
                           "config": str(config), "log": str(log_file)}
    gpu = GpuMemory(args.sample_every).start()
    t0 = time.monotonic()
    with open(log_file, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "daemon.cli", "serve", "--config",
                                 str(config)], stdout=log, stderr=subprocess.STDOUT)
    tree = TreeMemory(proc.pid, args.sample_every).start()
    pids: list[int] = []
    try:
        print(f"budget {arm.label}: serving on port {port}, log {log_file} ...", flush=True)
        wait_ready(url, proc, timeout=args.ready_timeout)
        rec["load_seconds"] = time.monotonic() - t0
        rec.update(asyncio.run(_chat(url, served_model(url), args.max_tokens)))
        pids = process_tree(proc.pid)
        tree.sample()  # the last VmHWM of every process, before they go
    except (SystemExit, OSError, ValueError) as exc:  # not ready, or the chat failed
        rec["error"] = str(exc) or type(exc).__name__
        print(f"budget {arm.label}: {rec['error']}", file=sys.stderr)
    finally:
        pids = pids or process_tree(proc.pid)
        tree.stop()
        gpu.stop()
        stop_server(proc, pids)
        shutil.rmtree(run_dir.parent, ignore_errors=True)
    rec.update(tree.report())
    rec.update(peak_gpu_bytes=gpu.peak, gpu_used_before_bytes=gpu.before)
    rec.update(run_facts(plan, load_facts(log_file)))
    budget = None if arm.budget_gib is None else int(arm.budget_gib * GIB)
    rec["checks"] = checks(rec, budget, numpy_backend=args.backend == "numpy")
    if "error" in rec:
        rec["log_tail"] = log_file.read_text(errors="replace").splitlines()[-30:]
    return rec


def served_model(url: str) -> str:
    """The model id the server answers to (its /v1/models)."""
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as r:
        return json.load(r)["data"][0]["id"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-next-80b-a3b",
                   help="a configs/models name, a config.json or a model directory")
    p.add_argument("--gpu-budget", type=parse_budget, action="append", dest="budgets",
                   help="GiB or 'whole'; repeat for several runs (default: 32 and whole)")
    p.add_argument("--backend", choices=("cupy", "numpy"), default="cupy")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cupy, else float32")
    p.add_argument("--cpu-experts-per-layer", type=int, default=0,
                   help="fix the split instead of letting the plan choose (0: the plan)")
    p.add_argument("--max-context", type=int, default=4096)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--ready-timeout", type=float, default=900.0)
    p.add_argument("--sample-every", type=float, default=0.2)
    p.add_argument("--work-dir", type=Path, default=None,
                   help="model, configs and logs (default: a new temporary directory)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--append", action="store_true",
                   help="keep the runs of other budgets already in --out (one budget per "
                        "command, e.g. under a per-command time limit)")
    args = p.parse_args(argv)
    budgets = args.budgets or [32.0, None]
    work = (args.work_dir or Path(tempfile.mkdtemp(prefix="bench-load-"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    model = model_dir(args.model, work)
    device = nvidia_smi("memory.total") if args.backend == "cupy" else None
    todo = arms(budgets, device)
    from cpu_experts.rings import shm_dir  # noqa: PLC0415

    try:
        pre, plans = preflight(todo, args, model, work, shm_dir())
    except SystemExit as exc:
        print(exc, file=sys.stderr)
        return 2
    runs = [one_run(arm, plans[arm.label], args, model, work) for arm in todo]
    result = {"benchmark": "bench_load", "command": command_line(), "machine": machine(),
              "model": args.model, "model_dir": str(model), "backend": args.backend,
              "device_memory_bytes": device, "preflight": pre, "runs": runs}
    print(table(runs))
    if args.out:
        if args.append and args.out.is_file():
            result = merge(json.loads(args.out.read_text()), result)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 1 if any("error" in r for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
