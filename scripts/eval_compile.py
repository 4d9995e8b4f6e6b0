"""The compile rate measured by Tandem's NumPy engine: greedy decoding of held-out functions'
``signature + docstring`` until the body has ended, by the rule of ``scripts/compile_rule.py``.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import numpy as np

from daemon.tokenizer import Tokenizer
from gpu_worker.backend import to_numpy
from gpu_worker.engine import Engine
from gpu_worker.sampling import sample
from protocol.messages import SamplingParams
from scripts.compile_rule import body_ended, body_of, compiles, extract_body, tally

GREEDY = SamplingParams(temperature=0)
STRICT_BUDGETS = (128, 160, 192, 256, 320)

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


def first_line_rule(text: str) -> bool:
    """The OLD stopping rule of the transformers ``compile-rate`` (before this fix), kept
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
    stops = {s: sum(r["stop"] == s for r in results) for s in ("dedent", "eos", "limit")}
    old = sum(r["compiles_old_rule"] for r in results)
    # strict: a body counts only if it ended by itself (column-0 line or EOS) and compiles;
    # greedy decoding is the same under a smaller limit, so smaller budgets are exact here
    strict_within = {str(b): sum(r["compiles"] and ended_within(r["stop"], r["tokens"], b)
                                 for r in results)
                     for b in sorted({*STRICT_BUDGETS, max_new}) if b <= max_new}
    return {**tally(results), "max_new_tokens": max_new,
            "strict_compiles_within": strict_within, "stops": stops,
            "old_first_line_rule": {"compiles": old, "rate": old / max(len(funcs), 1)},
            "generated_tokens": generated, "seconds": round(time.time() - t0, 1),
            "results": results}

