"""How a request picks its tokens: one frozen type for the daemon, the wire and the worker."""

from __future__ import annotations

import math
from dataclasses import dataclass

from protocol.fields import check

MAX_SEED = 2**63 - 1
MAX_TOP_K = 2**31 - 1  # past any vocabulary; an unbounded int could not be sent to the worker
# penalty -> its "off" value; any other value is refused by both APIs (not implemented yet)
PENALTIES_OFF = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    """How a request picks its tokens: the one type of the daemon, the wire and the worker
    (gpu_worker/sampling.py applies it)."""

    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    seed: int | None = None  # None: the daemon picks one (a StepPlan always carries one)
    repetition_penalty: float = 1.0  # 1 = off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def __post_init__(self) -> None:
        fin = math.isfinite
        check(fin(self.temperature) and self.temperature >= 0, "temperature must be >= 0")
        check(fin(self.top_p) and 0 < self.top_p <= 1, "top_p must be in (0, 1]")
        check(0 <= self.top_k <= MAX_TOP_K, f"top_k must be in [0, {MAX_TOP_K}] (0 = off)")
        check(fin(self.min_p) and 0 <= self.min_p <= 1, "min_p must be in [0, 1]")
        check(self.seed is None or 0 <= self.seed <= MAX_SEED, "seed must be in [0, 2**63)")
        check(fin(self.repetition_penalty) and self.repetition_penalty > 0,
              "repetition_penalty must be > 0")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            check(fin(v) and -2 <= v <= 2, f"{name} must be in [-2, 2]")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    def unsupported(self) -> str | None:
        """The first penalty set to anything but off, or None: the daemon refuses such a
        request with :func:`penalty_error` on HTTP and ZeroMQ alike."""
        for name, off in PENALTIES_OFF.items():
            if getattr(self, name) != off:
                return name
        return None


def penalty_error(name: str) -> str:
    """The one message for a penalty that is set (both APIs send it)."""
    return f"{name} is not implemented yet: leave it out or send {PENALTIES_OFF[name]:g}"


@dataclass(slots=True, kw_only=True)
class SamplingDefaults:
    """The model's sampling defaults (generation_config.json): what a request that leaves a
    value out gets on HTTP; None: the neutral SamplingParams default."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "top_k", "min_p"):
            v = getattr(self, name)
            kinds = (int,) if name == "top_k" else (int, float)
            check(v is None or (isinstance(v, kinds) and not isinstance(v, bool)),
                  f"{name} must be a{'n integer' if name == 'top_k' else ' number'}, got {v!r}")

    def as_dict(self) -> dict[str, float]:
        """The values that are set, by name."""
        return {name: getattr(self, name) for name in ("temperature", "top_p", "top_k", "min_p")
                if getattr(self, name) is not None}
