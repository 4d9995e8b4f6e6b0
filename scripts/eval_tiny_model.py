#!/usr/bin/env python3
"""Held-out figures of tandem-tiny measured by Tandem's own NumPy backend (issue 5).

Computes, with ``gpu_worker.engine.Engine`` (no torch, no transformers):

1. held-out perplexity per kind (code, prose, chat): the same evenly spaced windows as
   ``scripts/train_tiny_model.py evaluate`` / ``train --final-eval`` (128 windows of 512
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
   counts when it is non-blank and ``compile(prompt + body + "\\n", ..., "exec")`` succeeds.
   The headline figure is the *strict* one: bodies that ended by themselves (column-0 line or
   EOS within the limit) and compile; cut bodies count as failures there.
   ``train_tiny_model.py compile-rate`` (transformers) uses the same rule. The figure of the
   old rule (which stopped at the indentation of the body's second line, so it measured the
   first body line only) is recorded as ``old_first_line_rule``.

The held-out token streams are ``DATA/heldout_{code,prose,chat}.npy`` as written by
``train_tiny_model.py prepare``; when they are missing they are rebuilt here from
``CORPUS/heldout.jsonl`` with Tandem's tokenizer (and the corpus from
``scripts/build_corpus.py`` when that is missing too).

    .venv/bin/python scripts/eval_tiny_model.py                    # full run, ~15 min, 2 cores
    .venv/bin/python scripts/eval_tiny_model.py --compile-only     # compile rate only, merged
                                                                   # into the existing JSON
    .venv/bin/python scripts/eval_tiny_model.py --max-tokens 2048 --limit 5 --out /tmp/e.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # runnable as a plain script from any directory
    sys.path.insert(0, str(REPO))

from compile_rule import compiles  # noqa: E402  (scripts/: on sys.path as a script)

from daemon.tokenizer import Tokenizer  # noqa: E402
from gpu_worker.backend import to_numpy  # noqa: E402
from gpu_worker.engine import Engine  # noqa: E402
from gpu_worker.model.batch import RaggedBatch  # noqa: E402
from gpu_worker.sampling import sample  # noqa: E402
from protocol.messages import SamplingParams  # noqa: E402

KINDS = ("code", "prose", "chat")
EOT = "<|endoftext|>"
GREEDY = SamplingParams(temperature=0)

# The model card's transformers figures (float32, 128 windows x 512 per kind; compile-rate on
# CPU), for the comparison written next to Tandem's.
TRANSFORMERS_FIGURES: dict[str, Any] = {
    "code": {"ce": 2.613, "ppl": 13.64, "top1": 0.509, "mtp_ce": 2.709, "mtp_top1": 0.495,
             "mtp_agreement": 0.696},
    "prose": {"ce": 3.406, "ppl": 30.13, "top1": 0.388, "mtp_ce": 3.512, "mtp_top1": 0.372,
              "mtp_agreement": 0.587},
    "chat": {"ce": 1.666, "ppl": 5.29, "top1": 0.682, "mtp_ce": 1.743, "mtp_top1": 0.668,
             "mtp_agreement": 0.785},
    # no "compile_rate": train_tiny_model.py compile-rate (transformers) was not re-run for this
    # model; for round 2's model, validate's batched transformers decoding gave Tandem's body
    # for each of the first 16 headline functions
}


# --------------------------------------------------------------------------- data


def eval_offsets(n_tokens: int, seq: int, windows: int) -> np.ndarray:
    """Start offsets of ``train_tiny_model.eval_windows``: n evenly spaced (seq+1)-token
    windows, ``torch.linspace(0, n_tokens - seq - 2, n).long()`` reproduced bit for bit
    (float32 linspace, computed from both ends, fused multiply-add, truncation)."""
    n = max(1, min(windows, (n_tokens - 1) // (seq + 1)))
    end = np.float32(n_tokens - seq - 2)
    if n == 1:
        return np.zeros(1, dtype=np.int64)
    step = np.float64(end / np.float32(n - 1))
    i = np.arange(n)
    vals = np.where(i < n // 2, step * i, np.float64(end) - step * (n - 1 - i))
    return vals.astype(np.float32).astype(np.int64)


def ensure_streams(data: Path, corpus: Path, tok: Tokenizer, kinds: list[str]) -> None:
    """Write DATA/heldout_<kind>.npy (uint16, documents separated by <|endoftext|>) if absent,
    exactly as ``train_tiny_model.py prepare`` does, from CORPUS/heldout.jsonl."""
    if all((data / f"heldout_{k}.npy").exists() for k in kinds):
        return
    if not (corpus / "heldout.jsonl").exists():
        print(f"building the corpus in {corpus} (scripts/build_corpus.py)", file=sys.stderr)
        subprocess.run([sys.executable, str(REPO / "scripts" / "build_corpus.py"),
                        "--out", str(corpus)], check=True)
    manifest = corpus / "manifest.json"
    if manifest.exists():
        built_by = json.loads(manifest.read_text()).get("python")
        if built_by and built_by != platform.python_version():
            print(f"warning: corpus built by Python {built_by}; the shipped model's held-out "
                  "split came from CPython 3.11.7", file=sys.stderr)
    eot = tok.token_to_id(EOT)
    texts: dict[str, list[str]] = {k: [] for k in KINDS}
    with open(corpus / "heldout.jsonl", encoding="utf-8") as fh:
        for line in fh:
            d = json.loads(line)
            texts[d["kind"]].append(d["text"])
    data.mkdir(parents=True, exist_ok=True)
    for kind, docs in texts.items():
        ids: list[int] = []
        for doc in docs:
            ids.extend(tok.encode(doc))
            ids.append(eot)
        np.save(data / f"heldout_{kind}.npy", np.asarray(ids, dtype=np.uint16))


# --------------------------------------------------------------------------- perplexity, MTP


def _log_softmax_at(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """log p(target) per row, in float64."""
    z = logits.astype(np.float64)
    m = z.max(-1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(z - m).sum(-1))
    return z[np.arange(len(targets)), targets] - lse


def eval_window(engine: Engine, window: np.ndarray, mtp: bool) -> dict[str, float]:
    """Sums over one (seq+1)-token window: main NLL / top-1 over seq positions; MTP NLL /
    top-1 / agreement over seq-1 positions."""
    model, caches = engine.model, engine.caches
    inp, seq = window[:-1], len(window) - 1
    caches.reset_slot(0)
    out = model.forward(RaggedBatch.build([(0, 0, inp)]), caches, np.arange(seq))
    logits = to_numpy(out.logits)
    main_pred = logits.argmax(-1)  # main_pred[t] predicts window[t+1]
    res = {"nll": float(-_log_softmax_at(logits, window[1:]).sum()),
           "top1": float((main_pred == window[1:]).sum()), "n": seq}
    if mtp:
        # row t: token_{t+1} at position t with h_t; predicts window[t+2]
        m = model.mtp_forward(RaggedBatch.build([(0, 0, inp[1:])]), out.hidden[: seq - 1],
                              caches)
        mlogits = to_numpy(m.logits)
        mtp_pred = mlogits.argmax(-1)
        res.update({"mtp_nll": float(-_log_softmax_at(mlogits, window[2:]).sum()),
                    "mtp_top1": float((mtp_pred == window[2:]).sum()),
                    "agree": float((mtp_pred == main_pred[1:]).sum()), "mtp_n": seq - 1})
    return res


def eval_kind(engine: Engine, stream: np.ndarray, seq: int, windows: int, mtp: bool,
              kind: str) -> dict[str, Any]:
    offs = eval_offsets(stream.size, seq, windows)
    tot: dict[str, float] = {}
    t0 = time.time()
    for i, off in enumerate(offs):
        r = eval_window(engine, stream[off: off + seq + 1], mtp)
        for k, v in r.items():
            tot[k] = tot.get(k, 0.0) + v
        if (i + 1) % 16 == 0 or i + 1 == len(offs):
            el = time.time() - t0
            print(f"  {kind}: {i + 1}/{len(offs)} windows, CE {tot['nll'] / tot['n']:.4f}, "
                  f"{el:.0f}s ({tot['n'] / el:.0f} tok/s)", file=sys.stderr, flush=True)
    n = int(tot["n"])
    ce = tot["nll"] / n
    res: dict[str, Any] = {"windows": len(offs), "seq": seq, "tokens": n,
                           "stream_tokens": int(stream.size), "ce": ce, "ppl": math.exp(ce),
                           "top1": tot["top1"] / n}
    if mtp:
        mn = int(tot["mtp_n"])
        res.update({"mtp_positions": mn, "mtp_ce": tot["mtp_nll"] / mn,
                    "mtp_top1": tot["mtp_top1"] / mn, "mtp_agreement": tot["agree"] / mn})
    res["seconds"] = round(time.time() - t0, 1)
    return res


# --------------------------------------------------------------------------- compile rate


def is_module_level(line: str) -> bool:
    """A non-blank line that starts at column 0: the function body has ended before it."""
    return bool(line.strip()) and not line[0].isspace()


def body_of(completion: str) -> str:
    """The generated body: everything before the first non-blank line at column 0."""
    lines = []
    for line in completion.split("\n"):
        if is_module_level(line):
            break
        lines.append(line)
    return "\n".join(lines)


def body_ended(text: str) -> bool:
    """Stopping rule: a non-blank line starts at column 0 (a dedent to module level), so the
    body can no longer change."""
    return any(is_module_level(line) for line in text.split("\n"))


def drop_partial_line(body: str) -> str:
    """A body cut by the token limit: keep only its complete lines (up to the last newline,
    which is kept); nothing if it has none."""
    return body[: body.rfind("\n") + 1]


def extract_body(text: str, stop: str) -> str:
    """The body of a completion that stopped for ``stop`` ("dedent", "eos" or "limit"):
    everything before the first column-0 line; for "limit" (a cut body) without its trailing
    partial line."""
    body = body_of(text)
    return drop_partial_line(body) if stop == "limit" else body


def first_line_rule(text: str) -> bool:
    """The OLD stopping rule of ``train_tiny_model.py compile-rate`` (before this fix), kept
    only to report what it measured: it fires at the indentation token of the body's second
    line, so every body it measured was its first line."""
    return body_of(text) != text.rstrip(" ") and "\n" in text


def greedy_completion(engine: Engine, tok: Tokenizer, prompt_ids: list[int], max_new: int,
                      eos_ids: tuple[int, ...]) -> tuple[list[int], str, int | None]:
    """Greedy decoding (the same steps as ``Engine.generate``) until the body has ended.

    Returns the generated tokens (EOS excluded), why decoding stopped ("dedent": a non-blank
    column-0 line appeared; "eos"; "limit": ``max_new`` tokens without either, so the body is
    cut), and the number of tokens at which the old first-line rule would have stopped (None:
    it would not have fired)."""
    ids = np.asarray(prompt_ids, dtype=np.int64)
    logits = engine.prefill(0, ids)[0]
    out: list[int] = []
    old_stop: int | None = None
    pos = len(ids)
    while True:
        token = sample(logits, GREEDY, pos)
        if token in eos_ids:
            return out, "eos", old_stop
        out.append(token)
        text = tok.decode(out, skip_special_tokens=True)
        if old_stop is None and first_line_rule(text):
            old_stop = len(out)
        if body_ended(text):
            return out, "dedent", old_stop
        if len(out) >= max_new:
            return out, "limit", old_stop
        logits = to_numpy(engine.forward([(0, pos, np.array([token]))]).logits)[0]
        pos += 1


def ended_within(stop: str, tokens: int, budget: int) -> bool:
    """Whether a completion that stopped for ``stop`` after ``tokens`` generated tokens (EOS
    excluded) would also have ended by itself under a limit of ``budget`` new tokens: a
    column-0 line among the first ``budget`` tokens, or EOS sampled before the limit."""
    return (stop == "dedent" and tokens <= budget) or (stop == "eos" and tokens < budget)


STRICT_BUDGETS = (128, 160, 192, 256, 320)


def compile_rate(engine: Engine, tok: Tokenizer, funcs: list[dict], max_new: int,
                 eos_ids: tuple[int, ...]) -> dict[str, Any]:
    results = []
    t0 = time.time()
    generated = 0
    for i, f in enumerate(funcs):
        gen, stop, old_stop = greedy_completion(engine, tok, tok.encode(f["prompt"]), max_new,
                                                eos_ids)
        generated += len(gen)
        body = extract_body(tok.decode(gen, skip_special_tokens=True), stop)
        old_body = body_of(tok.decode(gen[:old_stop], skip_special_tokens=True))
        results.append({"module": f["module"], "name": f["name"],
                        "compiles": compiles(f["prompt"], body), "stop": stop,
                        "cut": stop == "limit", "tokens": len(gen),
                        "body_lines": body.rstrip("\n").count("\n") + 1 if body.strip() else 0,
                        "compiles_old_rule": compiles(f["prompt"], old_body), "body": body})
        if (i + 1) % 10 == 0 or i + 1 == len(funcs):
            ok = sum(r["compiles"] for r in results)
            cut = sum(r["cut"] for r in results)
            print(f"  compile: {i + 1}/{len(funcs)}, {ok} compile, {cut} cut, "
                  f"{time.time() - t0:.0f}s", file=sys.stderr, flush=True)
    n = len(funcs)
    ok = sum(r["compiles"] for r in results)
    uncut = [r for r in results if not r["cut"]]
    ok_uncut = sum(r["compiles"] for r in uncut)
    stops = {s: sum(r["stop"] == s for r in results) for s in ("dedent", "eos", "limit")}
    old = sum(r["compiles_old_rule"] for r in results)
    # strict: a body counts only if it ended by itself (column-0 line or EOS) and compiles;
    # greedy decoding is the same under a smaller limit, so smaller budgets are exact here
    strict_within = {str(b): sum(r["compiles"] and ended_within(r["stop"], r["tokens"], b)
                                 for r in results)
                     for b in sorted({*STRICT_BUDGETS, max_new}) if b <= max_new}
    return {"functions": n, "max_new_tokens": max_new,
            "strict_compiles": ok_uncut, "strict_rate": ok_uncut / max(n, 1),
            "strict_compiles_within": strict_within,
            "compiles": ok, "rate": ok / max(n, 1),
            "cut": stops["limit"], "cut_compiles": ok - ok_uncut,
            "uncut": len(uncut), "uncut_compiles": ok_uncut,
            "uncut_rate": ok_uncut / max(len(uncut), 1), "stops": stops,
            "old_first_line_rule": {"compiles": old, "rate": old / max(n, 1)},
            "generated_tokens": generated, "seconds": round(time.time() - t0, 1),
            "results": results}


# --------------------------------------------------------------------------- report


def machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "numpy": np.__version__, "platform": platform.platform(),
            "backend": "numpy, float32"}


def command_line() -> str:
    argv = list(getattr(sys, "orig_argv", [sys.executable, *sys.argv]))
    cwd = Path.cwd()
    for i, a in enumerate(argv):
        p = Path(a)
        if p.is_absolute() and p.is_relative_to(cwd):
            argv[i] = str(p.relative_to(cwd))
    return shlex.join(argv)


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


COMPILE_PROTOCOL = (
    "headline 'strict_compiles': bodies that ended by themselves (a column-0 line or EOS within "
    "the token limit) and compile; 'strict_compiles_within': the same under smaller limits "
    "(exact: greedy decoding does not depend on the limit). Protocol: "
    "greedy decoding of signature + docstring until the body has ended: a non-blank line at "
    "column 0 (dedent to module level), EOS {eos}, or {max_new} new tokens; the body is "
    "everything before the column-0 line; a completion that hits the limit is cut (its "
    "trailing partial line dropped, counted in 'cut', still compile-checked; 'uncut_rate' "
    "excludes them); counts when the body is non-blank and compile(prompt + body + '\\n', "
    "'exec') succeeds. 'old_first_line_rule': the same greedy run cut where the old rule "
    "stopped (the indentation token of the body's second line)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", type=Path, default=REPO / "models" / "tandem-tiny")
    ap.add_argument("--data", type=Path, default=REPO / ".corpus" / "tokens",
                    help="held-out token streams (train_tiny_model.py prepare's output)")
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
                      "(train_tiny_model.eval_windows offsets), each a fresh sequence at "
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
            "command": command_line(), "machine": machine(), "protocol": protocol,
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
        res["compile_rate"] = {"command": command_line(), "machine": machine(),
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
