"""The files of a Hugging Face checkpoint directory: config.json, the safetensors files (one,
or the shards an index lists) and their cross-checks, all before any tensor data is read.

Every problem is a :class:`CheckpointError` whose one-line message names the file and the
tensor or key, so a user can act on it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from gpu_worker.model_config import ModelConfig, ModelConfigError
from gpu_worker.safetensors_io import SafetensorsError, SafetensorsFile, TensorInfo
from gpu_worker.weights.source import CheckpointError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# config.json's dtype name -> the safetensors dtype its tensors should have
CONFIG_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "float64": "F64"}
_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(?:gate|up|down)_proj\.weight$")

Sources = dict[str, tuple[SafetensorsFile, TensorInfo]]  # on-disk name -> (file, header entry)


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


def load_config(path: str | Path) -> ModelConfig:
    """`config.json` of checkpoint directory `path` as a ModelConfig (CheckpointError if bad)."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{config_file}: missing config.json")
    try:
        return ModelConfig.from_file(config_file)
    except ModelConfigError as exc:
        raise CheckpointError(str(exc)) from None


def config_dtype(path: str | Path) -> tuple[str, str] | None:
    """``(key, value)`` of the dtype config.json declares (``torch_dtype``, or transformers
    5's ``dtype``), or None when it declares none Tandem can check."""
    raw = read_json_object(Path(path) / "config.json")
    for key in ("torch_dtype", "dtype"):
        if isinstance(raw.get(key), str) and raw[key] in CONFIG_DTYPES:
            return key, raw[key]
    return None


def open_files(root: Path) -> list[SafetensorsFile]:
    """Every safetensors file of ``root`` with its header parsed and checked against the
    file's size (a truncated shard fails here, before any data is read)."""
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
    names: list[str] = []
    missing: dict[str, str] = {}  # missing file -> first tensor listed in it
    for tensor, file in weight_map.items():
        if not isinstance(file, str) or Path(file).name != file:
            raise CheckpointError(f"{index_file}: bad index: tensor {tensor} maps to {file!r}, "
                                  f"expected a file name in {root}")
        if not (root / file).is_file():
            missing.setdefault(file, tensor)
        if file not in names:
            names.append(file)
    if missing:
        file, tensor = next(iter(missing.items()))
        more = f" ({len(missing) - 1} more shard files missing)" if len(missing) > 1 else ""
        raise CheckpointError(f"{index_file}: missing shard file: tensor {tensor} is in "
                              f"{file}, which does not exist in {root}{more}")
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


def source_tensors(files: list[SafetensorsFile]) -> Sources:
    """On-disk name -> (file, header entry) over all files; a name in two files is an error."""
    sources: Sources = {}
    for f in files:
        for name, info in f.tensors.items():
            if name in sources:
                raise CheckpointError(f"{f.path}: tensor {name} also appears in "
                                      f"{sources[name][0].path}")
            sources[name] = (f, info)
    return sources


def check_expert_counts(root: Path, config: ModelConfig, sources: Sources) -> None:
    """Every layer's routed experts on disk number ``config.num_experts``: a checkpoint for
    another expert count fails here by name, not as a list of missing tensors."""
    E = config.num_experts
    top: dict[str, tuple[int, str]] = {}  # experts prefix -> (highest id, its tensor)
    for name in sources:
        m = _PER_EXPERT.match(name)
        if m and int(m.group(2)) >= top.get(m.group(1), (-1, ""))[0]:
            top[m.group(1)] = (int(m.group(2)), name)
        if name.endswith(".mlp.experts.gate_up_proj"):
            f, info = sources[name]
            if E and info.shape and info.shape[0] != E:
                raise CheckpointError(f"{f.path}: tensor {name} holds {info.shape[0]} experts, "
                                      f"but config.json says num_experts = {E}")
    for prefix, (last, name) in sorted(top.items()):
        if not E:
            continue  # a dense config: the unexpected tensors are named later
        if last >= E:
            raise CheckpointError(f"{sources[name][0].path}: unexpected tensor {name}: "
                                  f"expert {last}, but config.json says num_experts = {E}")
        if last < E - 1:
            raise CheckpointError(f"{root}: {prefix} has {last + 1} experts on disk, but "
                                  f"config.json says num_experts = {E} (missing tensor "
                                  f"{prefix}.{last + 1}.gate_proj.weight)")
