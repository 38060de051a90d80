"""Interrupts by push, heartbeats for liveness only (DESIGN §3).

The push path: the abort schedules ``stopline.cancel_calls`` on the calls'
host queue and the worker cancels them in process — no heartbeat needed.
The fallback: with the push path off, Temporal's heartbeat-borne cancel and
the grace timer still abort the turn, later but cleanly. And the heartbeat
rate at the defaults, counted from the worker's own Temporal metrics, stays
within its bound. Real dev server, real processes, real HTTP.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client
from temporalio.runtime import MetricBuffer, Runtime, TelemetryConfig
from temporalio.worker import Worker

from stopline.activities.ledger import LedgerStore
from stopline.core.contracts import (
    CANCEL_CALLS_ACTIVITY,
    LEDGER_FLUSH_ACTIVITY,
    TOOL_ACTIVITY,
    AgentTaskResult,
    CancelCallsResult,
    InterruptResult,
    LedgerFlushInput,
    LedgerRow,
)
from stopline.settings import Settings, load_settings
from stopline.testing.scripted import anthropic_message, entry, scenario
from stopline.testing.workers import running_workers, wait_until
from stopline.worker.runtime import build_workers, connect
from stopline.testing.processes import group_alive
from tests.conftest import start_task

GRACE_S = 0.1
#: The defaults under test (a change to them should be a deliberate one).
DEFAULT_THROTTLE_S = Settings.model_fields["heartbeat_throttle_s"].default


def _workers(client: Client, queue: str, **overrides: Any) -> AbstractAsyncContextManager[list[Worker]]:
    """In-process workers for ``queue`` with settings overrides; shut down after."""
    return running_workers(build_workers(client, load_settings(**overrides), task_queue=queue))


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except OSError:
        return None




def _rows(home: Path, task_id: str) -> list[LedgerRow]:
    return LedgerStore(home / "ledger").read(task_id)


def _name(e: Any) -> str:
    return EventType.Name(e.event_type).removeprefix("EVENT_TYPE_")


def _scheduled(events: list[Any], activity_type: str) -> list[Any]:
    return [
        e for e in events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
        and e.activity_task_scheduled_event_attributes.activity_type.name == activity_type
    ]


def _closed(events: list[Any], scheduled: Any) -> Any | None:
    """The event that closed the activity scheduled by ``scheduled``, if any."""
    for e in events:
        for attr in (
            "activity_task_completed_event_attributes", "activity_task_failed_event_attributes",
            "activity_task_canceled_event_attributes", "activity_task_timed_out_event_attributes",
        ):
            if e.HasField(attr) and getattr(e, attr).scheduled_event_id == scheduled.event_id:
                return e
    return None


def _pushed(client: Client, events: list[Any]) -> CancelCallsResult:
    """What the one ``stopline.cancel_calls`` of the history found (it completed)."""
    [push] = _scheduled(events, CANCEL_CALLS_ACTIVITY)
    closed = _closed(events, push)
    assert closed is not None and closed.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED
    payload = closed.activity_task_completed_event_attributes.result.payloads[0]
    return client.data_converter.payload_converter.from_payload(payload, CancelCallsResult)


def _index(events: list[Any], event: Any) -> int:
    return next(i for i, e in enumerate(events) if e.event_id == event.event_id)


def _call_activity(round_tools: bool) -> str:
    """The activity running a round-1 tool call: its sampling activity when
    it runs the round's calls (DESIGN §1), else the call's own."""
    return "stopline.sample" if round_tools else TOOL_ACTIVITY


def _pushed_keys(round_tools: bool) -> list[str]:
    """What the push of an abort during round 1's call ``c1`` cancels."""
    return ["sample:1"] if round_tools else ["call:c1"]


# ------------------------------------------------------------------ push path


@pytest.mark.usefixtures("worker")
@pytest.mark.parametrize("round_tools", [True, False], ids=["round-tools", "tool-activity"])
async def test_the_abort_runs_in_the_seed_order_and_the_cancel_is_pushed(
    client: Client, task_queue: str, scripted: Any, workspace: Path, stopline_home: Path, round_tools: bool
) -> None:
    """Signal (push + Temporal cancel in one workflow task), grace (the tool
    answers), the irreversible step (the flush kills what did not finish),
    marker, fsync, and only then the Update returns — read from the history.
    The tool answered by push: no heartbeat was due (5 s) and the grace
    timer was cancelled, not fired."""
    server = scripted(scenario(
        "anthropic",
        entry(anthropic_message(tool_calls=[("c1", "shell", {"command": "echo $$ > pid; exec sleep 100"})])),
    ))
    handle = await start_task(client, task_queue, server, workspace, interrupt_grace_s=GRACE_S,
                              round_tools=round_tools)
    pgid = int(await wait_until(lambda: _read(workspace / "pid"), what="the tool's pid"))
    await asyncio.sleep(0.2)
    res = await handle.execute_update("interrupt", result_type=InterruptResult)
    assert res.interrupted and res.aborted_calls == ["c1"]
    assert group_alive(pgid) == []
    rows = _rows(stopline_home, handle.id)
    assert rows[-1].kind == "turn_aborted"
    # the receipt is the tool's own aborted result (it answered the push)
    receipt = next(r for r in rows if r.kind == "tool_result" and r.call_id == "c1")
    assert "Output so far" in (receipt.text or "") and receipt.meta.get("aborted")

    events = list((await handle.fetch_history()).events)
    accepted = next(e for e in events if e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED)
    [push] = _scheduled(events, CANCEL_CALLS_ACTIVITY)
    [tool] = _scheduled(events, _call_activity(round_tools))
    cancels = [e for e in events if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_CANCEL_REQUESTED]
    flushes = _scheduled(events, LEDGER_FLUSH_ACTIVITY)
    completed = next(e for e in events if e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_COMPLETED)
    assert len(flushes) == 1
    flush = flushes[0]
    if round_tools:
        # 1. signal: the push alone — a sampling activity running its round's
        # calls gets Temporal's cancel only if the push does not answer
        assert cancels == []
    else:
        # 1. signal: push and Temporal cancel issued by the same workflow task
        (cancel_requested,) = cancels
        assert push.activity_task_scheduled_event_attributes.workflow_task_completed_event_id == (
            cancel_requested.activity_task_cancel_requested_event_attributes.workflow_task_completed_event_id
        )
    assert _index(events, accepted) < _index(events, push)
    assert _pushed(client, events).cancelled == _pushed_keys(round_tools)
    # 2. grace: the tool answered before the hard abort; the timer never fired
    tool_closed = _closed(events, tool)
    assert tool_closed is not None and tool_closed.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED
    assert _index(events, push) < _index(events, tool_closed) < _index(events, flush)
    assert not any(e.event_type == EventType.EVENT_TYPE_TIMER_FIRED for e in events)
    # 3.+4. irreversible step, marker, fsync: one flush with the kill list,
    # the receipt then the marker; the Update returns after it completed
    attrs = flush.activity_task_scheduled_event_attributes
    flush_in = client.data_converter.payload_converter.from_payload(attrs.input.payloads[0], LedgerFlushInput)
    assert flush_in.kill_calls == ["c1"]
    assert [r.kind for r in flush_in.rows][-2:] == ["tool_result", "turn_aborted"]
    flush_closed = _closed(events, flush)
    assert flush_closed is not None
    assert _index(events, flush_closed) < _index(events, completed)
    await handle.terminate()


@pytest.mark.usefixtures("worker")
async def test_a_term_ignoring_tool_is_termed_then_killed_after_the_grace(
    client: Client, task_queue: str, scripted: Any, workspace: Path, stopline_home: Path
) -> None:
    """SIGTERM first (the trap records it), SIGKILL no sooner than the grace
    after it (the tool's ticks go on until then), the group gone at return."""
    grace = 0.3
    command = (
        "echo $$ > pid; trap 'date +%s.%N > term_at' TERM; "
        "while true; do date +%s.%N >> ticks; sleep 0.01; done"
    )
    server = scripted(scenario(
        "anthropic", entry(anthropic_message(tool_calls=[("c1", "shell", {"command": command})])),
    ))
    handle = await start_task(client, task_queue, server, workspace, interrupt_grace_s=grace)
    pgid = int(await wait_until(lambda: _read(workspace / "pid"), what="the tool's pid"))
    await wait_until(lambda: _read(workspace / "ticks"), what="the first tick")
    res = await handle.execute_update("interrupt", result_type=InterruptResult)
    assert res.aborted_calls == ["c1"]
    assert group_alive(pgid) == []
    term_at = float(_read(workspace / "term_at") or "nan")
    # the last complete tick (the KILL may cut a write short)
    ticks = (workspace / "ticks").read_text().splitlines()
    last_tick = max(float(t) for t in ticks if t.count(".") == 1 and len(t) > 15)
    # ticks every ~10 ms: the last one lands within a tick of the KILL
    assert last_tick - term_at >= grace - 0.05, (term_at, last_tick)
    rows = _rows(stopline_home, handle.id)
    assert rows[-1].kind == "turn_aborted"
    await handle.terminate()


@pytest.mark.usefixtures("worker")
async def test_a_dropped_sampling_call_counts_and_the_task_goes_on(
    client: Client, task_queue: str, scripted: Any, workspace: Path, stopline_home: Path
) -> None:
    """An interrupt during sampling drops the request by push (the server
    sees the client hang up), the dropped call counts as a provider call,
    and the task continues cleanly after a message."""
    server = scripted(scenario(
        "anthropic",
        entry(anthropic_message("never stored"), delay_s=30),
        entry(anthropic_message("fine, done")),
    ))
    handle = await start_task(client, task_queue, server, workspace)
    await wait_until(lambda: server.request_count() >= 1, what="the sampling request")
    await asyncio.sleep(0.2)
    res = await handle.execute_update("interrupt", result_type=InterruptResult)
    assert res.interrupted
    # dropped by push, not by a heartbeat (none is due for 5 s)
    await wait_until(lambda: server.requests()[0]["disconnected"], timeout_s=3.0, what="the hang-up")
    await handle.execute_update("message", "just finish")
    result = await handle.result()
    assert result.status == "completed" and result.final_text == "fine, done"
    assert result.provider_calls == 2
    kinds = [r.kind for r in _rows(stopline_home, handle.id)]
    assert kinds[:3] == ["prompt", "turn_aborted", "user_message"]
    events = list((await handle.fetch_history()).events)
    assert _pushed(client, events).cancelled == ["sample:1"]
    [push] = _scheduled(events, CANCEL_CALLS_ACTIVITY)
    [sampled, *_] = _scheduled(events, "stopline.sample")
    # pushed to the queue of the host that ran the call
    assert push.activity_task_scheduled_event_attributes.task_queue.name == (
        sampled.activity_task_scheduled_event_attributes.task_queue.name
    )


@pytest.mark.usefixtures("worker")
@pytest.mark.parametrize("round_tools", [True, False], ids=["round-tools", "tool-activity"])
async def test_task_stop_reaches_the_running_call_by_push(
    client: Client, task_queue: str, scripted: Any, workspace: Path, stopline_home: Path, round_tools: bool
) -> None:
    """``task_stop`` (workflow cancel) aborts the turn in flight the same
    way: the cancel is pushed to the call's host, the group is gone, the
    call gets its receipt and the task stops."""
    server = scripted(scenario(
        "anthropic",
        entry(anthropic_message(tool_calls=[("c1", "shell", {"command": "echo $$ > pid; exec sleep 100"})])),
    ))
    handle = await start_task(client, task_queue, server, workspace, interrupt_grace_s=GRACE_S,
                              round_tools=round_tools)
    pgid = int(await wait_until(lambda: _read(workspace / "pid"), what="the tool's pid"))
    await asyncio.sleep(0.2)
    await handle.cancel()
    result: AgentTaskResult = await handle.result()
    assert result.status == "stopped" and result.reason.startswith("cancelled by a workflow cancel request")
    assert group_alive(pgid) == []
    receipt = next(r for r in _rows(stopline_home, handle.id) if r.kind == "tool_result" and r.call_id == "c1")
    assert receipt.meta.get("aborted") and "Output so far" in (receipt.text or "")
    events = list((await handle.fetch_history()).events)
    assert _pushed(client, events).cancelled == _pushed_keys(round_tools)


@pytest.mark.usefixtures("worker")
@pytest.mark.parametrize("round_tools", [True, False], ids=["round-tools", "tool-activity"])
async def test_an_interrupt_and_a_stop_together_record_the_round_once(
    client: Client, task_queue: str, scripted: Any, workspace: Path, stopline_home: Path, round_tools: bool
) -> None:
    """An interrupt and a ``task_stop`` landing in the same moment: the stop
    cuts the interrupt's abort short, and aborts what is in flight itself —
    the model's message, the call's one receipt and the marker are recorded,
    and the request counts (the round's calls once ran unrecorded)."""
    sleeping = entry(anthropic_message("sleeping", tool_calls=[("c1", "shell", {"command": "echo $$ > pid; exec sleep 100"})]))
    for _ in range(3):  # the two must land together: several tries, each asserted
        handle = await start_task(client, task_queue, scripted(scenario("anthropic", sleeping)), workspace,
                                  interrupt_grace_s=GRACE_S, round_tools=round_tools)
        pgid = int(await wait_until(lambda: _read(workspace / "pid"), what="the tool's pid"))
        await asyncio.gather(handle.cancel(), handle.execute_update("interrupt", result_type=InterruptResult),
                             return_exceptions=True)
        result: AgentTaskResult = await handle.result()
        assert result.status == "stopped", result
        assert result.provider_calls == 1, result
        assert group_alive(pgid) == []
        rows = _rows(stopline_home, handle.id)
        kinds = [r.kind for r in rows]
        assert kinds.count("assistant") == 1, kinds
        receipts = [r for r in rows if r.kind == "tool_result" and r.call_id == "c1"]
        assert len(receipts) == 1 and receipts[0].meta.get("aborted"), receipts
        assert kinds.count("turn_aborted") == 1, kinds
        (workspace / "pid").unlink()


# ------------------------------------------------------------------ fallback


@pytest.mark.parametrize(("what", "round_tools"), [("tool", False), ("tool", True), ("sampling", True)])
async def test_with_the_push_path_broken_the_temporal_cancel_still_aborts_cleanly(
    client: Client, scripted: Any, workspace: Path, stopline_home: Path, what: str, round_tools: bool
) -> None:
    """The worker serves no ``stopline.cancel_calls`` (push off): the control
    activity fails, and Temporal's cancel reaches the call on its next
    heartbeat — later, but the call ends (a tool activity: the grace timer
    and the flush's SIGKILL end it at once; a call its sampling activity
    runs: the abort waits for that activity's answer, which names the call;
    a sampling call: the cancel drops it), nothing is left running, the
    task goes on."""
    queue = f"nopush-{uuid.uuid4().hex[:8]}"
    async with _workers(client, queue, push_cancel=False):
        if what == "tool":
            first = entry(anthropic_message(tool_calls=[
                ("q", "shell", {"command": "echo quick"}),
                ("c1", "shell", {"command": "echo $$ > pid; exec sleep 100"}),
            ]))
        else:
            first = entry(anthropic_message("never stored"), delay_s=60)
        server = scripted(scenario("anthropic", first, entry(anthropic_message("ok, stopped"))))
        handle = await start_task(client, queue, server, workspace, interrupt_grace_s=GRACE_S,
                                  round_tools=round_tools)
        pgid = None
        if what == "tool":
            pgid = int(await wait_until(lambda: _read(workspace / "pid"), what="the tool's pid"))
        else:
            await wait_until(lambda: server.request_count() >= 1, what="the sampling request")
        await asyncio.sleep(0.2)
        res = await handle.execute_update("interrupt", result_type=InterruptResult)
        assert res.interrupted
        if pgid is not None:
            # the quick call had finished: its real result is kept, also when
            # only its round's sampling activity could say so
            assert res.aborted_calls == ["c1"] and res.kept_calls == ["q"], res
            quick = next(r for r in _rows(stopline_home, handle.id) if r.call_id == "q")
            assert "quick" in (quick.text or "") and not quick.meta.get("aborted"), quick
            assert group_alive(pgid) == []  # the flush's SIGKILL
        assert _rows(stopline_home, handle.id)[-1].kind == "turn_aborted"

        # later: the heartbeat-borne cancel reaches the call and it ends
        bound = DEFAULT_THROTTLE_S + 10.0
        activity = _call_activity(round_tools) if what == "tool" else "stopline.sample"

        async def call_closed() -> bool:
            events = list((await handle.fetch_history()).events)
            return _closed(events, _scheduled(events, activity)[0]) is not None

        deadline = time.monotonic() + bound
        while not await call_closed():
            assert time.monotonic() < deadline, f"the {what} activity never ended"
            await asyncio.sleep(0.2)
        if what == "sampling":
            assert server.requests()[0]["disconnected"] is True
        events = list((await handle.fetch_history()).events)
        [push] = _scheduled(events, CANCEL_CALLS_ACTIVITY)
        closed = _closed(events, push)
        assert closed is not None and closed.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_FAILED

        await handle.execute_update("message", "leave it")
        result: AgentTaskResult = await handle.result()
        assert result.status == "completed" and result.final_text == "ok, stopped"


# ---------------------------------------------------------------- heartbeats


async def test_heartbeat_rate_at_the_defaults_is_within_its_bound(
    temporal_env: Any, scripted: Any, workspace: Path, stopline_home: Path
) -> None:
    """Count ``RecordActivityTaskHeartbeat`` RPCs from the worker's own
    Temporal metrics over a running tool call: at most one per
    ``heartbeat_throttle_s`` (plus one at the window's edge) per running
    activity — the call and the task's host session (DESIGN §7) — and at
    least one, so liveness is still proven."""
    buffer = MetricBuffer(100_000)
    runtime = Runtime(telemetry=TelemetryConfig(metrics=buffer))
    address = temporal_env.client.service_client.config.target_host
    settings = load_settings()
    assert settings.heartbeat_throttle_s == DEFAULT_THROTTLE_S
    client = await connect(settings, address=address, runtime=runtime)
    queue = f"hb-{uuid.uuid4().hex[:8]}"
    run_s = 7.0

    def heartbeats() -> int:
        return int(sum(
            u.value for u in buffer.retrieve_updates()
            if u.metric.name == "temporal_request"
            and u.attributes.get("operation") == "RecordActivityTaskHeartbeat"
        ))

    async with _workers(client, queue):
        server = scripted(scenario(
            "anthropic",
            entry(anthropic_message(tool_calls=[("c1", "shell", {"command": f"touch started; sleep {run_s}"})])),
            entry(anthropic_message("done")),
        ))
        handle = await start_task(client, queue, server, workspace)  # default limits
        await wait_until(lambda: (workspace / "started").exists(), what="the tool")
        heartbeats()  # drain what came before the call
        t0 = time.monotonic()
        result = await handle.result()
        window = time.monotonic() - t0
        count = heartbeats()
    assert result.status == "completed"
    running = 2  # the tool call and the task's host session
    bound = running * (window / DEFAULT_THROTTLE_S + 1)
    assert 1 <= count <= bound, f"{count} heartbeat RPCs in {window:.1f}s (bound {bound:.1f})"
