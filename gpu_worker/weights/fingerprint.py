"""What a weight source's tensors follow from, for cache keys (cpu_experts/shard_cache.py).

A checkpoint directory or GGUF file: the model config and every file's name, size and
modification time (a changed file gives a new key). A synthetic source: the config, the
seed and the generator's code (its values follow from them alone, docs/synthetic.md).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from cpu_experts.shard_cache import code_hash
from gpu_worker.weights import gguf_quants, gguf_source, synthetic
from gpu_worker.weights.gguf_source import split_files
from gpu_worker.weights.source import WeightSource


def source_facts(source: WeightSource) -> dict[str, Any]:
    """The source's identity as JSON-able facts."""
    config = json.loads(json.dumps(dataclasses.asdict(source.config), default=str))
    facts: dict[str, Any] = {"kind": type(source).__name__, "config": config}
    path = source.path
    if path is None:
        return facts | {"seed": getattr(source, "seed", None),
                        "generator": code_hash(synthetic.__file__)}
    path = Path(path)
    files = split_files(path) if path.is_file() else sorted(
        p for p in path.iterdir() if p.is_file())
    stats = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    facts |= {"path": str(path.resolve()), "files": stats}
    if path.is_file():  # a GGUF: its blocks are dequantized or converted by this code
        facts["reader"] = code_hash(gguf_quants.__file__, gguf_source.__file__)
    return facts

