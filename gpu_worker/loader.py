"""Load a Hugging Face checkpoint directory into Tandem's canonical tensors, all at once.

`load_checkpoint` reads every canonical tensor of a :class:`CheckpointSource`
(gpu_worker/weights/checkpoint.py: both expert layouts, shards, tied embeddings, BF16/F16/F32)
into one NumPy dtype: for tests, tools and small models. Serving loads through
`gpu_worker.engine.load_model`, which streams each tensor to where it lives instead
(gpu_worker/weights/stream.py). Everything is validated before any data is read; every
problem is a `CheckpointError` whose message names the file and the tensor.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from gpu_worker.model_config import ModelConfig
from gpu_worker.weights.checkpoint import CheckpointSource
from gpu_worker.weights.files import load_config, read_json_object
from gpu_worker.weights.source import CheckpointError

__all__ = ["Checkpoint", "CheckpointError", "load_checkpoint", "load_config",
           "load_generation_config", "read_json_object"]

PROGRESS_MIN_BYTES = 64 * 1024 * 1024


@dataclasses.dataclass(slots=True)
class Checkpoint:
    config: ModelConfig
    # canonical names (weights_spec), contiguous, one dtype; with tied embeddings
    # "lm_head.weight" is the same array object as "model.embed_tokens.weight"
    tensors: dict[str, np.ndarray]
    path: Path


def load_checkpoint(path: str | Path, *, dtype: Any = np.float32, include_mtp: bool = True,
                    progress: bool | None = None) -> Checkpoint:
    """Load and validate the checkpoint directory `path`.

    `include_mtp=False` skips `mtp.*` weights; with True they must be present whenever the
    config declares MTP layers. `progress=None` shows a bar on stderr for checkpoints over
    64 MB, True always, False never.
    """
    np_dtype = np.dtype(dtype)
    if np_dtype.kind != "f":
        raise ValueError(f"dtype must be a floating type, got {np_dtype}")
    source = CheckpointSource(path, include_mtp=include_mtp)
    config = source.config
    tied = config.tie_word_embeddings
    names = [n for n in source.shapes() if not (tied and n == "lm_head.weight")]
    total = sum(source.nbytes(n) for n in names)
    show = progress if progress is not None else total > PROGRESS_MIN_BYTES
    tensors: dict[str, np.ndarray] = {}
    root = Path(path)
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"loading {root.name}",
              disable=not show, file=sys.stderr) as bar:
        for name in names:
            tensors[name] = source.read(name, np_dtype)
            bar.update(source.nbytes(name))
    if tied:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    # canonical order, as weights_spec lists it
    ordered = {name: tensors[name] for name in source.shapes()}
    return Checkpoint(config=config, tensors=ordered, path=root)


def load_generation_config(path: str | Path) -> dict[str, Any]:
    """generation_config.json of `path` (empty if absent) with `eos_token_ids` as a list.

    EOS ids come from generation_config.json's `eos_token_id` (int or list), falling back to
    config.json's.
    """
    root = Path(path)
    gen = read_json_object(root / "generation_config.json", required=False)
    eos = gen.get("eos_token_id")
    if eos is None:
        eos = read_json_object(root / "config.json", required=False).get("eos_token_id")
    ids = [] if eos is None else [eos] if isinstance(eos, int) else eos
    if not isinstance(ids, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise CheckpointError(f"{root / 'generation_config.json'}: eos_token_id must be an "
                              f"integer or a list of integers, got {eos!r}")
    return {**gen, "eos_token_ids": list(ids)}
