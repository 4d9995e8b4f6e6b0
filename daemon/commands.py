"""The `serve` and `check-config` subcommands of `tandem` (their arguments: daemon/cli.py)."""

from __future__ import annotations

import argparse
import sys

from daemon.config import Config, ConfigError, load_config, summary


def config_from_args(args: argparse.Namespace) -> Config:
    """The config file of `args` with its command-line overrides applied (ConfigError)."""
    return load_config(args.config, {"model.path": args.model, "server.host": args.host,
                                     "server.port": args.port,
                                     "speculation.mode": getattr(args, "speculation", None),
                                     "speculation.proposer": getattr(args, "proposer", None),
                                     "speculation.num_drafts": getattr(args, "num_drafts", None),
                                     "speculation.draft_budget": getattr(args, "draft_budget",
                                                                         None)})


def run_serve(args: argparse.Namespace) -> int:
    """Serve until SIGTERM; a bad config is one line on stderr and status 2."""
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        print(f"tandem: config error: {exc}", file=sys.stderr)
        return 2
    from daemon import lifecycle  # noqa: PLC0415 (heavy imports only when serving)

    return int(lifecycle.serve(config) or 0)  # it configures logging from config.logging


def run_check_config(args: argparse.Namespace) -> int:
    """Validate a config file, and the config against its model's config.json; print a
    summary and the memory plan (status 0), or the first error (status 2): a plan that
    cannot fit the GPU budget or host RAM is printed, then refused. No weight is read."""
    # the model check reads the checkpoint's config.json with the worker's loader
    from daemon.inprocess import PlanRefused, check_model  # noqa: PLC0415

    try:
        config = load_config(args.config)
        plan = check_model(config)
    except PlanRefused as exc:
        _print_plan(exc.lines)
        print(f"tandem: memory plan refused: {exc}", file=sys.stderr)
        return 2
    except ConfigError as exc:
        print(f"tandem: config error: {exc}", file=sys.stderr)
        return 2
    print(f"OK: {args.config}")
    for line in summary(config):
        print(f"  {line}")
    _print_plan(plan)
    return 0


def _print_plan(lines: list[str]) -> None:
    print("memory plan (before any weight is read):")
    for line in lines:
        print(f"  {line}")
