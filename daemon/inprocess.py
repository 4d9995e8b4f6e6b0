"""The in-process commands: `tandem generate`, `score`, `expert-stats`, and the model checks of
`tandem check-config`. They load the model into this process, so this is the one daemon
module that imports `gpu_worker`; everything else reaches the worker through `protocol/`.

`run(args)` takes the parsed command line of daemon/cli.py and returns the exit status: a bad
input is one line on stderr (`tandem: error: ...`) and status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

from daemon.config import Config, ConfigError, default_model
from daemon.lifecycle import worker_config
from daemon.tokenizer import Tokenizer, TokenizerError
from gpu_worker.backend import get_xp
from gpu_worker.engine import Engine
from gpu_worker.expert_stats import count_routing, load_counts, save_counts
from gpu_worker.loader import (
    CheckpointError,
    load_checkpoint,
    load_generation_config,
)
from gpu_worker.memory_parts import device_memory_bytes
from gpu_worker.memory_plan import PlanError, describe, plan_for_worker
from gpu_worker.model.model import Model
from gpu_worker.model_config import ModelConfig, ModelConfigError
from gpu_worker.weights.resolve import model_config
from protocol.messages import SamplingParams


class CommandError(Exception):
    """A user-facing error: printed as one line, exit status 2."""


def run(args: argparse.Namespace) -> int:
    """Run the in-process command `args.command`; user errors -> one line, status 2."""
    commands: dict[str, Callable[[argparse.Namespace], int]] = {
        "generate": generate, "score": score, "expert-stats": expert_stats}
    try:
        return commands[args.command](args)
    except (CommandError, CheckpointError, ModelConfigError, TokenizerError, ValueError) as exc:
        print(f"tandem: error: {exc}", file=sys.stderr)
        return 2


class PlanRefused(ConfigError):
    """The memory plan does not fit; ``lines`` describe the refused plan."""

    def __init__(self, message: str, lines: list[str]) -> None:
        super().__init__(message)
        self.lines = lines


def check_model(config: Config) -> list[str]:
    """The model directory must hold a config.json the loader accepts, and the config must
    fit that model (ConfigError naming the key otherwise) and the memory (PlanRefused).
    Returns the memory plan's lines; reads no weight."""
    try:
        model = model_config(config.model.path)  # config.json, or a GGUF's metadata
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
    return _memory_plan(config, model)


def _memory_plan(config: Config, model: ModelConfig) -> list[str]:
    """The worker's memory plan for `config` (gpu_worker/memory_plan.py), made from the
    model's config.json alone, as lines; PlanRefused if it cannot fit."""
    worker = worker_config(config)
    backend = config.model.backend
    if backend == "auto":
        backend = "cupy" if device_memory_bytes() is not None else "numpy"
    note = []
    if backend == "cupy" and worker.gpu_memory_gb is None and device_memory_bytes() is None:
        note = ["GPU budget: the whole device, but no CUDA device is visible here: the GPU "
                "side is not checked"]
    hot = None
    if config.experts.hot_experts is not None:
        try:
            hot = load_counts(config.experts.hot_experts, model)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    try:
        plan = plan_for_worker(worker, model, backend=backend, hot_counts=hot)
    except PlanError as exc:
        raise PlanRefused(str(exc), note + (describe(exc.plan) if exc.plan else [])) from None
    return note + describe(plan)


# ---- the commands ---------------------------------------------------------------------------
def generate(args: argparse.Namespace) -> int:
    """Print the continuation of a prompt (text, or token ids with --json)."""
    path = args.model or default_model()
    tokenizer = None
    try:
        tokenizer = Tokenizer.from_dir(path)
    except TokenizerError as exc:
        if args.prompt is not None or args.chat or not args.json:
            raise CommandError(f"{exc} (a model without a tokenizer needs --prompt-ids and "
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
            raise CommandError("--chat needs --prompt text")
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


def score(args: argparse.Namespace) -> int:
    """Write the logits of every prompt position, [T, V] float32, to a .npy file."""
    ids = _parse_ids(args.prompt_ids)
    engine = _engine(args, len(ids))
    try:
        logits = engine.score(ids)
    finally:
        engine.close()
    np.save(args.out, logits)
    print(f"wrote {args.out} {logits.shape[0]}x{logits.shape[1]} float32")
    return 0


def expert_stats(args: argparse.Namespace) -> int:
    """Count the router's expert picks over a text, per MoE layer ([experts] hot_experts)."""
    path = _model_dir(args.model)
    if args.chunk_tokens < 1 or args.max_tokens < 1:
        raise CommandError("--chunk-tokens and --max-tokens must be >= 1")
    try:
        text = args.text.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CommandError(f"cannot read {args.text}: {exc}") from None
    ids = Tokenizer.from_dir(path).encode(text)[: args.max_tokens]
    if not ids:
        raise CommandError(f"{args.text} holds no text")
    ckpt = load_checkpoint(path, include_mtp=False)
    if not ckpt.config.num_experts:
        raise CommandError(f"{path} is not a mixture-of-experts model")
    model = Model(ckpt.config, ckpt.tensors, xp=get_xp(args.backend))
    n = args.chunk_tokens
    chunks = [ids[i:i + n] for i in range(0, len(ids), n)]
    counts = count_routing(model, chunks)
    save_counts(args.out, counts, model=str(path.resolve()), tokens=len(ids))
    picks = sum(int(c.sum()) for c in counts.values())
    print(f"{len(ids)} tokens in {len(chunks)} prompts, {picks} router picks over "
          f"{len(counts)} MoE layers -> {args.out}")
    return 0


# ---- helpers --------------------------------------------------------------------------------
def _model_dir(model: Path | None) -> Path:
    path = model or default_model()
    if not (path.is_dir() or (path.is_file() and path.suffix == ".gguf")):
        raise CommandError(f"model directory or .gguf file {path} does not exist")
    return path


def _engine(args: argparse.Namespace, max_len: int) -> Engine:
    """One slot of `max_len` tokens over the model of `args` (--model and the expert flags)."""
    return Engine.from_dir(_model_dir(args.model), dtype=args.dtype, backend=args.backend,
                           max_slots=1, max_len=max_len, placement=args.placement,
                           cpu_experts_per_layer=args.cpu_experts_per_layer,
                           cpu_workers=args.cpu_workers, cpu_isa=args.cpu_isa,
                           hot_experts=args.hot_experts)


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise CommandError(f"--prompt-ids must be comma-separated integers, got {text!r}") \
            from None
    if not ids:
        raise CommandError("--prompt-ids is empty")
    return ids
