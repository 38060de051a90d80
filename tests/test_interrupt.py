"""Interrupting a running turn (issue 3; seed 002; DESIGN §3): cancellation
tree, grace period, hard abort, honest append-only history. Real dev server,
real processes, real HTTP."""

from __future__ import annotations

import asyncio
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import psutil
import pytest
from temporalio import activity
from temporalio import client as client_interceptors
from temporalio import worker as worker_interceptors
from temporalio.client import Client
from temporalio.contrib.workflow_streams import WorkflowStreamClient
from temporalio.worker import Replayer

from stopline.activities.ledger import LedgerStore
from stopline.activities.tools.shell import shell_id_for
from stopline.core import policies
from stopline.core.contracts import (
    EVENTS_TOPIC,
    LEDGER_FLUSH_ACTIVITY,
    InterruptResult,
    LedgerRow,
    TaskEvent,
    TaskStatus,
)
from stopline.testing.scripted import anthropic_message, entry, scenario
from stopline.testing.workers import running_workers
from stopline.workflows.agent_task import AgentTask
from stopline.testing.processes import group_alive
from tests.conftest import start_task

# "unconfined": these tests follow each command by the pid it prints ($$),
# which a sandbox renumbers; tests/test_sandbox.py covers interrupts in it
pytestmark = pytest.mark.usefixtures("worker", "unconfined")

GRACE_S = 0.1
#: Slack over the grace a test allows (the benchmark measures the real p95).
SLACK_S = 1.5


async def _wait_for(path: Path, timeout: float = 20.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return path.read_text().strip()
        await asyncio.sleep(0.02)
    raise AssertionError(f"{path} never appeared")


async def _wait_state(handle: Any, state: str, timeout: float = 20.0) -> TaskStatus:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = await handle.query("status", result_type=TaskStatus)
        if st.state == state:
            return st
        await asyncio.sleep(0.05)
    raise AssertionError(f"task never reached {state}")




async def _interrupt(handle: Any) -> tuple[InterruptResult, float]:
    t0 = time.monotonic()
    res = await handle.execute_update("interrupt", result_type=InterruptResult)
    return res, time.monotonic() - t0


def _rows(home: Path, task_id: str) -> list[LedgerRow]:
    return LedgerStore(home / "ledger").read(task_id)


TOOLS = {
    "honours_term": "echo $$ > pid; exec sleep 100",
    "ignores_term": "echo $$ > pid; trap '' TERM; while true; do sleep 0.05; done",
    "trap_behind_child": "echo $$ > pid; trap 'echo cleaned > trap_ran; exit 0' TERM; sleep 100",
}


@pytest.mark.parametrize("kind", list(TOOLS))
async def test_interrupt_a_long_tool_leaves_no_process(
    client: Client, task_queue: str, scripted: Any, workspace: Path, stopline_home: Path, kind: str
) -> None:
    server = scripted(scenario(
        "anthropic",
        entry(anthropic_message("working", tool_calls=[("c1", "shell", {"command": TOOLS[kind]})])),
    ))
    handle = await start_task(client, task_queue, server, workspace, interrupt_grace_s=GRACE_S)
    pgid = int(await _wait_for(workspace / "pid"))
    await asyncio.sleep(0.2)
    res, took = await _interrupt(handle)
    assert res.interrupted and res.aborted_calls == ["c1"] and res.kept_calls == []
    assert took <= GRACE_S + SLACK_S, took
    # the process group is gone by the time the Update returns
    assert group_alive(pgid) == []
    if kind == "trap_behind_child":
        assert (workspace / "trap_ran").read_text().strip() == "cleaned"
    rows = _rows(stopline_home, handle.id)
    receipt = next(r for r in rows if r.kind == "tool_result" and r.call_id == "c1")
    assert receipt.text.startswith("aborted by user after") and receipt.meta.get("aborted")
    assert rows[-1].kind == "turn_aborted" and "Background shells" in rows[-1].text
    st = await handle.query("status", result_type=TaskStatus)
    assert st.state == "waiting"
    await handle.terminate()


async def test_finished_call_keeps_its_result_unfinished_one_is_aborted(
    client: Client, task_queue: str, scripted: Any, workspace: Path, stopline_home: Path
) -> None:
    server = scripted(scenario(
        "anthropic",
        entry(anthropic_message(tool_calls=[
            ("fast", "shell", {"command": "echo fast-done > fast.txt; echo fast-done"}),
            ("slow", "shell", {"command": "echo $$ > pid; sleep 100"}),
        ])),
    ))
    handle = await start_task(client, task_queue, server, workspace)
    await _wait_for(workspace / "pid")
    await _wait_for(workspace / "fast.txt")
    await asyncio.sleep(0.3)
    res, _ = await _interrupt(handle)
    assert res.kept_calls == ["fast"] and res.aborted_calls == ["slow"]
    rows = _rows(stopline_home, handle.id)
    results = {r.call_id: r for r in rows if r.kind == "tool_result"}
    assert "fast-done" in results["fast"].text and "exit code 0" in results["fast"].text
    assert results["slow"].text.startswith("aborted by user")
    kinds = [r.kind for r in rows]
    # real results, then receipts, then exactly one marker, last
    assert kinds[-1] == "turn_aborted" and kinds.count("turn_aborted") == 1
    assert [r.call_id for r in rows if r.kind == "tool_result"] == ["fast", "slow"]
    await handle.terminate()


async def test_interrupt_during_sampling_drops_it_and_closes_the_connection(
    client: Client, task_queue: str, scripted: Any, workspace: Path, stopline_home: Path
) -> None:
    server = scripted(scenario(
        "anthropic",
        entry(anthropic_message("this must never be stored"), delay_s=30),
    ))
    handle = await start_task(client, task_queue, server, workspace)
    while server.request_count() < 1:
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.2)
    res, took = await _interrupt(handle)
    assert res.interrupted and took <= GRACE_S + SLACK_S
    rows = _rows(stopline_home, handle.id)
    assert [r.kind for r in rows] == ["prompt", "turn_aborted"]
    assert not any("never be stored" in (r.text or "") for r in rows)
    deadline = time.monotonic() + 5
    while not server.requests()[0]["disconnected"] and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert server.requests()[0]["disconnected"] is True
    await handle.terminate()


async def test_tool_timeout_does_not_cancel_siblings_or_turn(
    client: Client, task_queue: str, scripted: Any, workspace: Path, stopline_home: Path
) -> None:
    server = scripted(scenario(
        "anthropic",
        entry(anthropic_message(tool_calls=[
            ("t", "shell", {"command": "sleep 30", "timeout_s": 0.3}),
            ("s", "shell", {"command": "sleep 1.2; echo sibling-finished"}),
        ])),
        entry(anthropic_message("both reported")),
    ))
    handle = await start_task(client, task_queue, server, workspace)
    result = await handle.result()
    assert result.status == "completed" and result.final_text == "both reported"
    results = {r.call_id: r for r in _rows(stopline_home, handle.id) if r.kind == "tool_result"}
    assert "timed out" in results["t"].text
    assert "sibling-finished" in results["s"].text


async def test_background_shell_survives_interrupt_and_shell_kill_ends_it(
    client: Client, task_queue: str, scripted: Any, workspace: Path, stopline_home: Path
) -> None:
    task_id = f"bg-{uuid.uuid4().hex[:8]}"
    sid = shell_id_for(task_id, "bg")  # stable per (task, call): a scenario can name it
    server = scripted(scenario(
        "anthropic",
        entry(anthropic_message(tool_calls=[
            ("bg", "shell", {"command": "echo $$ > bgpid; exec sleep 300", "background": True}),
        ])),
        entry(anthropic_message(tool_calls=[("fg", "shell", {"command": "echo $$ > pid; sleep 100"})])),
        entry(anthropic_message(tool_calls=[("k", "shell_kill", {"shell_id": sid})])),
        entry(anthropic_message("killed it")),
    ))
    handle = await start_task(client, task_queue, server, workspace, task_id=task_id)
    bg_pid = int(await _wait_for(workspace / "bgpid"))
    await _wait_for(workspace / "pid")
    await asyncio.sleep(0.2)
    res, _ = await _interrupt(handle)
    assert res.aborted_calls == ["fg"]
    assert psutil.pid_exists(bg_pid) and psutil.Process(bg_pid).status() != psutil.STATUS_ZOMBIE
    await handle.execute_update("message", "now stop the server")
    result = await handle.result()
    assert result.status == "completed"
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and group_alive(bg_pid):
        await asyncio.sleep(0.05)
    assert group_alive(bg_pid) == []


async def test_watcher_finds_marker_on_disk_when_event_arrives(
    client: Client, task_queue: str, scripted: Any, workspace: Path, stopline_home: Path
) -> None:
    server = scripted(scenario(
        "anthropic",
        entry(anthropic_message(tool_calls=[("c1", "shell", {"command": "echo $$ > pid; sleep 100"})])),
    ))
    handle = await start_task(client, task_queue, server, workspace)
    ledger_path = LedgerStore(stopline_home / "ledger").path(handle.id)
    seen: list[tuple[str, bool]] = []

    async def watch() -> None:
        stream = WorkflowStreamClient.create(client, handle.id)
        async for item in stream.topic(EVENTS_TOPIC, type=TaskEvent).subscribe(
            poll_cooldown=timedelta(milliseconds=10)
        ):
            if item.data.kind == "turn_aborted":
                text = ledger_path.read_text()  # re-read the file the moment the event lands
                seen.append(("turn_aborted", '"kind":"turn_aborted"' in text))
                return

    watcher = asyncio.create_task(watch())
    await _wait_for(workspace / "pid")
    await _interrupt(handle)
    await asyncio.wait_for(watcher, 20)
    assert seen == [("turn_aborted", True)]
    await handle.terminate()


async def test_message_after_interrupt_sends_all_three_and_is_valid(
    client: Client, task_queue: str, scripted: Any, workspace: Path, stopline_home: Path
) -> None:
    server = scripted(scenario(
        "anthropic",
        entry(anthropic_message("two things", tool_calls=[
            ("done1", "shell", {"command": "echo real-output"}),
            ("cut1", "shell", {"command": "echo $$ > pid; sleep 100"}),
        ])),
        entry(anthropic_message("understood; stopping here")),
    ))
    handle = await start_task(client, task_queue, server, workspace)
    await _wait_for(workspace / "pid")
    await asyncio.sleep(0.5)
    await _interrupt(handle)
    await handle.execute_update("message", "leave it, just summarize")
    result = await handle.result()
    assert result.status == "completed" and server.request_count() == 2
    body = server.requests()[1]["body"]
    last_user = body["messages"][-1]
    blocks = last_user["content"]
    results = {b["tool_use_id"]: b for b in blocks if b["type"] == "tool_result"}
    texts = [b["text"] for b in blocks if b["type"] == "text"]
    assert "real-output" in str(results["done1"]["content"])
    assert str(results["cut1"]["content"]).startswith("aborted by user")
    assert any("<turn_aborted>" in t for t in texts) and texts[-1] == "leave it, just summarize"
    # the same transcript passes the validator the activity runs before sampling
    rows = _rows(stopline_home, handle.id)
    upto = [r for r in rows if r.kind != "assistant" or r.text != "understood; stopping here"]
    policies.validate_conversation(policies.rows_to_messages(upto))
    # every tool call has exactly one result in what the provider received
    assistant = body["messages"][-2]
    call_ids = [b["id"] for b in assistant["content"] if b["type"] == "tool_use"]
    assert sorted(call_ids) == sorted(results)


async def test_interrupt_is_idempotent(
    client: Client, task_queue: str, scripted: Any, workspace: Path, stopline_home: Path
) -> None:
    server = scripted(scenario(
        "anthropic",
        entry(anthropic_message(tool_calls=[("c1", "shell", {"command": "echo $$ > pid; sleep 100"})])),
    ))
    handle = await start_task(client, task_queue, server, workspace)
    await _wait_for(workspace / "pid")
    pid = int((workspace / "pid").read_text())
    rows_seen: list[list[str]] = []

    async def interrupt_and_look() -> InterruptResult:
        res, _ = await _interrupt(handle)
        # each caller returns only once the abort is done: marker in the file, group gone
        rows_seen.append([r.kind for r in _rows(stopline_home, handle.id)])
        assert not group_alive(pid)
        return res

    first, second = await asyncio.gather(interrupt_and_look(), interrupt_and_look())
    by_this, joined = (first, second) if first.interrupted else (second, first)
    assert by_this.interrupted and not by_this.joined
    # the other one waited for that abort and reports it; it added nothing
    assert joined.joined and not joined.interrupted
    assert joined.aborted_calls == by_this.aborted_calls == ["c1"]
    assert joined.last_seq == by_this.last_seq
    assert all(kinds[-1] == "turn_aborted" for kinds in rows_seen), rows_seen
    await _wait_state(handle, "waiting")
    again, took = await _interrupt(handle)  # no turn running: returns at once, adds nothing
    assert again.interrupted is False and took < 2.0
    rows = _rows(stopline_home, handle.id)
    assert [r.kind for r in rows].count("turn_aborted") == 1
    await handle.terminate()


async def test_stop_after_an_interrupt_adds_only_the_stop(
    client: Client, task_queue: str, scripted: Any, workspace: Path, stopline_home: Path
) -> None:
    """An interrupted turn's calls have their one result each: a ``task_stop``
    of the waiting task (or ``stopline down``) adds the stop row, not a
    second receipt and marker (seed 002)."""
    server = scripted(scenario(
        "anthropic",
        entry(anthropic_message(tool_calls=[("c1", "shell", {"command": "echo $$ > pid; sleep 100"})])),
    ))
    handle = await start_task(client, task_queue, server, workspace, interrupt_grace_s=GRACE_S)
    await _wait_for(workspace / "pid")
    res, _ = await _interrupt(handle)
    assert res.interrupted and res.aborted_calls == ["c1"]
    await _wait_state(handle, "waiting")
    await handle.cancel(reason="stopline stop")
    result = await handle.result()
    assert result.status == "stopped"
    kinds = [r.kind for r in _rows(stopline_home, handle.id)]
    assert kinds.count("tool_result") == 1 and kinds.count("turn_aborted") == 1, kinds
    assert kinds[-1] == "system"
    history = await handle.fetch_history()
    replayer = Replayer(workflows=[AgentTask], data_converter=client.data_converter)
    assert (await replayer.replay_workflow(history)).replay_failure is None


class _SlowAbortFlush(client_interceptors.Interceptor, worker_interceptors.Interceptor):
    """Holds the abort's flush (the one that kills calls) for a while: the
    window in which a ``task_stop`` may arrive mid-abort."""

    def intercept_activity(
        self, next: worker_interceptors.ActivityInboundInterceptor
    ) -> worker_interceptors.ActivityInboundInterceptor:
        class Slow(worker_interceptors.ActivityInboundInterceptor):
            async def execute_activity(self, input: worker_interceptors.ExecuteActivityInput) -> Any:
                if activity.info().activity_type == LEDGER_FLUSH_ACTIVITY and input.args[0].kill_calls:
                    await asyncio.sleep(2.0)
                return await super().execute_activity(input)

        return Slow(next)


async def test_a_stop_during_an_interrupts_flush_aborts_nothing_twice(
    client: Client, scripted: Any, workspace: Path, stopline_home: Path
) -> None:
    """Interrupt and stop racing (two CLIs): the stop lands while the
    interrupt's abort flushes. One receipt and one marker; the interrupt is
    answered; the task ends stopped (seed 002)."""
    from stopline.settings import load_settings
    from stopline.worker.runtime import build_workers

    slow = Client(**{**client.config(), "interceptors": [_SlowAbortFlush()]})
    queue = f"race-{uuid.uuid4().hex[:8]}"
    async with running_workers(build_workers(slow, load_settings(), task_queue=queue)):
        server = scripted(scenario("anthropic", entry(anthropic_message(
            tool_calls=[("c1", "shell", {"command": "echo $$ > pid; sleep 100"})]))))
        handle = await start_task(client, queue, server, workspace, interrupt_grace_s=GRACE_S)
        await _wait_for(workspace / "pid")
        interrupt = asyncio.create_task(handle.execute_update("interrupt", result_type=InterruptResult))
        await asyncio.sleep(1.0)  # the abort has decided its rows and is flushing
        await handle.cancel(reason="stopline stop")
        result = await asyncio.wait_for(handle.result(), 30)
        answered = await asyncio.wait_for(interrupt, 30)
    assert result.status == "stopped"
    assert answered.interrupted and answered.aborted_calls == ["c1"], answered
    kinds = [r.kind for r in _rows(stopline_home, handle.id)]
    assert kinds.count("tool_result") == 1 and kinds.count("turn_aborted") == 1, kinds


async def test_interrupted_history_replays_deterministically(
    client: Client, task_queue: str, scripted: Any, workspace: Path
) -> None:
    server = scripted(scenario(
        "anthropic",
        entry(anthropic_message(tool_calls=[
            ("a", "shell", {"command": "echo quick"}),
            ("b", "shell", {"command": "echo $$ > pid; sleep 100"}),
        ])),
        entry(anthropic_message("ok, stopped")),
    ))
    handle = await start_task(client, task_queue, server, workspace)
    await _wait_for(workspace / "pid")
    await asyncio.sleep(0.3)
    await _interrupt(handle)
    await handle.execute_update("message", "fine")
    assert (await handle.result()).status == "completed"
    history = await handle.fetch_history()
    replayer = Replayer(workflows=[AgentTask], data_converter=client.data_converter)
    result = await replayer.replay_workflow(history)
    assert result.replay_failure is None
    assert server.request_count() == 2  # replay called no provider




@pytest.mark.parametrize(("round_tools", "heartbeat_timeout_s", "bound_s"), [
    (False, 60.0, 3.0),
    # a call its round's sampling activity runs: only that activity names
    # it, so the abort gives it one heartbeat interval (a third of the
    # timeout) and a margin to answer Temporal's cancel
    (True, 6.0, 6.0 / 3 + 2.0 + 1.0),
], ids=["tool-activity", "round-tools"])
async def test_a_tool_that_never_answers_the_cancel_is_abandoned_after_the_grace(
    client: Client, scripted: Any, workspace: Path, stopline_home: Path,
    monkeypatch: pytest.MonkeyPatch, round_tools: bool, heartbeat_timeout_s: float, bound_s: float,
) -> None:
    """The irreversible step: a worker the cancel cannot reach in time (no
    push path, heartbeats throttled to 30 s) still gets the turn aborted —
    the workflow stops waiting at its bound (the grace timer for a tool
    activity), the flush kills the group."""
    from stopline.settings import load_settings
    from stopline.worker.runtime import build_workers

    monkeypatch.setenv("STOPLINE_HEARTBEAT_THROTTLE_S", "30")
    monkeypatch.setenv("STOPLINE_PUSH_CANCEL", "0")
    queue = f"slow-{uuid.uuid4().hex[:8]}"
    workers = build_workers(client, load_settings(), task_queue=queue)
    async with running_workers(workers):
        server = scripted(scenario(
            "anthropic",
            entry(anthropic_message(tool_calls=[("c1", "shell", {"command": "echo $$ > pid; exec sleep 100"})])),
        ))
        handle = await start_task(client, queue, server, workspace, heartbeat_timeout_s=heartbeat_timeout_s,
                                  round_tools=round_tools)
        pgid = int(await _wait_for(workspace / "pid"))
        await asyncio.sleep(0.3)
        res, took = await _interrupt(handle)
        assert res.interrupted and res.aborted_calls == ["c1"]
        assert took < bound_s, took  # the bound (sub-second timers fire after ~1 s), not the tool
        assert group_alive(pgid) == []
        rows = _rows(stopline_home, handle.id)
        assert rows[-1].kind == "turn_aborted"
        assert next(r for r in rows if r.call_id == "c1").text.startswith("aborted by user")
        await handle.terminate()
