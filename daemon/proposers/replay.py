"""Replay drafts, for benchmarks only: the plain run's true continuation, cut by a profile.

A random (synthetic) model's drafts are never accepted, so a benchmark of speculation on it
would only measure misses. The replay proposer stands in for a real proposer: it knows the
continuation that plain decoding (``mode = "off"``, same prompts and seeds) produced for each
prompt, and proposes it with an acceptance length drawn from an *acceptance profile* measured
on the embedded model (docs/bench/acceptance_profile.json: per workload and source, a
per-token acceptance rate ``p``). A draft the draw says should stop after ``a`` tokens has
its token ``a`` changed (to a neighbouring id), so the verifier rejects it there. Drafts are
verified by sample-and-match as usual, so the emitted tokens are plain decoding's whatever
the draws; the arms only see realistic accept lengths.

The replay file (``[speculation] replay_file``) is JSON::

    {"workload": "coding", "source": "mtp" | "suffix", "seed": 0,
     "profile": "docs/bench/acceptance_profile.json" | {profile inline},
     "recorded_with": {"cpu_experts_per_layer": 467},   (optional: the plain run's split)
     "records": [{"prompt_ids": [...], "continuation": [...]}, ...]}

A request whose prompt has no record, or whose generated tokens left the recorded
continuation (a plain run that sampled differently), gets no drafts; ``stats`` counts both.

The records come from a plain run of the same workload: ``[speculation] record_file`` makes
the scheduler append one JSON line per finished request (``ReplayRecorder``:
``{"prompt_ids": [...], "continuation": [...], "finish_reason": "length"}``), whatever the
mode, and ``write_replay_file`` turns such a file into a replay file
(scripts/bench_concurrency.py does both).
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import TYPE_CHECKING

from protocol.messages import DraftSource

if TYPE_CHECKING:
    from daemon.config_sections import SpeculationSection
    from daemon.sequence import Sequence

SOURCES = {"mtp": DraftSource.MTP, "suffix": DraftSource.SUFFIX}
CHECK_TAIL = 16  # generated tokens compared with the record at each proposal


def prompt_key(prompt_ids: list[int]) -> str:
    """A prompt's record key: sha1 of its token ids (little-endian u32)."""
    return hashlib.sha1(b"".join(int(t).to_bytes(4, "little") for t in prompt_ids)).hexdigest()


def rate_for_mean(mean: float, k: int) -> float:
    """The per-token acceptance rate ``p`` whose expected accepted count over ``k`` drafts,
    sum_{j=1..k} p**j, is ``mean`` (bisection; mean is clipped to [0, k])."""
    mean = min(max(mean, 0.0), float(k))
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(mid ** j for j in range(1, k + 1)) < mean:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def expected_accepted(p: float, k: int) -> float:
    """Mean accepted drafts of ``k`` when each is accepted with ``p`` given the previous."""
    return sum(p ** j for j in range(1, k + 1))


def profile_rate(profile: dict, workload: str, source: str) -> float:
    """``p`` of a workload and source in an acceptance profile (KeyError names what lacks)."""
    try:
        return float(profile["workloads"][workload][source]["p"])
    except KeyError as exc:
        raise KeyError(f"acceptance profile has no {workload}/{source} entry") from exc


class ReplayProposer:
    """Replay drafts for every request of one server (one workload, one source)."""

    def __init__(self, records: dict[str, list[int]], p: float, source: str = "mtp",
                 seed: int = 0) -> None:
        if source not in SOURCES:
            raise ValueError(f"replay source must be one of {sorted(SOURCES)}, got {source!r}")
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"acceptance rate must be in [0, 1], got {p}")
        self.records, self.p, self.source_name = records, p, source
        self.source = SOURCES[source]
        self.seed = seed
        self.stats = {"proposals": 0, "unknown_prompt": 0, "diverged": 0, "cut": 0}

    @classmethod
    def load(cls, path: Path) -> ReplayProposer:
        """From a replay file (module docstring); a profile path is relative to the file's
        directory or the working directory."""
        data = json.loads(Path(path).read_text())
        profile = data["profile"]
        if isinstance(profile, str):
            candidates = [Path(path).parent / profile, Path(profile)]
            found = next((c for c in candidates if c.is_file()), candidates[-1])
            profile = json.loads(found.read_text())
        source = data.get("source", "mtp")
        records = {prompt_key(r["prompt_ids"]): [int(t) for t in r["continuation"]]
                   for r in data["records"]}
        return cls(records, profile_rate(profile, data["workload"], source), source,
                   int(data.get("seed", 0)))

    def draw(self, key: str, position: int, k: int) -> int:
        """Accepted length in 0..k for the drafts after ``position`` (deterministic per
        request and position, so arms and repeats see the same draws)."""
        rng = random.Random(f"{self.seed}:{key}:{position}")
        a = 0
        while a < k and rng.random() < self.p:
            a += 1
        return a

    def propose(self, seq: Sequence, room: int) -> list[int]:
        """Up to ``room`` drafts for ``seq``'s next decode row."""
        if room <= 0:
            return []
        key = prompt_key(seq.prompt)
        record = self.records.get(key)
        if record is None:
            self.stats["unknown_prompt"] += 1
            return []
        g = len(seq.generated)
        lo = max(0, g - CHECK_TAIL)
        if record[lo:g] != seq.generated[lo:g]:
            self.stats["diverged"] += 1
            return []
        # the decode row samples generated[g]; its drafts guess generated[g], g+1, ...
        drafts = list(record[g:g + room])
        if not drafts:
            return []
        self.stats["proposals"] += 1
        a = self.draw(key, g, len(drafts))
        if a < len(drafts):  # the profile says the draft misses here: make it wrong
            drafts[a] = drafts[a] - 1 if drafts[a] > 0 else drafts[a] + 1
            self.stats["cut"] += 1  # (the rows after it stay: a real proposer's would)
        return drafts


class ReplayRecorder:
    """Appends each finished request's prompt ids and generated ids to a JSON-lines file
    (benchmarks only: ``[speculation] record_file``). A line is written and closed at once,
    so a server stopped after its requests finished has written them all."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    @classmethod
    def of(cls, spec: SpeculationSection | None) -> ReplayRecorder | None:
        """The recorder a config asks for (None: no ``record_file``), in any mode."""
        path = getattr(spec, "record_file", None)
        return cls(path) if path is not None else None

    def add(self, seq: Sequence) -> None:
        line = json.dumps({"prompt_ids": [int(t) for t in seq.prompt],
                           "continuation": [int(t) for t in seq.generated],
                           "finish_reason": seq.finished}, separators=(",", ":"))
        with self.path.open("a") as f:
            f.write(line + "\n")


def read_records(path: Path) -> list[dict]:
    """The records a ``ReplayRecorder`` wrote, in order (a torn last line is skipped)."""
    out = []
    for line in Path(path).read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def write_replay_file(path: Path, records: list[dict], *, workload: str, source: str,
                      profile: str | dict, seed: int = 0,
                      recorded_with: dict | None = None) -> dict[str, int]:
    """A replay file (module docstring) of recorded requests; a prompt recorded twice keeps
    its longest continuation; ``recorded_with``: what the plain run's tokens depend on beyond
    the prompts (the benchmark's split of experts). Returns ``{"records", "prompt_tokens",
    "continuation_tokens"}``."""
    if source not in SOURCES:
        raise ValueError(f"replay source must be one of {sorted(SOURCES)}, got {source!r}")
    best: dict[str, dict] = {}
    for r in records:
        key = prompt_key(r["prompt_ids"])
        if key not in best or len(r["continuation"]) > len(best[key]["continuation"]):
            best[key] = {"prompt_ids": r["prompt_ids"], "continuation": r["continuation"]}
    data = {"workload": workload, "source": source, "seed": seed, "profile": profile,
            **({"recorded_with": recorded_with} if recorded_with else {}),
            "records": list(best.values())}
    Path(path).write_text(json.dumps(data, separators=(",", ":")) + "\n")
    return {"records": len(best),
            "prompt_tokens": sum(len(r["prompt_ids"]) for r in best.values()),
            "continuation_tokens": sum(len(r["continuation"]) for r in best.values())}
