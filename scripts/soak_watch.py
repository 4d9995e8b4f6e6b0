"""What the soak reads of GET /v1/slots: the prompt-progress rules while it runs, and that no
slot or queue entry is left when the load is over."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import aiohttp


def violations(snap: dict) -> list[str]:
    """Breaches of the monitoring rules in one snapshot: a waiting request shown as anything
    but queued, a slot's request shown as queued, progress past its total."""
    out = []
    for q in snap.get("queued", []):
        if q["state"] != "queued" or q["prompt_tokens_per_s"] is not None:
            out.append(f"queued request {q['request_id']} shown as {q['state']}")
    for s in snap.get("slots", []):
        if s["request_id"] is None:
            continue
        if s["state"] not in ("prefilling", "decoding"):
            out.append(f"slot {s['slot']} shown as {s['state']}")
        if s["prompt_done"] > s["prompt_total"]:
            out.append(f"slot {s['slot']} prompt {s['prompt_done']}/{s['prompt_total']}")
        if s["state"] == "decoding" and s["prompt_tokens_per_s"] is not None:
            out.append(f"slot {s['slot']} decoding with a prompt rate")
    return out


class SlotWatch:
    """Polls /v1/slots; counts the states seen and the rule breaches."""

    def __init__(self, url: str, every: float = 0.2) -> None:
        self.url, self.every = url, every
        self.snapshots = 0
        self.seen: Counter = Counter()
        self.breaches: list[str] = []

    async def run(self) -> None:
        async with aiohttp.ClientSession() as session:
            while True:
                try:
                    async with session.get(self.url + "/v1/slots") as r:
                        snap = await r.json() if r.status == 200 else None
                except (aiohttp.ClientError, TimeoutError):
                    snap = None
                if snap is not None:
                    self.snapshots += 1
                    self.seen.update(s["state"] for s in snap["slots"] + snap["queued"])
                    self.breaches += violations(snap)
                await asyncio.sleep(self.every)

    def as_dict(self) -> dict:
        return {"snapshots": self.snapshots, "states_seen": dict(self.seen),
                "violations": len(self.breaches), "examples": self.breaches[:5]}


async def wait_idle(url: str, within: float) -> bool:
    """True once no slot holds a request and nothing waits (a leaked slot never empties)."""
    deadline = time.monotonic() + within
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            try:
                async with session.get(url + "/v1/slots") as r:
                    snap = await r.json() if r.status == 200 else None
            except (aiohttp.ClientError, TimeoutError):
                snap = None
            if snap and not snap["queued"] and snap["queue_depth"] == 0 and all(
                    s["request_id"] is None for s in snap["slots"]):
                return True
            await asyncio.sleep(0.1)
    return False
