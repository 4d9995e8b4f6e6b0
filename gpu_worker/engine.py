"""In-process engine: a model, its caches and the plain generate / score loops.

The CLI uses it directly; the GPU worker process drives the same pieces from StepPlans.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from gpu_worker.backend import get_xp, to_numpy
from gpu_worker.experts.split import ExpertSplit, plan_split
from gpu_worker.kernels.bf16 import BF16
from gpu_worker.kernels.sampler import sample_token
from gpu_worker.model.batch import RaggedBatch
from gpu_worker.model.model import Caches, ForwardOut, Model
from gpu_worker.weights.resolve import open_source
from gpu_worker.weights.source import WeightSource
from gpu_worker.weights.stream import CHUNK_BYTES, Log, stream_load
from protocol.messages import SamplingParams
from protocol.worker_config import GPU_FORMATS

if TYPE_CHECKING:  # numba, imported only where some experts run on CPU workers
    from gpu_worker.experts.placement import ExpertPlacement

# bfloat16: weight matrices stored in bf16, computed in float32 (gpu_worker/model/ops.py);
# its checkpoint is read as float32 (exact for a bf16 checkpoint) and rounded at upload
DTYPES = {"float32": np.float32, "float64": np.float64, "bfloat16": BF16}
HOST_DTYPES = {**DTYPES, "bfloat16": np.float32}


def load_model(source: WeightSource | str | Path, *, dtype: str = "float32",
               backend: str = "numpy", exact: bool | None = None, placement: str = "gpu",
               cpu_experts_per_layer: int | Mapping[int, int] = 0, cpu_workers: int = 0,
               cpu_cores: list[list[int]] | None = None, cpu_isa: str = "auto",
               cpu_format: str = "int8", gpu_format: str = "model",
               hot_experts: str | Path | None = None, expert_split: ExpertSplit | None = None,
               progress: bool | None = None, log: Log | None = None,
               chunk_bytes: int = CHUNK_BYTES, cpu_shard_cache: str | Path | None = None
               ) -> tuple[Model, ExpertPlacement | None]:
    """The model on its backend plus, unless ``placement`` is "gpu", the started CPU expert
    workers (an ExpertPlacement, gpu_worker/experts/placement.py, to be closed by the
    caller), streamed from ``source`` (a WeightSource, gpu_worker/weights/source.py, or a
    checkpoint directory) one tensor or chunk of experts at a time
    (gpu_worker/weights/stream.py). ``exact`` defaults to float64;
    ``cpu_isa`` picks the CPU expert kernels ("auto": ``$TANDEM_CPU_ISA`` or the best),
    ``cpu_format`` their weights ("int8" or "int4", cpu_experts/formats.py); ``gpu_format``
    the backend's routed experts ("model": the model dtype; "int8": int8 blocks of 32,
    gpu_worker/kernels/int8_stack.py); ``cpu_shard_cache``: a directory that keeps the CPU
    experts' shards between loads (cpu_experts/shard_cache.py);
    ``hot_experts`` (split): a router counts file whose most-picked experts stay on the GPU
    (gpu_worker/expert_stats.py). ``expert_split``: which experts go where, decided by the
    caller (a memory plan's experts per layer and order); None: from ``placement``,
    ``cpu_experts_per_layer`` and ``hot_experts`` (gpu_worker/experts/split.py).
    ``progress``: a tqdm bar on stderr (None: above 64 MB); ``log(event, **fields)``: one
    line per load phase (None: the ``tandem.load`` logger)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if gpu_format not in GPU_FORMATS:
        raise ValueError(f"gpu_format must be one of {', '.join(GPU_FORMATS)}, got "
                         f"{gpu_format!r}")
    if not hasattr(source, "read"):  # a checkpoint directory or a synthetic: spec
        source = open_source(source)  # validated here, before any data is read
    if expert_split is None:
        hot = None
        if hot_experts is not None:
            from gpu_worker.expert_stats import load_counts  # noqa: PLC0415

            if placement != "split":
                raise ValueError("hot_experts needs placement 'split'")
            hot = load_counts(hot_experts, source.config)
        expert_split = plan_split(source.config, placement, cpu_experts_per_layer, hot)
    exact = (dtype == "float64") if exact is None else exact
    pool_options = {"num_workers": cpu_workers, "cores": cpu_cores,
                    "isa": None if cpu_isa == "auto" else cpu_isa, "weight_format": cpu_format,
                    "shard_cache": str(cpu_shard_cache) if cpu_shard_cache else None}
    return stream_load(source, expert_split, xp=get_xp(backend), dtype=DTYPES[dtype],
                       host_dtype=HOST_DTYPES[dtype], exact=exact, pool_options=pool_options,
                       progress=progress, log=log, chunk_bytes=chunk_bytes,
                       gpu_int8=gpu_format == "int8")


class Engine:
    def __init__(self, model: Model, *, max_slots: int = 4, max_len: int = 4096,
                 block_size: int = 16, prefill_chunk: int = 512,
                 placement: ExpertPlacement | None = None) -> None:
        self.model = model
        self.placement = placement  # ExpertPlacement when some experts run on CPU workers
        self.max_slots = max_slots
        self.max_len = max_len
        self.prefill_chunk = prefill_chunk
        self.caches: Caches = model.new_caches(max_slots, max_len, block_size)

    @classmethod
    def from_dir(cls, path: WeightSource | str | Path, *, dtype: str = "float32",
                 backend: str = "numpy", exact: bool | None = None, placement: str = "gpu",
                 cpu_experts_per_layer: int = 0, cpu_workers: int = 0,
                 cpu_cores: list[list[int]] | None = None, cpu_isa: str = "auto",
                 hot_experts: str | Path | None = None, progress: bool | None = None,
                 **kwargs) -> Engine:
        """An engine over :func:`load_model` of ``path`` (a directory or a WeightSource);
        ``kwargs`` go to the constructor."""
        model, experts = load_model(path, dtype=dtype, backend=backend, exact=exact,
                                    placement=placement,
                                    cpu_experts_per_layer=cpu_experts_per_layer,
                                    cpu_workers=cpu_workers, cpu_cores=cpu_cores,
                                    cpu_isa=cpu_isa, hot_experts=hot_experts,
                                    progress=progress)
        return cls(model, placement=experts, **kwargs)

    def close(self) -> None:
        if self.placement is not None:
            self.placement.close()
            self.placement = None

    @property
    def vocab_size(self) -> int:
        return self.model.cfg.vocab_size

    def forward(self, parts: list[tuple[int, int, np.ndarray]], logit_rows=None) -> ForwardOut:
        batch = RaggedBatch.build(parts)
        if self.placement is None:
            return self.model.forward(batch, self.caches, logit_rows)
        return self.placement.run_step(functools.partial(
            self.model.forward, batch, self.caches, logit_rows, self.placement))

    def prefill(self, slot: int, ids: np.ndarray, *, all_logits: bool = False) -> np.ndarray:
        """Reset ``slot`` and run the prompt in chunks; logits [n, V] of the last row, or of
        every row with ``all_logits``."""
        self.caches.reset_slot(slot)
        out = []
        for start in range(0, len(ids), self.prefill_chunk):
            chunk = ids[start:start + self.prefill_chunk]
            rows = np.arange(len(chunk)) if all_logits else None
            res = self.forward([(slot, start, chunk)], rows)
            out.append(to_numpy(res.logits))
        return np.concatenate(out) if all_logits else out[-1]

    def score(self, ids: list[int] | np.ndarray, slot: int = 0) -> np.ndarray:
        """float32 logits [T, V] of every prompt position."""
        ids = self._check_ids(ids)
        return self.prefill(slot, ids, all_logits=True).astype(np.float32)

    def generate(self, prompt_ids: list[int] | np.ndarray, *, params: SamplingParams,
                 max_tokens: int, eos_ids: tuple[int, ...] = (), slot: int = 0) -> list[int]:
        """Plain decoding of one request; the EOS token that stops it is not returned."""
        ids = self._check_ids(prompt_ids)
        if max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if len(ids) + max_tokens > self.max_len:
            raise ValueError(f"prompt ({len(ids)}) + max_tokens ({max_tokens}) exceeds the "
                             f"context limit {self.max_len}")
        logits = self.prefill(slot, ids)[0]
        out: list[int] = []
        pos = len(ids)
        while True:
            token = sample_token(logits, params, pos)
            if token in eos_ids:
                break
            out.append(token)
            if len(out) == max_tokens:
                break
            logits = self.forward([(slot, pos, np.array([token]))]).logits[0]
            pos += 1
        return out

    def _check_ids(self, ids) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size == 0:
            raise ValueError("the prompt is empty")
        if ids.min() < 0 or ids.max() >= self.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.vocab_size})")
        if ids.size > self.max_len:
            raise ValueError(f"prompt of {ids.size} tokens exceeds the context limit "
                             f"{self.max_len}")
        return ids
