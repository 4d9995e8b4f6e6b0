"""The sections of the daemon's TOML config: one frozen dataclass per `[table]`, each validated
on creation, and the defaults they fall back to (the embedded model, the run directory)."""

from __future__ import annotations

import ipaddress
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from daemon.config_checks import (
    ConfigError,
    check_bool,
    check_int,
    check_num,
    check_path,
    check_str,
    check_strs,
    fail,
)
from protocol.worker_config import (
    BACKENDS,
    CPU_FORMATS,
    CPU_ISAS,
    DTYPES,
    GPU_FORMATS,
    GRAPH_WARM_UPS,
    KV_CACHE_DTYPES,
    PLACEMENTS,
    SPECULATION_MODES,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = REPO_ROOT / "models" / "tandem-tiny"  # the embedded model (configs/tiny.toml)
LOOPBACK_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost")
IPC_PATH_MAX = 107  # sun_path is 108 bytes including the terminating NUL


def default_model() -> Path:
    """$TANDEM_MODEL, else the embedded tandem-tiny."""
    return Path(os.environ.get("TANDEM_MODEL", DEFAULT_MODEL))


def default_run_dir() -> Path:
    """systemd's $RUNTIME_DIRECTORY, else $XDG_RUNTIME_DIR/tandem, else /tmp/tandem-<uid>."""
    if os.environ.get("RUNTIME_DIRECTORY"):
        return Path(os.environ["RUNTIME_DIRECTORY"].split(":")[0])
    if os.environ.get("XDG_RUNTIME_DIR"):
        return Path(os.environ["XDG_RUNTIME_DIR"]) / "tandem"
    return Path(f"/tmp/tandem-{os.getuid()}")



def gguf_stem(name: str) -> str:
    """A model's default served name: a GGUF file's name without ``.gguf`` and a split
    set's ``-00001-of-0000N``, a directory's name as it is."""
    if not name.endswith(".gguf"):
        return name
    return re.sub(r"-\d{5}-of-\d{5}$", "", name.removesuffix(".gguf"))


@dataclass(frozen=True)
class ModelSection:
    path: Path = field(default_factory=default_model)
    name: str = ""  # served model name; "" -> the directory's name
    aliases: tuple[str, ...] = ()  # other names accepted in requests' "model"
    dtype: str = ""  # "" -> bfloat16 on the cupy backend, else float32
    backend: str = "numpy"
    cuda_graphs: bool = True  # cupy: decode/verify passes replayed as CUDA graphs (false: eager)
    # captured before the server is ready: "all" (decode and every verify layout the
    # speculation settings can make) or "decode" (verify layouts as they come: a shorter start)
    cuda_graph_warm_up: str = "all"
    # a pass whose rows fall between the capacity buckets (1, 2, 4, 8, 12, 16) is padded up
    # to the larger one, so one graph serves them all (false: a graph per rows and slots)
    cuda_graph_buckets: bool = True
    # the MTP head's drafting after a pass as one graph (false: its passes eager)
    cuda_graph_mtp: bool = True

    def __post_init__(self) -> None:
        if self.dtype == "":
            object.__setattr__(self, "dtype", "bfloat16" if self.backend == "cupy" else "float32")
        check_path("model.path", self.path)
        if not (self.path.is_dir() or (self.path.is_file() and self.path.suffix == ".gguf")):
            fail("model.path", "must be an existing model directory or .gguf file",
                 str(self.path))
        check_str("model.name", self.name, empty=True)
        check_strs("model.aliases", self.aliases)
        check_str("model.dtype", self.dtype, DTYPES)
        check_str("model.backend", self.backend, BACKENDS)
        check_bool("model.cuda_graphs", self.cuda_graphs)
        check_bool("model.cuda_graph_buckets", self.cuda_graph_buckets)
        check_bool("model.cuda_graph_mtp", self.cuda_graph_mtp)
        check_str("model.cuda_graph_warm_up", self.cuda_graph_warm_up, GRAPH_WARM_UPS)

    @property
    def served_name(self) -> str:
        return self.name or gguf_stem(self.path.resolve().name)


@dataclass(frozen=True)
class ServerSection:
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: tuple[str, ...] = ()  # merged with the lines of api_keys_file by load_config
    api_keys_file: Path | None = None
    allow_insecure_public: bool = False
    max_body_bytes: int = 1 << 20
    shutdown_grace_s: float = 5.0  # on SIGTERM: time running requests get to finish
    run_dir: Path = field(default_factory=default_run_dir)
    zmq_endpoint: str = ""  # client API; "" -> ipc://<run_dir>/client.sock
    zmq_curve_public_key: str = ""  # tcp:// only: the server's Z85 public key
    zmq_curve_secret_key_file: Path | None = None  # file holding the Z85 secret key
    zmq_curve_client_keys: tuple[str, ...] = ()  # Z85 public keys allowed to connect
    split_reasoning: bool = True  # chat: a leading <think> block -> reasoning_content

    def __post_init__(self) -> None:
        check_str("server.host", self.host)
        check_int("server.port", self.port, 0, 65535)
        check_strs("server.api_keys", self.api_keys)
        if any(k != k.strip() or len(k) < 8 for k in self.api_keys):
            raise ConfigError("server.api_keys: each key must be >= 8 characters without "
                              "surrounding whitespace")
        if self.api_keys_file is not None:
            check_path("server.api_keys_file", self.api_keys_file)
        check_bool("server.allow_insecure_public", self.allow_insecure_public)
        check_bool("server.split_reasoning", self.split_reasoning)
        check_int("server.max_body_bytes", self.max_body_bytes, 1024, 1 << 30)
        check_num("server.shutdown_grace_s", self.shutdown_grace_s, 0)
        check_path("server.run_dir", self.run_dir)
        check_str("server.zmq_endpoint", self.zmq_endpoint, empty=True)
        if not self.zmq_endpoint:
            object.__setattr__(self, "zmq_endpoint", self.ipc_endpoint("client"))
        self._check_zmq()

    def _check_zmq(self) -> None:
        endpoint = self.zmq_endpoint
        if endpoint.startswith("ipc://"):
            if len(endpoint[6:].encode()) > IPC_PATH_MAX:
                fail("server.zmq_endpoint", f"ipc path must be <= {IPC_PATH_MAX} bytes", endpoint)
            return
        if not endpoint.startswith("tcp://"):
            fail("server.zmq_endpoint", "must start with ipc:// or tcp://", endpoint)
        check_str("server.zmq_curve_public_key", self.zmq_curve_public_key, empty=True)
        if len(self.zmq_curve_public_key) != 40:
            fail("server.zmq_curve_public_key", "a tcp:// endpoint needs CURVE keys: the "
                  "server's 40-character Z85 public key", self.zmq_curve_public_key)
        if not isinstance(self.zmq_curve_secret_key_file, Path):
            fail("server.zmq_curve_secret_key_file", "a tcp:// endpoint needs the path of the "
                  "server's secret key file", self.zmq_curve_secret_key_file)
        check_strs("server.zmq_curve_client_keys", self.zmq_curve_client_keys)
        if not self.zmq_curve_client_keys or any(len(k) != 40 for k in self.zmq_curve_client_keys):
            fail("server.zmq_curve_client_keys", "a tcp:// endpoint needs a non-empty list of "
                  "40-character Z85 client public keys", self.zmq_curve_client_keys)

    @property
    def is_loopback(self) -> bool:
        if self.host.lower() in LOOPBACK_NAMES:
            return True
        try:
            return ipaddress.ip_address(self.host.strip("[]")).is_loopback
        except ValueError:
            return False  # a host name other than localhost may resolve to anything

    def ipc_endpoint(self, name: str) -> str:
        """`ipc://<run_dir>/<name>.sock` (e.g. the daemon <-> gpu_worker socket)."""
        return f"ipc://{self.run_dir}/{name}.sock"


@dataclass(frozen=True)
class LimitsSection:
    max_prompt_tokens: int | None = None  # None -> scheduler.max_context - 1
    max_tokens: int | None = None  # per request; None -> scheduler.max_context - 1
    max_queue: int = 64
    request_timeout_s: float = 600.0  # 0: no timeout
    step_timeout_s: float = 120.0  # a worker step's deadline floor (grows with its size)
    body_timeout_s: float = 30.0  # an HTTP request must arrive whole within it
    worker_ready_timeout_s: float = 900.0  # model load until the GPU worker's READY

    def __post_init__(self) -> None:
        if self.max_prompt_tokens is not None:
            check_int("limits.max_prompt_tokens", self.max_prompt_tokens, 1)
        if self.max_tokens is not None:
            check_int("limits.max_tokens", self.max_tokens, 1)
        check_int("limits.max_queue", self.max_queue, 0)
        check_num("limits.request_timeout_s", self.request_timeout_s, 0)
        check_num("limits.step_timeout_s", self.step_timeout_s, 1)
        check_num("limits.body_timeout_s", self.body_timeout_s, 1)
        check_num("limits.worker_ready_timeout_s", self.worker_ready_timeout_s, 1)


@dataclass(frozen=True)
class SchedulerSection:
    max_slots: int = 4
    max_context: int = 4096  # prompt + generated tokens per slot
    prefill_chunk: int = 512
    kv_block_size: int = 64
    kv_cache_dtype: str = "model"  # model: the compute dtype; int8: + an fp16 scale per 32
    prefix_cache: bool = True
    checkpoint_interval: int = 256  # GDN state checkpoint every N tokens
    prefix_cache_max_mb: int = 1024
    # the prefix cache's second tier, in the model worker's host memory (0: none): entries
    # the GPU budget pushes out are copied there instead of dropped (daemon/prefix_cache.py)
    prefix_cache_host_mb: int = 0
    preemption: str = "swap"

    def __post_init__(self) -> None:
        check_int("scheduler.max_slots", self.max_slots, 1, 256)
        check_int("scheduler.max_context", self.max_context, 2)
        check_int("scheduler.prefill_chunk", self.prefill_chunk, 1)
        check_int("scheduler.kv_block_size", self.kv_block_size, 1)
        if self.kv_block_size & (self.kv_block_size - 1):
            fail("scheduler.kv_block_size", "must be a power of two", self.kv_block_size)
        check_str("scheduler.kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        check_bool("scheduler.prefix_cache", self.prefix_cache)
        check_int("scheduler.checkpoint_interval", self.checkpoint_interval, 1)
        check_int("scheduler.prefix_cache_max_mb", self.prefix_cache_max_mb, 0)
        check_int("scheduler.prefix_cache_host_mb", self.prefix_cache_host_mb, 0)
        check_str("scheduler.preemption", self.preemption, ("swap", "recompute"))


@dataclass(frozen=True)
class ExpertsSection:
    placement: str = "gpu"  # gpu: all experts on the worker; cpu: all on CPU workers; split
    cpu_experts_per_layer: int = 0  # split: experts per layer computed on the CPU
    cpu_workers: int = 0  # 0 -> one per NUMA node
    cpu_cores: tuple[tuple[int, ...], ...] = ()  # per worker; () -> derived from NUMA nodes
    cpu_isa: str = "auto"  # CPU expert kernels: auto (the best the CPU has) or one by name
    cpu_format: str = "int8"  # CPU expert weights: int8, or int4 (half the bytes per token)
    # GPU routed experts: "model" (the model dtype, e.g. bf16) or "int8" (the CPU experts'
    # int8 blocks of 32: 1.0625 bytes a weight, so a budget holds ~1.9x the experts)
    gpu_format: str = "model"
    # split: per-layer router counts (`tandem expert-stats`); the GPU keeps the most-picked
    # experts, the CPU gets the rest. None: the last expert ids go to the CPU
    hot_experts: Path | None = None
    # how much of the GPU Tandem may use, in GiB (2**30 bytes); None: the whole device on
    # CuPy, no limit on NumPy. With placement = "split" and no cpu_experts_per_layer, the
    # memory plan (gpu_worker/memory_plan.py) keeps as many experts on the GPU as fit
    gpu_memory_gb: float | None = None
    # a directory that keeps the CPU experts' quantized shards between runs (on a memory file
    # system, e.g. /dev/shm/tandem-shards): a restart maps them instead of quantizing again
    # (cpu_experts/shard_cache.py). None: made anew at every start and freed at exit
    shard_cache: Path | None = None
    # the daemon and the GPU worker keep to the cores the CPU expert workers leave (pinned,
    # their BLAS pools as wide: docs/cpu_experts.md, "Cores"); false: they run anywhere
    pin_host: bool = True

    def __post_init__(self) -> None:
        check_str("experts.placement", self.placement, PLACEMENTS)
        check_bool("experts.pin_host", self.pin_host)
        if self.shard_cache is not None:
            check_path("experts.shard_cache", self.shard_cache)
            if self.shard_cache.exists() and not self.shard_cache.is_dir():
                fail("experts.shard_cache", "must be a directory (made if missing)",
                     str(self.shard_cache))
        if self.gpu_memory_gb is not None:
            check_num("experts.gpu_memory_gb", self.gpu_memory_gb, -math.inf)
            if self.gpu_memory_gb <= 0:
                fail("experts.gpu_memory_gb", "must be > 0 (leave it out for the whole device)",
                     self.gpu_memory_gb)
            object.__setattr__(self, "gpu_memory_gb", float(self.gpu_memory_gb))
        check_str("experts.cpu_isa", self.cpu_isa, CPU_ISAS)
        check_str("experts.cpu_format", self.cpu_format, CPU_FORMATS)
        check_str("experts.gpu_format", self.gpu_format, GPU_FORMATS)
        if self.hot_experts is not None:
            check_path("experts.hot_experts", self.hot_experts)
            if self.placement != "split":
                fail("experts.hot_experts", "needs placement = 'split'", str(self.hot_experts))
            if not self.hot_experts.is_file():
                fail("experts.hot_experts", "must be an existing file (`tandem expert-stats` "
                      "writes one)", str(self.hot_experts))
        check_int("experts.cpu_experts_per_layer", self.cpu_experts_per_layer, 0)
        if (self.placement == "split" and self.cpu_experts_per_layer < 1
                and self.gpu_memory_gb is None):
            fail("experts.cpu_experts_per_layer", "must be >= 1 with placement = 'split' (or "
                 "set experts.gpu_memory_gb and the memory plan chooses)",
                 self.cpu_experts_per_layer)
        check_int("experts.cpu_workers", self.cpu_workers, 0, 64)
        cores = self.cpu_cores
        if not isinstance(cores, tuple) or not all(
                isinstance(w, tuple) and w and all(isinstance(c, int) and not isinstance(c, bool)
                                                   and c >= 0 for c in w) for w in cores):
            fail("experts.cpu_cores", "must be a list of non-empty lists of core numbers >= 0",
                  cores)
        if cores and self.cpu_workers and len(cores) != self.cpu_workers:
            fail("experts.cpu_cores", f"must have one list per worker ({self.cpu_workers})",
                  cores)
        flat = [c for w in cores for c in w]
        if len(flat) != len(set(flat)):
            fail("experts.cpu_cores", "a core must belong to one worker only", cores)

    @property
    def num_cpu_workers(self) -> int:
        """Workers to start: cpu_workers, else one per cpu_cores list, else 0 (NUMA auto)."""
        return self.cpu_workers or len(self.cpu_cores)


@dataclass(frozen=True)
class SpeculationSection:
    """``mode``: "off"; "narrow" (each drafted slot verified in its own forward pass) or
    "wide" (every slot's rows in one pass: up to 4 drafted slots, <= 16 rows). Drafts come
    from ``proposer``: "suffix" (the request's own history, after a suffix of at least
    ``min_match`` tokens matched) or "mtp" (the model's MTP head, run by the worker after
    each step; no drafts from a model without one); ``num_drafts`` per slot and step.
    Tokens are those of "off". The scheduling controls and the global suffix index:
    docs/speculation.md (daemon/draft_plan.py)."""

    mode: str = "off"
    proposer: str = "suffix"
    num_drafts: int = 4
    min_match: int = 2
    max_match: int = 8
    global_index_tokens: int = 65536  # suffix: tokens of all requests indexed (0: off)
    max_drafts_per_step: int = 0  # draft rows of one step over all slots (0: no cap)
    prefer: str = "drafts"  # a step with a prompt chunk: "drafts" verifies, "admission" not
    # "fixed": every slot verifies its fitted drafts; "adaptive": daemon/draft_budget.py picks
    # each slot's count by expected tokens per ms of the predicted step (the cost_* below,
    # refitted online from the worker's step times)
    draft_budget: str = "fixed"
    cost_fixed_ms: float = 8.0  # per forward pass
    cost_row_ms: float = 0.25  # per row of a pass
    cost_expert_ms: float = 0.03  # per distinct CPU expert: its bytes / DRAM bandwidth
    # the worker runs a pass's MTP drafter while the CPU experts of the step's next pass are
    # in flight (same drafts and tokens; docs/speculation.md "Draft overlap")
    draft_overlap: bool = False
    # proposer = "replay" (benchmarks only): recorded continuations + acceptance profile
    # (daemon/proposers/replay.py)
    replay_file: Path | None = None
    # benchmarks only, any mode: append each finished request's prompt and generated ids
    # (JSON lines: a replay file's records, daemon/proposers/replay.py ReplayRecorder)
    record_file: Path | None = None
    # benchmarks only, any mode: a JSON line per step, its rows, time and the budget's choice
    # (daemon/step_trace.py)
    step_trace_file: Path | None = None

    def __post_init__(self) -> None:
        check_str("speculation.mode", self.mode, SPECULATION_MODES)
        check_str("speculation.proposer", self.proposer, ("suffix", "mtp", "replay"))
        if self.proposer == "replay" and not (isinstance(self.replay_file, Path)
                                              and self.replay_file.is_file()):
            fail("speculation.replay_file", "proposer = 'replay' needs an existing replay "
                 "file (benchmarks only: scripts/bench_concurrency.py writes one)",
                 self.replay_file)
        for key in ("record_file", "step_trace_file"):
            path = getattr(self, key)
            if path is not None and not (isinstance(path, Path) and path.parent.is_dir()):
                fail(f"speculation.{key}", "must be a file in an existing directory", path)
        check_int("speculation.num_drafts", self.num_drafts, 1, 15)
        check_int("speculation.min_match", self.min_match, 1, 64)
        check_int("speculation.max_match", self.max_match, self.min_match, 64)
        check_int("speculation.global_index_tokens", self.global_index_tokens, 0, 1 << 24)
        check_int("speculation.max_drafts_per_step", self.max_drafts_per_step, 0, 64)
        check_str("speculation.prefer", self.prefer, ("admission", "drafts"))
        check_str("speculation.draft_budget", self.draft_budget, ("fixed", "adaptive"))
        for key in ("cost_fixed_ms", "cost_row_ms", "cost_expert_ms"):
            check_num(f"speculation.{key}", getattr(self, key), 0.0)
        check_bool("speculation.draft_overlap", self.draft_overlap)


@dataclass(frozen=True)
class LoggingSection:
    level: str = "info"
    json: bool = True
    log_prompts: bool = False  # log prompt and output text (off: only token counts)

    def __post_init__(self) -> None:
        check_str("logging.level", self.level, ("debug", "info", "warning", "error"))
        check_bool("logging.json", self.json)
        check_bool("logging.log_prompts", self.log_prompts)


@dataclass(frozen=True)
class SystemdSection:
    watchdog: bool = True  # send WATCHDOG=1 when systemd asks for it (WatchdogSec=)

    def __post_init__(self) -> None:
        check_bool("systemd.watchdog", self.watchdog)


