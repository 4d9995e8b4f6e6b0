"""daemon.metrics: what the text exposition says after each call, parsed with
prometheus_client's own parser; registries are private to each Metrics."""

from __future__ import annotations

import prometheus_client
from prometheus_client.parser import text_string_to_metric_families

from daemon.metrics import Metrics, NullMetrics, StepStats


def _samples(metrics: Metrics) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _value(metrics: Metrics, name: str, **labels: str) -> float | None:
    return _samples(metrics).get((name, tuple(sorted(labels.items()))))


def test_request_counters():
    m = Metrics()
    m.request_received("chat_completions")
    m.request_received("chat_completions")
    m.request_received("completions")
    m.request_rejected("queue_full")
    m.request_finished("stop", prompt_tokens=10, completion_tokens=5, cached_tokens=4)
    m.request_finished("length", prompt_tokens=7, completion_tokens=3)
    assert _value(m, "tandem_requests_received_total", endpoint="chat_completions") == 2
    assert _value(m, "tandem_requests_received_total", endpoint="completions") == 1
    assert _value(m, "tandem_requests_rejected_total", reason="queue_full") == 1
    assert _value(m, "tandem_requests_finished_total", finish_reason="stop") == 1
    assert _value(m, "tandem_requests_finished_total", finish_reason="length") == 1
    assert _value(m, "tandem_prompt_tokens_total") == 17
    assert _value(m, "tandem_generation_tokens_total") == 8
    assert _value(m, "tandem_prompt_cached_tokens_total") == 4


def test_latency_histograms_bucket_their_observations():
    m = Metrics()
    for s in (0.02, 0.3, 7.0):
        m.observe_ttft(s)
    m.observe_itl(0.015)
    assert _value(m, "tandem_time_to_first_token_seconds_count") == 3
    assert _value(m, "tandem_time_to_first_token_seconds_sum") == 7.32
    assert _value(m, "tandem_time_to_first_token_seconds_bucket", le="0.025") == 1
    assert _value(m, "tandem_time_to_first_token_seconds_bucket", le="0.5") == 2
    assert _value(m, "tandem_time_to_first_token_seconds_bucket", le="5.0") == 2
    assert _value(m, "tandem_time_to_first_token_seconds_bucket", le="+Inf") == 3
    assert _value(m, "tandem_inter_token_latency_seconds_bucket", le="0.01") == 0
    assert _value(m, "tandem_inter_token_latency_seconds_bucket", le="0.02") == 1


def test_gauges_follow_the_latest_value():
    m = Metrics()
    m.set_queue_depth(3)
    m.set_active_slots(4)
    m.set_kv_usage(used_blocks=30, total_blocks=120)
    m.set_queue_depth(1)
    assert _value(m, "tandem_queue_depth") == 1
    assert _value(m, "tandem_active_slots") == 4
    assert _value(m, "tandem_kv_blocks_used") == 30
    assert _value(m, "tandem_kv_blocks_total") == 120
    assert _value(m, "tandem_kv_usage_ratio") == 0.25
    m.set_kv_usage(0, 0)
    assert _value(m, "tandem_kv_usage_ratio") == 0


def test_steps():
    m = Metrics()
    m.observe_step(0.004, rows=8, prompt_tokens=0, decode_tokens=8)
    m.observe_step(0.150, rows=512, prompt_tokens=510, decode_tokens=2)
    assert _value(m, "tandem_step_seconds_count") == 2
    assert _value(m, "tandem_step_seconds_bucket", le="0.005") == 1
    assert _value(m, "tandem_step_rows_bucket", le="8.0") == 1
    assert _value(m, "tandem_step_rows_bucket", le="512.0") == 2
    assert _value(m, "tandem_step_prompt_tokens_total") == 510
    assert _value(m, "tandem_step_decode_tokens_total") == 10


def _step(**over) -> StepStats:
    fields = dict(seconds=0.5, rows=16, prompt_tokens=0, decode_tokens=16, emitted=20,
                  active_slots=4, queue_depth=2, steady_seconds=0.6, steady_slots=4,
                  counters={"kv_total_blocks": 100, "kv_free_blocks": 75, "moe_layers": 2,
                            "gpu_experts": 10, "cpu_experts": 6, "cpu_expert_bytes": 4096},
                  cpu_expert_seconds=0.002)
    return StepStats(**{**fields, **over})


def test_record_step_updates_every_figure_of_a_step():
    m = Metrics()
    m.record_step(_step())
    assert _value(m, "tandem_step_seconds_count") == 1
    assert _value(m, "tandem_step_decode_tokens_total") == 16
    assert (_value(m, "tandem_active_slots"), _value(m, "tandem_queue_depth")) == (4, 2)
    assert (_value(m, "tandem_kv_blocks_used"), _value(m, "tandem_kv_usage_ratio")) == (25, 0.25)
    assert _value(m, "tandem_steady_decode_tokens_total", slots="4") == 20
    assert _value(m, "tandem_steady_decode_seconds_total", slots="4") == 0.6
    assert _value(m, "tandem_steady_decode_steps_total", slots="4") == 1
    assert _value(m, "tandem_steady_decode_cpu_expert_weight_bytes_total", slots="4") == 4096
    assert _value(m, "tandem_steady_decode_cpu_experts_seconds_total", slots="4") == 0.002
    assert _value(m, "tandem_distinct_experts_per_step", device="cpu") == 6
    assert _value(m, "tandem_cpu_experts_seconds_per_layer_sum") == 0.001
    assert _value(m, "tandem_cpu_experts_seconds_total") == 0.002
    assert _value(m, "tandem_cpu_expert_weight_bytes_total") == 4096
    assert _value(m, "tandem_prompt_throughput_tokens_per_second") is None
    m.record_step(_step(prompt_tokens=100, steady_seconds=None, counters={}))
    assert _value(m, "tandem_prompt_throughput_tokens_per_second") == 200
    assert _value(m, "tandem_steady_decode_tokens_total", slots="4") == 20  # not steady
    assert _value(m, "tandem_steady_decode_steps_total", slots="4") == 1
    # a steady step of two slots with no MoE layers run: its time, no CPU expert figures
    m.record_step(_step(steady_slots=2, counters={"cpu_expert_bytes": 7}))
    assert _value(m, "tandem_steady_decode_steps_total", slots="2") == 1
    assert _value(m, "tandem_steady_decode_cpu_expert_weight_bytes_total", slots="2") == 0
    assert _value(m, "tandem_steady_decode_cpu_expert_weight_bytes_total", slots="4") == 4096
    assert _value(m, "tandem_cpu_expert_weight_bytes_total") == 4096  # no MoE layers ran
    assert _value(m, "tandem_kv_blocks_total") == 0


def test_steady_steps_split_their_time_into_the_workers_parts():
    """A steady step's worker round trip, passes and per-slot routing (the adaptive
    budget's) are counted apart; the daemon's share is the rest; other steps add nothing."""
    m = Metrics()
    timings = {"forward": 400.0, "slot_routing": 2.0, "cache_ops": 1.0, "cpu_experts": 300.0}
    m.record_step(_step(worker_ms=timings))
    m.record_step(_step(worker_ms=timings, steady_seconds=None))  # a step with prompt work
    m.record_step(_step(worker_ms={"forward": 100.0}, steady_slots=2, steady_seconds=0.2,
                        seconds=0.15))
    parts = {p: _value(m, "tandem_steady_decode_part_seconds_total", slots="4", part=p)
             for p in ("worker", "forward", "slot_routing", "cache_ops")}
    assert parts == {"worker": 0.5, "forward": 0.4, "slot_routing": 0.002, "cache_ops": None}
    assert _value(m, "tandem_steady_decode_part_seconds_total", slots="2", part="forward") == 0.1
    assert _value(m, "tandem_steady_decode_part_seconds_total", slots="2",
                  part="slot_routing") is None


def test_cuda_graph_passes_are_counted_by_outcome():
    """The worker's per-step graph counts (gpu_worker/step_graph.py) add up across steps."""
    m = Metrics()
    counts = {"graph_replays": 3, "graph_captures": 1, "graph_first_runs": 2,
              "graph_refused": 0, "graphs": 4}
    m.record_step(_step(counters=counts))
    m.record_step(_step(counters={"graph_replays": 5, "graph_refused": 1}))
    got = {o: _value(m, "tandem_cuda_graph_passes_total", outcome=o)
           for o in ("replayed", "captured", "first_run", "capture_failed")}
    assert got == {"replayed": 8, "captured": 1, "first_run": 2, "capture_failed": 1}
    m.record_step(_step(counters={"mtp_graph_replays": 2, "mtp_graph_first_runs": 1}))
    assert _value(m, "tandem_mtp_graph_drafts_total", outcome="replayed") == 2
    assert _value(m, "tandem_mtp_graph_drafts_total", outcome="first_run") == 1
    assert _value(m, "tandem_cuda_graph_passes_total", outcome="replayed") == 8


def test_null_metrics_take_the_schedulers_calls():
    m = NullMetrics()
    m.record_step(_step())
    m.request_finished("stop", 3, 2)
    m.observe_ttft(0.1)
    m.observe_itl(0.01)
    m.observe_drafts("suffix", 3, 1)
    m.set_queue_depth(0)
    public = {n for n in dir(Metrics) if not n.startswith("_")}
    assert {n for n in dir(NullMetrics) if not n.startswith("_")} <= public


def test_prompt_throughput_is_absent_when_stale():
    m = Metrics()
    name = "tandem_prompt_throughput_tokens_per_second"
    assert _value(m, name) is None  # never measured
    m.set_prompt_throughput(1234.5)
    assert _value(m, name) == 1234.5
    m.set_prompt_throughput(None)  # no prompt work lately: absent, not the last value
    assert _value(m, name) is None
    assert f"# TYPE {name} gauge" in m.render().decode()


def test_worker_restarts():
    m = Metrics()
    m.worker_restarted("gpu_worker")
    m.worker_restarted("cpu_experts")
    m.worker_restarted("cpu_experts")
    assert _value(m, "tandem_worker_restarts_total", component="cpu_experts") == 2
    assert _value(m, "tandem_worker_restarts_total", component="gpu_worker") == 1


def test_registries_are_private():
    a, b = Metrics(), Metrics()  # a shared registry would refuse the duplicate names
    a.request_received("completions")
    assert _value(b, "tandem_requests_received_total", endpoint="completions") is None
    assert b"tandem_" not in prometheus_client.generate_latest(prometheus_client.REGISTRY)
    assert a.content_type.startswith("text/plain")


def test_prefix_cache_figures_are_read_at_scrape_time_and_hits_outlive_a_restart():
    """Entries, bytes and hits by tier come from the scheduler's cache when /metrics is read
    (nothing per step); the cache that replaces it after a worker restart keeps the hits."""
    from daemon.prefix_cache import PrefixCache

    m, holder = Metrics(), {"cache": None}
    m.watch_prefix_cache(lambda: holder["cache"])
    assert _value(m, "tandem_prefix_cache_entries", tier="gpu") is None  # no cache yet
    cache = PrefixCache(100, 4, block_bytes=10, state_bytes=5, max_bytes=45,
                        host_max_bytes=100)
    holder["cache"] = cache
    for a in range(3):  # 25 bytes each: the third pushes the first to the host tier
        cache.add([a * 100 + i for i in range(8)], a + 1)
    assert cache.lookup(list(range(8)) + [1]) == (1, 8)
    assert (_value(m, "tandem_prefix_cache_entries", tier="gpu"),
            _value(m, "tandem_prefix_cache_entries", tier="host")) == (1, 2)
    assert _value(m, "tandem_prefix_cache_bytes", tier="host") == 50
    assert _value(m, "tandem_prefix_cache_hits_total", tier="host") == 1
    holder["cache"] = cache.emptied()  # the worker restarted
    assert _value(m, "tandem_prefix_cache_entries", tier="host") == 0
    assert _value(m, "tandem_prefix_cache_hits_total", tier="host") == 1


def test_the_adaptive_budgets_figures_are_read_at_each_scrape():
    from daemon.config import load_config
    from daemon.draft_adaptive import DraftBudget
    from daemon.metrics_budget import BudgetFigures

    m, holder = Metrics(), {"budget": None}
    m.registry.register(BudgetFigures(lambda: holder["budget"]))
    assert _value(m, "tandem_draft_budget", figure="fixed_ms") is None  # no adaptive budget
    spec = load_config(None, {"speculation.mode": "wide",
                              "speculation.draft_budget": "adaptive"}).speculation
    budget = holder["budget"] = DraftBudget(spec)
    budget.chosen[[0, 2, 2, 3]] += 1
    budget.chosen[2] += 1
    assert _value(m, "tandem_draft_budget", figure="fixed_ms") == spec.cost_fixed_ms
    assert _value(m, "tandem_draft_budget", figure="expert_ms") == spec.cost_expert_ms
    assert _value(m, "tandem_draft_budget", figure="persistence") == 0.5
    assert _value(m, "tandem_draft_budget_choices_total", drafts="2") == 2  # read now
    assert _value(m, "tandem_draft_budget_choices_total", drafts="3") == 1
    assert _value(m, "tandem_draft_budget_choices_total", drafts="1") is None
