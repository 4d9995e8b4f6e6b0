"""The daemon's TOML configuration: frozen dataclasses, one per section, validated on creation.

Every error is a `ConfigError` whose message starts with the key path
(`scheduler.max_slots: must be >= 1, got 0`). Relative paths in a file are relative to that
file's directory. `load_config(path, overrides)` applies CLI flags (`{"server.port": 9000}`)
on top of the file, then validates everything, including the rules that span sections.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from daemon.cli import default_model

LOOPBACK_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost")
IPC_PATH_MAX = 107  # sun_path is 108 bytes including the terminating NUL


class ConfigError(ValueError):
    """A bad config file or value; the message names the key."""


def default_run_dir() -> Path:
    """systemd's $RUNTIME_DIRECTORY, else $XDG_RUNTIME_DIR/tandem, else /tmp/tandem-<uid>."""
    if os.environ.get("RUNTIME_DIRECTORY"):
        return Path(os.environ["RUNTIME_DIRECTORY"].split(":")[0])
    if os.environ.get("XDG_RUNTIME_DIR"):
        return Path(os.environ["XDG_RUNTIME_DIR"]) / "tandem"
    return Path(f"/tmp/tandem-{os.getuid()}")


# ---- value checks: each raises ConfigError("<section>.<key>: ...") ------------------------------
def _fail(key: str, message: str, value: Any) -> None:
    raise ConfigError(f"{key}: {message}, got {value!r}")


def _int(key: str, value: Any, lo: int | None = None, hi: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        _fail(key, "must be an integer", value)
    if lo is not None and value < lo:
        _fail(key, f"must be >= {lo}", value)
    if hi is not None and value > hi:
        _fail(key, f"must be <= {hi}", value)


def _num(key: str, value: Any, lo: float) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        _fail(key, "must be a finite number", value)
    if value < lo:
        _fail(key, f"must be >= {lo}", value)


def _bool(key: str, value: Any) -> None:
    if not isinstance(value, bool):
        _fail(key, "must be true or false", value)


def _str(key: str, value: Any, choices: tuple[str, ...] = (), empty: bool = False) -> None:
    if not isinstance(value, str):
        _fail(key, "must be a string", value)
    if choices and value not in choices:
        _fail(key, "must be one of " + ", ".join(repr(c) for c in choices), value)
    if not empty and not value:
        _fail(key, "must not be empty", value)


def _path(key: str, value: Any) -> None:
    if not isinstance(value, Path):
        _fail(key, "must be a path", value)


def _strs(key: str, value: Any) -> None:
    if not isinstance(value, tuple) or not all(isinstance(v, str) and v for v in value):
        _fail(key, "must be a list of non-empty strings", value)


# ---- sections -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelSection:
    path: Path = field(default_factory=default_model)
    name: str = ""  # served model name; "" -> the directory's name
    aliases: tuple[str, ...] = ()  # other names accepted in requests' "model"
    dtype: str = "float32"
    backend: str = "numpy"

    def __post_init__(self) -> None:
        _path("model.path", self.path)
        if not self.path.is_dir():
            _fail("model.path", "must be an existing model directory", str(self.path))
        _str("model.name", self.name, empty=True)
        _strs("model.aliases", self.aliases)
        _str("model.dtype", self.dtype, ("float32", "float64"))
        _str("model.backend", self.backend, ("numpy", "cupy", "auto"))

    @property
    def served_name(self) -> str:
        return self.name or self.path.resolve().name


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
        _str("server.host", self.host)
        _int("server.port", self.port, 0, 65535)
        _strs("server.api_keys", self.api_keys)
        if any(k != k.strip() or len(k) < 8 for k in self.api_keys):
            raise ConfigError("server.api_keys: each key must be >= 8 characters without "
                              "surrounding whitespace")
        if self.api_keys_file is not None:
            _path("server.api_keys_file", self.api_keys_file)
        _bool("server.allow_insecure_public", self.allow_insecure_public)
        _bool("server.split_reasoning", self.split_reasoning)
        _int("server.max_body_bytes", self.max_body_bytes, 1024, 1 << 30)
        _num("server.shutdown_grace_s", self.shutdown_grace_s, 0)
        _path("server.run_dir", self.run_dir)
        _str("server.zmq_endpoint", self.zmq_endpoint, empty=True)
        if not self.zmq_endpoint:
            object.__setattr__(self, "zmq_endpoint", self.ipc_endpoint("client"))
        self._check_zmq()

    def _check_zmq(self) -> None:
        endpoint = self.zmq_endpoint
        if endpoint.startswith("ipc://"):
            if len(endpoint[6:].encode()) > IPC_PATH_MAX:
                _fail("server.zmq_endpoint", f"ipc path must be <= {IPC_PATH_MAX} bytes", endpoint)
            return
        if not endpoint.startswith("tcp://"):
            _fail("server.zmq_endpoint", "must start with ipc:// or tcp://", endpoint)
        _str("server.zmq_curve_public_key", self.zmq_curve_public_key, empty=True)
        if len(self.zmq_curve_public_key) != 40:
            _fail("server.zmq_curve_public_key", "a tcp:// endpoint needs CURVE keys: the "
                  "server's 40-character Z85 public key", self.zmq_curve_public_key)
        if not isinstance(self.zmq_curve_secret_key_file, Path):
            _fail("server.zmq_curve_secret_key_file", "a tcp:// endpoint needs the path of the "
                  "server's secret key file", self.zmq_curve_secret_key_file)
        _strs("server.zmq_curve_client_keys", self.zmq_curve_client_keys)
        if not self.zmq_curve_client_keys or any(len(k) != 40 for k in self.zmq_curve_client_keys):
            _fail("server.zmq_curve_client_keys", "a tcp:// endpoint needs a non-empty list of "
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

    def __post_init__(self) -> None:
        if self.max_prompt_tokens is not None:
            _int("limits.max_prompt_tokens", self.max_prompt_tokens, 1)
        if self.max_tokens is not None:
            _int("limits.max_tokens", self.max_tokens, 1)
        _int("limits.max_queue", self.max_queue, 0)
        _num("limits.request_timeout_s", self.request_timeout_s, 0)


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
    preemption: str = "swap"

    def __post_init__(self) -> None:
        _int("scheduler.max_slots", self.max_slots, 1, 256)
        _int("scheduler.max_context", self.max_context, 2)
        _int("scheduler.prefill_chunk", self.prefill_chunk, 1)
        _int("scheduler.kv_block_size", self.kv_block_size, 1)
        if self.kv_block_size & (self.kv_block_size - 1):
            _fail("scheduler.kv_block_size", "must be a power of two", self.kv_block_size)
        _str("scheduler.kv_cache_dtype", self.kv_cache_dtype, ("model", "int8"))
        _bool("scheduler.prefix_cache", self.prefix_cache)
        _int("scheduler.checkpoint_interval", self.checkpoint_interval, 1)
        _int("scheduler.prefix_cache_max_mb", self.prefix_cache_max_mb, 0)
        _str("scheduler.preemption", self.preemption, ("swap", "recompute"))


@dataclass(frozen=True)
class ExpertsSection:
    placement: str = "gpu"  # gpu: all experts on the worker; cpu: all on CPU workers; split
    cpu_experts_per_layer: int = 0  # split: experts per layer computed on the CPU
    cpu_workers: int = 0  # 0 -> one per NUMA node
    cpu_cores: tuple[tuple[int, ...], ...] = ()  # per worker; () -> derived from NUMA nodes
    cpu_isa: str = "auto"  # CPU expert kernels: auto (the best the CPU has) or one by name
    # cupy: launched (GPU kernels ring the workers and wait for them on the stream) or sync
    # (the host rings and waits per layer); same bits (docs/cpu_experts.md)
    cpu_dispatch: str = "launched"
    # split: per-layer router counts (`tandem expert-stats`); the GPU keeps the most-picked
    # experts, the CPU gets the rest. None: the last expert ids go to the CPU
    hot_experts: Path | None = None

    def __post_init__(self) -> None:
        _str("experts.placement", self.placement, ("gpu", "cpu", "split"))
        _str("experts.cpu_isa", self.cpu_isa, ("auto", "portable", "avx2", "avx512vnni"))
        _str("experts.cpu_dispatch", self.cpu_dispatch, ("launched", "sync"))
        if self.hot_experts is not None:
            _path("experts.hot_experts", self.hot_experts)
            if self.placement != "split":
                _fail("experts.hot_experts", "needs placement = 'split'", str(self.hot_experts))
            if not self.hot_experts.is_file():
                _fail("experts.hot_experts", "must be an existing file (`tandem expert-stats` "
                      "writes one)", str(self.hot_experts))
        _int("experts.cpu_experts_per_layer", self.cpu_experts_per_layer, 0)
        if self.placement == "split" and self.cpu_experts_per_layer < 1:
            _fail("experts.cpu_experts_per_layer", "must be >= 1 with placement = 'split'",
                  self.cpu_experts_per_layer)
        _int("experts.cpu_workers", self.cpu_workers, 0, 64)
        cores = self.cpu_cores
        if not isinstance(cores, tuple) or not all(
                isinstance(w, tuple) and w and all(isinstance(c, int) and not isinstance(c, bool)
                                                   and c >= 0 for c in w) for w in cores):
            _fail("experts.cpu_cores", "must be a list of non-empty lists of core numbers >= 0",
                  cores)
        if cores and self.cpu_workers and len(cores) != self.cpu_workers:
            _fail("experts.cpu_cores", f"must have one list per worker ({self.cpu_workers})",
                  cores)
        flat = [c for w in cores for c in w]
        if len(flat) != len(set(flat)):
            _fail("experts.cpu_cores", "a core must belong to one worker only", cores)

    @property
    def num_cpu_workers(self) -> int:
        """Workers to start: cpu_workers, else one per cpu_cores list, else 0 (NUMA auto)."""
        return self.cpu_workers or len(self.cpu_cores)


@dataclass(frozen=True)
class SpeculationSection:
    """``mode``: "off"; "narrow" (each drafted slot verified in its own forward pass) or
    "wide" (2-4 drafted slots verified together in one pass, narrow otherwise). Drafts come
    from ``proposer``: "suffix" (the request's own history, after a suffix of at least
    ``min_match`` tokens matched) or "mtp" (the model's MTP head, run by the worker after
    each step; no drafts from a model without one); ``num_drafts`` per slot and step.
    Tokens are those of "off"."""

    mode: str = "off"
    proposer: str = "suffix"
    num_drafts: int = 4
    min_match: int = 2
    max_match: int = 8

    def __post_init__(self) -> None:
        _str("speculation.mode", self.mode, ("off", "narrow", "wide"))
        _str("speculation.proposer", self.proposer, ("suffix", "mtp"))
        _int("speculation.num_drafts", self.num_drafts, 1, 15)
        _int("speculation.min_match", self.min_match, 1, 64)
        _int("speculation.max_match", self.max_match, self.min_match, 64)


@dataclass(frozen=True)
class LoggingSection:
    level: str = "info"
    json: bool = True
    log_prompts: bool = False  # log prompt and output text (off: only token counts)

    def __post_init__(self) -> None:
        _str("logging.level", self.level, ("debug", "info", "warning", "error"))
        _bool("logging.json", self.json)
        _bool("logging.log_prompts", self.log_prompts)


@dataclass(frozen=True)
class SystemdSection:
    watchdog: bool = True  # send WATCHDOG=1 when systemd asks for it (WatchdogSec=)

    def __post_init__(self) -> None:
        _bool("systemd.watchdog", self.watchdog)


@dataclass(frozen=True)
class Config:
    model: ModelSection = field(default_factory=ModelSection)
    server: ServerSection = field(default_factory=ServerSection)
    limits: LimitsSection = field(default_factory=LimitsSection)
    scheduler: SchedulerSection = field(default_factory=SchedulerSection)
    experts: ExpertsSection = field(default_factory=ExpertsSection)
    speculation: SpeculationSection = field(default_factory=SpeculationSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    systemd: SystemdSection = field(default_factory=SystemdSection)
    source: Path | None = None  # the file it came from

    def __post_init__(self) -> None:
        server, ctx = self.server, self.scheduler.max_context
        if not server.is_loopback and not server.api_keys and not server.allow_insecure_public:
            raise ConfigError(
                f"server.host: {server.host!r} is not a loopback address; set server.api_keys "
                f"(or server.api_keys_file), or server.allow_insecure_public = true to serve "
                f"without authentication")
        limit = self.limits.max_prompt_tokens
        if limit is not None and limit >= ctx:
            _fail("limits.max_prompt_tokens", f"must be < scheduler.max_context ({ctx})", limit)

    @property
    def max_prompt_tokens(self) -> int:
        """Longest prompt accepted (the config's limit, else max_context - 1)."""
        return self.limits.max_prompt_tokens or self.scheduler.max_context - 1

    @property
    def max_tokens(self) -> int:
        """Largest max_tokens a request may ask for."""
        return self.limits.max_tokens or self.scheduler.max_context - 1


_SECTION_TYPES = {"model": ModelSection, "server": ServerSection, "limits": LimitsSection,
                  "scheduler": SchedulerSection, "experts": ExpertsSection,
                  "speculation": SpeculationSection, "logging": LoggingSection,
                  "systemd": SystemdSection}
_PATH_KEYS = {"model.path", "server.api_keys_file", "server.run_dir",
              "server.zmq_curve_secret_key_file", "experts.hot_experts"}


# ---- loading ------------------------------------------------------------------------------------
def load_config(path: str | Path | None, overrides: dict[str, Any] | None = None) -> Config:
    """Read TOML file `path` (None: all defaults), apply `overrides` (dotted keys such as
    "server.port"; None values are ignored) and validate. Raises ConfigError."""
    data: dict[str, Any] = {}
    base = Path.cwd()
    if path is not None:
        file = Path(path)
        try:
            with file.open("rb") as f:
                data = tomllib.load(f)
        except OSError as exc:
            raise ConfigError(f"{file}: cannot read: {exc.strerror or exc}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{file}: invalid TOML: {exc}") from None
        base = file.resolve().parent
    for key, value in (overrides or {}).items():
        if value is None:
            continue
        section, _, name = key.partition(".")
        if section not in _SECTION_TYPES or not name:
            raise ConfigError(f"{key}: unknown override")
        if key in _PATH_KEYS and isinstance(value, str | Path):
            value = Path(value).expanduser().resolve()  # a flag's path is relative to the cwd
        data.setdefault(section, {})[name] = value
    sections = {name: _section(name, data.pop(name, {}), base) for name in _SECTION_TYPES}
    if data:
        unknown = sorted(data)[0]
        raise ConfigError(f"{unknown}: unknown section (known: {', '.join(_SECTION_TYPES)})")
    server = sections["server"]
    if server.api_keys_file is not None:
        keys = server.api_keys + _read_keys(server.api_keys_file)
        sections["server"] = dataclasses.replace(server, api_keys=keys)
    return Config(**sections, source=Path(path).resolve() if path is not None else None)


def _section(name: str, table: Any, base: Path) -> Any:
    cls = _SECTION_TYPES[name]
    if not isinstance(table, dict):
        raise ConfigError(f"{name}: must be a table ([{name}]), got {table!r}")
    known = [f.name for f in dataclasses.fields(cls)]
    values: dict[str, Any] = {}
    for key, value in table.items():
        if key not in known:
            raise ConfigError(f"{name}.{key}: unknown key (known: {', '.join(known)})")
        if f"{name}.{key}" in _PATH_KEYS and isinstance(value, str | Path):
            value = Path(os.path.normpath(base / Path(value).expanduser())) if value else value
        values[key] = _freeze(value)
    return cls(**values)


def _freeze(value: Any) -> Any:
    """TOML arrays -> tuples (the dataclasses are frozen and hashable)."""
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    return value


def _read_keys(file: Path) -> tuple[str, ...]:
    """One API key per line; blank lines and lines starting with # are skipped."""
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"server.api_keys_file: cannot read {file}: {exc}") from None
    keys = tuple(line.strip() for line in text.splitlines()
                 if line.strip() and not line.lstrip().startswith("#"))
    if not keys:
        raise ConfigError(f"server.api_keys_file: {file} holds no keys")
    if any(len(k) < 8 for k in keys):
        raise ConfigError(f"server.api_keys_file: {file}: each key must be >= 8 characters")
    return keys


def summary(config: Config) -> list[str]:
    """A few human-readable lines describing what `config` will serve."""
    m, s, sc, e = config.model, config.server, config.scheduler, config.experts
    auth = f"{len(s.api_keys)} API key(s)" if s.api_keys else "no API keys"
    cpu = ("" if e.placement == "gpu" else
           f", {e.num_cpu_workers or 'one per NUMA node'} CPU worker(s)")
    return [
        f"model: {m.served_name} from {m.path} ({m.dtype}, {m.backend} backend)",
        f"http: http://{s.host}:{s.port} ({auth}), body <= {s.max_body_bytes} bytes",
        f"zmq: {s.zmq_endpoint}",
        f"scheduler: {sc.max_slots} slots x {sc.max_context} tokens, prefill chunk "
        f"{sc.prefill_chunk}, prefix cache {'on' if sc.prefix_cache else 'off'}, "
        f"preemption {sc.preemption}, kv cache {sc.kv_cache_dtype}",
        f"limits: prompt <= {config.max_prompt_tokens}, max_tokens <= {config.max_tokens}, "
        f"queue <= {config.limits.max_queue}",
        f"experts: {e.placement}{cpu}",
        "speculation: off" if config.speculation.mode == "off" else
        f"speculation: {config.speculation.mode}, {config.speculation.num_drafts} "
        f"{config.speculation.proposer} drafts per slot",
    ]
