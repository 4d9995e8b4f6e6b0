"""Load a Hugging Face checkpoint directory into Tandem's canonical tensors.

Reads `config.json` and `model.safetensors` (or shards listed in
`model.safetensors.index.json`), accepts both expert layouts (per-expert
`mlp.experts.{e}.{gate,up,down}_proj.weight` and transformers-5 fused
`mlp.experts.gate_up_proj` [E, 2I, H] + `mlp.experts.down_proj` [E, H, I]) and tied
embeddings, and converts BF16/F16/F32 to one NumPy dtype. Everything is validated against
`weights_spec.expected_tensors` before any data is read; every problem is a
`CheckpointError` whose message names the file and the tensor.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from gpu_worker.model_config import ModelConfig, ModelConfigError
from gpu_worker.safetensors_io import FLOAT_DTYPES, SafetensorsError, SafetensorsFile, TensorInfo
from gpu_worker.weights_spec import expected_tensors, is_mtp

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
PROGRESS_MIN_BYTES = 64 * 1024 * 1024
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")  # buffers some old exporters saved


class CheckpointError(ValueError):
    """A checkpoint Tandem cannot load; the message names the file and tensor."""


@dataclasses.dataclass(slots=True)
class Checkpoint:
    config: ModelConfig
    # canonical names (weights_spec), contiguous, one dtype; with tied embeddings
    # "lm_head.weight" is the same array object as "model.embed_tokens.weight"
    tensors: dict[str, np.ndarray]
    path: Path


# A reader fills one canonical tensor: it returns the array converted to `dtype`.
_Reader = Callable[[np.dtype], np.ndarray]


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
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"{root}: not a checkpoint directory")
    config = load_config(root)
    files = _open_files(root)
    sources = _source_tensors(files)
    expected = expected_tensors(config, include_mtp=include_mtp)
    plan = _plan(root, config, expected, sources, include_mtp)

    total = sum(nbytes for _, nbytes in plan.values())
    show = progress if progress is not None else total > PROGRESS_MIN_BYTES
    tensors: dict[str, np.ndarray] = {}
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"loading {root.name}",
              disable=not show, file=sys.stderr) as bar:
        for name, (reader, nbytes) in plan.items():
            try:
                tensors[name] = reader(np_dtype)
            except (OSError, SafetensorsError) as exc:
                raise CheckpointError(f"{root}: reading tensor {name}: {exc}") from None
            bar.update(nbytes)
    if config.tie_word_embeddings:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    # canonical order, as weights_spec lists it
    ordered = {name: tensors[name] for name in expected}
    return Checkpoint(config=config, tensors=ordered, path=root)


def load_config(path: str | Path) -> ModelConfig:
    """`config.json` of checkpoint directory `path` as a ModelConfig (CheckpointError if bad)."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{config_file}: missing config.json")
    try:
        return ModelConfig.from_file(config_file)
    except ModelConfigError as exc:
        raise CheckpointError(str(exc)) from None


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


# ---- files ---------------------------------------------------------------------------------
def read_json_object(file: Path, *, required: bool = False,
                     error: type[Exception] = CheckpointError) -> dict[str, Any]:
    """A JSON object file ({} when absent and not required); problems raise ``error``."""
    if not file.is_file():
        if required:
            raise error(f"{file}: missing")
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise error(f"{file}: cannot parse JSON: {exc}") from None
    if not isinstance(data, dict):
        raise error(f"{file}: expected a JSON object")
    return data


def _open_files(root: Path) -> list[SafetensorsFile]:
    index_file = root / INDEX_FILE
    if index_file.exists():
        names = _index_files(root, index_file)
    elif (root / SINGLE_FILE).exists():
        names = [SINGLE_FILE]
    else:
        names = sorted(p.name for p in root.glob("*.safetensors"))
        if not names:
            found = "pytorch_model.bin only (convert it to safetensors)" if any(
                root.glob("*.bin")) else "no *.safetensors files"
            raise CheckpointError(f"{root}: no {SINGLE_FILE} or {INDEX_FILE}: {found}")
    files = []
    for name in names:
        try:
            files.append(SafetensorsFile(root / name))
        except SafetensorsError as exc:
            raise CheckpointError(str(exc)) from None
    if index_file.exists():
        _check_index(index_file, files)
    return files


def _index_files(root: Path, index_file: Path) -> list[str]:
    index = read_json_object(index_file, required=True)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index_file}: bad index: 'weight_map' must be a non-empty object")
    names = []
    for tensor, file in weight_map.items():
        if not isinstance(file, str) or Path(file).name != file:
            raise CheckpointError(f"{index_file}: bad index: tensor {tensor} maps to {file!r}, "
                                  f"expected a file name in {root}")
        if not (root / file).is_file():
            raise CheckpointError(f"{index_file}: tensor {tensor} is in {file}, "
                                  f"which does not exist in {root}")
        if file not in names:
            names.append(file)
    return sorted(names)


def _check_index(index_file: Path, files: list[SafetensorsFile]) -> None:
    weight_map = json.loads(index_file.read_text(encoding="utf-8"))["weight_map"]
    by_name = {f.path.name: f for f in files}
    for tensor, file in weight_map.items():
        if tensor not in by_name[file].tensors:
            raise CheckpointError(f"{index_file}: tensor {tensor} is listed in {file}, but "
                                  f"{by_name[file].path} does not contain it")
    for f in files:
        for tensor in f.tensors:
            if weight_map.get(tensor) != f.path.name:
                raise CheckpointError(f"{f.path}: tensor {tensor} is not listed for this file "
                                      f"in {index_file.name}")


def _source_tensors(files: list[SafetensorsFile]) -> dict[str, tuple[SafetensorsFile, TensorInfo]]:
    sources: dict[str, tuple[SafetensorsFile, TensorInfo]] = {}
    for f in files:
        for name, info in f.tensors.items():
            if name in sources:
                raise CheckpointError(f"{f.path}: tensor {name} also appears in "
                                      f"{sources[name][0].path}")
            sources[name] = (f, info)
    return sources


# ---- planning: map every canonical tensor to its on-disk source(s) ---------------------------
def _plan(root: Path, config: ModelConfig, expected: dict[str, tuple[int, ...]],
          sources: dict[str, tuple[SafetensorsFile, TensorInfo]],
          include_mtp: bool) -> dict[str, tuple[_Reader, int]]:
    """Validate names, shapes and dtypes; return canonical name -> (reader, bytes to read)."""
    used: set[str] = set()
    plan: dict[str, tuple[_Reader, int]] = {}

    def source(name: str, shape: tuple[int, ...]) -> tuple[SafetensorsFile, TensorInfo]:
        if name not in sources:
            raise CheckpointError(f"{root}: missing tensor {name} (expected shape {shape})")
        f, info = sources[name]
        if info.shape != shape:
            raise CheckpointError(f"{f.path}: tensor {name} has shape {info.shape}, "
                                  f"expected {shape}")
        if info.dtype not in FLOAT_DTYPES:
            raise CheckpointError(f"{f.path}: tensor {name} has dtype {info.dtype}, "
                                  f"expected one of {', '.join(FLOAT_DTYPES)}")
        used.add(name)
        return f, info

    for name, shape in expected.items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if name.endswith(".mlp.experts.gate_proj"):
            plan.update(_plan_experts(root, name[: -len(".gate_proj")], shape, sources, source))
        elif name.endswith((".mlp.experts.up_proj", ".mlp.experts.down_proj")):
            continue  # planned together with gate_proj
        else:
            f, info = source(name, shape)
            plan[name] = (_single(f, name), info.nbytes)

    for name, (f, _) in sources.items():
        if name in used or _IGNORED.search(name):
            continue
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # transformers ties it to the embedding: the on-disk copy is unused
        if is_mtp(name) and (not include_mtp or (config.is_next and not config.num_mtp_layers)):
            continue  # MTP weights not asked for, or not declared by the config
        raise CheckpointError(f"{f.path}: unexpected tensor {name} "
                              f"(not part of a {config.arch} model with this config.json)")
    return plan


def _plan_experts(root: Path, prefix: str, gate_shape: tuple[int, ...],
                  sources: dict[str, tuple[SafetensorsFile, TensorInfo]],
                  source: Callable[[str, tuple[int, ...]], tuple[SafetensorsFile, TensorInfo]],
                  ) -> dict[str, tuple[_Reader, int]]:
    E, I, H = gate_shape
    fused = f"{prefix}.gate_up_proj"
    if fused in sources:
        if f"{prefix}.0.gate_proj.weight" in sources:
            raise CheckpointError(f"{sources[fused][0].path}: both {fused} and per-expert "
                                  f"tensors {prefix}.N.* are present; expected one layout")
        gf, gi = source(fused, (E, 2 * I, H))
        df, di = source(f"{prefix}.down_proj", (E, H, I))

        def gate(dt: np.dtype) -> np.ndarray:  # gate rows come first in gate_up_proj
            return gf.read(fused, dt, (slice(None), slice(None, I)))  # [E, I, H]

        def up(dt: np.dtype) -> np.ndarray:
            return gf.read(fused, dt, (slice(None), slice(I, None)))  # [E, I, H]

        return {f"{prefix}.gate_proj": (gate, gi.nbytes // 2),
                f"{prefix}.up_proj": (up, gi.nbytes // 2),
                f"{prefix}.down_proj": (_single(df, f"{prefix}.down_proj"), di.nbytes)}

    plan: dict[str, tuple[_Reader, int]] = {}
    for proj, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
        parts = [source(f"{prefix}.{e}.{proj}.weight", shape) for e in range(E)]
        plan[f"{prefix}.{proj}"] = (_stacked(parts, (E, *shape)),
                                    sum(info.nbytes for _, info in parts))
    return plan


def _single(f: SafetensorsFile, name: str) -> _Reader:
    return lambda dt: f.read(name, dt)


def _stacked(parts: list[tuple[SafetensorsFile, TensorInfo]], shape: tuple[int, ...]) -> _Reader:
    def read(dt: np.dtype) -> np.ndarray:
        out = np.empty(shape, dt)  # [E, rows, cols]
        for e, (f, info) in enumerate(parts):
            out[e] = f.read(info.name, dt)
        return out
    return read

