"""Write a tiny random Qwen3-MoE / Qwen3-Next checkpoint (plus a small BPE tokenizer).

    python -m scripts.make_tiny_model --arch qwen3_next --out models/tiny-next --seed 0

Only NumPy, safetensors and tokenizers are used (no torch). See scripts/tiny_model.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from scripts.tiny_model import DEFAULT_SIZES, DTYPES, EXPERT_LAYOUTS, make_tiny_model

_INT_SIZES = {
    "hidden": "hidden size H", "layers": "number of decoder layers",
    "heads": "attention heads", "kv-heads": "key/value heads", "head-dim": "attention head dim",
    "experts": "routed experts E", "topk": "experts per token",
    "moe-intermediate": "expert intermediate size I",
    "intermediate": "dense MLP intermediate size",
    "shared-intermediate": "shared expert intermediate size (qwen3_next)",
    "vocab": "vocabulary size (tokenizer gets exactly this many ids)",
    "linear-key-heads": "GDN key heads", "linear-value-heads": "GDN value heads",
    "linear-key-dim": "GDN key head dim", "linear-value-dim": "GDN value head dim",
    "conv-kernel": "GDN conv kernel", "full-attention-interval": "every Nth layer is full "
    "attention (qwen3_next)", "decoder-sparse-step": "every Nth layer is MoE",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", required=True, choices=("qwen3_moe", "qwen3_next"))
    p.add_argument("--out", required=True, type=Path, help="output directory")
    p.add_argument("--seed", type=int, default=0)
    for flag, help_text in _INT_SIZES.items():
        key = flag.replace("-", "_")
        p.add_argument(f"--{flag}", dest=key, type=int, default=DEFAULT_SIZES[key],
                       help=f"{help_text} (default {DEFAULT_SIZES[key]})")
    p.add_argument("--partial-rotary-factor", type=float, default=None,
                   help="fraction of head_dim rotated (default 0.25 next, 1.0 moe)")
    p.add_argument("--mlp-only-layers", default="",
                   help="comma-separated layer indices with a dense MLP, e.g. 0,2")
    p.add_argument("--rope-theta", type=float, default=DEFAULT_SIZES["rope_theta"])
    p.add_argument("--tie-embeddings", action="store_true")
    p.add_argument("--no-norm-topk-prob", dest="norm_topk_prob", action="store_false")
    p.add_argument("--attention-bias", action="store_true")
    p.add_argument("--std", type=float, default=DEFAULT_SIZES["std"],
                   help="std of the random matrices (default 0.02)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    p.add_argument("--expert-layout", choices=EXPERT_LAYOUTS, default="per_expert")
    p.add_argument("--shards", type=int, default=1, help="write N shards plus an index")
    p.add_argument("--no-mtp", dest="mtp", action="store_false",
                   help="qwen3_next: no MTP head (mtp_num_hidden_layers 0)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = {key.replace("-", "_"): getattr(args, key.replace("-", "_")) for key in _INT_SIZES}
    try:
        mlp_only = tuple(int(x) for x in args.mlp_only_layers.split(",") if x.strip())
    except ValueError:
        print(f"error: --mlp-only-layers: not a list of integers: {args.mlp_only_layers!r}",
              file=sys.stderr)
        return 2
    try:
        out = make_tiny_model(
            args.out, args.arch, args.seed, dtype=args.dtype, expert_layout=args.expert_layout,
            shards=args.shards, partial_rotary_factor=args.partial_rotary_factor,
            mlp_only_layers=mlp_only, rope_theta=args.rope_theta,
            tie_embeddings=args.tie_embeddings, norm_topk_prob=args.norm_topk_prob,
            attention_bias=args.attention_bias, std=args.std, mtp=args.mtp, **sizes)
    except ValueError as exc:  # ConfigError is a ValueError
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
