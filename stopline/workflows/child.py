"""Start an agent task from your own workflow: typed child-workflow helpers.

An agent task is an ``AgentTask`` workflow, so a team's own workflow starts
one as a child and gets its :class:`~stopline.core.contracts.AgentTaskResult`
back — typed, whatever the outcome (a failed task's workflow fails carrying
its result; :func:`execute_agent_task` returns it rather than raising)::

    from stopline import AgentTaskInput, execute_agent_task

    @workflow.defn
    class TriageTicket:
        @workflow.run
        async def run(self, ticket_id: str) -> str:
            result = await execute_agent_task(AgentTaskInput(
                prompt=f"Look up ticket {ticket_id} and summarise it.",
                model="anthropic:claude-sonnet-4-5", workspace="/srv/ws/triage",
                tools=[activity_tool(lookup_ticket)],
            ))
            return result.final_text

The child runs wherever stopline's workflows run (``task_queue``, default
``stopline``) and claims a host there (DESIGN §7): the parent's worker needs
no stopline worker settings of its own. Deterministic code: safe in the
workflow sandbox.
"""

from __future__ import annotations

from typing import Any

from temporalio import workflow
from temporalio.exceptions import ChildWorkflowError

with workflow.unsafe.imports_passed_through():
    from stopline.core.contracts import (
        AGENT_TASK_WORKFLOW,
        DEFAULT_TASK_QUEUE,
        AgentTaskInput,
        AgentTaskResult,
    )

__all__ = ["execute_agent_task", "start_agent_task"]


async def start_agent_task(
    inp: AgentTaskInput,
    *,
    id: str | None = None,
    task_queue: str = DEFAULT_TASK_QUEUE,
    **options: Any,
) -> workflow.ChildWorkflowHandle[Any, AgentTaskResult]:
    """Start an agent task as a child of the calling workflow.

    Args:
        inp: The task (prompt, model, workspace, limits, tools …).
        id: Its workflow id (default: ``<parent id>.agent-<8 hex>``, from
            ``workflow.uuid4()``, so replay makes the same one).
        task_queue: Where stopline's workflows run.
        **options: Any other ``workflow.start_child_workflow`` option
            (``parent_close_policy``, timeouts, ``search_attributes`` …).

    Returns:
        The child's handle; awaiting it gives the result, or raises
        ``ChildWorkflowError`` for a failed task (see
        :func:`execute_agent_task`).
    """
    child_id = id or f"{workflow.info().workflow_id}.agent-{workflow.uuid4().hex[:8]}"
    return await workflow.start_child_workflow(
        AGENT_TASK_WORKFLOW, inp, id=child_id, task_queue=task_queue,
        result_type=AgentTaskResult, **options,
    )


async def execute_agent_task(inp: AgentTaskInput, **kwargs: Any) -> AgentTaskResult:
    """Run an agent task as a child and return its result, whatever its status.

    Args:
        inp: The task.
        **kwargs: As for :func:`start_agent_task`.

    Returns:
        The task's result: ``completed``, ``stopped`` (a limit, a refusal —
        ``refused`` is set —, a stop) or ``failed`` (an engine error).

    Raises:
        ChildWorkflowError: The child ended without a task result
            (terminated, timed out, cancelled before it recorded one).
    """
    handle = await start_agent_task(inp, **kwargs)
    try:
        return await handle
    except ChildWorkflowError as err:
        result = AgentTaskResult.from_failure(err)
        if result is None:
            raise
        return result
