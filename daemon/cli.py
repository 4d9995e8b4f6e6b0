"""The ``tandem`` command line: every subcommand's arguments live here."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = REPO_ROOT / "models" / "tandem-tiny"


class CliError(Exception):
    """A user-facing error: printed as one line, exit status 2."""


def default_model() -> Path:
    return Path(os.environ.get("TANDEM_MODEL", DEFAULT_MODEL))


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise CliError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise CliError("--prompt-ids is empty")
    return ids


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, default=None,
                   help="Hugging Face model directory (default: the embedded tandem-tiny)")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--backend", choices=("numpy", "cupy", "auto"), default="numpy")
    p.add_argument("--placement", choices=("gpu", "cpu", "split"), default="gpu",
                   help="where routed experts run: the backend, CPU workers, or split")
    p.add_argument("--cpu-experts-per-layer", type=int, default=0)
    p.add_argument("--cpu-workers", type=int, default=0, help="0: one per NUMA node")
    p.add_argument("--cpu-isa", choices=("auto", "portable", "avx2", "avx512vnni"),
                   default="auto", help="CPU expert kernels (same bits; auto: the best)")
    p.add_argument("--hot-experts", type=Path, default=None,
                   help="split: router counts (tandem expert-stats); the GPU keeps the hottest")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__)
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

    score = sub.add_parser("score", help="write the logits of every prompt position (.npy)")
    _add_model_args(score)
    score.add_argument("--prompt-ids", required=True)
    score.add_argument("--out", type=Path, required=True)

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

    from daemon import commands  # noqa: PLC0415  (serve and check-config)

    commands.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0) if hasattr(args, "func") else _dispatch(args)
    except CliError as exc:
        print(f"tandem: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _dispatch(args: argparse.Namespace) -> int:
    from daemon.tokenizer import TokenizerError  # noqa: PLC0415
    from gpu_worker.model_config import ModelConfigError  # noqa: PLC0415
    from gpu_worker.loader import CheckpointError  # noqa: PLC0415

    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "score":
            return _score(args)
        if args.command == "expert-stats":
            return _expert_stats(args)
    except (CheckpointError, ModelConfigError, TokenizerError, ValueError) as exc:
        raise CliError(str(exc)) from None
    raise CliError(f"unknown command {args.command}")


def _engine(args: argparse.Namespace, max_len: int):
    from gpu_worker.engine import Engine  # noqa: PLC0415

    path = args.model or default_model()
    if not path.is_dir():
        raise CliError(f"model directory {path} does not exist")
    return Engine.from_dir(path, dtype=args.dtype, backend=args.backend, max_slots=1,
                           max_len=max_len, placement=args.placement,
                           cpu_experts_per_layer=args.cpu_experts_per_layer,
                           cpu_workers=args.cpu_workers, cpu_isa=args.cpu_isa,
                           hot_experts=args.hot_experts)


def _generate(args: argparse.Namespace) -> int:
    from daemon.tokenizer import Tokenizer, TokenizerError  # noqa: PLC0415
    from gpu_worker.loader import load_generation_config  # noqa: PLC0415
    from protocol.messages import SamplingParams  # noqa: PLC0415

    path = args.model or default_model()
    tokenizer = None
    try:
        tokenizer = Tokenizer.from_dir(path)
    except TokenizerError as exc:
        if args.prompt is not None or args.chat or not args.json:
            raise CliError(f"{exc} (a model without a tokenizer needs --prompt-ids and "
                           f"--json)") from None
    if args.prompt is not None:
        text = args.prompt
        if args.chat:
            text = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                 add_generation_prompt=True)
        ids = tokenizer.encode(text)
    else:
        ids = _parse_ids(args.prompt_ids)
        if args.chat:
            raise CliError("--chat needs --prompt text")
    gen_cfg = load_generation_config(path)
    eos = tuple(tokenizer.eos_token_ids if tokenizer else gen_cfg.get("eos_token_ids", ()))

    def pick(value, key, fallback):
        return value if value is not None else gen_cfg.get(key, fallback)

    params = SamplingParams(temperature=pick(args.temperature, "temperature", 1.0),
                            top_p=pick(args.top_p, "top_p", 1.0),
                            top_k=pick(args.top_k, "top_k", 0), min_p=args.min_p, seed=args.seed)
    engine = _engine(args, len(ids) + args.max_tokens)
    try:
        out = engine.generate(ids, params=params, max_tokens=args.max_tokens, eos_ids=eos)
    finally:
        engine.close()
    text = tokenizer.decode(out) if tokenizer else None
    if args.json:
        print(json.dumps({"token_ids": out, "text": text}, ensure_ascii=False))
    else:
        print(text)
    return 0


def _score(args: argparse.Namespace) -> int:
    import numpy as np  # noqa: PLC0415

    ids = _parse_ids(args.prompt_ids)
    engine = _engine(args, len(ids))
    try:
        logits = engine.score(ids)
    finally:
        engine.close()
    np.save(args.out, logits)
    print(f"wrote {args.out} {logits.shape[0]}x{logits.shape[1]} float32")
    return 0


def _expert_stats(args: argparse.Namespace) -> int:
    from daemon.tokenizer import Tokenizer  # noqa: PLC0415
    from gpu_worker.backend import get_xp  # noqa: PLC0415
    from gpu_worker.expert_stats import count_routing, save_counts  # noqa: PLC0415
    from gpu_worker.loader import load_checkpoint  # noqa: PLC0415
    from gpu_worker.model.model import Model  # noqa: PLC0415

    path = args.model or default_model()
    if not path.is_dir():
        raise CliError(f"model directory {path} does not exist")
    if args.chunk_tokens < 1 or args.max_tokens < 1:
        raise CliError("--chunk-tokens and --max-tokens must be >= 1")
    try:
        text = args.text.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"cannot read {args.text}: {exc}") from None
    ids = Tokenizer.from_dir(path).encode(text)[: args.max_tokens]
    if not ids:
        raise CliError(f"{args.text} holds no text")
    ckpt = load_checkpoint(path, include_mtp=False)
    if not ckpt.config.num_experts:
        raise CliError(f"{path} is not a mixture-of-experts model")
    model = Model(ckpt.config, ckpt.tensors, xp=get_xp(args.backend))
    n = args.chunk_tokens
    chunks = [ids[i:i + n] for i in range(0, len(ids), n)]
    counts = count_routing(model, chunks)
    save_counts(args.out, counts, model=str(path.resolve()), tokens=len(ids))
    picks = sum(int(c.sum()) for c in counts.values())
    print(f"{len(ids)} tokens in {len(chunks)} prompts, {picks} router picks over "
          f"{len(counts)} MoE layers -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
