"""Prometheus metrics of the daemon (docs/architecture.md §8), on a registry of their own.

Who calls what: the HTTP and ZeroMQ front ends call `request_received` and `request_rejected`
(a request refused before it reached a slot); lifecycle calls `worker_restarted`; the
scheduler calls the rest, once per request (`request_finished`), per emitted token
(`observe_ttft` for the first one, `observe_itl` for the rest), per verification
(`observe_drafts`), per change of the queue (`set_queue_depth`, `set_request_states`) and
once per step (`record_step`). The prefix cache's figures are read when /metrics is
scraped (`watch_prefix_cache`, set by lifecycle), not on the step loop. A scheduler without
metrics gets `NullMetrics`, whose calls do nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

PREFIX = "tandem"
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0,
               2.5, 5.0)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12,
                10.24)
ROW_BUCKETS = (1, 2, 4, 8, 12, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
# the worker's timings (StepResult.timings_ms) counted per steady decode step
STEADY_PARTS = ("forward", "slot_routing")
CPU_LAYER_BUCKETS = (25e-6, 50e-6, 100e-6, 200e-6, 400e-6, 800e-6, 0.0016, 0.0032, 0.0064,
                     0.0128, 0.0256, 0.0512)


@dataclass(frozen=True, slots=True)
class StepStats:
    """One committed step as the scheduler saw it."""

    seconds: float  # the worker's step, send to result
    rows: int  # rows of the forward (StepPlan.num_rows)
    prompt_tokens: int
    decode_tokens: int
    emitted: int  # tokens appended to requests
    active_slots: int  # after the commit
    queue_depth: int  # after the commit
    steady_seconds: float | None  # planning to commit when every slot decoded, else None
    steady_slots: int  # slots of the step
    counters: Mapping[str, int]  # the worker's StepResult.counters (KV blocks, experts)
    cpu_expert_seconds: float  # the worker's CPU expert time in this step
    # the worker's account of the step (StepResult.timings_ms), ms: "forward", "cache_ops",
    # "slot_routing" (the adaptive budget's per-slot experts), ...
    worker_ms: Mapping[str, float] = field(default_factory=dict)


class _StaleAbsentGauge(Collector):
    """A gauge of the latest step, absent while stale (None): a figure that only means
    something for a step that did that work is never shown for a step that did not."""

    def __init__(self, name: str, documentation: str) -> None:
        self.name, self.documentation = name, documentation
        self.value: float | None = None

    def collect(self):
        family = GaugeMetricFamily(self.name, self.documentation)
        if self.value is not None:
            family.add_metric([], self.value)
        yield family


class _PrefixCacheFigures(Collector):
    """The prefix cache's entries, bytes and hits by tier (daemon/prefix_cache.py), read from
    the scheduler's current cache at each scrape: nothing on the step loop. ``source``
    returns that cache (a new one after a worker restart carries the hit counts over)."""

    TIERS = ("gpu", "host")

    def __init__(self) -> None:
        self.source: Callable[[], object] | None = None

    def collect(self):
        p = PREFIX
        entries = GaugeMetricFamily(f"{p}_prefix_cache_entries", "Prefix checkpoints held, by "
                                    "tier (gpu; host: the host memory tier, "
                                    "prefix_cache_host_mb)", labels=["tier"])
        nbytes = GaugeMetricFamily(f"{p}_prefix_cache_bytes", "Bytes those checkpoints hold "
                                   "(KV blocks and states), by tier", labels=["tier"])
        hits = CounterMetricFamily(f"{p}_prefix_cache_hits", "Admitted prompts that started "
                                   "from a prefix checkpoint, by the checkpoint's tier",
                                   labels=["tier"])
        cache = self.source() if self.source is not None else None
        if cache is not None:
            tiers = cache.tiers()
            for tier in self.TIERS:
                entries.add_metric([tier], tiers[tier][0])
                nbytes.add_metric([tier], tiers[tier][1])
                hits.add_metric([tier], cache.hits[tier])
        yield from (entries, nbytes, hits)


# tandem_cuda_graph_passes_total's outcomes and the worker's step counters they count
# (gpu_worker/step_graph.py)
GRAPH_OUTCOMES = {"replayed": "graph_replays", "captured": "graph_captures",
                  "first_run": "graph_first_runs", "capture_failed": "graph_refused"}
MTP_GRAPH_OUTCOMES = {o: f"mtp_{key}" for o, key in GRAPH_OUTCOMES.items()}


class Metrics:
    """All of the daemon's metrics; `render()` gives the Prometheus text exposition."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r, p = self.registry, PREFIX
        self._received = Counter(f"{p}_requests_received", "Requests received, by endpoint",
                                 ["endpoint"], registry=r)
        self._rejected = Counter(f"{p}_requests_rejected",
                                 "Requests refused before generation, by reason", ["reason"],
                                 registry=r)
        self._finished = Counter(f"{p}_requests_finished",
                                 "Requests finished, by finish reason", ["finish_reason"],
                                 registry=r)
        self._prompt_tokens = Counter(f"{p}_prompt_tokens", "Prompt tokens of finished requests",
                                      registry=r)
        self._cached_tokens = Counter(f"{p}_prompt_cached_tokens",
                                      "Prompt tokens served from the prefix cache", registry=r)
        self._generation_tokens = Counter(f"{p}_generation_tokens",
                                          "Generated tokens of finished requests", registry=r)
        self._ttft = Histogram(f"{p}_time_to_first_token_seconds",
                               "Time from arrival to the first generated token",
                               buckets=TTFT_BUCKETS, registry=r)
        self._itl = Histogram(f"{p}_inter_token_latency_seconds",
                              "Time between consecutive generated tokens of a request",
                              buckets=ITL_BUCKETS, registry=r)
        self._queue_depth = Gauge(f"{p}_queue_depth", "Requests waiting for a slot", registry=r)
        self._active_slots = Gauge(f"{p}_active_slots", "Slots holding a request", registry=r)
        self._kv_used = Gauge(f"{p}_kv_blocks_used", "KV cache blocks in use", registry=r)
        self._kv_total = Gauge(f"{p}_kv_blocks_total", "KV cache blocks in all", registry=r)
        self._kv_usage = Gauge(f"{p}_kv_usage_ratio", "Fraction of KV cache blocks in use",
                               registry=r)
        self._step = Histogram(f"{p}_step_seconds", "Wall time of one engine step",
                               buckets=STEP_BUCKETS, registry=r)
        self._rows = Histogram(f"{p}_step_rows", "Rows (tokens) in one engine step",
                               buckets=ROW_BUCKETS, registry=r)
        self._step_prompt = Counter(f"{p}_step_prompt_tokens",
                                    "Prompt tokens processed by engine steps", registry=r)
        self._step_decode = Counter(f"{p}_step_decode_tokens",
                                    "Decode rows processed by engine steps", registry=r)
        self._steady_s = Counter(f"{p}_steady_decode_seconds",
                                 "Wall time of steps in which every active slot decoded (no "
                                 "prompt work), planning to commit, by active slots",
                                 ["slots"], registry=r)
        self._steady_tokens = Counter(f"{p}_steady_decode_tokens",
                                      "Tokens emitted by those steps, by active slots (decode "
                                      "TPS at N streams = this / steady_decode_seconds)",
                                      ["slots"], registry=r)
        self._steady_steps = Counter(f"{p}_steady_decode_steps",
                                     "Steps counted in steady_decode_seconds, by active slots",
                                     ["slots"], registry=r)
        self._steady_cpu_bytes = Counter(f"{p}_steady_decode_cpu_expert_weight_bytes",
                                         "CPU expert weight bytes read by those steps (as "
                                         "cpu_expert_weight_bytes), by active slots",
                                         ["slots"], registry=r)
        self._steady_cpu_s = Counter(f"{p}_steady_decode_cpu_experts_seconds",
                                     "CPU expert time of those steps (as cpu_experts_seconds), "
                                     "by active slots", ["slots"], registry=r)
        self._steady_parts = Counter(f"{p}_steady_decode_part_seconds",
                                     "Parts of those steps' time, by active slots: worker "
                                     "(plan sent to result received), forward (the worker's "
                                     "passes), slot_routing (the worker's per-slot experts for "
                                     "the adaptive draft budget); the rest of "
                                     "steady_decode_seconds is the daemon's planning and commit",
                                     ["slots", "part"], registry=r)
        self._experts = Gauge(f"{p}_distinct_experts_per_step",
                              "Distinct routed experts touched by the last step, summed over "
                              "MoE layers, by where they ran", ["device"], registry=r)
        self._cpu_expert_time = Histogram(f"{p}_cpu_experts_seconds_per_layer",
                                          "CPU expert wall time per MoE layer of a step",
                                          buckets=CPU_LAYER_BUCKETS, registry=r)
        self._cpu_expert_s = Counter(f"{p}_cpu_experts_seconds",
                                     "CPU expert time of all steps, summed over their MoE "
                                     "layers (launched path: the slowest worker's kernels; "
                                     "host path: the dispatches' wall time)", registry=r)
        self._cpu_expert_bytes = Counter(f"{p}_cpu_expert_weight_bytes",
                                         "Bytes of CPU expert weights read (each distinct "
                                         "expert once per layer per step)", registry=r)
        self._prefix = _PrefixCacheFigures()
        self._drafts = Counter(f"{p}_spec_draft_tokens",
                               "Draft tokens proposed for verification (speculation)",
                               registry=r)
        self._accepted = Counter(f"{p}_spec_accepted_tokens",
                                 "Draft tokens accepted by verification (speculation)",
                                 registry=r)
        self._verifies = Counter(f"{p}_spec_verifies",
                                 "Slot verifications (a decode row with drafts), by draft "
                                 "source", ["source"], registry=r)
        self._accepted_by = Counter(f"{p}_spec_accepted_by_source_tokens",
                                    "Draft tokens accepted, by draft source (accepted per "
                                    "verify = this / spec_verifies)", ["source"], registry=r)
        self._graph_passes = Counter(f"{p}_cuda_graph_passes",
                                     "Decode and verify passes by how CUDA graphs served them: "
                                     "replayed (captured before), captured (then replayed), "
                                     "first_run (a layout's first pass, eager), "
                                     "capture_failed (eager)", ["outcome"], registry=r)
        self._mtp_graphs = Counter(f"{p}_mtp_graph_drafts",
                                   "A pass's MTP drafting (the head's passes) by how CUDA "
                                   "graphs served it, as cuda_graph_passes", ["outcome"],
                                   registry=r)
        self._restarts = Counter(f"{p}_worker_restarts", "Child processes restarted, by component",
                                 ["component"], registry=r)
        self._prompt_work_s = Counter(f"{p}_prompt_work_seconds",
                                      "Wall time of engine steps that processed prompt tokens "
                                      "(prompt TPS = step_prompt_tokens / this)", registry=r)
        self._states = Gauge(f"{p}_requests", "Requests by state: queued (waiting for a slot), "
                             "prefilling, decoding", ["state"], registry=r)
        self._throughput = _StaleAbsentGauge(
            f"{p}_prompt_throughput_tokens_per_second",
            "Prompt (prefill) tokens per second of the latest step; absent when that step "
            "processed no prompt tokens (stale)")
        self._cpu_dram = _StaleAbsentGauge(
            f"{p}_cpu_expert_dram_gbytes_per_second",
            "CPU expert weight bytes read per second of CPU expert time (GB/s, 1e9), latest "
            "step with MoE layers; absent when it ran no expert on the CPU")
        r.register(self._throughput)
        r.register(self._cpu_dram)
        r.register(self._prefix)
        ProcessCollector(registry=r)  # the daemon's own CPU, memory and open files

    # ---- requests ----------------------------------------------------------------------------
    def request_received(self, endpoint: str) -> None:
        self._received.labels(endpoint=endpoint).inc()

    def request_rejected(self, reason: str) -> None:
        self._rejected.labels(reason=reason).inc()

    def request_finished(self, finish_reason: str, prompt_tokens: int, completion_tokens: int,
                         cached_tokens: int = 0) -> None:
        self._finished.labels(finish_reason=finish_reason).inc()
        self._prompt_tokens.inc(prompt_tokens)
        self._generation_tokens.inc(completion_tokens)
        self._cached_tokens.inc(cached_tokens)

    def observe_ttft(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def observe_itl(self, seconds: float) -> None:
        self._itl.observe(seconds)

    # ---- engine state ------------------------------------------------------------------------
    def set_queue_depth(self, n: int) -> None:
        self._queue_depth.set(n)

    def set_request_states(self, counts: Mapping[str, int]) -> None:
        """How many requests are queued, prefilling and decoding (daemon.progress.counts)."""
        for state, n in counts.items():
            self._states.labels(state=state).set(n)

    def set_active_slots(self, n: int) -> None:
        self._active_slots.set(n)

    def set_kv_usage(self, used_blocks: int, total_blocks: int) -> None:
        self._kv_used.set(used_blocks)
        self._kv_total.set(total_blocks)
        self._kv_usage.set(used_blocks / total_blocks if total_blocks else 0.0)

    def observe_step(self, seconds: float, rows: int, prompt_tokens: int,
                     decode_tokens: int) -> None:
        self._step.observe(seconds)
        self._rows.observe(rows)
        self._step_prompt.inc(prompt_tokens)
        self._step_decode.inc(decode_tokens)

    def observe_steady_decode(self, slots: int, seconds: float, tokens: int,
                              cpu_bytes: int = 0, cpu_seconds: float = 0.0,
                              parts: Mapping[str, float] | None = None) -> None:
        """A step in which all ``slots`` active slots decoded and none took prompt tokens:
        its time, tokens and CPU experts' bytes and time (the decode passes' own figures,
        apart from the prompt chunks' in the whole-run counters), and ``parts`` of its time
        (seconds: worker, forward, slot_routing)."""
        label = str(slots)
        for part, value in (parts or {}).items():
            self._steady_parts.labels(slots=label, part=part).inc(max(value, 0.0))
        self._steady_s.labels(slots=label).inc(seconds)
        self._steady_tokens.labels(slots=label).inc(tokens)
        self._steady_steps.labels(slots=label).inc()
        self._steady_cpu_bytes.labels(slots=label).inc(cpu_bytes)
        self._steady_cpu_s.labels(slots=label).inc(max(cpu_seconds, 0.0))

    def observe_drafts(self, source: str, proposed: int, accepted: int) -> None:
        """One slot's verification: ``proposed`` drafts from ``source`` ("mtp", "suffix"),
        ``accepted`` of them kept."""
        self._drafts.inc(proposed)
        self._accepted.inc(accepted)
        self._verifies.labels(source=source).inc()
        self._accepted_by.labels(source=source).inc(accepted)

    def observe_experts(self, gpu_distinct: int, cpu_distinct: int, moe_layers: int,
                        cpu_seconds: float, cpu_bytes: int) -> None:
        """The hybrid figures of one step (docs/architecture.md §8)."""
        self._experts.labels(device="gpu").set(gpu_distinct)
        self._experts.labels(device="cpu").set(cpu_distinct)
        if moe_layers:
            self._cpu_expert_time.observe(cpu_seconds / moe_layers)
        self._cpu_expert_s.inc(max(cpu_seconds, 0.0))
        self._cpu_expert_bytes.inc(cpu_bytes)
        self._cpu_dram.value = (cpu_bytes / cpu_seconds / 1e9 if cpu_bytes and cpu_seconds > 0
                                else None)

    def set_prompt_throughput(self, tokens_per_s: float | None) -> None:
        """None marks it stale: no recent step did prompt work, so the gauge is absent."""
        self._throughput.value = tokens_per_s

    def record_step(self, step: StepStats) -> None:
        """Everything one step changes: step histograms, gauges, steady decode, experts."""
        self.observe_step(step.seconds, step.rows, step.prompt_tokens, step.decode_tokens)
        prompt_work = step.prompt_tokens > 0 and step.seconds > 0
        self.set_prompt_throughput(step.prompt_tokens / step.seconds if prompt_work else None)
        if prompt_work:
            self._prompt_work_s.inc(step.seconds)
        self.set_active_slots(step.active_slots)
        self.set_queue_depth(step.queue_depth)
        c = step.counters
        self.set_kv_usage(c.get("kv_total_blocks", 0) - c.get("kv_free_blocks", 0),
                          c.get("kv_total_blocks", 0))
        if step.steady_seconds is not None:
            moe = bool(c.get("moe_layers"))
            parts = {"worker": step.seconds} | {k: step.worker_ms[k] / 1e3 for k in STEADY_PARTS
                                                 if k in step.worker_ms}
            self.observe_steady_decode(step.steady_slots, step.steady_seconds, step.emitted,
                                       c.get("cpu_expert_bytes", 0) if moe else 0,
                                       step.cpu_expert_seconds if moe else 0.0, parts)
        for counter, outcomes in ((self._graph_passes, GRAPH_OUTCOMES),
                                  (self._mtp_graphs, MTP_GRAPH_OUTCOMES)):
            for outcome, key in outcomes.items():
                if c.get(key):
                    counter.labels(outcome=outcome).inc(c[key])
        if c.get("moe_layers"):  # a step that ran MoE layers (not cache ops alone)
            self.observe_experts(c["gpu_experts"], c["cpu_experts"], c["moe_layers"],
                                 step.cpu_expert_seconds, c["cpu_expert_bytes"])

    def watch_prefix_cache(self, source: Callable[[], object]) -> None:
        """``source()``: the scheduler's prefix cache now (or None), read at each scrape."""
        self._prefix.source = source

    def worker_restarted(self, component: str) -> None:
        self._restarts.labels(component=component).inc()

    # ---- exposition --------------------------------------------------------------------------
    def render(self) -> bytes:
        return generate_latest(self.registry)


class NullMetrics:
    """The scheduler's metrics when nobody reads them (tests, tools): every call does nothing."""

    def request_finished(self, finish_reason: str, prompt_tokens: int, completion_tokens: int,
                         cached_tokens: int = 0) -> None:
        pass

    def observe_ttft(self, seconds: float) -> None:
        pass

    def observe_itl(self, seconds: float) -> None:
        pass

    def observe_drafts(self, source: str, proposed: int, accepted: int) -> None:
        pass

    def set_queue_depth(self, n: int) -> None:
        pass

    def set_request_states(self, counts: Mapping[str, int]) -> None:
        pass

    def record_step(self, step: StepStats) -> None:
        pass
