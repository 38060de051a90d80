"""The ``ChatThread`` workflow: a long-lived conversation.

It takes user messages (Updates ``message`` / ``ask``), runs a turn for
each, and receives external increments the provider has not accepted yet
(``increment``: inbox summaries, cross-thread events; sub-task results
arrive the same way). A refusal is handled by the chat row of the
disposition matrix (seed 000 §2): quarantine the unaccepted increments,
retry the same provider a bounded number of times, then stop the turn with
one critical notification. The thread never switches model by itself and
does not pretend to be healed: the next message is sent as usual.

It continues-as-new when Temporal suggests it (or past the configured
event count), carrying the ledger by reference.
"""

from __future__ import annotations

import asyncio

from temporalio import workflow
from temporalio.contrib.workflow_streams import WorkflowStream
from temporalio.exceptions import ActivityError

from stopline.workflows._engine import TurnEngine
from stopline.workflows._placement import HostLost
from stopline.workflows._state import activity_failure_reason
from stopline.workflows._subtasks import QUIET_END_PATCH

with workflow.unsafe.imports_passed_through():
    from pydantic import BaseModel

    from stopline.core import policies
    from stopline.core.contracts import (
        CHAT_THREAD_WORKFLOW,
        AgentTaskResult,
        ChatThreadInput,
        InterruptResult,
        LedgerRow,
        MessageAck,
        TaskStatus,
    )
    from stopline.core.search_attributes import updates as search_attribute_updates
    from stopline.core.turn_state import End


class TurnOutcome(BaseModel):
    """What ``ask`` returns: how the turn it started ended."""

    status: str
    reason: str
    refused: bool = False
    final_text: str = ""
    turn: int = 0


@workflow.defn(name=CHAT_THREAD_WORKFLOW)
class ChatThread(TurnEngine):
    """A long-lived chat thread."""

    @workflow.init
    def __init__(self, inp: ChatThreadInput) -> None:
        self._inp = inp
        self._stream = WorkflowStream(prior_state=inp.carry.stream_state if inp.carry else None)
        self._init_engine(inp.carry)
        self._closing = False
        self._turns: list[TurnOutcome] = []

    @workflow.run
    async def run(self, inp: ChatThreadInput) -> AgentTaskResult:
        """Serve turns until ``close``; continue-as-new when history grows."""
        status, reason = "completed", "thread closed"
        try:
            end = await self._place()
            if end is None:
                self._set_host_state("waiting")
                end = await self._serve(inp)
            if end is not None:
                status, reason = end.status, end.reason
        except asyncio.CancelledError:
            # A workflow cancel (`stopline stop`, `temporal workflow cancel`):
            # abort the turn in flight the way an interrupt would, then end
            # as stopped, recorded, and named as the cancel it was.
            self._closing = True
            await self._abort_inflight()
            status, reason = "stopped", policies.cancel_stop_reason(workflow.cancellation_reason())
        self._closing = True  # from here on, messages are refused
        quiet = workflow.patched(QUIET_END_PATCH)  # see AgentTask._finish
        if quiet:
            await self._settle_children(f"its chat thread {workflow.info().workflow_id} ended ({status})")
        undelivered = list(self._inbox)
        self._inbox.clear()
        if undelivered:
            self._append("system", model_visible=False, text=policies.undelivered_note(undelivered),
                         meta={"undelivered_messages": len(undelivered)})
        self._append("system", model_visible=False, text=f"thread {status}: {reason}",
                     meta={"outcome": status})
        unflushed: list[LedgerRow] = []
        self._releasing = True
        try:
            await self._flush(release=True)
        except HostLost:
            unflushed = self._pending_rows()  # no host: the rows go with the result
        except ActivityError as err:
            unflushed = self._pending_rows()
            status, reason = "failed", f"the ledger could not be written: {activity_failure_reason(err)}"
        if quiet:
            await self._session_reported()
        self._state = status
        self._result = AgentTaskResult(
            task_id=workflow.info().workflow_id,
            status=status,  # type: ignore[arg-type]
            reason=reason,
            rounds=self._n.rounds,
            final_text=self._n.final_text,
            provider_calls=self._n.provider_calls,
            host_id=self._host.host_id if self._host else None,
            unflushed_rows=unflushed,
            undelivered_messages=undelivered,
        )
        self._upsert(status)
        self._publish("task_finished", text=reason, result=self._result)
        await self._handlers_done()
        return self._result

    async def _serve(self, inp: ChatThreadInput) -> End | None:
        """One turn per user message until ``close``; every turn's ending is
        a ledger row (hidden from the model) and a ``turn_finished`` event.

        Returns:
            ``None`` when closed; ``End`` when the thread cannot go on (its
            host was lost and no other reaches its workspace).
        """
        while True:
            await workflow.wait_condition(
                lambda: bool(self._inbox) or self._closing or self._host_gone()
                or self._move_requested
            )
            if (self._host_gone() or self._move_requested) and not self._inbox:
                if self._host_gone():
                    lost = await self._recover_host(self._why_host_gone())
                else:
                    lost = await self._maybe_move()
                if lost is not None:
                    return lost
                self._set_host_state("waiting")
                continue
            if self._closing and not self._inbox:
                return None
            self._set_host_state("running")
            end = await self._turn()
            if end is not None and end.final:
                return end
            self._state = "waiting"
            outcome = TurnOutcome(
                status=end.status if end else "interrupted",
                reason=end.reason if end else "interrupted by user",
                refused=bool(end and end.refused),
                final_text=self._turn_text,
                turn=len(self._turns) + 1,
            )
            self._append("system", model_visible=False,
                         text=f"turn {outcome.turn} {outcome.status}: {outcome.reason}",
                         meta={"outcome": outcome.status, "turn": outcome.turn})
            try:
                await self._flush()
            except HostLost as lost:
                self._mark_host_lost(lost.why)  # rows stay pending; recovered above
            self._turns.append(outcome)
            self._publish("turn_finished", text=outcome.reason)
            self._upsert("waiting")
            if self._should_continue_as_new() and not self._children_running():
                self._trim_stream()
                await self._stream.continue_as_new(
                    lambda state: [inp.model_copy(update={"carry": self._carry(state)})]
                )

    def _upsert(self, status: str) -> None:
        workflow.upsert_search_attributes(
            search_attribute_updates(
                status=status, refused=self._refusal_stop is not None, kind="chat",
                model=self._inp.model, host=self._host_attribute(),
            )
        )

    # ------------------------------------------------------------ handlers

    @workflow.update
    async def message(self, text: str) -> MessageAck:
        """A user message; it starts (or joins) a turn."""
        self._inbox.append(text)
        return MessageAck(accepted=True, state=self._state)

    @message.validator
    def _validate_message(self, text: str) -> None:
        if not text.strip():
            raise ValueError("message is empty")
        if self._closing:
            raise ValueError("thread is closing")

    @workflow.update
    async def ask(self, text: str) -> TurnOutcome:
        """A user message; returns when the turn it starts has ended."""
        self._inbox.append(text)
        target = len(self._turns) + 1
        await workflow.wait_condition(lambda: len(self._turns) >= target or self._result is not None)
        if len(self._turns) >= target:
            return self._turns[target - 1]
        # the thread ended first: the message is in the result's undelivered list
        assert self._result is not None
        return TurnOutcome(
            status=self._result.status, turn=target,
            reason=f"not delivered: the thread ended first ({self._result.reason})",
        )

    @ask.validator
    def _validate_ask(self, text: str) -> None:
        self._validate_message(text)

    @workflow.update
    async def increment(self, source: str, text: str) -> MessageAck:
        """An external increment (inbox summary, cross-thread event) the
        provider has not accepted yet; it rides on the next request."""
        self._increments_inbox.append((source, text))
        return MessageAck(accepted=True, state=self._state)

    @workflow.update
    async def interrupt(self) -> InterruptResult:
        """Abort the current turn only; background shells keep running."""
        return await self._interrupt()

    @workflow.signal
    def close(self) -> None:
        """Close the thread after the current turn."""
        self._closing = True

    @workflow.query
    def status(self) -> TaskStatus:
        """The thread's state, round, ledger length and refusal."""
        return self._status()

    @workflow.query
    def turns(self) -> list[TurnOutcome]:
        """How each turn of this run ended."""
        return list(self._turns)

    @workflow.query
    def ledger(self) -> list[LedgerRow]:
        """This run's ledger rows."""
        return list(self._rows)


