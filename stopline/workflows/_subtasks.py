"""Sub-tasks: the ``task_*`` tools, run by the workflow as child workflows.

``task_start`` starts a child ``AgentTask``; its result reaches this thread
exactly once, as a ``task_result`` row (an external increment, seed 000 §2).
A refused child's receipt carries only where it stopped (seed 000 §4).

Deterministic code only.
"""

from __future__ import annotations

import asyncio
import json
import posixpath
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.exceptions import ChildWorkflowError
from temporalio.workflow import ParentClosePolicy

from stopline.workflows._state import TOOL_RETRY, activity_failure_reason

#: ``workflow.patched`` id of a quiet end: a thread stops and awaits its
#: running sub-tasks, and waits for its released host session to report,
#: before it completes (no event can then arrive during its last workflow
#: task). Histories recorded before it did neither.
QUIET_END_PATCH = "stopline-quiet-end"
#: How long a thread's end waits for its released host session to report.
SESSION_END_WAIT = timedelta(seconds=5)
#: A model reference naming a scripted scenario (served on the host).
SCRIPTED_PREFIX = "scripted:"

with workflow.unsafe.imports_passed_through():
    from pydantic import ValidationError

    from stopline.core import policies, refusal
    from stopline.core.contracts import (
        AGENT_TASK_WORKFLOW,
        TASK_MESSAGE_ACTIVITY,
        AgentTaskInput,
        AgentTaskResult,
        ChildInfo,
        Fatal,
        RespondToModel,
        TaskMessageInput,
        ToolCall,
        ToolOutcome,
    )
    from stopline.core.task_tools import (
        TaskIdArgs,
        TaskMessageArgs,
        TaskStartArgs,
        TaskWaitArgs,
    )
    from stopline.core.turn_state import Child


class SubtaskMixin:
    """The ``task_start`` / ``task_wait`` / ``task_message`` / ``task_stop`` /
    ``task_status`` tools."""

    _inp: Any
    _children: dict[str, Child]
    _unaccepted: list[int]
    _host: Any
    _fleet: bool
    _session: Any

    async def _run_task_tool(self, call: ToolCall) -> RespondToModel:
        """Run a sub-task tool in the workflow (child workflows)."""
        args = call.arguments or {}
        try:
            if call.name == "task_start":
                return await self._task_start(TaskStartArgs.model_validate(args))
            if call.name == "task_wait":
                return await self._task_wait(TaskWaitArgs.model_validate(args))
            if call.name == "task_stop":
                return await self._task_stop(TaskIdArgs.model_validate(args))
            if call.name == "task_message":
                return await self._task_message(TaskMessageArgs.model_validate(args))
            return self._task_status_tool(TaskIdArgs.model_validate(args))
        except ValidationError as err:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or 'arguments'}: {e['msg']}" for e in err.errors()
            )
            return RespondToModel(text=f"invalid arguments for {call.name}: {problems}", ok=False)

    async def _task_start(self, args: TaskStartArgs) -> RespondToModel:
        parent = workflow.info().workflow_id
        if args.id is not None:
            child_id = f"{parent}.{args.id}"
            if child_id in self._children:
                return RespondToModel(
                    text=f"a sub-task with id {args.id!r} already exists ({child_id}); pick another id",
                    ok=False,
                )
        else:
            n = len(self._children) + 1
            while f"{parent}.sub{n}" in self._children:  # a named one took it
                n += 1
            child_id = f"{parent}.sub{n}"
        limits = self._inp.limits.model_copy(
            update={"max_rounds": args.max_rounds} if args.max_rounds else {}
        )
        model = args.model or self._inp.model
        base_url = args.base_url if args.model else (args.base_url or self._inp.base_url)
        if args.model and args.model.startswith(SCRIPTED_PREFIX):
            # a scripted scenario is read on the host, from the workspace
            path = args.model[len(SCRIPTED_PREFIX):]
            model = SCRIPTED_PREFIX + posixpath.normpath(posixpath.join(self._inp.workspace, path))
            base_url = None
        handle = await workflow.start_child_workflow(
            AGENT_TASK_WORKFLOW,
            AgentTaskInput(
                prompt=args.prompt,
                model=model,
                base_url=base_url,
                workspace=self._inp.workspace,
                limits=limits,
                host_task_queue=self._inp.host_task_queue,
                # on this task's host by default: the same workspace, and the
                # sub-task shares this task's capacity slot there (DESIGN §7)
                host=self._host.host_id if self._host is not None else None,
                parent_task_id=parent,
                tools=list(self._inp.tools),
                stream=self._inp.stream,
                route="subagent",
                execution_scope="worker",
                usage_source=f"subtask:{parent}",
            ),
            id=child_id,
            task_queue=workflow.info().task_queue,
            result_type=AgentTaskResult,
            parent_close_policy=ParentClosePolicy.ABANDON,
        )
        child = Child(ChildInfo(task_id=child_id), handle)
        self._children[child_id] = child
        asyncio.create_task(self._await_child(child))
        return RespondToModel(text=f"started task {child_id} (model {model})")

    async def _session_reported(self) -> None:
        """Wait (at most :data:`SESSION_END_WAIT`) until the host session the
        end's flush released has reported: its completion must not arrive
        during the thread's last workflow task (it would be rejected as
        ``UnhandledCommand``, failing that task and any Update in flight)."""
        session = self._session
        if session is None or session.done():
            return
        try:
            await workflow.wait_condition(session.done, timeout=SESSION_END_WAIT)
        except asyncio.TimeoutError:
            pass

    async def _settle_children(self, why: str) -> None:
        """Stop the sub-tasks still running as this thread ends; wait for their results.

        A thread that ended while a child ran used to complete with the
        child's completion able to arrive in the same workflow task, which
        Temporal rejects (``WorkflowTaskFailed … UnhandledCommand``) — and
        the child ran on unattended, its result delivered to no one. Now the
        cancellation tree holds (DESIGN §3: a parent's end reaches every
        child): each running child gets a workflow cancel naming ``why``,
        and the thread waits (at most 60 s) until every result is delivered
        as a ``task_result`` row. Only then does it write its own end, so no
        child event can arrive after it.

        Args:
            why: The cancel reason each child records.
        """
        running = [c for c in self._children.values() if not c.info.settled]
        if not running:
            return
        for child in running:
            try:
                await workflow.get_external_workflow_handle(child.info.task_id).cancel(reason=why)
            except Exception:  # already closed: its completion is on the way
                pass
        try:
            await workflow.wait_condition(
                lambda: all(c.info.delivered for c in running), timeout=timedelta(seconds=60)
            )
        except asyncio.TimeoutError:
            pass

    async def _await_child(self, child: Child) -> None:
        """Deliver a child's result exactly once, as a task-result row."""
        try:
            result: AgentTaskResult = await child.handle
        except ChildWorkflowError as err:
            # a failed task's workflow fails carrying its result; anything
            # else (terminated, timed out) gets one made from the failure
            result = AgentTaskResult.from_failure(err) or AgentTaskResult(
                task_id=child.info.task_id, status="failed", reason=activity_failure_reason(err)
            )
        child.info.settled = True
        child.info.result = result
        self._deliver(child)

    def _deliver(self, child: Child) -> None:
        if child.info.delivered or child.info.result is None:
            return
        result = child.info.result
        if result.refused and result.refusal is not None:
            text = refusal.refusal_receipt(result.refusal, result.final_text)
        else:
            text = f"Task {result.task_id} {result.status}: {result.reason}."
            if result.final_text:
                text += f"\nIts final message:\n{policies.cap_text(result.final_text, 8000)}"
        row = self._append(
            "task_result",
            text=f"<task_result id={result.task_id}>\n{text}\n</task_result>",
            meta={
                "task_id": result.task_id,
                "status": result.status,
                "refused": result.refused,
                "delivery": refusal.delivery_status(result.status),
                "increment": True,
            },
        )
        self._unaccepted.append(row.seq)
        child.info.delivered = True
        self._publish("task_result", text=f"{result.task_id} {result.status}")

    async def _task_wait(self, args: TaskWaitArgs) -> RespondToModel:
        unknown = [i for i in args.ids if i not in self._children]
        if unknown:
            return RespondToModel(text=f"unknown task ids {unknown}; known: {sorted(self._children)}", ok=False)
        try:
            await workflow.wait_condition(
                lambda: all(self._children[i].info.delivered for i in args.ids),
                timeout=timedelta(seconds=args.timeout_s),
            )
        except asyncio.TimeoutError:
            pass
        lines = []
        for i in args.ids:
            info = self._children[i].info
            if info.result is None:
                lines.append(f"{i}: still running after {args.timeout_s:g}s")
            else:
                tag = " (refused)" if info.result.refused else ""
                lines.append(f"{i}: {info.result.status}{tag}; its result is in the task result above")
        self._publish("task_wait_done", text=", ".join(args.ids))
        return RespondToModel(text="\n".join(lines))

    async def _task_message(self, args: TaskMessageArgs) -> RespondToModel:
        """Send a task a message (an activity: an Update on another workflow);
        sync mode then waits for its settlement like ``task_wait``."""
        sent: RespondToModel | Fatal = await workflow.execute_activity(
            TASK_MESSAGE_ACTIVITY,
            TaskMessageInput(task_id=args.id, text=args.text),
            result_type=ToolOutcome,
            # an Update on another workflow: any worker can send it, so it
            # runs on the workflow task queue, not on this thread's host
            task_queue=self._inp.host_task_queue if not self._fleet else workflow.info().task_queue,
            start_to_close_timeout=timedelta(seconds=60),
            retry_policy=TOOL_RETRY,
            summary=f"task_message {args.id}",
        )
        if not isinstance(sent, RespondToModel) or not sent.ok or not args.wait:
            return sent if isinstance(sent, RespondToModel) else RespondToModel(text=sent.reason, ok=False)
        if args.id not in self._children:
            return RespondToModel(text=f"{sent.text}; not a sub-task of this thread, so not waiting")
        waited = await self._task_wait(TaskWaitArgs(ids=[args.id], timeout_s=args.timeout_s))
        return RespondToModel(text=f"{sent.text}\n{waited.text}")

    async def _task_stop(self, args: TaskIdArgs) -> RespondToModel:
        child = self._children.get(args.id)
        if child is None:
            return RespondToModel(text=f"unknown task id {args.id!r}", ok=False)
        if not child.info.settled:
            try:
                await workflow.get_external_workflow_handle(args.id).cancel(
                    reason=f"task_stop from its parent task {workflow.info().workflow_id}"
                )
            except Exception:  # already closed: its result is on the way
                pass
            try:
                await workflow.wait_condition(lambda: child.info.settled, timeout=timedelta(seconds=60))
            except asyncio.TimeoutError:
                return RespondToModel(text=f"task {args.id} did not stop within 60s", ok=False)
        result = child.info.result
        assert result is not None
        body: dict[str, Any] = {
            "task_id": args.id,
            "status": result.status,
            "refused": result.refused,
            "evidence": result.evidence,
        }
        if result.refused:
            body["note"] = refusal.NOT_CONTINUABLE
        return RespondToModel(text=json.dumps(body, indent=1))

    def _task_status_tool(self, args: TaskIdArgs) -> RespondToModel:
        child = self._children.get(args.id)
        if child is None:
            return RespondToModel(text=f"unknown task id {args.id!r}", ok=False)
        result = child.info.result
        body: dict[str, Any] = {"task_id": args.id, "state": result.status if result else "running"}
        if result is not None:
            body["stop_reason"] = result.reason
            if result.refused and result.refusal is not None:
                body["refusal"] = result.refusal.model_dump()
                body["note"] = refusal.NOT_CONTINUABLE
        return RespondToModel(text=json.dumps(body))

    def _children_running(self) -> bool:
        return any(not c.info.settled for c in self._children.values())
