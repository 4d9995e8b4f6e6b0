"""The ``tandem`` command line: every subcommand's arguments live here.

`serve` and `check-config` run in daemon/commands.py; `generate`, `score` and `expert-stats`
load the model into this process and run in daemon/inprocess.py, imported only for them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from daemon import commands
from protocol.worker_config import CPU_ISAS

DESCRIPTION = "Serve Mixture-of-Experts models on one GPU plus the host CPU."


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, default=None,
                   help="Hugging Face model directory or GGUF file (default: the embedded "
                        "tandem-tiny)")
    p.add_argument("--dtype", choices=("float32", "float64", "bfloat16"), default="float32")
    p.add_argument("--backend", choices=("numpy", "cupy", "auto"), default="numpy")
    p.add_argument("--placement", choices=("gpu", "cpu", "split"), default="gpu",
                   help="where routed experts run: the backend, CPU workers, or split")
    p.add_argument("--cpu-experts-per-layer", type=int, default=0)
    p.add_argument("--cpu-workers", type=int, default=0, help="0: one per NUMA node")
    p.add_argument("--cpu-isa", choices=CPU_ISAS,
                   default="auto", help="CPU expert kernels (same bits; auto: the best)")
    p.add_argument("--hot-experts", type=Path, default=None,
                   help="split: router counts (tandem expert-stats); the GPU keeps the hottest")


def build_parser() -> argparse.ArgumentParser:
    """Every subcommand; each sets `func`, the function that runs it (-> exit status)."""
    parser = argparse.ArgumentParser(prog="tandem", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text in-process")
    _add_model_args(gen)
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", help="prompt as comma-separated token ids")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=None)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--json", action="store_true",
                     help='print {"token_ids": [...], "text": "..."} (generated tokens only)')
    gen.set_defaults(func=_in_process)

    score = sub.add_parser("score", help="write the logits of every prompt position (.npy)")
    _add_model_args(score)
    score.add_argument("--prompt-ids", required=True)
    score.add_argument("--out", type=Path, required=True)
    score.set_defaults(func=_in_process)

    stats = sub.add_parser("expert-stats", help="count the router's expert picks over a text "
                           "(for [experts] hot_experts)")
    stats.add_argument("--model", type=Path, default=None,
                       help="Hugging Face model directory (default: the embedded tandem-tiny)")
    stats.add_argument("--backend", choices=("numpy", "cupy", "auto"), default="numpy")
    stats.add_argument("--text", type=Path, required=True,
                       help="UTF-8 text like the service's traffic (prompts, documents, code)")
    stats.add_argument("--chunk-tokens", type=int, default=512,
                       help="the text runs as prompts of this many tokens")
    stats.add_argument("--max-tokens", type=int, default=200_000, help="tokens to use at most")
    stats.add_argument("--out", type=Path, required=True, help="the counts file (JSON)")
    stats.set_defaults(func=_in_process)

    serve = sub.add_parser("serve", help="run the daemon: HTTP API, ZeroMQ API, workers")
    serve.add_argument("--config", type=Path, default=None,
                       help="TOML config (default: built-in defaults, as configs/tiny.toml)")
    serve.add_argument("--model", type=Path, default=None,
                       help="model directory or .gguf file ([model] path)")
    serve.add_argument("--host", default=None, help="HTTP address to bind ([server] host)")
    serve.add_argument("--port", type=int, default=None, help="HTTP port ([server] port)")
    serve.add_argument("--speculation", choices=("off", "narrow", "wide"), default=None,
                       help="speculative decoding ([speculation] mode)")
    serve.add_argument("--proposer", choices=("suffix", "mtp"), default=None,
                       help="where drafts come from ([speculation] proposer)")
    serve.add_argument("--num-drafts", type=int, default=None,
                       help="drafts per slot and step ([speculation] num_drafts)")
    serve.add_argument("--draft-budget", choices=("fixed", "adaptive"), default=None,
                       help="draft lengths: fixed or by expected tokens per ms "
                            "([speculation] draft_budget)")
    serve.set_defaults(func=commands.run_serve)

    check = sub.add_parser("check-config", help="validate a config file and summarize it")
    check.add_argument("config", type=Path, help="TOML config file")
    check.set_defaults(func=commands.run_check_config)
    return parser


def _in_process(args: argparse.Namespace) -> int:
    from daemon import inprocess  # noqa: PLC0415 (the model code loads only for these commands)

    return inprocess.run(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
