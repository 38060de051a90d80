"""A team's own activities and workflow, for tests/test_activity_tools.py (a
module of its own so the workflow sandbox can import it cleanly)."""

from __future__ import annotations

import asyncio

from pydantic import BaseModel
from temporalio import activity, workflow

with workflow.unsafe.imports_passed_through():
    from stopline import AgentTaskInput, AgentTaskResult, FatalToolError, execute_agent_task


class Lookup(BaseModel):
    """Arguments of the team's tools."""

    key: str


@activity.defn(name="team.lookup")
async def lookup(inp: Lookup) -> dict[str, str]:
    """Look a key up in the team's system."""
    if inp.key == "missing":
        raise KeyError(f"no such key: {inp.key}")
    if inp.key == "broken":
        raise FatalToolError("the team's system returned a shape the engine cannot use")
    return {"key": inp.key, "value": f"value-of-{inp.key}"}


@activity.defn(name="team.slow")
async def slow(inp: Lookup) -> str:
    """Take a long time, heartbeating."""
    for _ in range(300):
        activity.heartbeat()
        await asyncio.sleep(0.1)
    return "finished"


@workflow.defn(name="TeamParent")
class TeamParent:
    """The team's workflow: runs an agent task as a child."""

    @workflow.run
    async def run(self, inp: AgentTaskInput) -> AgentTaskResult:
        return await execute_agent_task(inp, task_queue=workflow.info().task_queue)
