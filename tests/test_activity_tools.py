"""The team's own activities as the agent's tools, and agent tasks started
from the team's own workflow (DESIGN §2 outcomes; ``StoplinePlugin``).

Real dev server, the stopline host in-process, the team's activities on a
worker of their own task queue, real HTTP to the scripted provider.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.worker import Worker

from stopline import AgentTaskInput, AgentTaskResult, StoplinePlugin, TaskLimits, activity_tool, task_result
from stopline.core.contracts import InterruptResult, LedgerRow
from stopline.testing import anthropic_message, entry, scenario
from stopline.testing.workers import wait_until
from tests._team import TeamParent, lookup, slow
from tests.conftest import provider_for


@pytest_asyncio.fixture
async def team_queue(client: Client, worker: Any) -> AsyncIterator[str]:
    """A worker of the team's own, on its own task queue, running its tools."""
    queue = f"team-{uuid.uuid4().hex[:8]}"
    async with Worker(client, task_queue=queue, activities=[lookup, slow]):
        yield queue


def _input(server: Any, workspace: Path, team_queue: str, **limits: Any) -> AgentTaskInput:
    return AgentTaskInput(
        prompt="use the team's tools", model=provider_for(server), base_url=server.url,
        workspace=str(workspace), limits=TaskLimits(**limits),
        tools=[activity_tool(lookup, task_queue=team_queue),
               activity_tool(slow, task_queue=team_queue, heartbeat_timeout_s=2)],
    )


async def _start(client: Client, task_queue: str, inp: AgentTaskInput) -> Any:
    return await client.start_workflow("AgentTask", inp, id=f"tools-{uuid.uuid4().hex[:8]}",
                                       task_queue=task_queue, result_type=AgentTaskResult)


def test_activity_tool_describes_the_activity() -> None:
    tool = activity_tool(lookup, task_queue="q")
    assert tool.name == "team_lookup" and tool.activity == "team.lookup"
    assert tool.description == "Look a key up in the team's system."
    assert tool.input_schema["properties"]["key"]["type"] == "string"
    with pytest.raises(TypeError, match="not an activity"):
        activity_tool(lambda x: x)


async def test_a_result_and_an_exception_reach_the_model_and_the_task_goes_on(
    client: Client, task_queue: str, scripted: Any, workspace: Path, team_queue: str,
    stopline_home: Path,
) -> None:
    server = scripted(scenario("anthropic",
        entry(anthropic_message(tool_calls=[("a", "team_lookup", {"key": "k1"}),
                                            ("b", "team_lookup", {"key": "missing"}),
                                            ("c", "team_lookup", {"wrong": 1})])),
        entry(anthropic_message("done"))))
    handle = await _start(client, task_queue, _input(server, workspace, team_queue))
    result = await task_result(handle)

    assert result.status == "completed", result
    tools = [t["name"] for t in server.requests()[0]["body"]["tools"]]
    assert {"team_lookup", "team_slow", "shell", "task_start"} <= set(tools)
    rows = [LedgerRow.model_validate(r) for r in await handle.query("ledger")]
    by_call = {r.call_id: r for r in rows if r.kind == "tool_result"}
    assert by_call["a"].ok and json.loads(by_call["a"].text) == {"key": "k1", "value": "value-of-k1"}
    assert not by_call["b"].ok and "no such key: missing" in by_call["b"].text
    assert not by_call["c"].ok and "team_lookup failed" in by_call["c"].text  # bad arguments
    sent = json.dumps(server.requests()[1]["body"]["messages"])
    assert "value-of-k1" in sent and "no such key" in sent


async def test_a_fatal_tool_error_fails_the_task_with_its_reason(
    client: Client, task_queue: str, scripted: Any, workspace: Path, team_queue: str,
) -> None:
    server = scripted(scenario("anthropic",
        entry(anthropic_message(tool_calls=[("a", "team_lookup", {"key": "broken"})])),
        entry(anthropic_message("never sent"))))
    handle = await _start(client, task_queue, _input(server, workspace, team_queue))
    result = await task_result(handle)

    assert result.status == "failed" and "shape the engine cannot use" in result.reason, result
    assert server.request_count() == 1
    assert (await handle.describe()).status == WorkflowExecutionStatus.FAILED


async def test_an_interrupt_aborts_a_team_tool_with_an_aborted_receipt(
    client: Client, task_queue: str, scripted: Any, workspace: Path, team_queue: str,
) -> None:
    server = scripted(scenario("anthropic",
        entry(anthropic_message(tool_calls=[("s", "team_slow", {"key": "x"})]))))
    handle = await _start(client, task_queue, _input(server, workspace, team_queue, interrupt_grace_s=0.1))
    deadline = asyncio.get_running_loop().time() + 20
    while asyncio.get_running_loop().time() < deadline:
        desc = await handle.describe()
        if any(a.activity_type == "team.slow" for a in desc.raw_description.pending_activities):
            break
        await asyncio.sleep(0.05)
    started = asyncio.get_running_loop().time()
    res = await handle.execute_update("interrupt", result_type=InterruptResult)
    took = asyncio.get_running_loop().time() - started

    assert res.interrupted and res.aborted_calls == ["s"], res
    assert took < 5, took
    rows = [LedgerRow.model_validate(r) for r in await handle.query("ledger")]
    (receipt,) = [r for r in rows if r.kind == "tool_result" and r.call_id == "s"]
    assert receipt.text.startswith("aborted by user") and receipt.meta.get("aborted")
    assert rows[-1].kind == "turn_aborted"
    await handle.cancel()


async def test_the_teams_workflow_runs_an_agent_task_as_a_child_and_gets_its_typed_result(
    client: Client, task_queue: str, scripted: Any, workspace: Path, team_queue: str,
) -> None:
    server = scripted(scenario("anthropic",
        entry(anthropic_message(tool_calls=[("a", "team_lookup", {"key": "k9"})])),
        entry(anthropic_message("k9 is value-of-k9"))))
    async with Worker(client, task_queue=f"{task_queue}-team", workflows=[TeamParent],
                      plugins=[StoplinePlugin(host=True)]):
        # the team's worker with the plugin: its own workflow and stopline's
        # (and, host=True, this machine's host workers beside it)
        result = await client.execute_workflow(
            "TeamParent", _input(server, workspace, team_queue),
            id=f"parent-{uuid.uuid4().hex[:8]}", task_queue=f"{task_queue}-team",
            result_type=AgentTaskResult,
        )
    assert isinstance(result, AgentTaskResult)
    assert result.status == "completed" and result.final_text == "k9 is value-of-k9", result


async def test_a_team_worker_on_a_home_another_worker_serves_refuses_to_start(
    client: Client, task_queue: str, stopline_home: Path,
) -> None:
    """One host per STOPLINE_HOME for the plugin's host workers too (DESIGN §7):
    a team worker beside a running ``stopline-worker`` on the same home says so."""
    from stopline.activities.host import HomeLock, HostInUse

    held = HomeLock(stopline_home).acquire()  # as a running stopline-worker holds it
    try:
        worker = Worker(client, task_queue=f"{task_queue}-team", workflows=[TeamParent],
                        plugins=[StoplinePlugin(host=True)])
        with pytest.raises(HostInUse, match="already serves"):
            await asyncio.wait_for(worker.run(), 30)
    finally:
        held.release()

    def taken() -> bool:
        try:
            HomeLock(stopline_home).acquire().release()
        except HostInUse:
            return True
        return False

    # once it is free, the team worker starts, holds the home while it runs, and lets go
    async with Worker(client, task_queue=f"{task_queue}-team2", workflows=[TeamParent],
                      plugins=[StoplinePlugin(host=True)]):
        await wait_until(taken, 30, "the team worker's hold on the home")
    assert not taken()
