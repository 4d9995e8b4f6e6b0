"""bench_concurrency's arms: an arm's ``[speculation]`` keys and its variant's other config
keys, ``--set`` overrides, and one run's config from the base (scripts/bench_concurrency.py's
module doc)."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

# an arm's "+NAME": config keys beside its speculation, to run one arm two ways in one call
ARM_VARIANTS: dict[str, dict[str, Any]] = {
    "nopin": {"experts.pin_host": False},  # the daemon and GPU worker on any core
}


def arm_speculation(arm: str, proposer: str) -> dict[str, Any]:
    """An arm's ``[speculation]`` keys: "off", "narrow", "wide" or "adaptive" (wide with
    ``draft_budget = "adaptive"``), then an optional "@N" (``num_drafts``), then an optional
    "+NAME" of :data:`ARM_VARIANTS` (:func:`arm_overrides`)."""
    arm_overrides(arm)  # an unknown variant is refused here too
    mode, _, drafts = arm.partition("+")[0].partition("@")
    spec: dict[str, Any] = {"proposer": proposer}
    if mode == "adaptive":
        mode, spec["draft_budget"] = "wide", "adaptive"
    if mode not in ("off", "narrow", "wide"):
        raise SystemExit(f"unknown arm {arm!r}: off, narrow, wide or adaptive, then @N")
    spec["mode"] = mode
    if drafts:
        spec["num_drafts"] = int(drafts)
    return spec


def arm_overrides(arm: str) -> dict[str, Any]:
    """The config keys (``section.key``) of an arm's "+NAME" variant ({} without one)."""
    variant = arm.partition("+")[2]
    if variant and variant not in ARM_VARIANTS:
        raise SystemExit(f"unknown arm variant {variant!r} in {arm!r}: one of "
                         f"{', '.join(ARM_VARIANTS)}")
    return dict(ARM_VARIANTS.get(variant, {}))


def parse_set(items: list[str]) -> dict[str, Any]:
    """``--set section.key=VALUE`` (VALUE a TOML value; a bare word is a string)."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or "." not in key:
            raise SystemExit(f"--set wants section.key=VALUE, got {item!r}")
        try:
            out[key.strip()] = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            out[key.strip()] = value
    return out


def run_config(base: dict, *, port: int, run_dir: Path, speculation: dict,
               overrides: dict[str, Any] | None = None) -> dict:
    """One run's config: the base with its own port, run directory and speculation, and
    ``overrides`` (``section.key``: value; an arm's variant)."""
    cfg = {k: dict(v) for k, v in base.items()}
    cfg.setdefault("server", {}).update(host="127.0.0.1", port=port, run_dir=str(run_dir))
    cfg["speculation"] = {**base.get("speculation", {}), **speculation}
    return set_keys(cfg, overrides or {})


def set_keys(cfg: dict, keys: dict[str, Any]) -> dict:
    """``cfg`` ({section: {key: value}}) with ``keys`` (``section.key``: value) set in place."""
    for key, value in keys.items():
        section, _, name = key.partition(".")
        cfg.setdefault(section, {})[name] = value
    return cfg


def replay_split(cfg: dict, replays: list[Path], needed: int | None) -> int | None:
    """The CPU experts a layer the runs use, where replay files say which split their plain
    run had (``recorded_with``). A request's tokens depend on the split (GPU experts in the
    model's dtype, CPU ones in int8), so a replay file's continuations are plain decoding's
    only on its own: the recorded split is kept where it holds at least ``needed`` (the
    arms' plans, :func:`scripts.bench_concurrency_serve.pin_placement`: fewer GPU experts
    always fit); a split fixed by the config, one too small for the arms, or files recorded on
    different splits are refused. Returns the split now in ``cfg`` (None: none fixed)."""
    experts = cfg.setdefault("experts", {})
    now = experts.get("cpu_experts_per_layer")
    recorded: dict[str, int] = {}
    for path in replays:
        if not path.is_file():
            continue
        split = json.loads(path.read_text()).get("recorded_with", {}).get("cpu_experts_per_layer")
        # (a file without a split, where the config has none either: nothing to compare)
        if split is None and now is not None:
            print(f"{path}: no recorded split; its continuations are plain decoding's only "
                  f"if it was recorded with {now} CPU experts a layer", flush=True)
        elif split is not None:
            recorded[path.name] = int(split)
    if not recorded or set(recorded.values()) == {now}:
        return now
    if len(set(recorded.values())) > 1:
        raise SystemExit(f"replay files recorded on different splits (CPU experts a layer): "
                         f"{recorded}; record them again in one call")
    split = next(iter(recorded.values()))
    if needed is None or split < needed:
        raise SystemExit(
            f"the replay files were recorded with {split} CPU experts a layer, and these runs "
            + (f"need at least {needed} (the arms' memory plans)" if needed is not None else
               f"have {now} (fixed by the config)" if now is not None else
               "have no split (no GPU budget)")
            + ": tokens would not be plain decoding's; delete the replay files to record "
            "them again with these arms, or set experts.cpu_experts_per_layer to "
            f"{split}")
    experts["cpu_experts_per_layer"] = split
    print(f"the replay files' split: {split} CPU experts a layer (the arms need {needed})",
          flush=True)
    return split
