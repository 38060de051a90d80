"""A provider refusal is the task's outcome (issue 4; seed 000; DESIGN §4).

Real dev server; two scripted servers standing for two providers, with
request counts ("first provider hit once, second never")."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import psutil
import pytest
from temporalio.client import Client
from temporalio.contrib.workflow_streams import WorkflowStreamClient
from temporalio.worker import Replayer

from stopline.activities.ledger import LedgerStore
from stopline.activities.providers.registry import WIRE_TO_PROVIDER
from stopline.activities.tasks import TaskNotContinuable, send_task_message
from stopline.core.contracts import (
    EVENTS_TOPIC,
    AgentTaskInput,
    AgentTaskResult,
    ChatThreadInput,
    LedgerRow,
    ModelCandidate,
    TaskEvent,
    TaskLimits,
    TaskStatus,
)
from stopline.core.refusal import NOT_CONTINUABLE, NOT_FORWARDED, QUARANTINE_PLACEHOLDER
from stopline.testing.scripted import anthropic_message, entry, scenario
from stopline.testing.workers import running_workers
from stopline.workflows.agent_task import AgentTask
from stopline.workflows.chat_thread import ChatThread, TurnOutcome

TRIGGER = "TRIGGER-7731-exploit-payload"


def _refusal(text: str = "", **extra: Any) -> dict:
    return entry(anthropic_message(text, stop_reason="refusal", **extra))


def _model(server: Any) -> str:
    return f"{WIRE_TO_PROVIDER[server.wire]}:scripted"


async def _start(
    client: Client, task_queue: str, server: Any, workspace: Path, *, task_id: str | None = None,
    prompt: str = "do it", **fields: Any,
) -> Any:
    inp = AgentTaskInput(
        prompt=prompt, model=_model(server), base_url=server.url, workspace=str(workspace),
        **fields,
    )
    return await client.start_workflow(
        "AgentTask", inp, id=task_id or f"task-{uuid.uuid4().hex[:10]}", task_queue=task_queue,
        result_type=AgentTaskResult,
    )


async def _events(client: Client, wf_id: str) -> list[TaskEvent]:
    """Every event a (closed) workflow published."""
    out: list[TaskEvent] = []
    stream = WorkflowStreamClient.create(client, wf_id)

    async def read() -> None:
        async for item in stream.topic(EVENTS_TOPIC, type=TaskEvent).subscribe(
            poll_cooldown=timedelta(milliseconds=20)
        ):
            out.append(item.data)
            if item.data.kind == "task_finished":
                return

    await asyncio.wait_for(read(), 20)
    return out


def _rows(home: Path, task_id: str) -> list[LedgerRow]:
    return LedgerStore(home / "ledger").read(task_id)


@pytest.mark.usefixtures("worker")
@pytest.mark.parametrize(("route", "scope"), [("subagent", "worker"), ("chat", "worker")])
async def test_task_stops_on_first_refusal_without_quarantine(
    client: Client, task_queue: str, scripted: Any, workspace: Path, stopline_home: Path,
    route: str, scope: str,
) -> None:
    first = scripted(scenario("anthropic", _refusal(stop_details={"category": "cyber"}), ))
    second = scripted(scenario("anthropic", entry(anthropic_message("I would have helped"))))
    handle = await _start(
        client, task_queue, first, workspace, route=route, execution_scope=scope,
        candidates=[ModelCandidate(model=_model(second), base_url=second.url)],
    )
    result = await handle.result()
    assert result.status == "stopped" and result.refused is True
    assert result.refusal is not None and result.refusal.category == "cyber"
    assert first.request_count() == 1 and second.request_count() == 0
    events = await _events(client, handle.id)
    assert not any(e.kind == "fallback" for e in events)
    kinds = [r.kind for r in _rows(stopline_home, handle.id)]
    assert "quarantine" not in kinds and kinds.count("provider-refusal-stop") == 1
    st = await handle.query("status", result_type=TaskStatus)
    assert st.refusal is not None and st.refusal.provider == "anthropic" and st.refusal.round == 1
    assert st.note == NOT_CONTINUABLE and st.stop_reason and "refused" in st.stop_reason


@pytest.mark.usefixtures("worker")
async def test_chat_stops_when_quarantine_is_exhausted_and_next_message_is_still_refused(
    client: Client, task_queue: str, scripted: Any, workspace: Path, stopline_home: Path
) -> None:
    first = scripted(scenario("anthropic", _refusal(), _refusal(), _refusal(), _refusal(), _refusal()))
    second = scripted(scenario("anthropic", entry(anthropic_message("other model"))))
    thread_id = f"chat-{uuid.uuid4().hex[:8]}"
    inp = ChatThreadInput(
        model=_model(first), base_url=first.url, workspace=str(workspace),
        candidates=[ModelCandidate(model=_model(second), base_url=second.url)],
        limits=TaskLimits(continue_as_new_after_events=1),  # continue-as-new after every turn
    )
    handle = await client.start_workflow("ChatThread", inp, id=thread_id, task_queue=task_queue)
    await handle.execute_update("increment", args=["inbox", f"inbox summary: {TRIGGER}"])
    outcome = await handle.execute_update("ask", "what's new?", result_type=TurnOutcome)
    assert outcome.status == "stopped" and outcome.refused
    assert first.request_count() == 4 and second.request_count() == 0
    # the increment was sent once, then withheld behind a neutral placeholder
    bodies = [json.dumps(r["body"]) for r in first.requests()]
    assert TRIGGER in bodies[0] and all(TRIGGER not in b for b in bodies[1:])
    assert all(QUARANTINE_PLACEHOLDER in b for b in bodies[1:])
    rows = _rows(stopline_home, thread_id)
    kinds = [r.kind for r in rows]
    assert kinds.count("quarantine") == 1 and kinds.count("notification") == 1
    note = next(r for r in rows if r.kind == "notification")
    assert note.meta["severity"] == "critical" and "switches the model" in note.text
    # the thread continued-as-new; the next ordinary message is still sent, and still refused
    await asyncio.sleep(0.5)
    again = await client.get_workflow_handle(thread_id).execute_update(
        "ask", "please continue", result_type=TurnOutcome
    )
    assert again.refused and first.request_count() == 5 and second.request_count() == 0
    st = await client.get_workflow_handle(thread_id).query("status", result_type=TaskStatus)
    assert st.refusal is not None  # carried over continue-as-new
    desc = await client.get_workflow_handle(thread_id).describe()
    assert desc.run_id != handle.result_run_id
    await client.get_workflow_handle(thread_id).signal("close")


@pytest.mark.usefixtures("worker")
async def test_fix_task_switches_candidate_after_refusal(
    client: Client, task_queue: str, scripted: Any, workspace: Path, stopline_home: Path
) -> None:
    first = scripted(scenario("anthropic", _refusal()))
    second = scripted(scenario("anthropic", entry(anthropic_message("fixed by the second model"))))
    handle = await _start(
        client, task_queue, first, workspace, usage_source="fix:ci-lint",
        candidates=[ModelCandidate(model=_model(second), base_url=second.url)],
    )
    result = await handle.result()
    assert result.status == "completed" and result.final_text == "fixed by the second model"
    assert first.request_count() == 1 and second.request_count() == 1
    events = await _events(client, handle.id)
    assert [e.kind for e in events].count("fallback") == 1
    # the refusal evidence stays in its own thread for the candidate loop to read
    assert any(r.kind == "refusal" for r in _rows(stopline_home, handle.id))


def _parent_scenario(child_model: str, child_url: str, *then: dict) -> dict:
    return scenario(
        "anthropic",
        entry(anthropic_message("delegating", tool_calls=[
            ("ts", "task_start", {"prompt": "look into it", "model": child_model, "base_url": child_url}),
        ])),
        *then,
    )


@pytest.mark.usefixtures("worker")
async def test_refused_task_settles_task_wait_once_as_stopped(
    client: Client, task_queue: str, scripted: Any, workspace: Path, stopline_home: Path
) -> None:
    child = scripted(scenario("anthropic", _refusal()))
    parent_id = f"parent-{uuid.uuid4().hex[:8]}"
    child_id = f"{parent_id}.sub1"
    parent = scripted(_parent_scenario(
        _model(child), child.url,
        entry(anthropic_message(tool_calls=[("tw", "task_wait", {"ids": [child_id], "timeout_s": 60})])),
        entry(anthropic_message("the sub-task was refused; I will start another")),
    ))
    handle = await _start(client, task_queue, parent, workspace, task_id=parent_id)
    result = await handle.result()
    assert result.status == "completed"
    rows = _rows(stopline_home, parent_id)
    results = [r for r in rows if r.kind == "task_result" and r.meta.get("task_id") == child_id]
    assert len(results) == 1
    assert results[0].meta["status"] == "stopped" and results[0].meta["refused"] is True
    assert results[0].meta["delivery"] == "cancelled"
    events = await _events(client, parent_id)
    assert [e.kind for e in events].count("task_wait_done") == 1
    assert [e.kind for e in events].count("task_result") == 1
    wait_result = next(r for r in rows if r.kind == "tool_result" and r.call_id == "tw")
    assert "stopped (refused)" in wait_result.text
    child_result = await client.get_workflow_handle(child_id, result_type=AgentTaskResult).result()
    assert child_result.status == "stopped" and child_result.refused


@pytest.mark.usefixtures("unconfined")  # follows the command by the pid it prints
@pytest.mark.usefixtures("worker")
@pytest.mark.parametrize("ending", ["refused", "completed"])
async def test_subagent_refusal_leaves_its_shell_running_completion_closes_it(
    client: Client, task_queue: str, scripted: Any, workspace: Path, ending: str
) -> None:
    last = _refusal() if ending == "refused" else entry(anthropic_message("done"))
    server = scripted(scenario(
        "anthropic",
        entry(anthropic_message(tool_calls=[
            ("bg", "shell", {"command": "echo $$ > bgpid; trap '' TERM; exec sleep 300",
                             "background": True}),
        ])),
        last,
    ))
    handle = await _start(client, task_queue, server, workspace, route="subagent")
    result = await handle.result()
    pid = int((workspace / "bgpid").read_text())
    try:
        if ending == "refused":
            assert result.refused and psutil.pid_exists(pid)
            assert psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        else:
            assert result.status == "completed"
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and psutil.pid_exists(pid) and \
                    psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                await asyncio.sleep(0.05)
            assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    finally:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.usefixtures("worker")
async def test_receipt_and_task_stop_evidence_carry_no_trigger(
    client: Client, task_queue: str, scripted: Any, workspace: Path, stopline_home: Path
) -> None:
    child = scripted(scenario(
        "anthropic",
        entry(anthropic_message("Collecting what was asked.", tool_calls=[
            ("c1", "shell", {"command": f"echo {TRIGGER} > loot.txt; echo {TRIGGER}"}),
        ])),
        _refusal("I started collecting the data."),
    ))
    parent_id = f"parent-{uuid.uuid4().hex[:8]}"
    child_id = f"{parent_id}.sub1"
    parent = scripted(_parent_scenario(
        _model(child), child.url,
        entry(anthropic_message(tool_calls=[("tw", "task_wait", {"ids": [child_id]})])),
        entry(anthropic_message(tool_calls=[("st", "task_stop", {"id": child_id}),
                                            ("ss", "task_status", {"id": child_id})])),
        entry(anthropic_message("noted")),
    ))
    handle = await _start(client, task_queue, parent, workspace, task_id=parent_id)
    assert (await handle.result()).status == "completed"
    parent_rows = _rows(stopline_home, parent_id)
    whole = json.dumps([r.model_dump(mode="json") for r in parent_rows])
    assert TRIGGER not in whole
    assert TRIGGER not in json.dumps(parent.requests())
    receipt = next(r for r in parent_rows if r.kind == "task_result")
    assert "I started collecting the data." in receipt.text and "round 2" in receipt.text
    assert "(last tool: shell)" in receipt.text and NOT_CONTINUABLE in receipt.text
    stop = json.loads(next(r for r in parent_rows if r.call_id == "st").text)
    assert stop["refused"] is True and stop["note"] == NOT_CONTINUABLE
    assert stop["evidence"]["last_tool"]["args_firstline"] == NOT_FORWARDED
    assert stop["evidence"]["changed_paths"] == []
    status = json.loads(next(r for r in parent_rows if r.call_id == "ss").text)
    assert status["refusal"]["round"] == 2 and status["note"] == NOT_CONTINUABLE
    # the trigger stays in the child's own ledger, not quarantined, for audit
    child_rows = _rows(stopline_home, child_id)
    assert any(TRIGGER in (r.text or "") for r in child_rows if r.kind == "tool_result")
    assert not any(r.kind == "quarantine" for r in child_rows)


@pytest.mark.usefixtures("worker")
@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
async def test_task_message_to_refused_task_fails_with_the_sentence(
    client: Client, task_queue: str, scripted: Any, workspace: Path, stopline_home: Path,
    sync: bool,
) -> None:
    child = scripted(scenario("anthropic", _refusal()))
    parent_id = f"parent-{uuid.uuid4().hex[:8]}"
    child_id = f"{parent_id}.sub1"
    parent = scripted(_parent_scenario(
        _model(child), child.url,
        entry(anthropic_message(tool_calls=[("tw", "task_wait", {"ids": [child_id]})])),
        entry(anthropic_message(tool_calls=[("tm", "task_message",
                                             {"id": child_id, "text": "go on", "wait": sync})])),
        entry(anthropic_message("ok")),
    ))
    handle = await _start(client, task_queue, parent, workspace, task_id=parent_id)
    assert (await handle.result()).status == "completed"
    tm = next(r for r in _rows(stopline_home, parent_id) if r.call_id == "tm")
    assert tm.ok is False and tm.text == NOT_CONTINUABLE
    # and from outside (the CLI's path), after the worker is gone:
    with pytest.raises(TaskNotContinuable, match="start a new task|task_start and another model"):
        await send_task_message(client, LedgerStore(stopline_home / "ledger"), child_id, "continue")
    assert child.request_count() == 1


async def test_task_message_after_a_worker_restart_fails_with_zero_model_calls(
    client: Client, task_queue: str, scripted: Any, workspace: Path, stopline_home: Path,
) -> None:
    from stopline.settings import load_settings
    from stopline.worker.runtime import build_workers

    server = scripted(scenario("anthropic", _refusal()))
    for phase in ("before", "after"):
        workers = build_workers(client, load_settings(), task_queue=task_queue)
        async with running_workers(workers):
            if phase == "before":
                handle = await _start(client, task_queue, server, workspace)
                assert (await handle.result()).refused
            else:
                with pytest.raises(TaskNotContinuable) as exc:
                    await send_task_message(
                        client, LedgerStore(stopline_home / "ledger"), handle.id, "continue please"
                    )
                assert str(exc.value) == NOT_CONTINUABLE
    assert server.request_count() == 1


@pytest.mark.usefixtures("worker")
async def test_refused_history_replays_without_calling_a_provider(
    client: Client, task_queue: str, scripted: Any, workspace: Path
) -> None:
    server = scripted(scenario(
        "anthropic",
        entry(anthropic_message(tool_calls=[("c1", "list_dir", {})])),
        _refusal("partial"),
    ))
    handle = await _start(client, task_queue, server, workspace)
    assert (await handle.result()).refused
    history = await handle.fetch_history()
    replayer = Replayer(workflows=[AgentTask, ChatThread], data_converter=client.data_converter)
    replay = await replayer.replay_workflow(history)
    assert replay.replay_failure is None
    assert server.request_count() == 2


@pytest.mark.usefixtures("worker")
async def test_reset_of_a_refused_task_makes_no_model_call(
    client: Client, task_queue: str, scripted: Any, workspace: Path, temporal_env: Any,
) -> None:
    from stopline.worker.runtime import temporal_binary

    server = scripted(scenario("anthropic", _refusal()))
    handle = await _start(client, task_queue, server, workspace)
    assert (await handle.result()).refused
    address = client.service_client.config.target_host
    reset = subprocess.run(
        [temporal_binary(), "workflow", "reset", "--address", address, "--workflow-id", handle.id,
         "--type", "FirstWorkflowTask", "--reason", "test reset of a refused task", "--yes"],
        capture_output=True, text=True, timeout=60,
    )
    assert reset.returncode == 0, reset.stderr + reset.stdout
    latest = client.get_workflow_handle(handle.id, result_type=AgentTaskResult)
    result = await asyncio.wait_for(latest.result(), 60)
    assert (await latest.describe()).run_id != handle.result_run_id
    assert result.status == "stopped" and result.refused and result.provider_calls == 0
    assert server.request_count() == 1


async def test_persisted_refusal_is_recovered_as_cancelled_after_worker_kill(
    client: Client, task_queue: str, scripted: Any, workspace: Path, stopline_home: Path,
) -> None:
    """Kill -9 the worker between the refusal row and the parent's settlement."""
    child = scripted(scenario("anthropic", _refusal()))
    parent_id = f"parent-{uuid.uuid4().hex[:8]}"
    child_id = f"{parent_id}.sub1"
    parent = scripted(_parent_scenario(
        _model(child), child.url,
        entry(anthropic_message(tool_calls=[("tw", "task_wait", {"ids": [child_id]})])),
        entry(anthropic_message("done")),
    ))
    env = {
        **os.environ,
        "TEMPORAL_ADDRESS": client.service_client.config.target_host,
        "STOPLINE_HOME": str(stopline_home),
        "STOPLINE_TASK_QUEUE": task_queue,
        "STOPLINE_HOST_TASK_QUEUE": task_queue,
        # a 1 s heartbeat timeout needs heartbeats well inside it (the SDK's
        # own spacing, 0.8 s, is too thin on a loaded machine)
        "STOPLINE_HEARTBEAT_THROTTLE_S": "0.25",
    }

    def spawn() -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, "-m", "stopline.worker.main"], env=env, start_new_session=True,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )

    procs = [spawn()]
    try:
        handle = await _start(client, task_queue, parent, workspace, task_id=parent_id,
                              limits=TaskLimits(heartbeat_timeout_s=1.0))
        child_ledger = LedgerStore(stopline_home / "ledger").path(child_id)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if child_ledger.exists() and b"provider-refusal-stop" in child_ledger.read_bytes():
                break
            await asyncio.sleep(0.005)
        else:
            raise AssertionError("child never wrote its refusal row")
        os.killpg(procs[0].pid, signal.SIGKILL)
        procs[0].wait()
        calls_at_kill = child.request_count()
        procs.append(spawn())
        result = await asyncio.wait_for(handle.result(), 90)
        assert result.status == "completed"
        assert child.request_count() == calls_at_kill == 1  # zero new model calls
        rows = _rows(stopline_home, parent_id)
        deliveries = [r for r in rows if r.kind == "task_result" and r.meta.get("task_id") == child_id]
        assert len(deliveries) == 1 and deliveries[0].meta["delivery"] == "cancelled"
        assert "restart" not in deliveries[0].text.lower()
        child_result = await client.get_workflow_handle(child_id, result_type=AgentTaskResult).result()
        assert child_result.status == "stopped" and child_result.refused
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


@pytest.mark.usefixtures("worker")
async def test_task_message_reaches_a_running_subtask_and_sync_waits_for_it(
    client: Client, task_queue: str, scripted: Any, workspace: Path, stopline_home: Path
) -> None:
    child = scripted(scenario(
        "anthropic",
        entry(anthropic_message(tool_calls=[("c1", "shell", {"command": "sleep 1.5"})])),
        entry(anthropic_message("child done, with the extra note")),
    ))
    parent_id = f"parent-{uuid.uuid4().hex[:8]}"
    child_id = f"{parent_id}.sub1"
    parent = scripted(_parent_scenario(
        _model(child), child.url,
        entry(anthropic_message(tool_calls=[("tm", "task_message",
                                             {"id": child_id, "text": "also note X", "wait": True})])),
        entry(anthropic_message("all good")),
    ))
    handle = await _start(client, task_queue, parent, workspace, task_id=parent_id)
    assert (await handle.result()).status == "completed"
    tm = next(r for r in _rows(stopline_home, parent_id) if r.call_id == "tm")
    assert tm.ok and "message delivered" in tm.text and f"{child_id}: completed" in tm.text
    child_rows = _rows(stopline_home, child_id)
    assert any(r.kind == "user_message" and r.text == "also note X" for r in child_rows)
    assert "also note X" in json.dumps(child.requests()[-1]["body"])


@pytest.mark.usefixtures("unconfined")  # follows the command by the pid it prints
@pytest.mark.usefixtures("worker")
async def test_task_stop_mid_tool_gives_every_call_one_result(
    client: Client, task_queue: str, scripted: Any, workspace: Path, stopline_home: Path
) -> None:
    server = scripted(scenario("anthropic", entry(anthropic_message(tool_calls=[
        ("fast", "shell", {"command": "echo done-fast"}),
        ("slow", "shell", {"command": "echo $$ > pid; sleep 100"}),
    ]))))
    handle = await _start(client, task_queue, server, workspace)
    deadline = time.monotonic() + 20
    while not (workspace / "pid").exists() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.3)
    pgid = int((workspace / "pid").read_text())
    await handle.cancel()
    result = await handle.result()
    assert result.status == "stopped" and result.reason.startswith("cancelled by a workflow cancel request")
    rows = _rows(stopline_home, handle.id)
    results = {r.call_id: r for r in rows if r.kind == "tool_result"}
    assert set(results) == {"fast", "slow"} and results["slow"].meta.get("aborted")
    assert rows[-2].kind == "turn_aborted"
    assert rows[-1].kind == "system" and rows[-1].meta["outcome"] == "stopped"
    assert not psutil.pid_exists(pgid) or psutil.Process(pgid).status() == psutil.STATUS_ZOMBIE


@pytest.mark.usefixtures("unconfined")  # follows the command by the pid it prints
@pytest.mark.usefixtures("worker")
async def test_stopping_a_chat_thread_is_a_recorded_ending(
    client: Client, task_queue: str, scripted: Any, workspace: Path, stopline_home: Path
) -> None:
    server = scripted(scenario("anthropic", entry(anthropic_message(tool_calls=[
        ("c1", "shell", {"command": "echo $$ > pid; sleep 100"}),
    ]))))
    thread_id = f"chat-{uuid.uuid4().hex[:8]}"
    handle = await client.start_workflow(
        "ChatThread",
        ChatThreadInput(model=_model(server), base_url=server.url, workspace=str(workspace)),
        id=thread_id, task_queue=task_queue, result_type=AgentTaskResult,
    )
    await handle.execute_update("message", "start something long")
    deadline = time.monotonic() + 20
    while not (workspace / "pid").exists() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    await handle.cancel()
    result = await handle.result()
    assert result.status == "stopped"
    rows = _rows(stopline_home, thread_id)
    assert next(r for r in rows if r.call_id == "c1").meta.get("aborted")
    assert rows[-1].kind == "system" and rows[-1].meta["outcome"] == "stopped"


@pytest.mark.usefixtures("worker")
async def test_the_refusal_path_runs_in_the_seed_order_with_one_stop_model(
    client: Client, task_queue: str, scripted: Any, workspace: Path, stopline_home: Path,
) -> None:
    """Record → disposition → persist the stop row → end (seed 000): the
    ledger holds, in this order and nothing between, the hidden ``refusal``
    verdict, the assistant's own accepted text, the ``provider-refusal-stop``
    row and the task's end; the stop row's meta, the result's refusal and the
    status query's refusal are one and the same ``RefusalStop``."""
    from stopline.core.contracts import RefusalStop

    server = scripted(scenario("anthropic",
        entry(anthropic_message(tool_calls=[("c1", "list_dir", {})])),
        _refusal("I will stop here.", stop_details={"type": "refusal", "category": "cyber"})))
    handle = await _start(client, task_queue, server, workspace)
    result = await handle.result()

    rows = LedgerStore(stopline_home / "ledger").read(handle.id)
    kinds = [r.kind for r in rows]
    at = kinds.index("refusal")
    assert kinds[at:] == ["refusal", "assistant", "provider-refusal-stop", "system"], kinds
    assert rows[at + 1].text == "I will stop here." and rows[at + 1].model_visible
    assert not rows[at].model_visible and not rows[at + 2].model_visible
    stop = RefusalStop.model_validate(rows[at + 2].meta)
    assert stop == result.refusal == RefusalStop(provider="anthropic", category="cyber", round=2,
                                                 tool="list_dir")
    assert (await handle.query("status", result_type=TaskStatus)).refusal == stop
    assert result.status == "stopped" and result.refused and rows[-1].meta["outcome"] == "stopped"
    events = [e.kind for e in await _events(client, handle.id)]
    assert events.index("refusal") < events.index("task_finished")
