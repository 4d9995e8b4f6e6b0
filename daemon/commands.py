"""The `serve` and `check-config` subcommands of `tandem` (hooked into daemon/cli.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from daemon.config import Config, ConfigError, load_config, summary


def register(sub: Any) -> None:
    """Add `serve` and `check-config` to the `tandem` subparsers `sub`."""
    serve = sub.add_parser("serve", help="run the daemon: HTTP API, ZeroMQ API, workers")
    serve.add_argument("--config", type=Path, default=None,
                       help="TOML config (default: built-in defaults, as configs/tiny.toml)")
    serve.add_argument("--model", type=Path, default=None, help="model directory ([model] path)")
    serve.add_argument("--host", default=None, help="HTTP address to bind ([server] host)")
    serve.add_argument("--port", type=int, default=None, help="HTTP port ([server] port)")
    serve.add_argument("--speculation", choices=("off", "narrow", "wide"), default=None,
                       help="speculative decoding ([speculation] mode)")
    serve.add_argument("--proposer", choices=("suffix", "mtp"), default=None,
                       help="where drafts come from ([speculation] proposer)")
    serve.set_defaults(func=run_serve)

    check = sub.add_parser("check-config", help="validate a config file and summarize it")
    check.add_argument("config", type=Path, help="TOML config file")
    check.set_defaults(func=run_check_config)


def config_from_args(args: argparse.Namespace) -> Config:
    """The config file of `args` with its command-line overrides applied (ConfigError)."""
    return load_config(args.config, {"model.path": args.model, "server.host": args.host,
                                     "server.port": args.port,
                                     "speculation.mode": getattr(args, "speculation", None),
                                     "speculation.proposer": getattr(args, "proposer", None)})


def run_serve(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        print(f"tandem: config error: {exc}", file=sys.stderr)
        return 2
    from daemon import lifecycle  # noqa: PLC0415 (heavy imports only when serving)

    return int(lifecycle.serve(config) or 0)  # it configures logging from config.logging


def run_check_config(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config)
        _check_model(config)
    except ConfigError as exc:
        print(f"tandem: config error: {exc}", file=sys.stderr)
        return 2
    print(f"OK: {args.config}")
    for line in summary(config):
        print(f"  {line}")
    return 0


def _check_model(config: Config) -> None:
    """The model directory must hold a config.json the loader accepts, and the config must
    fit that model."""
    from gpu_worker.loader import CheckpointError, load_config  # noqa: PLC0415

    try:
        model = load_config(config.model.path)
    except CheckpointError as exc:
        raise ConfigError(f"model.path: {exc}") from None
    ctx, positions = config.scheduler.max_context, model.max_position_embeddings
    if ctx > positions:
        raise ConfigError(f"scheduler.max_context: must be <= the model's "
                          f"max_position_embeddings ({positions}), got {ctx}")
    if config.scheduler.kv_cache_dtype == "int8" and model.head_dim % 32:
        raise ConfigError(f"scheduler.kv_cache_dtype: int8 needs the model's head_dim to be a "
                          f"multiple of 32, got {model.head_dim}")
    cpu = config.experts.cpu_experts_per_layer
    if config.experts.placement == "split" and cpu >= model.num_experts:
        raise ConfigError(f"experts.cpu_experts_per_layer: must be < the model's "
                          f"{model.num_experts} experts per layer with placement = 'split' "
                          f"(use placement = 'cpu' for all), got {cpu}")
