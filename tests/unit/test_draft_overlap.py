"""Draft overlap (issue 15 item 2, gpu_worker/draft_overlap.py): a pass's MTP drafter runs while
the CPU experts of the step's next pass are in flight. Through the scheduler and the real
Runner with a real CPU expert worker (split placement, float64, both architectures): the
tokens, the drafts and the head passes are those without overlap (and the tokens those of
plain decoding), narrow and wide, greedy and seeded, 1-4 slots; the head passes are issued
between ringing the CPU workers and awaiting them (an event recorder, not timing); the step
stats count them; the config key is checked at every boundary."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from daemon.config import ConfigError, SpeculationSection, load_config
from daemon.request import GenerationRequest
from daemon.scheduler import Scheduler
from gpu_worker.draft_overlap import DraftOverlap, overlap_status
from gpu_worker.engine import load_model
from gpu_worker.mtp_drafter import run_all
from gpu_worker.runner import Runner
from protocol.messages import SamplingParams
from protocol.worker_config import WorkerConfig
from scripts.tiny_model import make_tiny_model
from tests.harness import InProcessWorker, drain

PROMPTS = [[5, 6, 7, 8] * 5, list(range(20, 41)), [3, 1, 4, 1, 5, 9, 2, 6, 5, 3] * 2,
           [9, 8, 7, 6, 5] * 4]
CONTEXT = 160


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_moe"])
def split_model(request, tmp_path_factory):
    """A tiny float64 model with 4 of its experts per layer on a real CPU worker."""
    path = make_tiny_model(tmp_path_factory.mktemp("m"), request.param, seed=6,
                           tokenizer=False)
    model, experts = load_model(path, dtype="float64", placement="split",
                                cpu_experts_per_layer=4, cpu_workers=1)
    yield model, experts
    experts.close()


class _Trace:
    """What a run did, step by step: head passes (Model.mtp_forward calls) and events."""

    def __init__(self, model) -> None:
        self.events: list[str] = []
        self.head_passes: list[int] = []  # per step
        self._mtp = model.mtp_forward

    def mtp_forward(self, *args, **kwargs):
        self.head_passes[-1] += 1
        return self._mtp(*args, **kwargs)


def _serve(split_model, *, overlap: bool, mode: str, temperature: float, slots: int,
           n: int = 16, record: bool = False):
    model, experts = split_model
    trace = _Trace(model)
    runner = Runner(model, max_slots=slots, max_context=CONTEXT, block_size=4,
                    extra_blocks=48, experts=experts, draft_overlap=overlap)
    sched = Scheduler(max_slots=slots, max_context=CONTEXT, max_queue=8, prefill_chunk=8,
                      block_size=4, checkpoint_interval=8, prefix_blocks=48,
                      speculation=SpeculationSection(mode=mode, proposer="mtp", num_drafts=3))
    worker = InProcessWorker(runner)
    execute = runner.execute

    def traced(plan):
        trace.head_passes.append(0)
        trace.events.append("step")
        return execute(plan)

    runner.execute = traced
    model.mtp_forward = trace.mtp_forward
    pool = experts.pool
    start, finish = pool.start, pool.finish
    if record:
        if runner.overlap is not None:
            runner.overlap.record = trace.events.append

        def started(*args):
            start(*args)
            trace.events.append("experts_started")

        def awaited():
            out = finish()
            trace.events.append("experts_awaited")
            return out

        pool.start, pool.finish = started, awaited
    sched.attach(worker)
    handles = [sched.submit(GenerationRequest(
        f"r{i}", PROMPTS[i], SamplingParams(temperature=temperature, seed=21 + i), n - 2 * i,
        eos=False)) for i in range(slots)]
    try:
        out = asyncio.run(drain(sched, handles))
    finally:
        del model.mtp_forward  # the class's methods again
        if record:
            del pool.start, pool.finish
    return out, worker, trace, runner


def _plans(worker) -> list[list[tuple]]:
    return [[(w.slot, w.kind, w.start_pos, w.input_ids.tolist(), w.draft_ids.tolist())
             for w in p.slots] for p in worker.plans]


def _drafts(worker) -> list[list[list[int]]]:
    return [[list(r.drafts) for r in res.slots] for res in worker.results]


LAYOUTS = [("narrow", 1), ("narrow", 2), ("narrow", 3), ("narrow", 4), ("wide", 2), ("wide", 4)]


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "seeded"])
@pytest.mark.parametrize(("mode", "slots"), LAYOUTS, ids=[f"{m}-{s}" for m, s in LAYOUTS])
def test_overlap_keeps_drafts_and_tokens(split_model, mode, temperature, slots):
    model = split_model[0]
    if model.mtp is None and (mode, slots) not in (("narrow", 3), ("wide", 2)):
        pytest.skip("Qwen3-MoE has no drafter: two layouts show the key changes nothing")
    kw = dict(mode=mode, temperature=temperature, slots=slots)
    off, w_off, t_off, r_off = _serve(split_model, overlap=False, **kw)
    on, w_on, t_on, r_on = _serve(split_model, overlap=True, **kw)
    assert on == off
    if slots == 3 and mode == "narrow":  # and plain decoding's (test_speculation.py: all)
        assert on == _serve(split_model, overlap=False, mode="off", temperature=temperature,
                            slots=slots)[0]
    assert _plans(w_on) == _plans(w_off)
    assert _drafts(w_on) == _drafts(w_off)
    assert t_on.head_passes == t_off.head_passes  # the same head passes, step by step
    assert r_off.overlap is None
    if model.mtp is None:  # Qwen3-MoE: no drafter, nothing to overlap
        assert r_on.overlap is None and "no MTP head" in r_on.overlap_reason
        return
    assert r_on.overlap is not None
    assert sum(t_on.head_passes) > 0 and any(any(d) for d in _drafts(w_on))
    units = [(r.counters["draft_units"], r.counters["draft_units_overlapped"])
             for r in w_on.results if r.slots]
    assert [u for u, _ in units] == [h for h, p in zip(t_on.head_passes, w_on.plans,
                                                       strict=True) if p.slots]
    several = [i for i, r in enumerate(w_on.results) if r.counters.get("passes", 0) > 1]
    if mode == "narrow" and slots > 1:
        assert several  # steps of several passes: the drafter hides under the next one
        assert sum(o for _, o in units) > 0
        assert all(r.timings_ms["draft_overlapped"] > 0 for r in w_on.results
                   if r.counters.get("draft_units_overlapped"))
    else:  # one pass per step: nothing to hide the drafter under
        assert not several and all(o == 0 for _, o in units)


def test_head_passes_are_issued_while_cpu_experts_are_in_flight(split_model):
    model = split_model[0]
    if model.mtp is None:
        pytest.skip("Qwen3-MoE has no MTP head")
    _, worker, trace, _ = _serve(split_model, overlap=True, mode="narrow", temperature=0.0,
                                 slots=3, record=True)
    ev = trace.events
    overlapped = [i for i, e in enumerate(ev) if e == "draft_unit_overlapped"]
    assert len(overlapped) > 5
    for i in overlapped:  # between ringing the workers and awaiting them, one per load
        assert ev[i - 1] == "experts_started" and ev[i + 1] == "experts_awaited", ev[i - 3:i + 3]
    for i in (j for j, e in enumerate(ev) if e == "draft_unit_exposed"):
        # exposed only after the step's last load (the last pass's drafter)
        nxt = next((e for e in ev[i:] if e in ("step", "experts_started")), "step")
        assert nxt == "step", ev[i - 3:i + 3]
    per_step = " ".join(ev).split("step")[1:]
    counted = [r.counters.get("draft_units_overlapped", 0) for r in worker.results]
    assert [s.split().count("draft_unit_overlapped") for s in per_step] == counted
    deferred = sum(s.split().count("draft_deferred") for s in per_step)
    assert deferred == sum(s.split().count("draft_done") for s in per_step) > 0


# ---- the hooks without a CPU worker -----------------------------------------------------------
class _Experts:
    """A stand-in placement: the launched path's run_step (forward, then the stream awaited)."""

    launched, pool = True, object()

    def __init__(self, events: list[str]) -> None:
        self.events = events

    def run_step(self, forward):
        out = forward()
        self.events.append("stream_awaited")
        return out


def _steps(events: list[str], name: str, passes: int):
    for i in range(passes):
        events.append(f"{name}{i}")
        yield
    return {0: [name]}


def test_launched_path_drafts_after_enqueue_before_the_stream_is_awaited():
    events: list[str] = []
    overlap = DraftOverlap(_Experts(events), np, record=events.append)
    got = {}
    overlap.defer(_steps(events, "a", 2), got.update)
    assert overlap.run_pass(lambda: events.append("enqueued") or 7) == 7
    assert events == ["draft_deferred", "enqueued", "a0", "draft_unit_overlapped", "a1",
                      "draft_unit_overlapped", "draft_done", "stream_awaited"]
    assert got == {0: ["a"]}
    timings, counters = overlap.take_stats()
    assert counters == {"draft_units": 2, "draft_units_overlapped": 2}
    assert timings["draft"] >= timings["draft_overlapped"] > 0
    assert overlap.take_stats()[1] == {"draft_units": 0, "draft_units_overlapped": 0}
    overlap.defer(_steps(events, "b", 3), got.update)
    overlap.discard()  # a failed step
    overlap.drain()
    assert "b0" not in events and got == {0: ["a"]}
    assert run_all(_steps([], "c", 3)) == {0: ["c"]}


def test_overlap_status_says_when_and_why():
    class Model:
        mtp = {"fc.weight": 0}

    class Placement:
        pool, launched = object(), False

    assert overlap_status(False, Model(), Placement()) == (False,
                                                           "speculation.draft_overlap = false")
    Model.mtp = None
    assert "no MTP head" in overlap_status(True, Model(), Placement())[1]
    Model.mtp = {}
    assert "no CPU experts" in overlap_status(True, Model(), None)[1]
    active, reason = overlap_status(True, Model(), Placement())
    assert active and reason.startswith("host path")
    Placement.launched = True
    assert overlap_status(True, Model(), Placement())[1].startswith("launched")


# ---- the config key at every boundary -----------------------------------------------------------
def test_the_config_key_is_checked_everywhere(tmp_path):
    from daemon.commands import run_check_config
    from daemon.lifecycle import worker_config

    assert SpeculationSection().draft_overlap is False
    for bad in ("yes", 1, None):
        with pytest.raises(ConfigError, match="speculation.draft_overlap: must be true or false"):
            SpeculationSection(draft_overlap=bad)
    for bad in ("true", 0):
        with pytest.raises(ValueError, match="draft_overlap must be a bool"):
            WorkerConfig(run_dir="/r", model="/m", draft_overlap=bad)
    cfg = WorkerConfig(run_dir="/r", model="/m", draft_overlap=True)
    assert WorkerConfig.from_json(cfg.to_json()).draft_overlap is True
    with pytest.raises(ValueError, match="draft_overlap"):
        WorkerConfig.from_json(json.dumps({"run_dir": "/r", "model": "/m",
                                           "draft_overlap": "on"}))
    model = make_tiny_model(tmp_path / "m", "qwen3_next", seed=1, tokenizer=False)

    def toml(value: str, mode: str = "narrow") -> str:
        path = tmp_path / f"c{abs(hash((value, mode)))}.toml"
        path.write_text(f'[model]\npath = "{model}"\n[speculation]\nmode = "{mode}"\n'
                        f'proposer = "mtp"\ndraft_overlap = {value}\n')
        return str(path)

    assert worker_config(load_config(toml("true"))).draft_overlap is True
    assert worker_config(load_config(toml("true", "off"))).draft_overlap is False
    assert worker_config(load_config(toml("false"))).draft_overlap is False
    with pytest.raises(ConfigError, match="speculation.draft_overlap"):
        load_config(toml('"yes"'))

    class Args:
        config = toml("1")

    assert run_check_config(Args) == 2
    Args.config = toml("true")
    assert run_check_config(Args) == 0
