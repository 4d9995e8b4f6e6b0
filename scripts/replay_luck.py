"""How the replay proposer's draws fall for fixed draft lengths, offline (no model, no server).

The replay proposer (daemon/proposers/replay.py) draws each verify's accepted length from its
request and position, so a fixed-length arm decoding a replay file meets the same draws in
every run: its tokens per verify can sit a few percent above or below the profile's rate
for the whole benchmark. This walks each record's continuation as a fixed arm decodes it (from its
second token, the first being the prompt pass's: a verify of min(k, tokens left - 1) drafts
at each position it reaches, the draw deciding how
many are accepted) and gives, per seed and k, the tokens the draws give over those the rate
makes expected of the same verifies (``luck``; scripts/bench_concurrency_serve.py's
``acceptance_luck`` measures the same from a run's step trace, for any arm)::

    python -m scripts.replay_luck REPLAY.json --drafts 1,2,3,4 --seeds 0-7
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from daemon.proposers.replay import ReplayProposer, expected_accepted, prompt_key
from scripts.bench_common import emit_json


def fixed_luck(records: list[dict], rate: float, k: int, seed: int) -> dict:
    """A fixed arm of ``k`` drafts over ``records`` (a replay file's): its verifies, the
    tokens the draws give, those the rate makes expected, their ratio."""
    draws = ReplayProposer({}, rate, "mtp", seed)
    verifies, got, expected = 0, 0, 0.0
    for r in records:
        # token 0 comes from the prompt's last pass; each decode step then samples token g
        # and verifies the drafts after it
        key, n, g = prompt_key(r["prompt_ids"]), len(r["continuation"]), 1
        while g < n:
            room = min(k, n - g - 1)
            a = draws.draw(key, g, room) if room > 0 else 0
            verifies += room > 0
            got += 1 + a
            expected += 1 + expected_accepted(rate, max(room, 0))
            g += 1 + a
    return {"verifies": verifies, "tokens": got, "expected_tokens": round(expected, 3),
            "luck": round(got / expected, 5)}


def _seeds(text: str) -> list[int]:
    lo, _, hi = text.partition("-")
    return list(range(int(lo), int(hi) + 1)) if hi else [int(x) for x in text.split(",")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("replay", type=Path)
    p.add_argument("--drafts", default="1,2,3,4")
    p.add_argument("--seeds", default=None, help="e.g. 0-7 or 0,3 (default: the file's)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    data = json.loads(args.replay.read_text())
    rate = ReplayProposer.load(args.replay).p
    seeds = _seeds(args.seeds) if args.seeds else [int(data.get("seed", 0))]
    out = {"replay": str(args.replay), "rate": rate, "file_seed": int(data.get("seed", 0)),
           "by_seed": {str(s): {f"k={k}": fixed_luck(data["records"], rate, int(k), s)
                                for k in args.drafts.split(",")} for s in seeds}}
    emit_json(out, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
