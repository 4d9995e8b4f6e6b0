"""The scheduler driven against the real Runner in-process (no sockets), for tests."""

from __future__ import annotations

import asyncio

from protocol.codec import decode, encode


class InProcessWorker:
    """The real Runner behind the scheduler's ``async step(plan)`` interface; keeps every
    plan and result. Plans and results cross the wire codec as they do between processes
    (encoded, checked, decoded), so a field of the wrong type fails here, not only when a
    real worker sends it."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.plans, self.results = [], []

    async def step(self, plan):
        self.plans.append(plan)
        await asyncio.sleep(0)  # like a real worker, let the front ends run during a step
        result = decode(encode(self.runner.execute(decode(encode(plan)))))
        self.results.append(result)
        return result


async def drain(sched, handles) -> list[tuple[list[int], str | None]]:
    """Run the scheduler's step loop until every handle finished: (token ids, finish reason)
    per handle. A step loop that dies (a worker error) fails the call instead of hanging."""
    async def consume():
        out = []
        for h in handles:
            ids, finish = [], None
            async for ev in h:
                ids += ev.token_ids
                finish = ev.finish_reason
            out.append((ids, finish))
        return out

    loop, reader = asyncio.create_task(sched.run()), asyncio.create_task(consume())
    await asyncio.wait({loop, reader}, return_when=asyncio.FIRST_COMPLETED)
    if loop.done():
        reader.cancel()
        loop.result()
    loop.cancel()
    return reader.result()
