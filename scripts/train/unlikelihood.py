"""Sequence-level unlikelihood (Welleck et al. 2019) and self-training targets from the model's
own greedy function-body completions: the data side of ``finetune-ul``."""

from __future__ import annotations

import numpy as np
import torch

from scripts.compile_rule import compiles, extract_body, greedy_stop
from scripts.train.model import TinyModel


def repeated_ngram_mask(tokens: list[int], n: int) -> list[bool]:
    """Sequence-level unlikelihood candidates (Welleck et al. 2019): ``mask[i]`` is True when
    token i belongs to an n-gram that already occurred earlier in ``tokens``."""
    mask = [False] * len(tokens)
    seen: set[tuple[int, ...]] = set()
    for end in range(n, len(tokens) + 1):
        gram = tuple(tokens[end - n : end])
        if gram in seen:
            mask[end - n : end] = [True] * n
        seen.add(gram)
    return mask


def first_repeated_line(body: str) -> int | None:
    """Character offset of the first non-blank line that repeats an earlier line of ``body``
    exactly (indentation included): where a greedy loop starts. None when no line repeats."""
    seen: set[str] = set()
    off = 0
    for line in body.split("\n"):
        if line.strip():
            if line in seen:
                return off
            seen.add(line)
        off += len(line) + 1
    return None


def body_target(tok: object, prompt: str, out: list[int], stop: str, eot: int
                ) -> list[int] | None:
    """The self-training target for one greedy completion: its body up to (not including) the
    first repeated line, followed by EOT, in the completion's own tokens (the last partial
    line re-encoded). None when that body is blank or does not compile."""
    text = tok.decode(out, skip_special_tokens=True)
    body = extract_body(text, stop)
    cut = first_repeated_line(body)
    if cut is not None:
        body = body[:cut]
    body = body.rstrip(" ")
    if body and not body.endswith("\n"):
        body += "\n"
    if not compiles(prompt, body):
        return None
    k = len(out)
    while k and not body.startswith(tok.decode(out[:k], skip_special_tokens=True)):
        k -= 1
    rest = body[len(tok.decode(out[:k], skip_special_tokens=True)):]
    return out[:k] + (tok.encode(rest, add_special_tokens=False).ids if rest else []) + [eot]


def function_prompts(tok: object, stream: np.ndarray, eot: int, max_len: int) -> list[dict]:
    """Signature + docstring prompts of the train split's ``func`` documents (documents of
    ``train_func.npy``, each ``function_prompt + body``), with their token ids."""
    out = []
    bounds = np.flatnonzero(stream == eot)
    start = 0
    for end in bounds:
        text = tok.decode(stream[start:end].tolist(), skip_special_tokens=False)
        start = end + 1
        first = text.find('"""')
        close = text.find('\n    """\n', first + 3)
        if first < 0 or close < 0:
            continue
        prompt = text[: close + len('\n    """\n')]
        ids = tok.encode(prompt, add_special_tokens=False).ids
        if len(ids) <= max_len and compiles(prompt, "    pass"):
            out.append({"prompt": prompt, "ids": ids})
    return out


def ul_batch(tok: object, prompts: list[dict], gens: list[list[int]], max_new: int,
             eos_ids: tuple[int, ...], eot: int, ngram: int, device: torch.device) -> dict:
    """Training tensors from greedy completions: right-padded ``prompt + completion`` rows
    with the unlikelihood candidates (repeated n-grams of the completion), and
    ``prompt + body_target`` rows with their CE mask. Shapes: ids [rows, T], masks [rows, T]
    marking the *target* token at each position (predicted from position t-1)."""
    ul_rows, ul_masks, st_rows, st_masks = [], [], [], []
    stats = {"limit": 0, "eos": 0, "dedent": 0, "targets": 0, "candidates": 0, "tokens": 0}
    for p, g in zip(prompts, gens, strict=True):
        out, stop = greedy_stop(tok, g, max_new, eos_ids)
        stats[stop] += 1
        cont = g[: len(out) + (stop == "eos")]
        cand = repeated_ngram_mask(cont, ngram)
        stats["candidates"] += sum(cand)
        stats["tokens"] += len(cont)
        if any(cand):
            ul_rows.append(p["ids"] + cont)
            ul_masks.append([False] * len(p["ids"]) + cand)
        target = body_target(tok, p["prompt"], out, stop, eot)
        if target is not None:
            st_rows.append(p["ids"] + target)
            st_masks.append([False] * len(p["ids"]) + [True] * len(target))
            stats["targets"] += 1

    def pad(rows: list[list], fill: object, dtype: torch.dtype) -> torch.Tensor:
        width = max(len(r) for r in rows)
        return torch.tensor([r + [fill] * (width - len(r)) for r in rows], dtype=dtype,
                            device=device)

    out: dict = {"stats": stats}
    if ul_rows:
        out["ul"] = (pad(ul_rows, eot, torch.long), pad(ul_masks, False, torch.bool))
    if st_rows:
        out["st"] = (pad(st_rows, eot, torch.long), pad(st_masks, False, torch.bool))
    return out


def ul_losses(model: TinyModel, ids: torch.Tensor, mask: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(unlikelihood -log(1 - p), CE) averaged over the masked target tokens of ``ids``
    ([rows, T]; mask[:, t] marks token t, predicted at position t-1)."""
    logits = model.logits(model.hidden(ids[:, :-1])).float()  # [rows, T-1, V]
    logp = logits.log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]  # [rows, T-1]
    m = mask[:, 1:].float()
    n = m.sum().clamp(min=1)
    one_minus = (1 - logp.exp()).clamp(min=1e-5)
    return -(one_minus.log() * m).sum() / n, -(logp * m).sum() / n

