"""Which weight source a model path names.

* ``synthetic:NAME[?k=v&...]``: a :class:`SyntheticSource` of ``configs/models/NAME.json``
  (e.g. ``synthetic:qwen3-next-80b-a3b``) or of a config file
  (``synthetic:/path/to/config.json``); options ``seed`` (int, default 0), ``skew`` and
  ``locality`` (the routing knobs, default the calibrated ones) and ``mtp`` (MTP layers;
  default the config's, or 1 for a Qwen3-Next config that names none, as the public
  checkpoints ship an MTP head their config.json does not declare).
* a directory holding ``synthetic.json`` (written by ``python -m scripts.make_synthetic_model``,
  with a tokenizer, so ``tandem serve`` can answer chat requests): a SyntheticSource of its
  config.json with the seed and knobs stored there.
* a ``.gguf`` file, or the first file of a split set (``NAME-00001-of-0000N.gguf``): a
  llama.cpp GGUF of qwen3moe / qwen3next (GGUFSource, docs/gguf.md).
* any other directory: a Hugging Face checkpoint (CheckpointSource).
"""

from __future__ import annotations

import dataclasses
import json
import urllib.parse
from pathlib import Path
from typing import Any

from gpu_worker.loader import load_generation_config
from gpu_worker.model_config import ModelConfig
from gpu_worker.weights.checkpoint import CheckpointSource
from gpu_worker.weights.files import load_config
from gpu_worker.weights.routing import RoutingParams
from gpu_worker.weights.source import WeightSource
from gpu_worker.weights.synthetic import DEFAULT_ROUTING, SyntheticSource

PREFIX = "synthetic:"
MARKER = "synthetic.json"  # in a synthetic model directory
FORMAT = "tandem-synthetic-v1"
NAMED_CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "models"
_OPTIONS = {"seed": int, "skew": float, "locality": float, "mtp": int}


def is_synthetic(spec: str | Path) -> bool:
    """True for a ``synthetic:`` spec or a directory holding ``synthetic.json``."""
    text = str(spec)
    return text.startswith(PREFIX) or (Path(text) / MARKER).is_file()


def is_gguf(spec: str | Path) -> bool:
    """True for a path naming a GGUF file (``*.gguf``; a split set by its first file)."""
    return str(spec).endswith(".gguf") and not str(spec).startswith(PREFIX)


def open_source(spec: str | Path) -> WeightSource:
    """The weight source ``spec`` names (see the module doc); ValueError naming the problem."""
    text = str(spec)
    if is_gguf(text):
        from gpu_worker.weights.gguf_source import GGUFSource  # noqa: PLC0415 (gguf package)

        return GGUFSource(text)
    if text.startswith(PREFIX):
        config_file, options = parse_spec(text)
        return synthetic_from(ModelConfig.from_file(config_file), options)
    path = Path(text)
    if (path / MARKER).is_file():  # its config.json is authoritative, MTP layers included
        config = ModelConfig.from_file(path / "config.json")
        return synthetic_from(config, {"mtp": config.num_mtp_layers,
                                       **read_marker(path / MARKER)})
    return CheckpointSource(path)


def model_config(spec: str | Path) -> ModelConfig:
    """The ModelConfig of a model path without reading weights: a GGUF's metadata, or a
    directory's config.json (CheckpointError naming the problem)."""
    if is_gguf(spec):
        return open_source(spec).config
    return load_config(spec)


def generation_config(source: WeightSource, spec: str | Path) -> dict[str, Any]:
    """Sampling defaults and ``eos_token_ids`` of a model: a GGUF's metadata, or a
    directory's generation_config.json (gpu_worker/loader.py)."""
    own = getattr(source, "generation_config", None)
    if own is not None:
        return own()
    return load_generation_config(spec)


def parse_spec(spec: str) -> tuple[Path, dict[str, Any]]:
    """``synthetic:NAME_OR_PATH[?k=v&...]`` -> (config.json path, typed options)."""
    body = spec[len(PREFIX):] if spec.startswith(PREFIX) else spec
    target, _, query = body.partition("?")
    if not target:
        raise ValueError(f"{spec!r}: name a config after {PREFIX!r} (e.g. "
                         f"{PREFIX}qwen3-next-80b-a3b or {PREFIX}/path/to/config.json)")
    options: dict[str, Any] = {}
    for key, values in urllib.parse.parse_qs(query, keep_blank_values=True,
                                             strict_parsing=bool(query)).items():
        if key not in _OPTIONS or len(values) != 1:
            raise ValueError(f"{spec!r}: unknown or repeated option {key!r} "
                             f"(known: {', '.join(_OPTIONS)})")
        try:
            options[key] = _OPTIONS[key](values[0])
        except ValueError:
            raise ValueError(f"{spec!r}: option {key} must be {_OPTIONS[key].__name__}, "
                             f"got {values[0]!r}") from None
    named = NAMED_CONFIGS / f"{target}.json"
    if "/" not in target and not target.endswith(".json"):
        if not named.is_file():
            known = sorted(p.stem for p in NAMED_CONFIGS.glob("*.json"))
            raise ValueError(f"{spec!r}: no config named {target!r} (known: "
                             f"{', '.join(known)}; or give a path to a config.json)")
        return named, options
    path = Path(target).expanduser()
    return (path / "config.json" if path.is_dir() else path), options


def synthetic_from(config: ModelConfig, options: dict[str, Any]) -> SyntheticSource:
    """A SyntheticSource of ``config`` with ``options`` (seed, skew, locality, mtp)."""
    mtp = options.get("mtp")
    if mtp is None and config.is_next and not config.num_mtp_layers:
        mtp = 1
    if mtp is not None:
        if mtp < 0 or (mtp and not config.is_next):
            raise ValueError(f"synthetic option mtp={mtp}: MTP layers need a qwen3_next "
                             "config and a count >= 0")
        config = dataclasses.replace(config, num_mtp_layers=mtp)
    params = RoutingParams(options.get("skew", DEFAULT_ROUTING.skew),
                           options.get("locality", DEFAULT_ROUTING.locality))
    return SyntheticSource(config, options.get("seed", 0), routing=params)


def read_marker(file: Path) -> dict[str, Any]:
    """The options stored in a synthetic model directory's ``synthetic.json``."""
    try:
        data = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{file}: cannot read: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{file}: not a {FORMAT} file")
    options = {k: data[k] for k in _OPTIONS if data.get(k) is not None}
    for key, value in options.items():
        if _OPTIONS[key] is int and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"{file}: {key} must be an integer, got {value!r}")
        if _OPTIONS[key] is float and not isinstance(value, int | float):
            raise ValueError(f"{file}: {key} must be a number, got {value!r}")
    return options


def marker(seed: int, params: RoutingParams) -> dict[str, Any]:
    """The content of ``synthetic.json`` for a directory's config.json (mtp is declared in
    that config.json itself)."""
    return {"format": FORMAT, "seed": seed, "skew": params.skew, "locality": params.locality,
            "mtp": None}
