"""Calibrate the synthetic routing model's knobs from a trained model's measured routing.

    python -m scripts.calibrate_routing --text corpus.txt [--model models/tandem-tiny]

Runs the text through the model in prompts of --chunk-tokens (as `tandem expert-stats`
does), fits the popularity skew to the per-layer pick counts and the locality to the overlap
of consecutive tokens' expert sets (gpu_worker/weights/routing_fit.py), and prints what the
knobs mean at the real models' expert counts. docs/synthetic.md records a run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from daemon.tokenizer import Tokenizer
from gpu_worker.expert_stats import routing_stats
from gpu_worker.loader import load_checkpoint
from gpu_worker.model.model import Model
from gpu_worker.weights import routing_fit as fit

ROOT = Path(__file__).resolve().parents[1]
TARGETS = {"qwen3-next-80b-a3b": (512, 10), "qwen3-30b-a3b": (128, 8)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=ROOT / "models" / "tandem-tiny")
    p.add_argument("--text", type=Path, required=True)
    p.add_argument("--chunk-tokens", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=24576)
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)
    ids = Tokenizer.from_dir(args.model).encode(args.text.read_text(encoding="utf-8"))
    ids = ids[: args.max_tokens]
    ckpt = load_checkpoint(args.model, include_mtp=False)
    cfg = ckpt.config
    chunks = [np.asarray(ids[i:i + args.chunk_tokens])
              for i in range(0, len(ids), args.chunk_tokens)]
    counts, overlap = routing_stats(Model(cfg, ckpt.tensors), chunks)
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    skew = fit.fit_skew(counts, k)
    measured_overlap = float(np.mean(list(overlap.values())))
    locality = fit.fit_locality(measured_overlap, skew, E, k)
    out = {
        "model": args.model.name, "tokens": len(ids), "experts": E, "top_k": k,
        "hot25_share_measured": float(fit.sorted_shares(counts)[: E // 4].sum()),
        "hot25_share_fitted": fit.hot_share(skew, E, k),
        "overlap_measured_per_layer": {str(i): round(v, 4) for i, v in overlap.items()},
        "overlap_measured": measured_overlap,
        "overlap_chance_uniform": fit.chance_overlap(0.0, E, k),
        "overlap_chance_fitted_skew": fit.chance_overlap(skew, E, k),
        "skew": skew, "locality": round(locality, 3),
        "targets": {name: {"experts": e, "top_k": tk,
                           "hot25_share": fit.hot_share(skew, e, tk),
                           "hot25_share_uniform": fit.hot_share(0.0, e, tk),
                           "overlap": fit.expected_overlap(locality, skew, e, tk),
                           "overlap_uniform": fit.chance_overlap(0.0, e, tk)}
                    for name, (e, tk) in TARGETS.items()},
    }
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
