"""``TriageTicket``: the team's workflow, which hands a ticket to an agent."""

from __future__ import annotations

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from activities.tickets import lookup_ticket
    from stopline import AgentTaskInput, AgentTaskResult, TaskLimits, activity_tool, execute_agent_task


@workflow.defn
class TriageTicket:
    """Ask an agent to look a ticket up (with the team's own tool) and triage it."""

    @workflow.run
    async def run(self, ticket_id: str, model: str, workspace: str, base_url: str | None = None) -> AgentTaskResult:
        return await execute_agent_task(
            AgentTaskInput(
                prompt=f"Look up ticket {ticket_id} with lookup_ticket and say who should act on it.",
                model=model,
                base_url=base_url,
                workspace=workspace,
                limits=TaskLimits(max_rounds=5),
                tools=[activity_tool(lookup_ticket)],
            ),
            # stopline's workflows run on this worker's own task queue
            task_queue=workflow.info().task_queue,
        )
