"""The daemon's TOML configuration: the `Config` of all sections, and how a file becomes one.

Every error is a `ConfigError` whose message starts with the key path
(`scheduler.max_slots: must be >= 1, got 0`). Relative paths in a file are relative to that
file's directory. `load_config(path, overrides)` applies CLI flags (`{"server.port": 9000}`)
on top of the file, then validates everything, including the rules that span sections. The
sections themselves live in daemon/config_sections.py, their value checks in
daemon/config_checks.py; this module is the one to import.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from daemon.config_checks import ConfigError, fail
from daemon.config_sections import (
    DEFAULT_MODEL,
    REPO_ROOT,
    ExpertsSection,
    LimitsSection,
    LoggingSection,
    ModelSection,
    SchedulerSection,
    ServerSection,
    SpeculationSection,
    SystemdSection,
    default_model,
)

__all__ = ["DEFAULT_MODEL", "REPO_ROOT", "Config", "ConfigError", "ExpertsSection",
           "LimitsSection", "LoggingSection", "ModelSection", "SchedulerSection",
           "ServerSection", "SpeculationSection", "SystemdSection", "default_model",
           "load_config", "summary"]


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
            fail("limits.max_prompt_tokens", f"must be < scheduler.max_context ({ctx})", limit)

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
              "server.zmq_curve_secret_key_file", "experts.hot_experts", "experts.shard_cache",
              "speculation.replay_file", "speculation.record_file",
              "speculation.step_trace_file"}


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
    if e.placement == "split":
        cpu += (f", {e.cpu_experts_per_layer} experts per layer on the CPU"
                if e.cpu_experts_per_layer else ", experts per layer chosen by the memory plan")
    budget = (f"{e.gpu_memory_gb:g} GiB" if e.gpu_memory_gb is not None else
              "the whole device" if m.backend != "numpy" else "no limit")
    return [
        f"model: {m.served_name} from {m.path} ({m.dtype}, {m.backend} backend"
        + (f", CUDA graphs{' in capacity buckets' if m.cuda_graph_buckets else ''}, "
           f"{m.cuda_graph_warm_up} layouts captured at start-up)"
           if m.cuda_graphs and m.backend != "numpy" else ")"),
        f"http: http://{s.host}:{s.port} ({auth}), body <= {s.max_body_bytes} bytes",
        f"zmq: {s.zmq_endpoint}",
        f"scheduler: {sc.max_slots} slots x {sc.max_context} tokens, prefill chunk "
        f"{sc.prefill_chunk}, prefix cache "
        + (f"{sc.prefix_cache_max_mb} MB" + (f" + {sc.prefix_cache_host_mb} MB host"
                                              if sc.prefix_cache_host_mb else "")
           if sc.prefix_cache else "off") + ", "
        f"preemption {sc.preemption}, kv cache {sc.kv_cache_dtype}",
        f"limits: prompt <= {config.max_prompt_tokens}, max_tokens <= {config.max_tokens}, "
        f"queue <= {config.limits.max_queue}",
        f"experts: {e.placement}{cpu}; GPU budget {budget}"
        + (f"; CPU expert shards kept in {e.shard_cache}"
           if e.shard_cache is not None and e.placement != "gpu" else ""),
        "speculation: off" if config.speculation.mode == "off" else
        f"speculation: {config.speculation.mode}, {config.speculation.num_drafts} "
        f"{config.speculation.proposer} drafts per slot"
        + (", draft overlap" if config.speculation.draft_overlap else ""),
    ]
