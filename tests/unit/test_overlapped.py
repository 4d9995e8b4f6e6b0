"""daemon.draft_plan.overlapped: the scheduler's wait for a step's result, with host work run
while the step is under way (the adaptive budget's, daemon/draft_adaptive.py)."""

from __future__ import annotations

import asyncio

import pytest
import structlog
import structlog.testing

from daemon.draft_plan import overlapped


def test_the_work_runs_after_the_plan_went_out_and_before_the_result():
    order: list[str] = []
    done = asyncio.Event()

    async def step() -> int:
        order.append("sent")  # the plan goes out in the step's first turn
        await done.wait()
        order.append("result")
        return 7

    def meanwhile() -> None:
        order.append("meanwhile")
        done.set()

    assert asyncio.run(overlapped(step(), meanwhile)) == 7
    assert order == ["sent", "meanwhile", "result"]


def test_an_error_of_the_work_is_logged_and_the_step_still_counts():
    async def step() -> str:
        await asyncio.sleep(0)
        return "ok"

    def meanwhile() -> None:
        raise RuntimeError("a bug between steps")

    with structlog.testing.capture_logs() as logs:
        assert asyncio.run(overlapped(step(), meanwhile)) == "ok"
    assert [e["event"] for e in logs] == ["work between steps failed"]
    assert logs[0]["log_level"] == "error"


def test_the_steps_own_error_is_raised():
    async def step() -> None:
        await asyncio.sleep(0)
        raise ConnectionError("worker gone")

    with pytest.raises(ConnectionError, match="worker gone"):
        asyncio.run(overlapped(step(), lambda: None))


def test_a_cancelled_wait_cancels_the_step():
    started, cancelled = asyncio.Event(), []

    async def step() -> None:
        started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def main() -> None:
        waiter = asyncio.ensure_future(overlapped(step(), lambda: None))
        await started.wait()
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter

    asyncio.run(main())
    assert cancelled == [True]
