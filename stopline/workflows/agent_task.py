"""The ``AgentTask`` workflow: one agent task, durable, with honest endings.

The turn loop, the abort path, refusal disposition and sub-tasks live in
:mod:`workflows._engine`; this module adds what is particular to a task: it
runs one prompt to an outcome (``completed`` | ``stopped`` | ``failed``),
waits for a message after an interrupt, answers ``task_stop`` (workflow
cancellation) with stop evidence, and completes — never fails — so no
workflow retry re-runs a task from the top.
"""

from __future__ import annotations

import asyncio

from temporalio import workflow
from temporalio.contrib.workflow_streams import WorkflowStream
from temporalio.exceptions import ActivityError, ApplicationError

from stopline.workflows._engine import TurnEngine
from stopline.workflows._placement import HostLost
from stopline.workflows._state import activity_failure_reason
from stopline.workflows._subtasks import QUIET_END_PATCH

with workflow.unsafe.imports_passed_through():
    from stopline.core.turn_state import End
    from stopline.core import policies, refusal
    from stopline.core.contracts import (
        AGENT_TASK_WORKFLOW,
        AgentTaskInput,
        TASK_FAILED_ERROR,
        AgentTaskResult,
        InterruptResult,
        LedgerRow,
        MessageAck,
        TaskStatus,
    )
    from stopline.core.search_attributes import updates as search_attribute_updates


#: ``workflow.patched`` id: a failed task fails its workflow (histories
#: recorded before completed it with status ``failed``).
FAIL_FAILED_PATCH = "stopline-fail-failed-tasks"


@workflow.defn(name=AGENT_TASK_WORKFLOW)
class AgentTask(TurnEngine):
    """One agent task: a turn loop over sampling and tool activities."""

    @workflow.init
    def __init__(self, inp: AgentTaskInput) -> None:
        self._inp = inp
        self._stream = WorkflowStream(prior_state=inp.carry.stream_state if inp.carry else None)
        self._init_engine(inp.carry)

    @workflow.run
    async def run(self, inp: AgentTaskInput) -> AgentTaskResult:
        """Run the task until the model ends its turn, a limit, an engine
        error, a refusal, or ``task_stop``.

        Returns:
            The task result; the workflow completes for every outcome.
        """
        if inp.carry is None:
            self._append("prompt", text=inp.prompt)
        try:
            end = await self._place()
            while end is None:
                self._set_host_state("running")
                end = await self._turn()
                if end is not None:
                    break
                # The turn was interrupted: wait for the user's next message.
                self._set_host_state("waiting")
                end = await self._wait_for_message()
        except asyncio.CancelledError:
            # A workflow cancel (`stopline stop`, task_stop, a parent's end,
            # `temporal workflow cancel`): a stop, recorded like any other and
            # named as the cancel it was, with its sender's reason — the turn
            # in flight is aborted as an interrupt would abort it.
            self._state = "finishing"
            await self._abort_inflight()
            end = End("stopped", policies.cancel_stop_reason(workflow.cancellation_reason()))
        return await self._finish(end)

    async def _at_round_boundary(self) -> None:
        """Continue-as-new between rounds once history is long (DESIGN §5).

        The ledger travels by reference: rows are flushed to the JSONL file
        first and the next run carries only counters (``ThreadCarry``).
        """
        if self._interrupt_pending or self._children_running():
            return
        if not self._should_continue_as_new():
            return
        self._continuing = True
        try:
            await self._flush()
        except HostLost:
            self._continuing = False
            raise
        self._trim_stream()
        inp = self._inp
        await self._stream.continue_as_new(
            lambda state: [inp.model_copy(update={"carry": self._carry(state)})]
        )

    async def _finish(self, end: End) -> AgentTaskResult:
        self._state = "finishing"  # from here on, `message` is refused
        # A quiet end: sub-tasks still running are stopped and their results
        # delivered first, and the released host session reports before the
        # task completes — no event may arrive during its last workflow task.
        quiet = workflow.patched(QUIET_END_PATCH)
        if quiet:
            await self._settle_children(
                f"its parent task {workflow.info().workflow_id} ended ({end.status})"
            )
        # A message accepted while the task ran but never drained into a
        # turn is reported, not lost (it reaches the result and the ledger).
        undelivered = list(self._inbox)
        self._inbox.clear()
        if undelivered:
            self._append("system", model_visible=False, text=policies.undelivered_note(undelivered),
                         meta={"undelivered_messages": len(undelivered)})
        self._append("system", model_visible=False, text=f"task {end.status}: {end.reason}",
                     meta={"outcome": end.status, "refused": end.refused})
        # A normal finish closes unattended background shells; a refused (or
        # otherwise stopped) task leaves the scene as it is (seed 000 §3).
        # The same flush releases the host session: the slot is free at once.
        unflushed: list[LedgerRow] = []
        self._releasing = True
        try:
            await self._flush(close_shells=end.status == "completed", release=True)
        except HostLost:
            # No host to write to (it was lost, or none was ever claimed):
            # the rows enter history with the result (DESIGN §7).
            unflushed = self._pending_rows()
        except ActivityError as err:
            unflushed = self._pending_rows()
            if end.status != "failed":
                end = End("failed", f"the ledger could not be written: {activity_failure_reason(err)}")
        if quiet:
            await self._session_reported()
        evidence = None
        if end.status == "stopped":
            evidence = refusal.stop_evidence(
                refused=end.refused or self._refusal_stop is not None,
                last_message=self._n.final_text,
                last_tool=self._n.last_tool,
                last_tool_args=self._n.last_tool_args,
                last_tool_outcome=self._n.last_tool_outcome,
                changed_paths=self._n.changed_paths,
            )
        self._result = AgentTaskResult(
            task_id=workflow.info().workflow_id,
            status=end.status,  # type: ignore[arg-type]
            refused=end.refused,
            reason=end.reason,
            rounds=self._n.rounds,
            final_text=self._n.final_text,
            provider_calls=self._n.provider_calls,
            refusal=self._refusal_info() if end.refused else None,
            evidence=evidence,
            host_id=self._host.host_id if self._host else None,
            unflushed_rows=unflushed,
            undelivered_messages=undelivered,
        )
        self._state = end.status
        self._upsert(end.status)
        self._publish("task_finished", text=end.reason, result=self._result)
        await self._handlers_done()
        if end.status == "failed" and workflow.patched(FAIL_FAILED_PATCH):
            # Temporal sees what stopline sees: a failed task is a failed
            # workflow (the UI, alerting and `temporal workflow list` count
            # it), never retried (non-retryable), and its result rides along.
            # Stopped and refused tasks complete: seed 000, DESIGN §4.
            raise ApplicationError(
                end.reason, self._result.model_dump(mode="json"),
                type=TASK_FAILED_ERROR, non_retryable=True,
            )
        return self._result

    def _upsert(self, status: str) -> None:
        workflow.upsert_search_attributes(
            search_attribute_updates(
                status=status,
                refused=self._refusal_stop is not None,
                kind="task",
                model=self._inp.model,
                host=self._host_attribute(),
            )
        )

    # ------------------------------------------------------------ handlers

    @workflow.update
    async def interrupt(self) -> InterruptResult:
        """Abort the current turn only; background shells keep running.

        The protocol's contract (seed 002): an interrupt stops the turn in
        progress — its sampling call is dropped, its unfinished tool calls
        are cancelled (SIGTERM, then SIGKILL after the grace) and get
        "aborted by user" receipts, finished ones keep their real results —
        and appends one ``turn_aborted`` marker. Background shells started
        by earlier tool calls are not touched. The task then waits for the
        next ``message``. Returns after the ledger is fsynced.

        Idempotent: with no turn running it returns at once and adds
        nothing; with an interrupt already in progress it adds nothing,
        waits for that abort and reports it (``joined``).
        """
        return await self._interrupt()

    @workflow.update
    async def message(self, text: str) -> MessageAck:
        """Send the task a user message: answered in the current turn, or
        starting a new one when the task is waiting after an interrupt."""
        self._inbox.append(text)
        return MessageAck(accepted=True, state=self._state)

    @message.validator
    def _validate_message(self, text: str) -> None:
        # The persisted refusal row is checked, not a flag (seed 000 §5):
        # ``_refusal_stop`` is rebuilt from history on every replay.
        if self._refusal_stop is not None:
            raise ValueError(refusal.NOT_CONTINUABLE)
        if not text.strip():
            raise ValueError("message is empty")
        if self._state not in ("running", "waiting"):
            raise ValueError(f"task is {self._state}; it takes no more messages")

    @workflow.query
    def status(self) -> TaskStatus:
        """The task's state, round, ledger length, refusal and result."""
        return self._status()

    @workflow.query
    def ledger(self) -> list[LedgerRow]:
        """This run's ledger rows as workflow state (equal to the JSONL file's
        rows of this run once flushed)."""
        return list(self._rows)
