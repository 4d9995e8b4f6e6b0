"""Write a synthetic model directory: config, tokenizer and seed, no weights.

    python -m scripts.make_synthetic_model qwen3-next-80b-a3b --out models/synthetic-80b

The directory holds config.json (the named config, or --config FILE, plus
mtp_num_hidden_layers for Qwen3-Next), generation_config.json, a byte-level BPE tokenizer of
exactly vocab_size ids with Qwen's special tokens and chat template (scripts/tiny_tokenizer.py),
and synthetic.json (seed and routing knobs). `[model] path = "<that directory>"` then serves
it like a checkpoint: the worker's weight source generates the tensors
(gpu_worker/weights/resolve.py), the daemon reads the tokenizer, so chat requests work.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from gpu_worker.weights.resolve import MARKER, marker, parse_spec
from gpu_worker.weights.routing import RoutingParams
from gpu_worker.weights.synthetic import DEFAULT_ROUTING
from scripts.tiny_tokenizer import write_tokenizer


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config", help="a name under configs/models (e.g. qwen3-next-80b-a3b) "
                   "or a config.json path")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skew", type=float, default=DEFAULT_ROUTING.skew)
    p.add_argument("--locality", type=float, default=DEFAULT_ROUTING.locality)
    p.add_argument("--mtp", type=int, default=None,
                   help="MTP layers (default: the config's, or 1 for Qwen3-Next)")
    args = p.parse_args(argv)
    try:
        config_file, _ = parse_spec(args.config)
        raw = json.loads(Path(config_file).read_text())
        params = RoutingParams(args.skew, args.locality)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if raw.get("model_type") == "qwen3_next" or "Qwen3NextForCausalLM" in raw.get(
            "architectures", []):
        has = raw.get("mtp_num_hidden_layers") or raw.get("num_nextn_predict_layers")
        raw["mtp_num_hidden_layers"] = args.mtp if args.mtp is not None else (has or 1)
    args.out.mkdir(parents=True, exist_ok=True)
    special = write_tokenizer(args.out, raw["vocab_size"])
    eos = [special["<|im_end|>"], special["<|endoftext|>"]]
    raw.update(bos_token_id=special["<|endoftext|>"], eos_token_id=eos[0])
    (args.out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    generation = {"bos_token_id": eos[1], "eos_token_id": eos, "pad_token_id": eos[1],
                  "do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20}
    (args.out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    (args.out / MARKER).write_text(json.dumps(marker(args.seed, params), indent=2) + "\n")
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
