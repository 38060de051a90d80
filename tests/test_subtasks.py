"""Sub-tasks: named ids, scripted sub-task models served on the host, and the
race between a parent's end and a child's completion (DESIGN §3: a parent's
end reaches every child). Real dev server, real HTTP, in-process workers."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from temporalio import workflow
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client
from temporalio.worker import (
    ExecuteWorkflowInput,
    Interceptor,
    WorkflowInboundInterceptor,
    WorkflowInterceptorClassInput,
)

from stopline.activities.ledger import LedgerStore
from stopline.core.contracts import AgentTaskResult, LedgerRow
from stopline.settings import load_settings
from stopline.testing.scripted import anthropic_message, entry, scenario
from stopline.worker.runtime import build_workers, task_result
from tests.conftest import start_task


def _rows(home: Path, task_id: str) -> list[LedgerRow]:
    return LedgerStore(home / "ledger").read(task_id)


async def _event_types(client: Client, workflow_id: str) -> list[int]:
    history = await client.get_workflow_handle(workflow_id).fetch_history()
    return [e.event_type for e in history.events]


@pytest.mark.usefixtures("worker")
async def test_named_subtask_with_a_scripted_model_from_the_workspace(
    client: Client, task_queue: str, scripted: Any, workspace: Path, stopline_home: Path
) -> None:
    """task_start(id=…, model="scripted:FILE"): the child's id is known in
    advance, its scenario is read from the workspace and served on the host."""
    (workspace / "child.json").write_text(json.dumps(scenario(
        "anthropic", entry(anthropic_message("the child read its own scenario")),
    )))
    parent_id = f"task-{uuid.uuid4().hex[:8]}"
    server = scripted(scenario(
        "anthropic",
        entry(anthropic_message(tool_calls=[("s1", "task_start", {
            "prompt": "help", "id": "helper", "model": "scripted:child.json"})])),
        entry(anthropic_message(tool_calls=[
            ("s2", "task_start", {"prompt": "again", "id": "helper"}),
            ("w1", "task_wait", {"ids": [f"{parent_id}.helper"]}),
        ])),
        entry(anthropic_message("parent done")),
    ))
    handle = await start_task(client, task_queue, server, workspace, task_id=parent_id)
    result = await asyncio.wait_for(handle.result(), 60)
    assert result.status == "completed", result.reason
    child = await client.get_workflow_handle(f"{parent_id}.helper", result_type=AgentTaskResult).result()
    assert child.status == "completed" and child.final_text == "the child read its own scenario"
    rows = _rows(stopline_home, parent_id)
    results = {r.call_id: r for r in rows if r.kind == "tool_result"}
    assert results["s1"].text.startswith(f"started task {parent_id}.helper")
    assert results["s2"].ok is False and "already exists" in results["s2"].text
    assert any(r.kind == "task_result" and f"id={parent_id}.helper" in (r.text or "") for r in rows)
    # the parent's own scripted server answered the parent only
    assert server.request_count() == 3


@pytest.mark.usefixtures("worker")
async def test_subtask_with_a_missing_scenario_fails_with_a_clear_reason(
    client: Client, task_queue: str, scripted: Any, workspace: Path
) -> None:
    parent_id = f"task-{uuid.uuid4().hex[:8]}"
    server = scripted(scenario(
        "anthropic",
        entry(anthropic_message(tool_calls=[("s1", "task_start", {
            "prompt": "help", "id": "nofile", "model": "scripted:missing.json"})])),
        entry(anthropic_message(tool_calls=[("w1", "task_wait", {"ids": [f"{parent_id}.nofile"]})])),
        entry(anthropic_message("parent done")),
    ))
    handle = await start_task(client, task_queue, server, workspace, task_id=parent_id)
    assert (await asyncio.wait_for(handle.result(), 60)).status == "completed"
    child = await task_result(client.get_workflow_handle(f"{parent_id}.nofile", result_type=AgentTaskResult))
    assert child.status == "failed"
    assert f"no scenario file {workspace / 'missing.json'} on this host" in child.reason


# ---------------------------------------------------------------------------
# The race: a child's completion arriving during the parent's last workflow task.
# ---------------------------------------------------------------------------


class _HoldParentsEnd(Interceptor):
    """Hold a chosen workflow's last workflow task open until a file appears.

    The workflow's code has returned (its completion command is about to be
    sent); the worker thread then blocks until the test has seen the child
    close, so the child's completion event lands in the parent's history
    while that workflow task is still running — the race, made certain.
    """

    def __init__(self, workflow_id: str, flag: Path) -> None:
        self.workflow_id = workflow_id
        self.flag = flag

    def workflow_interceptor_class(
        self, input: WorkflowInterceptorClassInput
    ) -> type[WorkflowInboundInterceptor]:
        target, flag = self.workflow_id, str(self.flag)

        class Inbound(WorkflowInboundInterceptor):
            async def execute_workflow(self, input: ExecuteWorkflowInput) -> Any:
                result = await super().execute_workflow(input)
                if workflow.info().workflow_id == target and not workflow.unsafe.is_replaying():
                    with workflow.unsafe.sandbox_unrestricted():
                        import os
                        import time as _time

                        deadline = _time.monotonic() + 20
                        while not os.path.exists(flag) and _time.monotonic() < deadline:
                            _time.sleep(0.02)
                return result

        return Inbound


async def test_a_parent_ending_as_its_child_completes_fails_no_workflow_task(
    client: Client, task_queue: str, scripted: Any, workspace: Path, stopline_home: Path,
    tmp_path: Path,
) -> None:
    """The parent ends its turn while its sub-task still runs; the child's
    completion arrives while the parent's last workflow task is held open.
    The parent's end must first stop the child and take its result, so the
    history holds no ``WorkflowTaskFailed`` and the task completes."""
    parent_id = f"task-{uuid.uuid4().hex[:8]}"
    child_id = f"{parent_id}.kid"
    (workspace / "kid.json").write_text(json.dumps(scenario(
        "anthropic", {**entry(anthropic_message("kid done")), "delay_s": 1.0},
    )))
    server = scripted(scenario(
        "anthropic",
        entry(anthropic_message(tool_calls=[("s1", "task_start", {
            "prompt": "work", "id": "kid", "model": "scripted:kid.json"})])),
        entry(anthropic_message("parent done without waiting")),
    ))
    flag = tmp_path / "child-closed"
    workers = build_workers(client, load_settings(), task_queue=task_queue, workflow_options={
        "interceptors": [_HoldParentsEnd(parent_id, flag)],
    })
    # The hold blocks the workflow's thread (not the event loop, which must
    # go on running the child); the SDK's 2 s deadlock detector would fail
    # the held task first, so it is off for this worker. (``debug_mode``
    # would run workflows on the event loop itself, and block everything.)
    assert workers[0]._workflow_worker is not None
    workers[0]._workflow_worker._deadlock_timeout_seconds = None
    runs = [asyncio.create_task(w.run()) for w in workers]

    async def mark_child_closed() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                await client.get_workflow_handle(child_id).result()
                break
            except Exception:
                await asyncio.sleep(0.05)
        flag.write_text("closed")

    watcher = asyncio.create_task(mark_child_closed())
    try:
        handle = await start_task(client, task_queue, server, workspace, task_id=parent_id)
        result = await asyncio.wait_for(handle.result(), 90)
        await asyncio.wait_for(watcher, 60)
    finally:
        watcher.cancel()
        await asyncio.gather(*(w.shutdown() for w in workers), return_exceptions=True)
        for r in runs:
            r.cancel()
    assert result.status == "completed", result.reason
    parent_events = await _event_types(client, parent_id)
    assert EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED not in parent_events
    child = await client.get_workflow_handle(child_id, result_type=AgentTaskResult).result()
    # the parent's end reached its child, and the child's result reached the parent
    assert child.status == "stopped"
    assert child.reason == (
        f"cancelled by a workflow cancel request: its parent task {parent_id} ended (completed)"
    )
    rows = _rows(stopline_home, parent_id)
    delivered = [r for r in rows if r.kind == "task_result"]
    assert len(delivered) == 1 and delivered[0].meta["status"] == "stopped"
    assert rows[-1].kind == "system" and rows[-1].meta["outcome"] == "completed"
