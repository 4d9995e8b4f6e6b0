"""``python -m scripts.train SUBCOMMAND``: the command line of ``scripts/train`` (see its
``__init__`` for what each sub-command does)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

import scripts.train as package
from scripts.train.checkpoint import export, interpolate, load_model
from scripts.train.compile_rate import compile_rate, select_functions, validate
from scripts.train.data import KIND_WEIGHTS, load_streams, prepare
from scripts.train.finetune import finetune_ul
from scripts.train.loop import train
from scripts.train.losses import evaluate
from scripts.train.reference import reference, sample


def run_options(p: argparse.ArgumentParser, batch: int, lr: float, warmup: int, seed: int,
                kind_weights: str) -> None:
    """The options ``train`` and ``finetune-ul`` share (their defaults differ where given)."""
    p.add_argument("--data", type=Path, required=True, help="dir written by prepare")
    p.add_argument("--out", type=Path, required=True, help="checkpoint dir to write")
    p.add_argument("--device", default=None)
    p.add_argument("--time-budget", type=float, default=420.0, help="seconds, whole command")
    p.add_argument("--kind-weights", default=kind_weights,
                   help="per-token sampling weights replacing those of "
                        + ",".join(f"{k}={w}" for k, w in KIND_WEIGHTS.items())
                        + f", e.g. 'chat=1.5,func=0' (default: {kind_weights!r})")
    p.add_argument("--batch", type=int, default=batch)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--lr", type=float, default=lr)
    p.add_argument("--warmup", type=int, default=warmup)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--mtp-weight", type=float, default=0.3)
    p.add_argument("--aux-weight", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=seed)
    p.add_argument("--eval-windows", type=int, default=128)
    p.add_argument("--final-eval", action="store_true")
    p.add_argument("--experts-impl", default="", help="force grouped_mm or eager on CUDA")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.train",
                                 description=package.__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--corpus", type=Path, required=True)
    p.add_argument("--tokenizer", type=Path, default=Path("models/tandem-tiny/tokenizer.json"))
    p.add_argument("--out", type=Path, required=True)
    t = sub.add_parser("train")
    run_options(t, batch=64, lr=2e-3, warmup=150, seed=1234, kind_weights="")
    t.add_argument("--resume", type=Path, default=None, help="checkpoint dir to resume from")
    t.add_argument("--max-steps", type=int, default=0)
    t.add_argument("--max-tokens", type=int, default=0,
                   help="token target: the run (and its decay phase) ends at this many tokens "
                        "or at the time budget, whichever comes first")
    t.add_argument("--decay-frac", type=float, default=0.0,
                   help="linear decay over this final fraction of the run (WSD); the run's "
                        "progress is the larger of its time and --max-tokens fractions")
    t.add_argument("--min-lr-ratio", type=float, default=0.05)
    t.add_argument("--log-every", type=int, default=25)
    t.add_argument("--eval-every", type=float, default=120.0)
    e = sub.add_parser("export")
    e.add_argument("--ckpt", type=Path, required=True)
    e.add_argument("--model-dir", type=Path, default=Path("models/tandem-tiny"))
    r = sub.add_parser("reference")
    r.add_argument("--model-dir", type=Path, default=Path("models/tandem-tiny"))
    r.add_argument("--data", type=Path, required=True)
    r.add_argument("--out", type=Path, default=Path("models/tandem-tiny/reference_logits.npz"))
    v = sub.add_parser("evaluate")
    v.add_argument("--model-dir", type=Path, default=Path("models/tandem-tiny"))
    v.add_argument("--data", type=Path, required=True)
    v.add_argument("--windows", type=int, default=8)
    v.add_argument("--seq", type=int, default=512)
    s = sub.add_parser("sample")
    s.add_argument("--model-dir", type=Path, default=Path("models/tandem-tiny"))
    s.add_argument("--prompt", default="Write a Python function that reverses a string")
    s.add_argument("--max-new", type=int, default=80)
    c = sub.add_parser("compile-rate")
    c.add_argument("--model-dir", type=Path, default=Path("models/tandem-tiny"))
    c.add_argument("--functions", type=Path, default=Path(".corpus/heldout_functions.jsonl"))
    c.add_argument("--n", type=int, default=100)
    c.add_argument("--max-new", type=int, default=160)
    c.add_argument("--write-selection", type=Path, default=None)
    c.add_argument("--out", type=Path, default=None, help="JSON with every completion")
    u = sub.add_parser("finetune-ul", help="sequence-level unlikelihood fine-tuning")
    run_options(u, batch=32, lr=1e-4, warmup=10, seed=4321, kind_weights="chat=1.5,func=1")
    u.add_argument("--init", type=Path, default=Path("models/tandem-tiny"),
                   help="model or checkpoint dir to start from (a finetune-ul output resumes)")
    u.add_argument("--functions", type=Path, default=Path(".corpus/heldout_functions.jsonl"))
    u.add_argument("--exclude", type=Path,
                   default=Path("models/tandem-tiny/eval/heldout_functions_100.jsonl"),
                   help="headline functions, never used for validation")
    u.add_argument("--tokenizer", type=Path, default=Path("models/tandem-tiny/tokenizer.json"))
    u.add_argument("--reserve", type=float, default=60.0,
                   help="seconds kept for the last check, saving and --final-eval")
    u.add_argument("--max-rounds", type=int, default=0)
    u.add_argument("--gen-batch", type=int, default=256, help="prompts per round")
    u.add_argument("--steps-per-round", type=int, default=2)
    u.add_argument("--max-new", type=int, default=160)
    u.add_argument("--max-prompt", type=int, default=320)
    u.add_argument("--ngram", type=int, default=4)
    u.add_argument("--ul-weight", type=float, default=1.0)
    u.add_argument("--st-weight", type=float, default=1.0)
    u.add_argument("--val-every", type=float, default=60.0, help="seconds between checks")
    u.add_argument("--val-limit", type=int, default=0, help="first N validation functions")
    u.add_argument("--check-windows", type=int, default=32)
    u.add_argument("--max-ce-rise", type=float, default=0.05)
    w = sub.add_parser("interpolate", help="(1 - w) * base + w * tuned, as a checkpoint")
    w.add_argument("--base", type=Path, default=Path("models/tandem-tiny"))
    w.add_argument("--tuned", type=Path, required=True)
    w.add_argument("--weight", type=float, required=True)
    w.add_argument("--out", type=Path, required=True)
    q = sub.add_parser("validate", help="strict compile figures on the validation functions")
    q.add_argument("--model-dir", type=Path, default=Path("models/tandem-tiny"))
    q.add_argument("--functions", type=Path, default=Path(".corpus/heldout_functions.jsonl"))
    q.add_argument("--exclude", type=Path,
                   default=Path("models/tandem-tiny/eval/heldout_functions_100.jsonl"))
    q.add_argument("--stride", type=int, default=1, help="every STRIDE-th validation function")
    q.add_argument("--max-new", type=int, default=160)
    q.add_argument("--batch", type=int, default=64)
    args = ap.parse_args(argv)
    if args.cmd == "prepare":
        print(json.dumps(prepare(args.corpus, args.tokenizer, args.out), indent=1))
    elif args.cmd == "train":
        train(args)
    elif args.cmd == "finetune-ul":
        finetune_ul(args)
    elif args.cmd == "interpolate":
        interpolate(args.base, args.tuned, args.weight, args.out)
    elif args.cmd == "validate":
        print(json.dumps(validate(args.model_dir, args.functions, args.exclude, args.stride,
                                  args.max_new, args.batch)))
    elif args.cmd == "export":
        export(args.ckpt, args.model_dir)
    elif args.cmd == "reference":
        reference(args.model_dir, args.data, args.out)
    elif args.cmd == "evaluate":
        model = load_model(args.model_dir)
        ev = evaluate(model, load_streams(args.data, "heldout", torch.device("cpu")),
                      args.seq, args.windows, 4)
        print(json.dumps(ev, indent=1))
    elif args.cmd == "compile-rate":
        funcs = select_functions(args.functions, args.n)
        if args.write_selection:
            args.write_selection.parent.mkdir(parents=True, exist_ok=True)
            args.write_selection.write_text("".join(json.dumps(f) + "\n" for f in funcs))
        res = compile_rate(args.model_dir, funcs, args.max_new)
        if args.out:
            args.out.write_text(json.dumps(res, indent=1) + "\n")
        print(json.dumps({k: v for k, v in res.items() if k != "results"}))
    elif args.cmd == "sample":
        print(sample(args.model_dir, args.prompt, args.max_new))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    sys.exit(main())
