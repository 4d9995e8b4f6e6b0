#!/usr/bin/env python3
"""Held-out figures of tandem-tiny measured by Tandem's own NumPy backend (issue 5).

Computes, with ``gpu_worker.engine.Engine`` (no torch, no transformers):

1. held-out perplexity per kind (code, prose, chat): the same evenly spaced windows as
   ``python -m scripts.train evaluate`` / ``train --final-eval`` (128 windows of 512
   tokens = 65,536 tokens per kind, each window a fresh sequence starting at position 0),
   plus next-token top-1, the MTP head's CE / top-1 against token t+2, and
2. MTP agreement: the share of positions t where argmax MTP(token_{t+1}, h_t) equals the main
   model's argmax at position t+1 (the MTP head runs causally over the window, positions
   0..seq-2, as in training),
3. compile rate: for the held-out functions in ``models/tandem-tiny/eval/
   heldout_functions_100.jsonl``, greedy decoding from ``signature + docstring`` until the
   function body has ended: a non-blank line at column 0 (a dedent to module level), EOS, or
   160 new tokens. The body is everything before that column-0 line. A completion that hits
   the limit is *cut*: its trailing partial line is dropped and it is counted as cut (it still
   goes through the compile check; the rate among uncut completions is reported too). A body
   counts when it is non-blank and ``compile(prompt + body + "\\n", ..., "exec")`` succeeds
   (``scripts/compile_rule.py``).
   The headline figure is the *strict* one: bodies that ended by themselves (column-0 line or
   EOS within the limit) and compile; cut bodies count as failures there.
   ``python -m scripts.train compile-rate`` (transformers) uses the same rule. The figure of the
   old rule (which stopped at the indentation of the body's second line, so it measured the
   first body line only) is recorded as ``old_first_line_rule``.

The held-out token streams are ``DATA/heldout_{code,prose,chat}.npy`` as written by
``python -m scripts.train prepare``; when they are missing they are rebuilt here from
``CORPUS/heldout.jsonl`` with Tandem's tokenizer (and the corpus from
``scripts/build_corpus.py`` when that is missing too).

    .venv/bin/python -m scripts.eval_tiny_model                  # full run, ~15 min, 2 cores
    .venv/bin/python -m scripts.eval_tiny_model --compile-only   # compile rate only, merged
                                                                 # into the existing JSON
    .venv/bin/python -m scripts.eval_tiny_model --max-tokens 2048 --limit 5 --out /tmp/e.json

Held-out figures: ``scripts/eval_heldout.py``; compile rate: ``scripts/eval_compile.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from daemon.tokenizer import Tokenizer
from gpu_worker.engine import Engine
from scripts.bench_common import command_line, machine
from scripts.eval_compile import COMPILE_PROTOCOL, compile_rate
from scripts.eval_heldout import KINDS, REPO, ensure_streams, eval_kind

# The model card's transformers figures (float32, 128 windows x 512 per kind; compile-rate on
# CPU), for the comparison written next to Tandem's.
TRANSFORMERS_FIGURES: dict[str, Any] = {
    "code": {"ce": 2.613, "ppl": 13.64, "top1": 0.509, "mtp_ce": 2.709, "mtp_top1": 0.495,
             "mtp_agreement": 0.696},
    "prose": {"ce": 3.406, "ppl": 30.13, "top1": 0.388, "mtp_ce": 3.512, "mtp_top1": 0.372,
              "mtp_agreement": 0.587},
    "chat": {"ce": 1.666, "ppl": 5.29, "top1": 0.682, "mtp_ce": 1.743, "mtp_top1": 0.668,
             "mtp_agreement": 0.785},
    # no "compile_rate": scripts.train compile-rate (transformers) was not re-run for this
    # model; for round 2's model, validate's batched transformers decoding gave Tandem's body
    # for each of the first 16 headline functions
}


def comparison(res: dict[str, Any]) -> dict[str, Any]:
    """Tandem minus transformers, per figure the model card lists."""
    out: dict[str, Any] = {}
    for kind, figs in res.get("heldout", {}).items():
        ref = TRANSFORMERS_FIGURES.get(kind, {})
        out[kind] = {k: round(figs[k] - ref[k], 4) for k in ref if k in figs}
    cr, ref = res.get("compile_rate"), TRANSFORMERS_FIGURES.get("compile_rate")
    if cr and ref:
        out["compile_rate"] = {k: cr[k] - ref[k] for k in ("strict_compiles", "compiles", "cut")
                               if ref.get(k) is not None}
    return out


def tandem_machine() -> dict[str, Any]:
    """The machine, with the NumPy backend this script measures."""
    return {**machine(), "numpy": np.__version__, "backend": "numpy, float32"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", type=Path, default=REPO / "models" / "tandem-tiny")
    ap.add_argument("--data", type=Path, default=REPO / ".corpus" / "tokens",
                    help="held-out token streams (scripts.train prepare's output)")
    ap.add_argument("--corpus", type=Path, default=REPO / ".corpus",
                    help="build_corpus.py output, used only when --data lacks the streams")
    ap.add_argument("--functions", type=Path,
                    default=REPO / "models" / "tandem-tiny" / "eval" /
                    "heldout_functions_100.jsonl")
    ap.add_argument("--kinds", default="code,prose,chat",
                    help="comma-separated held-out kinds for perplexity ('' for none)")
    ap.add_argument("--seq", type=int, default=512, help="window length (training eval: 512)")
    ap.add_argument("--windows", type=int, default=128, help="windows per kind (128)")
    ap.add_argument("--max-tokens", type=int, default=0,
                    help="cap tokens per kind (windows = max_tokens // seq), for quick tests")
    ap.add_argument("--limit", type=int, default=0, help="only the first N functions")
    ap.add_argument("--max-new", type=int, default=160, help="new tokens per function (160)")
    ap.add_argument("--skip-compile", action="store_true")
    ap.add_argument("--compile-only", action="store_true",
                    help="only the compile rate; replaces 'compile_rate' in --out (when it "
                         "exists) and keeps its other figures")
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "bench" / "tandem_tiny_eval.json")
    args = ap.parse_args(argv)
    t_start = time.time()
    if args.compile_only and args.skip_compile:
        ap.error("--compile-only and --skip-compile exclude each other")
    kinds = [] if args.compile_only else [k for k in args.kinds.split(",") if k]
    unknown = set(kinds) - set(KINDS)
    if unknown:
        ap.error(f"unknown kinds {sorted(unknown)}")
    windows = args.windows
    if args.max_tokens:
        windows = max(1, min(windows, args.max_tokens // args.seq))

    tok = Tokenizer.from_dir(args.model_dir)
    eos_ids = tuple(tok.eos_token_ids)
    funcs: list[dict] = []
    if not args.skip_compile:
        funcs = [json.loads(x) for x in args.functions.read_text().splitlines() if x.strip()]
        if args.limit:
            funcs = funcs[: args.limit]
    longest = max((len(tok.encode(f["prompt"])) for f in funcs), default=0)
    max_len = max(args.seq + 1, longest + args.max_new + 1)
    engine = Engine.from_dir(args.model_dir, dtype="float32", max_slots=1, max_len=max_len)

    protocol = {
        "perplexity": f"{windows} evenly spaced windows of {args.seq} tokens per kind "
                      "(scripts.train.data.eval_windows offsets), each a fresh sequence at "
                      "position 0; CE over all positions, MTP over positions 0..seq-2",
        "mtp_agreement": "share of positions t where argmax MTP(token_{t+1}, h_t) equals "
                         "the main model's argmax at position t+1",
        "compile_rate": COMPILE_PROTOCOL.format(eos=list(eos_ids), max_new=args.max_new),
    }
    if args.compile_only and args.out.exists():
        res: dict[str, Any] = json.loads(args.out.read_text())
        res.setdefault("protocol", {})["compile_rate"] = protocol["compile_rate"]
    else:
        res = {
            "what": "tandem-tiny held-out figures measured by Tandem's NumPy backend (issue 5)",
            "model_dir": os.path.relpath(args.model_dir, REPO),
            "command": command_line(), "machine": tandem_machine(), "protocol": protocol,
            "full_protocol": windows == 128 and args.seq == 512 and not args.limit
            and args.max_new == 160 and not args.compile_only,
        }
    if kinds:
        ensure_streams(args.data, args.corpus, tok, kinds)
        res["heldout"] = {}
        for kind in kinds:
            stream = np.load(args.data / f"heldout_{kind}.npy").astype(np.int64)
            print(f"{kind}: {stream.size} held-out tokens", file=sys.stderr, flush=True)
            res["heldout"][kind] = eval_kind(engine, stream, args.seq, windows, True, kind)
    if funcs:
        print(f"compile rate: {len(funcs)} functions", file=sys.stderr, flush=True)
        t_compile = time.time()
        cr = compile_rate(engine, tok, funcs, args.max_new, eos_ids)
        res["compile_rate"] = {"command": command_line(), "machine": tandem_machine(),
                               "full_protocol": not args.limit and args.max_new == 160,
                               **cr, "wall_seconds": round(time.time() - t_compile, 1)}
    res["transformers"] = TRANSFORMERS_FIGURES
    res["tandem_minus_transformers"] = comparison(res)
    if not args.compile_only:
        res["wall_seconds"] = round(time.time() - t_start, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1) + "\n")
    summary = {k: {kk: vv for kk, vv in v.items() if kk != "results"} if isinstance(v, dict)
               else v for k, v in res.items() if k in ("heldout", "compile_rate",
                                                       "tandem_minus_transformers",
                                                       "wall_seconds")}
    print(json.dumps(summary, indent=1))
    print(f"wall {time.time() - t_start:.1f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
