"""The daemon's own time per step, with fixed drafts and with the adaptive draft budget.

Between one step's result and the next step's plan the daemon's work is on the critical
path: ``Scheduler.commit`` (tokens, metrics, the budget's ``observe``) and
``Scheduler.plan`` (admission, each slot's work, the draft fit and the budget's
``choose``). The adaptive budget's other work (its estimates from the last step's routes
and time, the next fresh choice) runs while a step runs (``DraftBudget.between_steps``),
not here. This serves ``--requests`` requests of four MTP-drafting slots on the tiny
qwen3_next model in process (NumPy backend, experts split with the CPU workers, slot
routing on), the arms alternated over ``--pairs``, and gives the medians of both parts per
step::

    python -m scripts.bench_plan_host --out docs/bench/plan_host_devvm.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from daemon.config import SpeculationSection
from daemon.request import GenerationRequest
from daemon.scheduler import Scheduler
from gpu_worker.engine import load_model
from gpu_worker.runner import Runner
from protocol.messages import SamplingParams
from scripts.bench_common import command_line, emit_json, machine
from scripts.tiny_model import make_tiny_model

SLOTS = 4


class Worker:
    """The runner behind the scheduler's ``async step(plan)``."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner

    async def step(self, plan):
        await asyncio.sleep(0)
        return self.runner.execute(plan)


def _timed(fn, seconds: list[float]):
    """``fn``, each call's duration appended to ``seconds``."""
    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - t0)
    return timed


def serve(model, experts, budget: str, args: argparse.Namespace) -> dict:
    """One run: ``args.requests`` requests through a fresh scheduler; the medians (us)."""
    runner = Runner(model, max_slots=SLOTS, max_context=512, block_size=4, extra_blocks=32,
                    experts=experts, slot_routing=True)
    sched = Scheduler(max_slots=SLOTS, max_context=512, max_queue=64, prefill_chunk=16,
                      block_size=4, checkpoint_interval=8, prefix_blocks=32,
                      speculation=SpeculationSection(mode="wide", proposer="mtp",
                                                     num_drafts=args.drafts,
                                                     draft_budget=budget))
    sched.attach(Worker(runner))
    plan_s: list[float] = []
    commit_s: list[float] = []
    sched.plan, sched.commit = _timed(sched.plan, plan_s), _timed(sched.commit, commit_s)
    rng = np.random.default_rng(0)
    handles = [sched.submit(GenerationRequest(
        f"r{i}", rng.integers(5, 200, 24).tolist(), SamplingParams(temperature=0.0, seed=i),
        args.tokens)) for i in range(args.requests)]

    async def drain() -> None:
        loop = asyncio.create_task(sched.run())
        for h in handles:
            async for _ in h:
                pass
        loop.cancel()

    asyncio.run(drain())
    return {"plan_us": float(np.median(plan_s) * 1e6), "commit_us": float(np.median(commit_s)
                                                                         * 1e6),
            "steps": len(plan_s)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--drafts", type=int, default=3)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    runs: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_model(Path(tmp), "qwen3_next", seed=4, tokenizer=False)
        model, experts = load_model(path, placement="split", cpu_experts_per_layer=4,
                                    cpu_workers=1)
        try:
            for pair in range(args.pairs):
                arms = ("fixed", "adaptive") if pair % 2 == 0 else ("adaptive", "fixed")
                for budget in arms:
                    runs.append({"budget": budget, "pair": pair + 1,
                                 **serve(model, experts, budget, args)})
                    print(json.dumps(runs[-1]))
        finally:
            experts.close()
    medians = {b: {k: float(np.median([r[k] for r in runs if r["budget"] == b]))
                   for k in ("plan_us", "commit_us")} for b in ("fixed", "adaptive")}
    emit_json({"machine": machine(), "command": command_line(),
               "args": vars(args) | {"out": None}, "medians": medians, "runs": runs},
              args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
