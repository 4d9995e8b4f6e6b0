"""CheckpointSource: a Hugging Face safetensors directory as a WeightSource.

Accepts both expert layouts (per-expert `mlp.experts.{e}.{gate,up,down}_proj.weight` and
transformers-5 fused `mlp.experts.gate_up_proj` [E, 2I, H] + `mlp.experts.down_proj`
[E, H, I]), tied embeddings, BF16/F16/F32 storage, one file or index-listed shards.
Everything is validated against `weights_spec.expected_tensors` and config.json when the
source is made, before any tensor data is read: files, sizes, index, names, shapes,
expert counts, dtypes. Reads then touch only the bytes asked for (pread, no mapping).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from gpu_worker.safetensors_io import FLOAT_DTYPES, SafetensorsError, SafetensorsFile
from gpu_worker.weights.files import (
    CONFIG_DTYPES,
    Sources,
    check_expert_counts,
    config_dtype,
    load_config,
    open_files,
    source_tensors,
)
from gpu_worker.weights.source import CheckpointError, Shape, check_read
from gpu_worker.weights_spec import expected_tensors, is_mtp

_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")  # buffers some old exporters saved


@dataclasses.dataclass(frozen=True, slots=True)
class _Entry:
    """Where one canonical tensor lies on disk."""

    parts: tuple[tuple[SafetensorsFile, str], ...]  # one tensor, or one per expert [E]
    nbytes: int  # stored bytes of the whole canonical tensor
    part: slice | None = None  # rows of axis 1 (gate or up of gate_up_proj [E, 2I, H])
    per_expert: bool = False


class CheckpointSource:
    """The canonical tensors of checkpoint directory ``path``, read on demand.

    ``include_mtp=False`` skips `mtp.*` weights; with True they must be present whenever the
    config declares MTP layers.
    """

    def __init__(self, path: str | Path, *, include_mtp: bool = True) -> None:
        root = Path(path)
        if not root.is_dir():
            raise CheckpointError(f"{root}: not a checkpoint directory")
        self.path: Path | None = root
        self.config = load_config(root)
        self.include_mtp = include_mtp
        sources = source_tensors(open_files(root))
        check_expert_counts(root, self.config, sources)
        self._shapes = expected_tensors(self.config, include_mtp=include_mtp)
        self._plan = _Planner(root, self, sources).plan()

    def shapes(self) -> dict[str, Shape]:
        return dict(self._shapes)

    def nbytes(self, name: str) -> int:
        return self._entry(name).nbytes

    def read(self, name: str, dtype: np.dtype, *, experts: Sequence[int] | None = None
             ) -> np.ndarray:
        entry = self._entry(name)
        dtype = check_read(name, dtype, experts)
        try:
            if not entry.per_expert:
                f, stored = entry.parts[0]
                return f.read(stored, dtype, rows=experts, part=entry.part)
            ids = range(len(entry.parts)) if experts is None else experts
            out = np.empty((len(ids), *self._shapes[name][1:]), dtype)  # [n, rows, cols]
            for j, e in enumerate(ids):
                f, stored = entry.parts[e]
                out[j] = f.read(stored, dtype)
            return out
        except (OSError, SafetensorsError) as exc:
            raise CheckpointError(f"{self.path}: reading tensor {name}: {exc}") from None

    def _entry(self, name: str) -> _Entry:
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            name = "model.embed_tokens.weight"
        if name not in self._plan:
            raise KeyError(f"{self.path}: no canonical tensor {name}")
        return self._plan[name]


class _Planner:
    """Map every canonical tensor to its on-disk source(s), validating as it goes."""

    def __init__(self, root: Path, src: CheckpointSource, sources: Sources) -> None:
        self.root, self.config, self.sources = root, src.config, sources
        self.include_mtp = src.include_mtp
        self.dtype = config_dtype(root)  # (key, value) or None
        self.used: set[str] = set()

    def plan(self) -> dict[str, _Entry]:
        config = self.config
        plan: dict[str, _Entry] = {}
        for name, shape in expected_tensors(config, include_mtp=self.include_mtp).items():
            if name == "lm_head.weight" and config.tie_word_embeddings:
                continue
            if name.endswith(".mlp.experts.gate_proj"):
                plan.update(self._experts(name[: -len(".gate_proj")], shape))
            elif name.endswith((".mlp.experts.up_proj", ".mlp.experts.down_proj")):
                continue  # planned together with gate_proj
            else:
                f, nbytes = self.source(name, shape)
                plan[name] = _Entry(((f, name),), nbytes)
        for name, (f, _) in self.sources.items():
            if name in self.used or _IGNORED.search(name):
                continue
            if name == "lm_head.weight" and config.tie_word_embeddings:
                continue  # transformers ties it to the embedding: the on-disk copy is unused
            if is_mtp(name) and (not self.include_mtp
                                 or (config.is_next and not config.num_mtp_layers)):
                continue  # MTP weights not asked for, or not declared by the config
            raise CheckpointError(f"{f.path}: unexpected tensor {name} "
                                  f"(not part of a {config.arch} model with this config.json)")
        return plan

    def source(self, name: str, shape: Shape) -> tuple[SafetensorsFile, int]:
        """The file holding on-disk tensor ``name`` (checked: present, shape, dtype)."""
        if name not in self.sources:
            raise CheckpointError(f"{self.root}: missing tensor {name} (expected shape {shape})")
        f, info = self.sources[name]
        if info.shape != shape:
            cfg = self.config
            hint = (f" (config.json: num_experts = {cfg.num_experts}, hidden_size = "
                    f"{cfg.hidden_size}, moe_intermediate_size = {cfg.moe_intermediate_size})"
                    if ".mlp.experts." in name or name.endswith(".mlp.gate.weight") else "")
            raise CheckpointError(f"{f.path}: tensor {name} has shape {info.shape}, "
                                  f"expected {shape}{hint}")
        if info.dtype not in FLOAT_DTYPES:
            raise CheckpointError(f"{f.path}: tensor {name} has dtype {info.dtype}, "
                                  f"expected one of {', '.join(FLOAT_DTYPES)}")
        if self.dtype is not None:
            key, value = self.dtype
            # NOTE: exporters keep some vectors (norms, A_log, biases) in float32 in a
            # bfloat16 checkpoint; only a matrix in another dtype is a mismatch.
            if info.dtype != CONFIG_DTYPES[value] and not (info.dtype == "F32"
                                                           and len(shape) <= 1):
                raise CheckpointError(f"{f.path}: tensor {name} has dtype {info.dtype}, but "
                                      f"config.json says {key} = {value} "
                                      f"({CONFIG_DTYPES[value]}): re-save the checkpoint in "
                                      f"{value} or correct {key}")
        self.used.add(name)
        return f, info.nbytes

    def _experts(self, prefix: str, gate_shape: Shape) -> dict[str, _Entry]:
        E, I, H = gate_shape
        fused, sources = f"{prefix}.gate_up_proj", self.sources
        if fused in sources:
            if f"{prefix}.0.gate_proj.weight" in sources:
                raise CheckpointError(f"{sources[fused][0].path}: both {fused} and per-expert "
                                      f"tensors {prefix}.N.* are present; expected one layout")
            gf, gate_up = self.source(fused, (E, 2 * I, H))
            df, down = self.source(f"{prefix}.down_proj", (E, H, I))
            # gate rows come first in gate_up_proj
            return {f"{prefix}.gate_proj": _Entry(((gf, fused),), gate_up // 2, slice(0, I)),
                    f"{prefix}.up_proj": _Entry(((gf, fused),), gate_up // 2, slice(I, 2 * I)),
                    f"{prefix}.down_proj": _Entry(((df, f"{prefix}.down_proj"),), down)}
        plan = {}
        for proj, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
            names = [f"{prefix}.{e}.{proj}.weight" for e in range(E)]
            found = [self.source(n, shape) for n in names]
            plan[f"{prefix}.{proj}"] = _Entry(tuple((f, n) for (f, _), n in zip(
                found, names, strict=True)), sum(b for _, b in found), per_expert=True)
        return plan
