"""CUDA graphs of decode and verify passes (gpu_worker/step_graph.py) give eager execution's
bits: tiny bf16 models of both architectures, three concurrent requests through the real
scheduler and Runner (prefill, decode, narrow and wide verification, greedy and seeded
sampling, KV blocks allocated every 4 tokens between replays), once eager and once with
graphs. Tokens, accepted drafts, and every byte of the KV cache and GDN states at the end
must be equal, and the graph run must have replayed graphs."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from daemon.config import SpeculationSection
from daemon.request import GenerationRequest
from daemon.scheduler import Scheduler
from gpu_worker.engine import Engine
from gpu_worker.graph_warm import layouts, mtp_layouts, one_per_bucket
from gpu_worker.model_config import ModelConfig
from gpu_worker.runner import Runner
from gpu_worker.weights.routing import RoutingParams
from gpu_worker.weights.synthetic import SyntheticSource
from protocol.messages import (
    CacheOp,
    CacheOpKind,
    DraftSource,
    SamplingParams,
    SlotWork,
    StepPlan,
    WorkKind,
)
from scripts.tiny_model import DEFAULT_SIZES, build_config, make_tiny_model
from tests.harness import InProcessWorker, drain
from tests.unit.test_speculation import CONTEXT, PROMPTS, SLOTS

cupy = pytest.importorskip("cupy")
# the CPU emulator (scripts/cuda_emu) captures as a GPU does: a graph records the launches
# with their arguments and a replay runs them again over the memory as it is then
# (scripts/cuda_emu/graph.py), so a value frozen at capture shows there too; shorter runs
EMULATED = "cpu-emulator" in cupy.__version__


def _daemons_caches(runner: Runner) -> list[np.ndarray]:
    """The KV pools and GDN states of the daemon's slots, on the host: without the capacity
    buckets' scratch slot's KV blocks (the highest ids; it has no state)."""
    caches, graphs = runner.caches, runner.graphs
    scratch = None if graphs is None else graphs.scratch
    blocks = caches.kv.num_blocks - (0 if scratch is None else len(caches.kv.tables[scratch]))
    pools = [a[:, :blocks].get() for a in (caches.kv.k, caches.kv.v)]
    if caches.states is not None:
        pools += [caches.states.conv.get(), caches.states.rec.get()]
    return pools


def _drive(runner: Runner, mode: str, requests, **spec) -> tuple[list, InProcessWorker]:
    """The scheduler over ``runner``, speculation ``mode`` (suffix drafts unless ``spec``
    says otherwise), serving ``requests`` ((prompt, SamplingParams, max tokens) each) to the
    end."""
    sched = Scheduler(max_slots=SLOTS, max_context=CONTEXT, max_queue=4, prefill_chunk=16,
                      block_size=4, checkpoint_interval=8, prefix_blocks=32,
                      speculation=SpeculationSection(mode=mode, **{"min_match": 1, **spec}))
    worker = InProcessWorker(runner)
    sched.attach(worker)
    handles = [sched.submit(GenerationRequest(f"r{i}", p, params, n, eos=False))
               for i, (p, params, n) in enumerate(requests)]
    return asyncio.run(drain(sched, handles)), worker


def _serve(model, graphs: bool, mode: str, temperature: float, n: int = 40):
    runner = Runner(model, max_slots=SLOTS, max_context=CONTEXT, block_size=4,
                    extra_blocks=32, cuda_graphs=graphs)
    assert (runner.graphs is not None) == graphs, runner.graphs_reason
    out, worker = _drive(runner, mode, [
        (p, SamplingParams(temperature=temperature, seed=11 + i), n - 3 * i)
        for i, p in enumerate(PROMPTS)])
    pools = _daemons_caches(runner)
    replays = sum(res.counters.get("graph_replays", 0) for res in worker.results)
    accepted = [r.num_accepted for res in worker.results for r in res.slots]
    refused = runner.graphs.refused if runner.graphs is not None else {}
    return out, accepted, pools, (replays, refused)


@pytest.mark.parametrize("mode", ["off", "narrow", "wide"])
@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "sampled"])
def test_graphs_give_the_bits_of_eager_passes(bf16_model, mode, temperature):
    model = bf16_model
    if EMULATED and (mode, temperature) != ("wide", 0.9):
        pytest.skip("the emulator runs one combination (slow)")
    n = 16 if EMULATED else 40
    eager, acc_e, pools_e, replays_e = _serve(model, False, mode, temperature, n)
    graphed, acc_g, pools_g, replays_g = _serve(model, True, mode, temperature, n)
    assert replays_e[0] == 0 and replays_g[0] > 0, replays_g[1]
    assert graphed == eager
    assert acc_g == acc_e
    for a, b in zip(pools_e, pools_g, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8))


def test_the_reason_is_given_where_graphs_are_not_taken(bf16_model):
    runner = Runner(bf16_model, max_slots=SLOTS, max_context=CONTEXT, block_size=4,
                    cuda_graphs=False)
    assert runner.graphs is None and "cuda_graphs = false" in runner.graphs_reason


def _serve_split(path, graphs: bool, mode: str, slot_routing: bool = False):
    engine = Engine.from_dir(path, dtype="bfloat16", backend="cupy", placement="split",
                             cpu_experts_per_layer=3, cpu_workers=1, max_slots=SLOTS,
                             max_len=CONTEXT)
    try:
        assert engine.placement.launched
        runner = Runner(engine.model, max_slots=SLOTS, max_context=CONTEXT, block_size=4,
                        extra_blocks=32, experts=engine.placement, cuda_graphs=graphs,
                        slot_routing=slot_routing)
        assert (runner.graphs is not None) == graphs, runner.graphs_reason
        out, worker = _drive(runner, mode, [
            (p, SamplingParams(temperature=0.8 if i else 0.0, seed=i), 32)
            for i, p in enumerate(PROMPTS)])
        counters = [r.counters for r in worker.results]
        if slot_routing:  # each slot's CPU experts and rows per expert, per step
            counters = [(c, [(r.slot, bytes(r.cpu_experts), bytes(r.cpu_expert_rows))
                             for r in res.slots]) for c, res in zip(counters, worker.results,
                                                                   strict=True)]
        refused = runner.graphs.refused if runner.graphs is not None else {}
        return out, counters, refused
    finally:
        engine.close()


@pytest.mark.parametrize("mode", ["off", "wide"])
def test_graphs_with_cpu_experts_give_the_tokens_and_counts_of_eager_passes(tmp_path, mode):
    """Split placement, the launched ring inside the graph: each replay takes fresh sequence
    numbers and distinct-expert tags, and the workers' partials arrive as in eager passes."""
    path = make_tiny_model(tmp_path, "qwen3_next", seed=5, tokenizer=False,
                           moe_intermediate=64, std=0.1)
    eager, c_eager, _ = _serve_split(path, False, mode)
    graphed, c_graph, refused = _serve_split(path, True, mode)
    assert sum(c.get("graph_replays", 0) for c in c_graph) > 0, refused
    assert graphed == eager
    keys = ("moe_layers", "cpu_experts", "gpu_experts")
    assert [[c.get(k) for k in keys] for c in c_graph] == [[c.get(k) for k in keys]
                                                           for c in c_eager]


@pytest.mark.parametrize("mode", ["narrow", "wide"])
def test_graphs_report_each_slots_cpu_experts_as_eager_passes(tmp_path, mode):
    """Per-slot expert tracking (the adaptive draft budget) inside graphs: the routes a
    replay writes are read with that pass's slots; every step's report equals eager's."""
    path = make_tiny_model(tmp_path, "qwen3_next", seed=6, tokenizer=False,
                           moe_intermediate=64, std=0.1)
    eager, r_eager, _ = _serve_split(path, False, mode, slot_routing=True)
    graphed, r_graph, refused = _serve_split(path, True, mode, slot_routing=True)
    assert sum(c.get("graph_replays", 0) for c, _ in r_graph) > 0, refused
    assert graphed == eager
    assert any(experts for _, slots in r_eager for _, experts, _ in slots)
    assert [slots for _, slots in r_graph] == [slots for _, slots in r_eager]


def test_decode_layouts_are_captured_before_serving(bf16_model):
    """Runner.warm_graphs (the worker calls it before READY): one graph per slot count, the
    slots free again, and plain decoding then replays them without capturing, giving the
    tokens of an eager runner."""
    runner = Runner(bf16_model, max_slots=SLOTS, max_context=CONTEXT, block_size=4,
                    extra_blocks=32, cuda_graphs=True)
    free = runner.kv.allocator.num_free
    warm = runner.warm_graphs()
    assert warm["graphs"] == SLOTS and warm["refused"] == 0 and warm["seconds"] > 0
    assert not runner.lengths and runner.kv.allocator.num_free == free
    requests = [(p, SamplingParams(temperature=0.7, seed=3 + i), 12) for i, p in
                enumerate(PROMPTS)]
    out, worker = _drive(runner, "off", requests)
    assert runner.graphs.totals["graph_captures"] == SLOTS  # none while serving
    assert sum(res.counters.get("graph_replays", 0) for res in worker.results) > 0
    eager = Runner(bf16_model, max_slots=SLOTS, max_context=CONTEXT, block_size=4,
                   extra_blocks=32)
    assert out == _drive(eager, "off", requests)[0]


@pytest.mark.parametrize("buckets", [True, False], ids=["buckets", "exact"])
def test_mtp_drafts_with_graphs_give_the_tokens_of_eager_passes(bf16_model, buckets):
    """The MTP head drafts from the hidden rows a replayed graph wrote, its passes as one
    graph of their own (gpu_worker/mtp_graph.py: the head over the committed rows, then each
    chained draft on the device's argmax): every step's drafts, the tokens and the KV bytes
    equal eager passes'."""
    if bf16_model.mtp is None:
        pytest.skip("this tiny architecture has no MTP head")
    _mtp_graphs_equal_eager(bf16_model, buckets)


def test_mtp_graphs_route_a_synthetic_model_as_its_eager_head():
    """A synthetic model's head routes by the routing kernel inside the graph (the host's
    routing model when eager): the same drafts, tokens and KV bytes."""
    cfg = ModelConfig.from_dict(build_config("qwen3_next", DEFAULT_SIZES, "bfloat16", [0]))
    src = SyntheticSource(cfg, seed=5, routing=RoutingParams(0.7, 0.4))
    model = Engine.from_dir(src, dtype="bfloat16", backend="cupy", max_slots=SLOTS,
                            max_len=CONTEXT).model
    assert model.mtp is not None and model.routing is not None
    _mtp_graphs_equal_eager(model, True)


def _mtp_graphs_equal_eager(model, buckets: bool) -> None:
    """Eager, graphs with eager drafting (``graph_mtp`` False), graphs with MTP graphs."""
    requests = [(p, SamplingParams(temperature=0.8, seed=5 + i), 8 if EMULATED else 40)
                for i, p in enumerate(PROMPTS)]
    out = []
    for graphs, mtp_graph in ((False, False), (True, False), (True, True)):
        runner = Runner(model, max_slots=SLOTS, max_context=CONTEXT, block_size=4,
                        extra_blocks=32, cuda_graphs=graphs, graph_buckets=buckets,
                        graph_mtp=mtp_graph)
        got, worker = _drive(runner, "wide", requests, proposer="mtp", num_drafts=3)
        drafted = sum(len(w.draft_ids) for p in worker.plans for w in p.slots)
        replays = sum(r.counters.get("graph_replays", 0) for r in worker.results)
        mtp = sum(r.counters.get("mtp_graph_replays", 0) for r in worker.results)
        assert drafted > 0 and (replays > 0) == graphs and (mtp > 0) == mtp_graph
        drafts = [[(r.slot, list(r.drafts)) for r in res.slots] for res in worker.results]
        out.append((got, drafts, _daemons_caches(runner)[:2]))
    for other in out[1:]:
        assert other[0] == out[0][0] and other[1] == out[0][1]
        for a, b in zip(out[0][2], other[2], strict=True):
            assert np.array_equal(a.view(np.uint8), b.view(np.uint8))


def test_verify_layouts_are_captured_before_serving(bf16_model):
    """With speculation, warm_graphs also captures every verify layout the daemon can plan
    (gpu_worker/graph_warm.py) and makes the shared buffers as big as they will get: wide
    serving with drafts of varying length then replays from its first pass, never running a
    layout eagerly or capturing one, and gives the tokens of an eager runner."""
    drafts = 1 if EMULATED else 3
    kw = dict(max_slots=SLOTS, max_context=CONTEXT, block_size=4, extra_blocks=32,
              max_drafts=drafts, speculation_mode="wide")
    runner = Runner(bf16_model, cuda_graphs=True, **kw)
    free = runner.kv.allocator.num_free
    warm = runner.warm_graphs()
    # one pass per graph: a capacity bucket's passes share one (graph_warm.one_per_bucket)
    assert warm["layouts"] == len(one_per_bucket(layouts(SLOTS, drafts, "wide"))) > SLOTS
    assert warm["graphs"] == warm["layouts"] and warm["refused"] == 0
    assert not runner.lengths and runner.kv.allocator.num_free == free
    before = dict(runner.graphs.totals)
    requests = [(p, SamplingParams(temperature=0.7, seed=3 + i), 10 if EMULATED else 40)
                for i, p in enumerate(PROMPTS)]
    spec = {"num_drafts": drafts}
    out, worker = _drive(runner, "wide", requests, **spec)
    drafted = sum(len(w.draft_ids) for p in worker.plans for w in p.slots)
    after = runner.graphs.totals
    assert drafted > 0 and after["graph_replays"] > before["graph_replays"]
    for k in ("graph_captures", "graph_first_runs", "graph_refused"):
        assert after[k] == before[k], k
    assert out == _drive(Runner(bf16_model, **kw), "wide", requests, **spec)[0]


def _split_passes(model, graphs: bool, splits, buckets: bool = True) -> tuple[list, list]:
    """Three slots with a 3-token prompt each, then one decode pass per entry of ``splits``
    (each slot's drafts, random ids, seeded sampling): every pass's (tokens, accepted), graph
    replays and padding rows, and the daemon's KV and GDN state bytes at the end."""
    runner = Runner(model, max_slots=3, max_context=64, block_size=4, extra_blocks=8,
                    cuda_graphs=graphs, graph_buckets=buckets)
    params, rng = SamplingParams(temperature=0.8, seed=7), np.random.default_rng(1)
    for s in range(3):
        runner.execute(StepPlan(step_id=s + 1, cache_ops=[CacheOp(op=CacheOpKind.ALLOCATE,
                                                                   slot=s)],
                                slots=[SlotWork(slot=s, request_id=f"r{s}",
                                                kind=WorkKind.PREFILL,
                                                input_ids=np.array([3 + s, 5, 7], np.int32),
                                                start_pos=0, num_tokens=3, prompt_len=3,
                                                needs_logits=True, sampling=params)]))
    out = []
    for i, drafts in enumerate(splits):
        res = runner.execute(StepPlan(step_id=10 + i, slots=[SlotWork(
            slot=s, request_id=f"r{s}", kind=WorkKind.DECODE,
            input_ids=np.array([9 + s], np.int32), start_pos=runner.lengths[s], num_tokens=1,
            prompt_len=3, needs_logits=True, sampling=params,
            draft_ids=rng.integers(0, 50, d).astype(np.int32),
            draft_sources=np.full(d, DraftSource.MTP, np.uint8))
            for s, d in enumerate(drafts)]))
        out.append(([(r.token_ids, r.num_accepted) for r in res.slots],
                    res.counters.get("graph_replays", 0), res.counters.get("padding_rows", 0)))
    return out, _daemons_caches(runner)


def test_a_graph_replays_other_splits_of_its_rows_with_eager_bits(bf16_model):
    """step_graph.layout_key keeps one graph per rows and slots: captured for drafts (2, 0)
    it replays (1, 1) and (0, 2); captured for (3, 0, 1), it replays (2, 1, 1), (1, 2, 1)
    and (0, 0, 4). Tokens, accepted drafts and every KV and GDN state byte equal eager."""
    splits = [(2, 0), (2, 0), (1, 1), (0, 2), (3, 0, 1), (3, 0, 1), (2, 1, 1), (1, 2, 1),
              (0, 0, 4)]
    eager, pools_e = _split_passes(bf16_model, False, splits)
    graphed, pools_g = _split_passes(bf16_model, True, splits, buckets=False)
    assert [r for _, r, _ in graphed] == [0, 1, 1, 1, 0, 1, 1, 1, 1]  # first runs, replays
    assert [t for t, _, _ in graphed] == [t for t, _, _ in eager]
    assert {p for _, _, p in graphed + eager} == {0}  # no buckets: nothing padded
    for a, b in zip(pools_e, pools_g, strict=True):
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8))


def test_a_buckets_graph_serves_its_rows_padded_with_eager_bits(bf16_model):
    """Capacity buckets (gpu_worker/graph_buckets.py): three slots' passes of 5, 6 and 7 rows
    are padded to 8 on the scratch slot and share one graph (its first pass eager, padded
    as the graph runs it); 8 rows is a graph of its own. Tokens, accepted drafts and the
    daemon's KV and GDN state bytes equal unpadded eager passes'; the step counts the rows
    it padded (``padding_rows``: the adaptive draft budget's step cost reads them)."""
    splits = [(2, 0, 0), (1, 1, 1), (3, 1, 0), (0, 0, 2), (2, 2, 1), (2, 2, 1)]
    eager, pools_e = _split_passes(bf16_model, False, splits)
    graphed, pools_g = _split_passes(bf16_model, True, splits)
    assert [r for _, r, _ in graphed] == [0, 1, 1, 1, 0, 1]
    assert [p for _, _, p in graphed] == [3, 2, 1, 3, 0, 0]  # rows 5, 6, 7, 5, 8, 8
    assert [p for _, _, p in eager] == [0] * 6
    assert [t for t, _, _ in graphed] == [t for t, _, _ in eager]
    for a, b in zip(pools_e, pools_g, strict=True):
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8))


def test_mtp_drafting_graphs_are_captured_before_serving(bf16_model):
    """With MTP drafts asked (WorkerConfig.mtp_drafts), warm_graphs also captures the MTP
    drafting graph of every head-pass layout (graph_warm.mtp_layouts); MTP serving then
    captures nothing and runs no drafting eagerly, with the tokens of an eager runner."""
    if bf16_model.mtp is None:
        pytest.skip("this tiny architecture has no MTP head")
    drafts = 1 if EMULATED else 3
    kw = dict(max_slots=SLOTS, max_context=CONTEXT, block_size=4, extra_blocks=32,
              max_drafts=drafts, speculation_mode="wide")
    runner = Runner(bf16_model, cuda_graphs=True, mtp_drafts=drafts, **kw)
    free = runner.kv.allocator.num_free
    warm = runner.warm_graphs()
    want = len(mtp_layouts(SLOTS, drafts, "wide", True))
    assert runner.graphs.totals["mtp_graph_captures"] == want > SLOTS
    assert warm["refused"] == 0 and not runner.lengths
    assert runner.kv.allocator.num_free == free
    before = dict(runner.graphs.totals)
    requests = [(p, SamplingParams(temperature=0.7, seed=3 + i), 10 if EMULATED else 40)
                for i, p in enumerate(PROMPTS)]
    spec = {"proposer": "mtp", "num_drafts": drafts}
    out, worker = _drive(runner, "wide", requests, **spec)
    after = runner.graphs.totals
    assert after["mtp_graph_replays"] > before["mtp_graph_replays"]
    for k in ("mtp_graph_captures", "mtp_graph_first_runs", "mtp_graph_refused"):
        assert after[k] == before[k], k
    assert out == _drive(Runner(bf16_model, **kw), "wide", requests, **spec)[0]
