"""The registry of running calls (stopline.activities.running), on a real
event loop: what a pushed cancel reaches, and that a call gets it once."""

from __future__ import annotations

import asyncio

import pytest

from stopline.activities.running import RunningCalls, call_key


async def _sleeper(started: asyncio.Event, log: list[str]) -> str:
    started.set()
    try:
        await asyncio.sleep(30)
    except asyncio.CancelledError:
        log.append("cancelled")
        return "aborted"
    return "finished"


async def test_a_pushed_cancel_reaches_the_unit_once_and_its_result_comes_back() -> None:
    calls = RunningCalls()
    started, log = asyncio.Event(), []
    run = asyncio.create_task(calls.run("t1", call_key("c1"), _sleeper(started, log)))
    await started.wait()
    assert calls.running() == [("t1", "call:c1")]
    assert calls.cancel("t1", [call_key("c1")], reason="interrupt") == ["call:c1"]
    assert calls.cancel("t1", [call_key("c1")], reason="again") == ["call:c1"]  # still ending: no second cancel
    assert await run == "aborted" and log == ["cancelled"]
    assert calls.running() == []


async def test_the_callers_cancel_and_the_push_are_delivered_once_together() -> None:
    calls = RunningCalls()
    started, log = asyncio.Event(), []
    run = asyncio.create_task(calls.run("t1", "k", _sleeper(started, log)))
    await started.wait()
    run.cancel()  # Temporal's activity cancel reaches the caller
    await asyncio.sleep(0)
    calls.cancel("t1", ["k"], reason="push")
    assert await run == "aborted"
    assert log == ["cancelled"]


async def test_a_cancel_only_touches_its_task_and_keys() -> None:
    calls = RunningCalls()
    ev = [asyncio.Event() for _ in range(3)]
    logs: list[list[str]] = [[], [], []]
    runs = [
        asyncio.create_task(calls.run("t1", "a", _sleeper(ev[0], logs[0]))),
        asyncio.create_task(calls.run("t1", "b", _sleeper(ev[1], logs[1]))),
        asyncio.create_task(calls.run("t2", "a", _sleeper(ev[2], logs[2]))),
    ]
    for e in ev:
        await e.wait()
    assert calls.cancel("t1", ["a"], reason="x") == ["a"]
    assert await runs[0] == "aborted"
    assert logs[1] == [] and logs[2] == []
    assert calls.cancel("t1", None, reason="stop") == ["b"]  # every unit of t1
    assert await runs[1] == "aborted" and logs[2] == []
    assert await calls.wait("t1", timeout_s=1.0) is True
    assert await calls.wait("t2", ["a"], timeout_s=0.05) is False
    calls.cancel("t2", None, reason="cleanup")
    assert await runs[2] == "aborted"


async def test_a_push_that_overtakes_the_call_is_delivered_when_it_registers() -> None:
    calls = RunningCalls()
    assert calls.cancel("t1", ["late"], reason="interrupt") == []
    ran: list[str] = []

    async def work() -> str:
        ran.append("ran")
        return "done"

    with pytest.raises(asyncio.CancelledError):
        await calls.run("t1", "late", work())
    assert ran == []  # cancelled before its first step
    # remembered once: a later unit under the same key runs normally
    assert await calls.run("t1", "late", work()) == "done"


async def test_an_expired_tombstone_cancels_nothing() -> None:
    calls = RunningCalls(tombstone_ttl_s=0.0)
    calls.cancel("t1", ["k"], reason="interrupt")

    async def work() -> str:
        return "done"

    assert await calls.run("t1", "k", work()) == "done"


async def test_register_the_current_task_for_a_block() -> None:
    calls = RunningCalls()
    with pytest.raises(asyncio.CancelledError):
        with calls.register("t1", "session") as unit:
            calls.cancel("t1", ["session"], reason="release")
            assert unit.cancelled and unit.cancel_reason == "release"
            await asyncio.sleep(1)
    me = asyncio.current_task()
    assert me is not None
    me.uncancel()  # this test's own task was the unit
    assert calls.running() == [] and unit.ended.is_set()


async def test_a_cancel_that_finds_the_work_done_reaches_the_keys_next_unit() -> None:
    """A round's sampling finished just as its cancel arrived: the cancel is
    remembered for the key, so the round's tool calls (registered under it
    next, DESIGN §1) are cancelled before they start."""
    calls = RunningCalls()
    done = asyncio.Event()

    async def sampled() -> str:
        done.set()
        return "response"

    async def cancel_when_done(key: str = "sample:1") -> list[str]:
        await done.wait()
        return calls.cancel("t1", [key], reason="interrupt")

    canceller = asyncio.ensure_future(cancel_when_done())
    assert await calls.run("t1", "sample:1", sampled(), pass_on_late_cancel=True) == "response"
    assert await canceller == ["sample:1"]  # it found the unit, its work already done
    with calls.register("t1", "sample:1", asyncio.ensure_future(asyncio.sleep(0))) as unit:
        assert unit.cancelled and unit.cancel_reason == "interrupt"
    # by default (a tool call's key: a model may name a later call the same)
    # a late cancel is not passed on
    done.clear()
    canceller = asyncio.ensure_future(cancel_when_done("call:c1"))
    assert await calls.run("t1", "call:c1", sampled()) == "response"
    assert await canceller == ["call:c1"]
    with calls.register("t1", "call:c1", asyncio.ensure_future(asyncio.sleep(0))) as unit:
        assert not unit.cancelled
