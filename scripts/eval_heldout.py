"""Held-out perplexity and MTP figures of a model measured by Tandem's NumPy engine: the
windows of ``scripts/train``'s evaluation, reproduced bit for bit, one fresh sequence each."""

from __future__ import annotations

import json
import math
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from daemon.tokenizer import Tokenizer
from gpu_worker.backend import to_numpy
from gpu_worker.engine import Engine
from gpu_worker.model.batch import RaggedBatch

REPO = Path(__file__).resolve().parents[1]
KINDS = ("code", "prose", "chat")
EOT = "<|endoftext|>"


def eval_offsets(n_tokens: int, seq: int, windows: int) -> np.ndarray:
    """Start offsets of ``scripts.train.data.eval_windows``: n evenly spaced (seq+1)-token
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
    exactly as ``python -m scripts.train prepare`` does, from CORPUS/heldout.jsonl."""
    if all((data / f"heldout_{k}.npy").exists() for k in kinds):
        return
    if not (corpus / "heldout.jsonl").exists():
        print(f"building the corpus in {corpus} (scripts/build_corpus.py)", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "scripts.build_corpus", "--out", str(corpus)],
                       check=True, cwd=REPO)
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

