"""The ``AgentTask`` workflow: one agent task, durable, with honest endings.

The turn loop (read top to bottom):

1. Drain queued user messages into the ledger; sample (one activity: it
   flushes pending ledger rows, reads the transcript by reference, calls the
   model).
2. A refusal stops the task (seed 000). No tool call, or end of turn: done.
3. Tool calls that must not run (output cut at max_tokens, unparsable
   arguments) get error results; the rest run as concurrent activities on
   the workspace host's task queue, each at most once.
4. Each result is appended as it arrives; then sample again.

A user interrupt is level-triggered state checked after every activity
returns: the turn is aborted in :meth:`AgentTask._abort_turn`, one function
in the order seed 002 gives. A tool failure is a tool result, never a turn
failure (DESIGN §2); only ``Fatal`` or a non-retryable provider error fails
the task.

Deterministic code only: no I/O, no clocks but ``workflow.now()``. The ledger
lives here as state; activities mirror it to the JSONL file.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.contrib.workflow_streams import WorkflowStream
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from stopline import policies
    from stopline.contracts import (
        AGENT_TASK_WORKFLOW,
        EVENTS_TOPIC,
        LEDGER_FLUSH_ACTIVITY,
        SAMPLE_ACTIVITY,
        TOOL_ACTIVITY,
        AgentTaskInput,
        AgentTaskResult,
        Fatal,
        InterruptResult,
        LedgerFlushInput,
        LedgerRow,
        MessageAck,
        RespondToModel,
        RowKind,
        SampleInput,
        SamplingResult,
        TaskEvent,
        TaskStatus,
        ToolCall,
        ToolCallInput,
        ToolOutcome,
    )

#: Sampling retries: transient provider errors (429/5xx/overloaded/network).
SAMPLING_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    backoff_coefficient=2.0,
    maximum_interval=timedelta(seconds=60),
    maximum_attempts=8,
)
#: A tool call runs at most once (DESIGN §2): no retries, ever.
TOOL_RETRY = RetryPolicy(maximum_attempts=1)
#: Ledger flushes are idempotent (rows keyed by seq), so they may retry.
FLUSH_RETRY = RetryPolicy(initial_interval=timedelta(milliseconds=200), maximum_attempts=5)


#: Returned by a step whose turn a user interrupt aborted.
_ABORTED = object()


@dataclass
class _End:
    """How a task ends."""

    status: str
    reason: str
    refused: bool = False


@dataclass
class _RunningCall:
    call: ToolCall
    handle: Any
    started_at: datetime
    settled: bool = False


@dataclass
class _Counters:
    rounds: int = 0
    provider_calls: int = 0
    aborts_done: int = 0
    final_text: str = ""
    last_tool: str | None = None
    kept: list[str] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)


@workflow.defn(name=AGENT_TASK_WORKFLOW)
class AgentTask:
    """One agent task: a turn loop over sampling and tool activities."""

    @workflow.init
    def __init__(self, inp: AgentTaskInput) -> None:
        self._inp = inp
        self._stream = WorkflowStream()
        self._events = self._stream.topic(EVENTS_TOPIC, type=TaskEvent)
        self._rows: list[LedgerRow] = []
        self._flushed_seq = 0
        self._sampled_upto = 0
        self._n = _Counters()
        self._state = "running"
        self._interrupt_pending = False
        self._inbox: list[str] = []
        self._result: AgentTaskResult | None = None

    # ------------------------------------------------------------------ run

    @workflow.run
    async def run(self, inp: AgentTaskInput) -> AgentTaskResult:
        """Run the task until the model ends its turn, a limit, or an engine error.

        Returns:
            The task result; the workflow completes (never fails) for every
            outcome, so no workflow retry re-runs a task from the top.
        """
        self._append("prompt", text=inp.prompt)
        while True:
            end = await self._run_turn()
            if end is not None:
                break
            # The turn was interrupted: wait for the user's next message.
            self._state = "waiting"
            await workflow.wait_condition(lambda: bool(self._inbox))
            self._state = "running"
        return await self._finish(end)

    async def _run_turn(self) -> _End | None:
        """Run rounds until the turn ends; ``None`` when a user interrupted it."""
        limits = self._inp.limits
        while True:
            self._drain_inbox()
            if self._n.rounds >= limits.max_rounds:
                return _End("stopped", f"max rounds ({limits.max_rounds}) reached")
            self._n.rounds += 1
            self._publish("turn_started")
            sampling = self._start_sampling()
            await workflow.wait_condition(lambda: self._interrupt_pending or sampling.done())
            if self._interrupt_pending:
                await self._abort_turn(sampling, [])
                return None
            try:
                result: SamplingResult = sampling.result()
            except ActivityError as err:
                self._count_failed_attempts(err)
                return _End("failed", _activity_failure_reason(err))
            self._n.provider_calls += result.attempt
            self._flushed_seq = max(self._flushed_seq, self._sampled_upto)

            if result.refusal is not None:
                return self._stop_refused(result)
            if result.text or result.tool_calls:
                self._append(
                    "assistant", text=result.text, tool_calls=list(result.tool_calls)
                )
                if result.text:
                    self._n.final_text = result.text
                    self._publish("assistant_text", text=result.text)
            if not result.tool_calls:
                if self._inbox:
                    continue  # a message arrived during the turn: answer it
                if result.stop_reason == "max_tokens":
                    return _End("stopped", "the model's output was cut off at max_tokens")
                return _End("completed", "the model ended its turn")

            blocked = policies.untriaged_calls(result)
            for call in result.tool_calls:
                if call.id in blocked:
                    self._append_tool_result(call, RespondToModel(text=blocked[call.id], ok=False))
            runnable = [c for c in result.tool_calls if c.id not in blocked]
            if not runnable:
                continue
            end = await self._run_tools(runnable)
            if end is _ABORTED:
                return None
            if end is not None:
                return end  # type: ignore[return-value]

    def _start_sampling(self) -> Any:
        pending = self._pending_rows()
        self._sampled_upto = self._rows[-1].seq
        limits = self._inp.limits
        return workflow.start_activity(
            SAMPLE_ACTIVITY,
            SampleInput(
                task_id=workflow.info().workflow_id,
                model=self._inp.model,
                base_url=self._inp.base_url,
                pending_rows=pending,
                upto_seq=self._sampled_upto,
                system=self._inp.system,
                max_tokens=limits.max_tokens,
                stream=self._inp.stream,
            ),
            result_type=SamplingResult,
            task_queue=self._inp.host_task_queue,
            start_to_close_timeout=timedelta(seconds=limits.sampling_timeout_s),
            heartbeat_timeout=timedelta(seconds=limits.heartbeat_timeout_s),
            retry_policy=SAMPLING_RETRY,
            cancellation_type=workflow.ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
            summary=f"sample round {self._n.rounds}",
        )

    async def _run_tools(self, calls: list[ToolCall]) -> _End | object | None:
        """Run a turn's tool calls concurrently; append each result as it arrives.

        A child ending early (one call timing out or failing) never cancels
        its siblings or the turn: each result is just data (seed 002).

        Returns:
            ``_End`` for a ``Fatal`` outcome, ``_ABORTED`` when a user
            interrupt aborted the turn, else ``None``.
        """
        limits = self._inp.limits
        running: list[_RunningCall] = []
        for call in calls:
            handle = workflow.start_activity(
                TOOL_ACTIVITY,
                ToolCallInput(
                    task_id=workflow.info().workflow_id,
                    call=call,
                    workspace=self._inp.workspace,
                    timeout_s=limits.tool_timeout_s,
                    kill_grace_s=limits.interrupt_grace_s,
                ),
                result_type=ToolOutcome,
                task_queue=self._inp.host_task_queue,
                start_to_close_timeout=timedelta(seconds=limits.tool_timeout_s + 60),
                heartbeat_timeout=timedelta(seconds=limits.heartbeat_timeout_s),
                retry_policy=TOOL_RETRY,
                cancellation_type=workflow.ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
                summary=f"{call.name} ({call.id})",
            )
            running.append(_RunningCall(call, handle, workflow.now()))
            self._n.last_tool = call.name
            self._publish("tool_call_started", call_id=call.id, tool_name=call.name)

        fatal: Fatal | None = None
        while not all(r.settled for r in running):
            await workflow.wait_condition(
                lambda: self._interrupt_pending
                or any(r.handle.done() and not r.settled for r in running)
            )
            if self._interrupt_pending:
                await self._abort_turn(
                    None,
                    [r for r in running if not r.settled],
                    finished=[r.call.id for r in running if r.settled],
                )
                return _ABORTED
            for r in running:
                if r.settled or not r.handle.done():
                    continue
                r.settled = True
                outcome = self._tool_outcome(r)
                match outcome:
                    case RespondToModel():
                        self._append_tool_result(r.call, outcome)
                    case Fatal():
                        fatal = fatal or outcome
                        self._append_tool_result(
                            r.call, RespondToModel(text=f"engine error: {outcome.reason}", ok=False)
                        )
        if fatal is not None:
            return _End("failed", fatal.reason)
        return None

    def _tool_outcome(self, r: _RunningCall) -> RespondToModel | Fatal:
        """The outcome of a finished tool activity; a lost one becomes a receipt."""
        try:
            return r.handle.result()
        except ActivityError as err:
            # The activity never reported (worker crash, heartbeat timeout):
            # never re-run silently — tell the model (DESIGN §5).
            return RespondToModel(
                text=policies.lost_receipt(r.call, _activity_failure_reason(err)), ok=False
            )

    # -------------------------------------------------------------- abort

    async def _abort_turn(
        self,
        sampling: Any | None,
        running: list[_RunningCall],
        finished: list[str] | None = None,
    ) -> None:
        """Abort the current turn: signal, grace, irreversible step (seed 002).

        1. Request cancellation of the turn's activities (a signal, not a
           kill: activities learn it on their next heartbeat and SIGTERM
           their process groups).
        2. Wait the grace period for them to finish cooperatively. A call
           that reached its terminal state returns its real result: kept.
        3. The irreversible step: stop waiting. Every call not finished gets
           an "aborted by user" receipt, and its process group is SIGKILLed
           by the flush activity; a result arriving later is ignored. A
           sampling call in flight is dropped whole.
        4. Append the ``turn_aborted`` marker; fsync the ledger; only then
           publish ``turn_aborted`` (a watcher may re-read the file at once).

        Args:
            sampling: The in-flight sampling activity, if any.
            running: The turn's tool calls that had not finished.
            finished: Ids of the turn's calls that finished before the
                interrupt (their results are already in the ledger).
        """
        # 1. signal
        handles = [h for h in ([sampling] if sampling else []) + [r.handle for r in running]]
        for h in handles:
            if not h.done():
                h.cancel()
        # 2. grace
        if any(not h.done() for h in handles):
            try:
                await workflow.wait_condition(
                    lambda: all(h.done() for h in handles),
                    timeout=timedelta(seconds=self._inp.limits.interrupt_grace_s),
                )
            except asyncio.TimeoutError:
                pass
        # 3. irreversible: decide from what has arrived, ignore the rest.
        if sampling is not None and sampling.done() and not sampling.cancelled():
            if sampling.exception() is None:
                self._n.provider_calls += sampling.result().attempt
                self._flushed_seq = max(self._flushed_seq, self._sampled_upto)
        now = workflow.now()
        kill: list[str] = []
        kept: list[str] = list(finished or [])
        aborted: list[str] = []
        for r in running:
            outcome = _settled_outcome(r.handle)
            if isinstance(outcome, RespondToModel) and outcome.terminal:
                self._append_tool_result(r.call, outcome)
                kept.append(r.call.id)
                continue
            elapsed = (now - r.started_at).total_seconds()
            partial = outcome.text if isinstance(outcome, RespondToModel) else ""
            text = partial if partial.startswith("aborted by user") else (
                policies.aborted_receipt(r.call, elapsed, partial)
            )
            self._append_tool_result(
                r.call,
                RespondToModel(text=text, ok=True, terminal=False, aborted=True, elapsed_s=elapsed),
            )
            aborted.append(r.call.id)
            kill.append(r.call.id)
        self._append("turn_aborted", text=policies.turn_aborted_marker(), meta={"aborted": aborted})
        # 4. flush (fsync) before the event.
        await self._flush(kill_calls=kill)
        self._n.kept, self._n.aborted = kept, aborted
        self._publish("turn_aborted", text="turn aborted by user")
        self._interrupt_pending = False
        self._n.aborts_done += 1

    # ------------------------------------------------------------- finish

    def _stop_refused(self, result: SamplingResult) -> _End:
        """A refusal is the task's outcome (seed 000): stop now, keep the scene."""
        refusal = result.refusal
        assert refusal is not None
        if result.text:
            self._append("assistant", text=result.text)
            self._n.final_text = result.text
        self._append(
            "provider-refusal-stop",
            model_visible=False,
            meta={
                "provider": refusal.provider,
                "category": refusal.category,
                "round": self._n.rounds,
                "last_tool": self._n.last_tool,
            },
        )
        category = f" ({refusal.category})" if refusal.category else ""
        return _End("stopped", f"refused by {refusal.provider}{category}", refused=True)

    async def _finish(self, end: _End) -> AgentTaskResult:
        self._state = "finishing"
        await self._flush(close_shells=end.status == "completed")
        self._result = AgentTaskResult(
            task_id=workflow.info().workflow_id,
            status=end.status,  # type: ignore[arg-type]
            refused=end.refused,
            reason=end.reason,
            rounds=self._n.rounds,
            final_text=self._n.final_text,
            provider_calls=self._n.provider_calls,
        )
        self._state = end.status
        self._publish("task_finished", text=end.reason, result=self._result)
        await workflow.wait_condition(workflow.all_handlers_finished)
        return self._result

    async def _flush(self, *, kill_calls: list[str] | None = None, close_shells: bool = False) -> None:
        """Append pending rows to the ledger file and fsync (one activity)."""
        pending = self._pending_rows()
        if not pending and not kill_calls and not close_shells:
            return
        last = await workflow.execute_activity(
            LEDGER_FLUSH_ACTIVITY,
            LedgerFlushInput(
                task_id=workflow.info().workflow_id,
                rows=pending,
                kill_calls=kill_calls or [],
                close_shells=close_shells,
            ),
            result_type=int,
            task_queue=self._inp.host_task_queue,
            start_to_close_timeout=timedelta(seconds=30),
            retry_policy=FLUSH_RETRY,
            summary="ledger flush",
        )
        self._flushed_seq = max(self._flushed_seq, last)

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

        Idempotent: with no turn running, or an interrupt already in
        progress, it returns at once and adds nothing.
        """
        if self._state != "running" or self._interrupt_pending:
            return InterruptResult(interrupted=False, last_seq=self._flushed_seq)
        self._interrupt_pending = True
        target = self._n.aborts_done + 1
        await workflow.wait_condition(lambda: self._n.aborts_done >= target)
        return InterruptResult(
            interrupted=True,
            aborted_calls=list(self._n.aborted),
            kept_calls=list(self._n.kept),
            last_seq=self._flushed_seq,
        )

    @workflow.update
    async def message(self, text: str) -> MessageAck:
        """Send the task a user message: answered in the current turn, or
        starting a new one when the task is waiting after an interrupt."""
        self._inbox.append(text)
        return MessageAck(accepted=True, state=self._state)

    @message.validator
    def _validate_message(self, text: str) -> None:
        if not text.strip():
            raise ValueError("message is empty")
        if self._state not in ("running", "waiting"):
            raise ValueError(f"task is {self._state}; it takes no more messages")

    @workflow.query
    def status(self) -> TaskStatus:
        """The task's state, round, ledger length and result when ended."""
        return TaskStatus(
            task_id=workflow.info().workflow_id,
            state=self._state if self._state != "finishing" else "running",  # type: ignore[arg-type]
            round=self._n.rounds,
            rows=len(self._rows),
            result=self._result,
        )

    @workflow.query
    def ledger(self) -> list[LedgerRow]:
        """The ledger as workflow state (equals the JSONL file once flushed)."""
        return list(self._rows)

    # ------------------------------------------------------------ helpers

    def _append(self, kind: RowKind, *, model_visible: bool = True, **fields: Any) -> LedgerRow:
        row = LedgerRow(
            seq=len(self._rows) + 1,
            kind=kind,
            round=self._n.rounds,
            model_visible=model_visible,
            at=workflow.now(),
            **fields,
        )
        self._rows.append(row)
        return row

    def _append_tool_result(self, call: ToolCall, outcome: RespondToModel) -> None:
        meta: dict[str, Any] = {"elapsed_s": round(outcome.elapsed_s, 3)}
        if outcome.aborted:
            meta["aborted"] = True
        if outcome.output_ref:
            meta["output_ref"] = outcome.output_ref
        self._append(
            "tool_result",
            text=outcome.text,
            call_id=call.id,
            tool_name=call.name,
            ok=outcome.ok,
            meta=meta,
        )
        self._publish(
            "tool_call_finished", call_id=call.id, tool_name=call.name, ok=outcome.ok,
            text=outcome.text[:200],
        )

    def _pending_rows(self) -> list[LedgerRow]:
        return [r for r in self._rows if r.seq > self._flushed_seq]

    def _drain_inbox(self) -> None:
        for text in self._inbox:
            self._append("user_message", text=text)
        self._inbox.clear()

    def _publish(self, kind: str, **fields: Any) -> None:
        self._events.publish(
            TaskEvent(kind=kind, round=self._n.rounds, last_seq=self._flushed_seq, **fields)  # type: ignore[arg-type]
        )

    def _count_failed_attempts(self, err: ActivityError) -> None:
        cause = err.cause
        if isinstance(cause, ApplicationError) and cause.details:
            detail = cause.details[0]
            if isinstance(detail, dict):
                self._n.provider_calls += int(detail.get("attempt", 1))
                return
        self._n.provider_calls += 1


def _settled_outcome(handle: Any) -> RespondToModel | Fatal | None:
    """The outcome of a handle that finished with a value; else ``None``."""
    if not handle.done() or handle.cancelled():
        return None
    try:
        return handle.result()
    except (ActivityError, asyncio.CancelledError):
        return None


def _activity_failure_reason(err: ActivityError) -> str:
    """A one-line reason from an activity failure (provider, status, what)."""
    cause = err.cause
    parts = []
    while cause is not None:
        parts.append(str(cause.message if hasattr(cause, "message") else cause))
        cause = cause.cause
    return "; ".join(p for p in parts if p) or str(err)
