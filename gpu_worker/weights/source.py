"""The seam between a model's weights and where they come from.

Every source (a Hugging Face safetensors directory, a synthetic generator, later GGUF) gives
the canonical tensors of gpu_worker/weights_spec.py one at a time, so the placement can put
each where it lives (backend, CPU experts' shared memory) without holding the whole model:

    source.read("model.layers.3.mlp.experts.gate_proj", np.float32, experts=[0, 5])
        -> [2, I, H]: experts 0 and 5 of layer 3 only

Implementations: gpu_worker/weights/checkpoint.py (CheckpointSource, a safetensors
directory), gpu_worker/weights/synthetic.py (generated weights). gpu_worker/weights/stream.py
puts any of them in place (``gpu_worker.engine.load_model(source)``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from gpu_worker.model_config import ModelConfig

Shape = tuple[int, ...]


class CheckpointError(ValueError):
    """Weights Tandem cannot load; the one-line message names the file and the tensor or key."""


class WeightSource(Protocol):
    """Canonical tensors (weights_spec.expected_tensors order and shapes), read on demand."""

    config: ModelConfig
    path: Path | None  # the directory or file it reads, None for a synthetic source

    def shapes(self) -> dict[str, Shape]:
        """Every canonical tensor this source provides, with its shape (validated up front:
        a missing or malformed tensor is an error here, before any data is read)."""
        ...

    def nbytes(self, name: str) -> int:
        """Bytes this source reads (or makes) for tensor ``name`` in its own storage dtype."""
        ...

    def read(self, name: str, dtype: np.dtype, *, experts: Sequence[int] | None = None
             ) -> np.ndarray:
        """Tensor ``name`` as a new C-contiguous host array of ``dtype``; for stacked expert
        tensors ([E, ...]) ``experts`` selects rows of the first axis in the given order
        (None: all; empty: a [0, ...] array), so a renumbered layer reads as its new order.
        With tied embeddings ``lm_head.weight`` reads as the embedding."""
        ...


def check_read(name: str, dtype: np.dtype, experts: Sequence[int] | None) -> np.dtype:
    """The arguments of :meth:`WeightSource.read`, checked alike by every source: a floating
    dtype, and ``experts`` only for stacked expert tensors. Returns the dtype."""
    dtype = np.dtype(dtype)
    if dtype.kind != "f":
        raise ValueError(f"dtype must be a floating type, got {dtype}")
    if experts is not None and ".mlp.experts." not in name:
        raise ValueError(f"{name} is not a stacked expert tensor: cannot select experts")
    return dtype
