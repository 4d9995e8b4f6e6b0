"""Token streams: ``prepare`` (corpus JSONL -> uint16 streams per split and kind), the training
sampler and the evaluation windows."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

KINDS = ("code", "prose", "chat")  # held-out kinds; train may add "func" (build_corpus.py)
TRAIN_KINDS = (*KINDS, "func")
KIND_WEIGHTS = {"code": 1.0, "prose": 1.5, "chat": 2.5, "func": 1.0}  # sampling weight per token
EOT = "<|endoftext|>"


def prepare(corpus: Path, tokenizer_path: Path, out: Path) -> dict:
    """Tokenize train/heldout JSONL into uint16 streams, one per split and kind."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    eot = tok.token_to_id(EOT)
    out.mkdir(parents=True, exist_ok=True)
    meta: dict = {"eot": eot, "vocab_size": tok.get_vocab_size(), "streams": {}}
    for split in ("train", "heldout"):
        texts: dict[str, list[str]] = {k: [] for k in KINDS}
        with open(corpus / f"{split}.jsonl", encoding="utf-8") as fh:
            for line in fh:
                d = json.loads(line)
                texts.setdefault(d["kind"], []).append(d["text"])
        for kind, docs in texts.items():
            ids: list[int] = []
            for enc in tok.encode_batch(docs, add_special_tokens=False):
                ids.extend(enc.ids)
                ids.append(eot)
            arr = np.asarray(ids, dtype=np.uint16)
            np.save(out / f"{split}_{kind}.npy", arr)
            meta["streams"][f"{split}_{kind}"] = {"docs": len(docs), "tokens": int(arr.size)}
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def load_streams(data: Path, split: str, device: torch.device,
                 kinds: tuple[str, ...] = KINDS) -> dict[str, torch.Tensor]:
    """The ``split_<kind>.npy`` streams of ``kinds`` (those of TRAIN_KINDS beyond KINDS only
    where present)."""
    return {k: torch.from_numpy(np.load(data / f"{split}_{k}.npy").astype(np.int64)).to(device)
            for k in kinds if k in KINDS or (data / f"{split}_{k}.npy").exists()}


def parse_kind_weights(spec: str) -> dict[str, float]:
    """'code=1,chat=1.5' -> KIND_WEIGHTS with those entries replaced."""
    out = dict(KIND_WEIGHTS)
    for item in filter(None, spec.split(",")):
        kind, _, w = item.partition("=")
        if kind not in out:
            raise ValueError(f"unknown kind {kind!r} in --kind-weights")
        out[kind] = float(w)
    return out


class Sampler:
    """Random (T+1)-token windows from the train streams, kinds weighted per token."""

    def __init__(self, streams: dict[str, torch.Tensor], seq: int, seed: int,
                 weights: dict[str, float] | None = None) -> None:
        weights = weights or KIND_WEIGHTS
        self.kinds = [k for k in streams if weights[k] > 0]
        self.streams, self.seq = streams, seq
        self.gen = torch.Generator(device="cpu").manual_seed(seed)
        w = torch.tensor([weights[k] * streams[k].numel() for k in self.kinds], dtype=torch.float)
        self.probs = w / w.sum()
        self.ar = {k: torch.arange(seq + 1, device=s.device) for k, s in streams.items()}

    def batch(self, bsz: int) -> torch.Tensor:
        kinds = torch.multinomial(self.probs, bsz, replacement=True, generator=self.gen)
        rows = []
        for i, k in enumerate(self.kinds):
            n = int((kinds == i).sum())
            if n == 0:
                continue
            s = self.streams[k]
            off = torch.randint(0, s.numel() - self.seq - 1, (n,), generator=self.gen)
            rows.append(s[off.to(s.device)[:, None] + self.ar[k][None]])
        return torch.cat(rows, 0)


def eval_windows(stream: torch.Tensor, seq: int, n: int) -> torch.Tensor:
    """n evenly spaced (seq+1)-token windows (deterministic)."""
    n = max(1, min(n, (stream.numel() - 1) // (seq + 1)))
    offs = torch.linspace(0, stream.numel() - seq - 2, n).long().to(stream.device)
    return stream[offs[:, None] + torch.arange(seq + 1, device=stream.device)[None]]

