"""The compile-rate rule of issue 5, in one place: where a generated function body ends, what
of it is kept, whether it compiles, and how results are counted.

Used by ``scripts/eval_tiny_model.py`` (Tandem's NumPy engine) and ``scripts/train``
(transformers: ``compile-rate``, ``validate`` and the fine-tuning's validation).

Greedy decoding from ``signature + docstring`` runs until the body has ended: a non-blank line
at column 0 (a dedent to module level), EOS, or the token limit. The body is everything before
that column-0 line; a completion that hits the limit is *cut*: its trailing partial line is
dropped (it still goes through the compile check). The headline figure is the *strict* one:
bodies that ended by themselves and compile.
"""

from __future__ import annotations

import warnings
from typing import Any


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


def compiles(prompt: str, body: str) -> bool:
    """``compile(signature + docstring + body + '\\n', 'exec')`` succeeds for a non-blank
    body."""
    if not body.strip():
        return False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compile(prompt + body + "\n", "<heldout>", "exec")
    except (SyntaxError, ValueError):
        return False
    return True


def tally(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Counts over per-function results (each with ``compiles`` and ``cut``): strict = the
    bodies that ended by themselves (not cut) and compile; the cut ones count as failures
    there and are reported apart."""
    n = len(results)
    ok = sum(r["compiles"] for r in results)
    uncut = [r for r in results if not r["cut"]]
    ok_uncut = sum(r["compiles"] for r in uncut)
    return {"functions": n, "strict_compiles": ok_uncut, "strict_rate": ok_uncut / max(n, 1),
            "compiles": ok, "rate": ok / max(n, 1),
            "cut": n - len(uncut), "cut_compiles": ok - ok_uncut,
            "uncut": len(uncut), "uncut_compiles": ok_uncut,
            "uncut_rate": ok_uncut / max(len(uncut), 1)}


def greedy_stop(tok: Any, gen: list[int], max_new: int, eos_ids: tuple[int, ...]
                ) -> tuple[list[int], str]:
    """The stopping rule replayed on a finished greedy run ``gen`` (``max_new`` tokens, or
    fewer when it sampled EOS; ``tok.decode(ids, skip_special_tokens=True)`` gives text):
    the kept tokens (EOS excluded) and the stop ("dedent", "eos" or "limit"), as
    ``eval_tiny_model.greedy_completion`` stops while decoding. body_ended is monotone in the
    prefix, so the first ending prefix is found by bisection."""
    end = next((i for i, t in enumerate(gen) if t in eos_ids), len(gen))
    out = gen[:end]

    def ended(k: int) -> bool:
        return body_ended(tok.decode(out[:k], skip_special_tokens=True))

    if out and ended(len(out)):
        lo, hi = 1, len(out)
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if ended(mid) else (mid + 1, hi)
        return out[:lo], "dedent"
    if end < len(gen):
        return out, "eos"
    return out[:max_new], "limit"
