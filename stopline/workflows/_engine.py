"""The turn engine shared by ``AgentTask`` and ``ChatThread``.

One turn (read top to bottom in :meth:`TurnEngine._run_turn`):

1. Drain queued user messages and external increments into the ledger;
   sample (one activity: it flushes pending ledger rows, reads the
   transcript by reference, calls the model).
2. A refusal goes to the disposition matrix (seed 000): a task stops at
   once; a chat thread quarantines unaccepted increments and retries the
   same provider, bounded, then stops with one critical notification; a fix
   task may switch candidate. No tool of a refused turn runs.
3. No tool call: the turn ends. Tool calls that must not run (output cut at
   max_tokens, unparsable arguments) get error results; the rest run
   concurrently — workspace tools as activities on the host's task queue,
   sub-task tools in the workflow — each at most once.
4. Each result is appended as it arrives; then sample again.

A user interrupt is level-triggered state checked after every activity
returns; :meth:`TurnEngine._abort_turn` is the one function that aborts a
turn, in the order seed 002 gives. A tool failure is a tool result, never a
turn failure (DESIGN §2).

Deterministic code only: no I/O, no clocks but ``workflow.now()``. This run's
ledger rows live here as state; activities mirror them to the JSONL file,
which is the reference carried over continue-as-new.
"""

from __future__ import annotations

import asyncio
import json
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.contrib.workflow_streams import WorkflowStream
from temporalio.exceptions import ActivityError, ApplicationError

from stopline.workflows._ledger import LedgerMixin
from stopline.workflows._placement import HostLost, PlacementMixin
from stopline.workflows._refusal import RefusalMixin
from stopline.workflows._state import (
    ABORT_ONCE_PATCH,
    ABORT_SURVIVES_STOP_PATCH,
    ABORTED,
    INTERRUPT_JOINS_PATCH,
    PUSH_CANCEL_PATCH,
    PUSH_CANCEL_RETRY,
    PUSH_CANCEL_TIMEOUT,
    RELEASE_POLLS_PATCH,
    CANCEL_ANSWER_MARGIN_S,
    ROUND_TOOLS_PATCH,
    SAMPLING_RETRY,
    STREAM_ITEMS_CARRIED,
    TOOL_RETRY,
    Resolved,
    Unanswered,
    activity_failure_reason,
    is_dropped_sampling,
    is_lost,
    lost_round_error,
    recorded_round,
    sampling_failure_reason,
    sampling_requests,
    settled_outcome,
)
from stopline.workflows._subtasks import SubtaskMixin

with workflow.unsafe.imports_passed_through():
    from stopline.core import policies, refusal
    from stopline.core.contracts import (
        CANCEL_CALLS_ACTIVITY,
        EVENTS_TOPIC,
        FATAL_TOOL_ERROR,
        ActivityTool,
        RefusalStop,
        SAMPLE_ACTIVITY,
        TOOL_ACTIVITY,
        AgentTaskResult,
        CancelCallsInput,
        CancelCallsResult,
        Fatal,
        InterruptResult,
        LedgerRow,
        ModelCandidate,
        ROUND_RECORD_ACTIVITY,
        RespondToModel,
        RoundRecord,
        RoundRecordInput,
        RoundTools,
        SampleInput,
        SamplingResult,
        TaskEvent,
        TaskLimits,
        TaskStatus,
        ThreadCarry,
        ToolCall,
        ToolCallInput,
        ToolOutcome,
    )
    from stopline.core.task_tools import TASK_TOOL_NAMES
    from stopline.core.turn_state import Child, Counters, End, RunningCall


class TurnEngine(LedgerMixin, PlacementMixin, RefusalMixin, SubtaskMixin):
    """The turn loop and the abort path, over the ledger, placement, refusal
    and sub-task parts (:mod:`._ledger`, :mod:`._placement`,
    :mod:`._refusal`, :mod:`._subtasks`).

    Subclasses set ``self._inp`` (an input with ``model``, ``base_url``,
    ``workspace``, ``limits``, ``host_task_queue``, ``system``, ``stream``,
    ``route``, ``execution_scope``, ``usage_source``, ``candidates``,
    ``quarantine_retries``, ``reprobe_limit``, ``carry``) and call
    :meth:`_init_engine` from their ``@workflow.init``.
    """

    _inp: Any

    _stream: WorkflowStream

    def _init_engine(self, carry: ThreadCarry | None) -> None:
        # ``self._stream`` is constructed by the subclass's __init__: the SDK
        # requires a WorkflowStream to be built directly from @workflow.init.
        self._events = self._stream.topic(EVENTS_TOPIC, type=TaskEvent)
        self._rows: list[LedgerRow] = []
        self._next_seq = carry.next_seq if carry else 1
        self._flushed_seq = carry.flushed_seq if carry else 0
        self._sampled_upto = 0
        self._n = Counters()
        if carry:
            self._n.rounds = carry.rounds
            self._n.provider_calls = carry.provider_calls
            self._n.final_text = carry.final_text
            self._n.last_tool = carry.last_tool
        self._state = "running"
        self._interrupt_pending = False
        self._inbox: list[str] = list(carry.inbox) if carry else []
        self._increments_inbox: list[tuple[str, str]] = []
        self._result: AgentTaskResult | None = None
        self._kind = refusal.thread_kind(
            self._inp.route, self._inp.execution_scope, self._inp.usage_source
        )
        self._candidates = [ModelCandidate(model=self._inp.model, base_url=self._inp.base_url)]
        self._candidates += list(self._inp.candidates)
        self._candidate = 0
        self._skipped: set[int] = set()
        self._reprobes = 0
        self._quarantine_used = 0
        self._accepted_upto = carry.accepted_upto if carry else 0
        self._unaccepted: list[int] = list(carry.unaccepted_increments) if carry else []
        self._refusal_stop: RefusalStop | None = carry.refusal_stop if carry else None
        self._turn_text = ""
        self._children: dict[str, Child] = {
            c.task_id: Child(c) for c in (carry.children if carry else [])
        }
        self._runs = carry.runs if carry else 1
        self._continuing = False
        self._notified = carry.notified if carry else False
        self._staged: dict[int, str] = {}  # seq -> staging key (DESIGN §5)
        self._inflight_sampling: Any = None
        self._sampling_runs_tools = False  # the in-flight sampling may run its round's calls
        self._sampling_started_at = workflow.now()
        self._inflight_calls: list[RunningCall] = []
        self._init_placement(carry)

    # ------------------------------------------------------------ the turn

    async def _run_turn(self) -> End | None:
        """Run rounds until the turn ends; ``None`` when a user interrupted it."""
        limits: TaskLimits = self._inp.limits
        self._quarantine_used = 0
        self._turn_text = ""
        while True:
            moved = await self._maybe_move()
            if moved is not None:
                return moved
            await self._at_round_boundary()
            self._drain_inbox()
            if self._n.rounds >= limits.max_rounds:
                return End("stopped", f"max rounds ({limits.max_rounds}) reached")
            self._n.rounds += 1
            self._publish("turn_started")
            sampling = self._start_sampling()
            self._inflight_sampling = sampling
            await workflow.wait_condition(
                lambda: self._interrupt_pending or sampling.done() or self._host_gone_now()
            )
            host_gone = False
            if not self._interrupt_pending and not sampling.done() and self._sampling_runs_tools:
                # Its host is gone, and the call may have started the round's
                # tool calls: they get their receipts before the thread moves.
                host_gone = True
                settled = await self._settle_unanswered_round(sampling)
                if settled is not None:
                    recorded = settled[0]
                    self._inflight_sampling = None
                    self._append_recorded_round(recorded)
                    label = self._host_label()
                    for call in recorded.tool_calls:
                        self._append_tool_result(call, RespondToModel(
                            text=policies.host_lost_receipt(call, label), ok=False))
                    raise HostLost(self._why_host_gone())
            if self._interrupt_pending:
                if not workflow.patched(ABORT_SURVIVES_STOP_PATCH):
                    self._inflight_sampling = None
                # else left set, as the tool calls are while their abort
                # runs: a task_stop that cancels this abort part-way aborts
                # the sampling call again (its round recorded), instead of
                # finding nothing in flight and losing the round
                await self._abort_turn(sampling, [])
                return None
            self._inflight_sampling = None
            if not sampling.done():
                sampling.cancel()  # its host is gone; the next host samples again
                # its requests still count once the abandoned call resolves
                # (a timeout carries the last heartbeat's request count)
                asyncio.create_task(self._count_abandoned(sampling))
                raise HostLost(self._why_host_gone())
            try:
                result: SamplingResult = sampling.result()
            except ActivityError as err:
                ran = self._record_lost_round(err)
                if ran:
                    # the round's calls were lost with their worker: each has
                    # its receipt; the model goes on (or the thread moves)
                    end = await self._run_tools(ran[0], preset=ran[1])
                    if isinstance(end, End):
                        return end
                    if host_gone or self._lost_host_of(err) or self._host_gone_now():
                        raise HostLost(self._why_host_gone()) from None
                    continue
                if host_gone:
                    self._count_failed_attempts(err)  # its requests were made
                    raise HostLost(self._why_host_gone()) from None
                if self._lost_host_of(err):
                    raise HostLost("a model call on it was never picked up") from None
                self._count_failed_attempts(err)
                return End("failed", sampling_failure_reason(
                    err, self._candidates[self._candidate].model,
                    attempt_timeout_s=limits.sampling_timeout_s,
                    total_timeout_s=limits.sampling_total_timeout_s,
                ))
            self._n.provider_calls += result.attempt
            self._flushed_seq = max(self._flushed_seq, self._sampled_upto)

            if result.refusal is not None:
                end = self._on_refusal(result)
                if end is None:
                    continue  # quarantined / switched: sample again
                return end
            problem = policies.response_shape_problem(result)
            if problem is not None:
                # an engine error: nothing of this response is stored or run
                return End("failed", f"{result.provider} response: {problem}")
            self._accept_increments()
            self._append_response(result)
            if result.tool_outcomes is not None:
                # the sampling activity ran the round's calls (DESIGN §1)
                end = await self._run_tools(list(result.tool_calls), preset={
                    c.id: Resolved(value=result.tool_outcomes[c.id]) for c in result.tool_calls
                })
                if end is ABORTED:
                    return None
                if isinstance(end, End):
                    return end
                if host_gone:
                    raise HostLost(self._why_host_gone())
                continue
            if not result.tool_calls:
                if self._inbox:
                    continue  # a message arrived during the turn: answer it
                if result.stop_reason == "max_tokens":
                    return End("stopped", "the model's output was cut off at max_tokens")
                if result.stop_reason == "other":
                    return End(
                        "stopped",
                        f"the model's turn ended with stop_reason {result.raw_stop_reason!r}, "
                        f"not a finished answer",
                    )
                return End("completed", "the model ended its turn")

            blocked = policies.untriaged_calls(result)
            for call in result.tool_calls:
                if call.id in blocked:
                    self._append_tool_result(call, RespondToModel(text=blocked[call.id], ok=False))
            runnable = [c for c in result.tool_calls if c.id not in blocked]
            if not runnable:
                continue
            end = await self._run_tools(runnable)
            if end is ABORTED:
                return None
            if isinstance(end, End):
                return end

    async def _at_round_boundary(self) -> None:
        """Hook between rounds (AgentTask continues-as-new here)."""

    def _append_response(self, result: SamplingResult, *, staged: bool = True) -> None:
        """Append the model's message of a round (never an empty one).

        Args:
            result: The response.
            staged: The sampling activity staged it on the host (the row then
                travels by reference, DESIGN §5); ``False`` for a response
                recovered from a lost call's heartbeat.
        """
        text = result.text if result.text.strip() else ""
        if not (text or result.tool_calls):
            return
        row = self._append("assistant", text=text, tool_calls=list(result.tool_calls))
        if staged and text == result.text:  # exactly what the sampling activity staged
            self._staged[row.seq] = f"round-{self._n.rounds}"
        if text:
            self._n.final_text = text
            self._turn_text = text
            self._publish("assistant_text", text=text)

    async def _settle_unanswered_round(self, sampling: Any, *, answer_s: float = 0.0) -> tuple[SamplingResult, bool] | None:
        """A sampling activity that runs its round's tool calls has not
        answered, and the thread will not wait for it (its host is gone; an
        abort's push did not reach it in the grace): cancel it without
        losing a call.

        Temporal alone still holds what it recorded — the response, in its
        last heartbeat, before any call started (DESIGN §1) — and a cancel
        closes a retry that waits for a gone host at once, details and all.
        So ``stopline.round_record`` (on the workflow queue: any worker
        answers) reads it first; then the cancel is requested. From then on
        the activity cannot start a call (its recording heartbeat is answered
        "cancelled"), so an attempt that had recorded nothing yet is read once
        more, for a response recorded in between. When a read fails, or the
        activity closed meanwhile, its own answer is awaited (bounded by its
        timeouts) and decides.

        Args:
            sampling: The activity's handle.
            answer_s: How long an attempt that recorded a response and may
                still run (its worker alive, the push not served) is given to
                answer Temporal's cancel with its calls' real outcomes — a call
                that had finished keeps its result (DESIGN §3). ``0`` (the
                host is gone): not at all.

        Returns:
            ``(response, lost)`` — the recorded response whose calls may
            have run, and whether the attempt that ran them is over (its
            worker lost; a retry waits) rather than possibly still running —
            or ``None``: nothing of the round ran, or ``sampling`` has the
            answer.
        """
        record = await self._read_round_record()
        if sampling.done():
            return None  # it answered meanwhile: its answer says it all
        sampling.cancel()
        if record is not None and record.pending and record.started and record.response is None:
            record = await self._read_round_record()
            if sampling.done():
                return None
        if record is None or not record.pending:
            await workflow.wait_condition(sampling.done)  # its answer decides
            return None
        if record.response is None:
            return None  # no call of the round started
        if answer_s > 0 and not record.calls_lost:
            try:
                await workflow.wait_condition(sampling.done, timeout=timedelta(seconds=answer_s))
                return None  # it answered: its outcomes decide
            except asyncio.TimeoutError:
                pass
        # its requests count (DESIGN §5); an answer that comes later is ignored
        self._n.provider_calls += max(record.requests, 1)
        return record.response, record.calls_lost

    def _append_recorded_round(self, response: SamplingResult) -> None:
        """Append a round's response read from its record (its calls ran or
        may have: their receipts follow), with the increments before it."""
        self._accept_increments()
        self._append_response(response, staged=False)
        self._note_calls(response.tool_calls)

    def _note_calls(self, calls: list[ToolCall]) -> None:
        """Remember a round's calls as the last ones made (a result's evidence)."""
        if calls:
            self._n.last_tool = calls[-1].name
            self._n.last_tool_args = calls[-1].raw_arguments

    async def _read_round_record(self) -> RoundRecord | None:
        """``stopline.round_record`` of this run; ``None`` when it failed."""
        info = workflow.info()
        try:
            return await workflow.execute_activity(
                ROUND_RECORD_ACTIVITY,
                RoundRecordInput(workflow_id=info.workflow_id, run_id=info.run_id),
                result_type=RoundRecord,
                task_queue=info.task_queue,
                start_to_close_timeout=timedelta(seconds=10),
                schedule_to_close_timeout=timedelta(seconds=30),
                retry_policy=RetryPolicy(maximum_attempts=3),
                summary="read the round in flight",
            )
        except ActivityError:
            return None

    def _record_lost_round(self, err: ActivityError) -> tuple[list[ToolCall], dict[str, Resolved]] | None:
        """A sampling call lost after it started its round's tool calls:
        append the response it recorded; each call then stands for a lost
        ``stopline.tool`` activity (a receipt, never a re-run — DESIGN §5).

        Returns:
            The round's calls and their stand-in handles, or ``None`` when
            the call recorded no round (nothing of it ran).
        """
        if not self._sampling_runs_tools:
            return None
        found = recorded_round(err)
        if found is None:
            return None
        self._count_failed_attempts(err)
        self._flushed_seq = max(self._flushed_seq, self._sampled_upto)
        self._append_recorded_round(found)
        return list(found.tool_calls), {c.id: Resolved(error=err) for c in found.tool_calls}

    async def _turn(self) -> End | None:
        """Run a turn; when its host is lost, move (DESIGN §7) and go on.

        Returns:
            How the turn ended; ``None`` when a user interrupt aborted it.
        """
        while True:
            try:
                if self._host_gone():
                    raise HostLost(self._why_host_gone())
                return await self._run_turn()
            except HostLost as lost:
                end = await self._recover_host(lost.why)
                if end is not None:
                    return end

    async def _lose_host_calls(self, running: list[RunningCall]) -> End | None:
        """The host went while tool calls ran on it: each unfinished call gets
        a "lost" receipt (it may have partly run; it is never re-run), then the
        thread moves. Sub-task tools run in the workflow and go on."""
        label = self._host_label()
        for r in running:
            if not r.settled and self._runs_on_host(r.call):
                r.settled = True
                if not r.handle.done():
                    r.handle.cancel()
                self._append_tool_result(
                    r.call, RespondToModel(text=policies.host_lost_receipt(r.call, label), ok=False)
                )
        return await self._recover_host(self._why_host_gone())

    def _round_tools(self) -> RoundTools | None:
        """What the sampling activity needs to run the round's tool calls
        itself (DESIGN §1), or ``None`` when every call stays its own
        activity (``TaskLimits.round_tools`` off, or a history from before)."""
        limits: TaskLimits = self._inp.limits
        if not limits.round_tools or not workflow.patched(ROUND_TOOLS_PATCH):
            return None
        return RoundTools(
            workspace=self._inp.workspace,
            timeout_s=limits.tool_timeout_s,
            kill_grace_s=limits.interrupt_grace_s,
            output_cap_bytes=limits.tool_output_cap_bytes,
            network=limits.tool_network,
            allow_unconfined=limits.allow_unconfined,
            env=limits.tool_env,
            elsewhere=[t.name for t in self._inp.tools],
        )

    def _start_sampling(self) -> Any:
        pending = self._pending_rows()
        self._sampled_upto = self._next_seq - 1
        limits: TaskLimits = self._inp.limits
        cand = self._candidates[self._candidate]
        round_tools = self._round_tools()
        self._sampling_runs_tools = round_tools is not None
        self._sampling_started_at = workflow.now()
        return workflow.start_activity(
            SAMPLE_ACTIVITY,
            SampleInput(
                task_id=workflow.info().workflow_id,
                model=cand.model,
                base_url=cand.base_url,
                pending_rows=pending,
                upto_seq=self._sampled_upto,
                system=self._inp.system,
                toolset="workspace+tasks",
                max_tokens=limits.max_tokens,
                stream=self._inp.stream,
                thread_kind=self._kind,
                round=self._n.rounds,
                chain_id=workflow.info().first_execution_run_id,
                extra_tools=[t.spec() for t in self._inp.tools],
                temperature=limits.temperature,
                top_p=limits.top_p,
                round_tools=round_tools,
                # an attached watcher has a poll in flight (a handler)
                watched=not workflow.all_handlers_finished(),
            ),
            result_type=SamplingResult,
            task_queue=self._host_queue(),
            **self._host_bound(),
            start_to_close_timeout=timedelta(seconds=limits.sampling_timeout_s),
            schedule_to_close_timeout=timedelta(seconds=limits.sampling_total_timeout_s),
            heartbeat_timeout=timedelta(seconds=limits.heartbeat_timeout_s),
            retry_policy=SAMPLING_RETRY,
            cancellation_type=workflow.ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
            # No summary: its input already names the round and the model,
            # and the SDK carries a summary as one more payload, encoded
            # through the workflow sandbox three times per workflow task
            # (~0.5 ms of worker CPU per round at 50 busy tasks).
        )

    # --------------------------------------------------------------- tools

    async def _run_tools(
        self, calls: list[ToolCall], preset: dict[str, Resolved] | None = None
    ) -> End | object | None:
        """Run a turn's tool calls concurrently; append each result as it arrives.

        A child ending early (one call timing out or failing) never cancels
        its siblings or the turn: each result is just data (seed 002).

        Args:
            calls: The calls, in the response's order.
            preset: Calls the sampling activity already ran (DESIGN §1): their
                outcomes (or the loss of their worker), by call id; they
                settle like finished tool activities.

        Returns:
            ``End`` for a ``Fatal`` outcome, :data:`ABORTED` when a user
            interrupt aborted the turn, else ``None``.
        """
        running: list[RunningCall] = []
        own = {t.name: t for t in self._inp.tools}
        for call in calls:
            if preset is not None and call.id in preset:
                handle: Any = preset[call.id]
            elif call.name in TASK_TOOL_NAMES:
                handle = asyncio.create_task(self._run_task_tool(call))
            elif call.name in own:
                handle = asyncio.create_task(self._run_activity_tool(call, own[call.name]))
            else:
                handle = self._start_tool_activity(call)
            running.append(RunningCall(call, handle, workflow.now()))
            self._n.last_tool = call.name
            self._n.last_tool_args = call.raw_arguments
            self._publish("tool_call_started", call_id=call.id, tool_name=call.name)

        self._inflight_calls = running
        fatal: Fatal | None = None
        lost: list[str] = []
        while not all(r.settled for r in running):
            await workflow.wait_condition(
                lambda: self._interrupt_pending
                or self._host_gone_now()
                or any(r.handle.done() and not r.settled for r in running)
            )
            if self._interrupt_pending:
                await self._abort_turn(
                    None,
                    [r for r in running if not r.settled],
                    finished=[r.call.id for r in running if r.settled],
                )
                return ABORTED
            if self._host_gone_now() and not any(r.handle.done() and not r.settled for r in running):
                end = await self._lose_host_calls(running)
                if end is not None:
                    return end
                continue
            for r in running:
                if r.settled or not r.handle.done():
                    continue
                r.settled = True
                err = _failure(r.handle)
                if err is not None and self._lost_host_of(err):
                    self._mark_host_lost("a tool call on it was never picked up")
                    self._append_tool_result(r.call, RespondToModel(
                        text=policies.host_lost_receipt(r.call, self._host_label()), ok=False))
                    continue
                outcome = self._tool_outcome(r)
                if is_lost(r.handle):
                    lost.append(r.call.id)
                match outcome:
                    case RespondToModel():
                        self._append_tool_result(r.call, outcome, staged=not is_lost(r.handle))
                    case Fatal():
                        fatal = fatal or outcome
                        self._append_tool_result(
                            r.call, RespondToModel(text=f"engine error: {outcome.reason}", ok=False)
                        )
        self._inflight_calls = []
        if lost:
            # A call lost with its worker may still be running on the host:
            # its process group goes before the model sees the receipt, so
            # nothing of it keeps writing while the task goes on (DESIGN §5).
            # A host that is itself gone kills them when it comes back (its
            # worker reaps what a dead predecessor left at start-up).
            try:
                await self._flush(kill_calls=lost)
            except HostLost:
                pass
        if fatal is not None:
            return End("failed", fatal.reason)
        return None

    def _start_tool_activity(self, call: ToolCall) -> Any:
        limits: TaskLimits = self._inp.limits
        return workflow.start_activity(
            TOOL_ACTIVITY,
            ToolCallInput(
                task_id=workflow.info().workflow_id,
                call=call,
                workspace=self._inp.workspace,
                timeout_s=limits.tool_timeout_s,
                kill_grace_s=limits.interrupt_grace_s,
                output_cap_bytes=limits.tool_output_cap_bytes,
                round=self._n.rounds,
                network=limits.tool_network,
                allow_unconfined=limits.allow_unconfined,
                env=limits.tool_env,
            ),
            result_type=ToolOutcome,
            task_queue=self._host_queue(),
            **self._host_bound(),
            start_to_close_timeout=timedelta(seconds=limits.tool_timeout_s + 60),
            heartbeat_timeout=timedelta(seconds=limits.heartbeat_timeout_s),
            retry_policy=TOOL_RETRY,
            cancellation_type=workflow.ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
            summary=f"{call.name} ({call.id})",
        )

    def _runs_on_host(self, call: ToolCall) -> bool:
        """Whether a call runs on the task's host (sub-task tools run in the
        workflow; the team's own tools on their own task queue)."""
        return call.name not in TASK_TOOL_NAMES and all(t.name != call.name for t in self._inp.tools)

    async def _run_activity_tool(self, call: ToolCall, tool: ActivityTool) -> RespondToModel | Fatal:
        """Run one of the team's own activities as a tool (DESIGN §2).

        The model's arguments are the activity's input. A returned value is
        the result the model reads (a string as it is, anything else as
        JSON, capped like any tool output); an exception is a result with
        ``ok=false`` naming what failed, and the task goes on; only
        :data:`FATAL_TOOL_ERROR` is ``Fatal``. A cancel (an interrupt) goes to
        the activity as Temporal's activity cancel.
        """
        limits: TaskLimits = self._inp.limits
        try:
            value = await workflow.execute_activity(
                tool.activity,
                call.arguments or {},
                task_queue=tool.task_queue or workflow.info().task_queue,
                start_to_close_timeout=timedelta(seconds=tool.start_to_close_s),
                heartbeat_timeout=(
                    timedelta(seconds=tool.heartbeat_timeout_s) if tool.heartbeat_timeout_s else None
                ),
                retry_policy=RetryPolicy(maximum_attempts=max(1, tool.max_attempts)),
                cancellation_type=workflow.ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
                summary=f"{call.name} ({call.id})",
            )
        except ActivityError as err:
            cause = err.cause
            if isinstance(cause, ApplicationError) and cause.type == FATAL_TOOL_ERROR:
                return Fatal(reason=f"{call.name}: {cause.message}")
            return RespondToModel(text=f"{call.name} failed: {activity_failure_reason(err)}", ok=False)
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
        return RespondToModel(text=policies.cap_text(text, limits.tool_output_cap_bytes))

    def _tool_outcome(self, r: RunningCall) -> RespondToModel | Fatal:
        """The outcome of a finished tool call; a lost one becomes a receipt."""
        try:
            return r.handle.result()
        except ActivityError as err:
            # The activity never reported (worker crash, heartbeat timeout):
            # never re-run silently — tell the model (DESIGN §5).
            return RespondToModel(
                text=policies.lost_receipt(r.call, activity_failure_reason(err)), ok=False
            )
        except Exception as err:  # a sub-task tool raised: a tool result, not a turn failure
            return RespondToModel(text=f"tool {r.call.name} raised {type(err).__name__}: {err}", ok=False)

    # -------------------------------------------------------------- abort

    async def _abort_turn(
        self,
        sampling: Any | None,
        running: list[RunningCall],
        finished: list[str] | None = None,
    ) -> None:
        """Abort the current turn: signal, grace, irreversible step (seed 002).

        1. Signal — a cancel request, not a kill — by two paths at once: the
           push (:meth:`_push_cancel`: the control activity on the calls'
           host hands the cancel to the worker's registry of running calls,
           which delivers it at once) and Temporal's activity cancel (the
           fallback: it reaches a call on its next heartbeat, within one
           heartbeat interval, if the push cannot be delivered). A call gets
           the cancel once, whichever arrives first.
        2. Grace. Each activity owns the grace from the moment the cancel
           reaches it: a tool SIGTERMs its group, waits ``kill_grace_s``
           (= the grace), SIGKILLs it and reports what it captured; sampling
           drops its request at once. A call that reached its terminal state
           returns its real result: kept. The workflow waits for those
           answers, bounded by a server timer of the grace — Temporal fires
           sub-second timers after about a second, so that bound only
           matters for an activity the cancel did not reach (push lost and
           no heartbeat yet, or its worker died; the flush below kills its
           group).
        3. The irreversible step: stop waiting. Every call not finished gets
           an "aborted by user" receipt, and its process group is SIGKILLed
           by the flush activity; a result arriving later is ignored. A
           sampling call in flight is dropped whole (it still counts as a
           provider call once its request was sent).
        4. Append the ``turn_aborted`` marker; fsync the ledger; only then
           publish ``turn_aborted`` (a watcher may re-read the file at once).

        Args:
            sampling: The in-flight sampling activity, if any.
            running: The turn's tool calls that had not finished.
            finished: Ids of the turn's calls that finished before the
                interrupt (their results are already in the ledger).
        """
        # 1. signal
        handles = ([sampling] if sampling else []) + [r.handle for r in running]
        round_tools = sampling is not None and self._sampling_runs_tools
        if workflow.patched(PUSH_CANCEL_PATCH):
            self._push_cancel(sampling, running)
        for h in handles:
            if not h.done() and not (round_tools and h is sampling):
                # (a sampling activity running its round's calls is cancelled
                # by Temporal only once its record is read, below)
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
        settled: tuple[SamplingResult, bool] | None = None
        if round_tools and not sampling.done():
            # It may be running its round's tool calls, which only it names:
            # the push did not reach it within the grace (no worker serves
            # the push, or its worker is gone) — learn them from Temporal.
            limits: TaskLimits = self._inp.limits
            settled = await self._settle_unanswered_round(
                sampling, answer_s=limits.heartbeat_timeout_s * policies.HEARTBEAT_TIMEOUT_FRACTION + CANCEL_ANSWER_MARGIN_S,
            )
        # 3. irreversible: decide from what has arrived, ignore the rest.
        now = workflow.now()
        if settled is not None:
            response, lost = settled
            self._append_recorded_round(response)
            # calls of a worker that is gone are lost; others did not answer
            # in the grace: aborted, their groups killed by the flush below
            gone = lost_round_error("its worker was lost before the interrupt reached it")
            running = running + [
                RunningCall(c, Resolved(error=gone) if lost else Unanswered(), self._sampling_started_at)
                for c in response.tool_calls
            ]
        if sampling is not None and sampling.done() and not sampling.cancelled():
            err = sampling.exception()
            if err is None:
                res: SamplingResult = sampling.result()
                self._n.provider_calls += res.attempt
                self._flushed_seq = max(self._flushed_seq, self._sampled_upto)
                if res.tool_outcomes is not None:
                    # its calls ran (DESIGN §1): the response and each call's
                    # one result are recorded before the marker
                    self._accept_increments()
                    self._append_response(res)
                    self._note_calls(res.tool_calls)
                    running = running + [
                        RunningCall(c, Resolved(value=o), now - timedelta(seconds=getattr(o, "elapsed_s", 0.0)))
                        for c in res.tool_calls
                        for o in [res.tool_outcomes[c.id]]
                    ]
            elif is_dropped_sampling(err):
                self._count_failed_attempts(err)  # the request was sent: it counts
            elif round_tools:
                ran = self._record_lost_round(err)
                if ran:
                    running = running + [RunningCall(c, ran[1][c.id], now) for c in ran[0]]
        kill: list[str] = []
        kept: list[str] = list(finished or [])
        aborted: list[str] = []
        for r in running:
            outcome = settled_outcome(r.handle)
            if isinstance(outcome, RespondToModel) and outcome.terminal:
                self._append_tool_result(r.call, outcome, staged=True)
                kept.append(r.call.id)
                continue
            if is_lost(r.handle):
                self._append_tool_result(r.call, self._tool_outcome(r))  # type: ignore[arg-type]
                kept.append(r.call.id)
                kill.append(r.call.id)
                continue
            elapsed = (now - r.started_at).total_seconds()
            partial = outcome.text if isinstance(outcome, RespondToModel) else ""
            text = partial if partial.startswith("aborted by user") else (
                policies.aborted_receipt(r.call, elapsed, partial)
            )
            self._append_tool_result(
                r.call,
                RespondToModel(text=text, ok=True, terminal=False, aborted=True, elapsed_s=elapsed),
                staged=bool(partial) and text == partial,
            )
            aborted.append(r.call.id)
            kill.append(r.call.id)
        self._append("turn_aborted", text=policies.turn_aborted_marker(), meta={"aborted": aborted})
        if workflow.patched(ABORT_ONCE_PATCH):
            # Every call has its one result now: a task_stop arriving during
            # the flush below finds nothing in flight to abort again.
            self._inflight_sampling, self._inflight_calls = None, []
        self._n.kept, self._n.aborted = kept, aborted
        # 4. flush (fsync) before the event. With the host gone there is no
        # file to fsync: the rows stay pending and reach the next host first
        # (the thread's loop moves it); the abort itself is complete.
        try:
            try:
                await self._flush(kill_calls=kill)
            except HostLost as lost:
                self._mark_host_lost(lost.why)
            self._publish("turn_aborted", text="turn aborted by user")
        finally:
            # also when a task_stop cancels the flush: the rows are decided
            # (the stop's own flush writes them) and the interrupt is answered
            self._interrupt_pending = False
            self._n.aborts_done += 1

    def _push_cancel(self, sampling: Any | None, running: list[RunningCall]) -> None:
        """Push the cancel to the host running the calls (DESIGN §3).

        Schedules ``stopline.cancel_calls`` on :meth:`_host_queue`, where the
        worker running the calls polls; it cancels them in process at once.
        Only the host's own calls are pushed: sub-task tools run in the
        workflow, and a team's own activity tools on the team's queue, where
        Temporal's cancel reaches them (on their next heartbeat).
        Not awaited: the abort goes on whether it runs or not — if it cannot
        (no worker polls the queue, the worker is gone), Temporal's cancel
        and the grace timer still end the turn. One attempt, bounded by
        :data:`PUSH_CANCEL_TIMEOUT`: a late push is useless.
        """
        own = {t.name for t in self._inp.tools}  # the team's tools run on the team's queue
        call_ids = [
            r.call.id for r in running
            if r.call.name not in TASK_TOOL_NAMES and r.call.name not in own and not r.handle.done()
        ]
        round_ = self._n.rounds if sampling is not None and not sampling.done() else None
        if not call_ids and round_ is None:
            return
        try:
            queue = self._host_queue()
        except HostLost:
            return  # no host holds the calls: Temporal's cancel and the grace decide
        handle = workflow.start_activity(
            CANCEL_CALLS_ACTIVITY,
            CancelCallsInput(
                task_id=workflow.info().workflow_id, call_ids=call_ids, sampling_round=round_
            ),
            result_type=CancelCallsResult,
            task_queue=queue,
            schedule_to_close_timeout=PUSH_CANCEL_TIMEOUT,
            retry_policy=PUSH_CANCEL_RETRY,
            summary=f"push cancel ({len(call_ids)} tool calls"
            + (f", sampling round {round_})" if round_ is not None else ")"),
        )
        # Nobody awaits it; its failure (not delivered) is expected and fine.
        handle.add_done_callback(lambda h: h.cancelled() or h.exception())

    async def _abort_inflight(self) -> None:
        """Abort whatever the turn has in flight (a ``task_stop``): the same
        path as an interrupt, so every call gets exactly one result."""
        sampling = self._inflight_sampling
        running = [r for r in self._inflight_calls if not r.settled]
        if sampling is None and not running:
            return
        finished = [r.call.id for r in self._inflight_calls if r.settled]
        self._inflight_sampling, self._inflight_calls = None, []
        await self._abort_turn(sampling, running, finished)

    async def _count_abandoned(self, sampling: Any) -> None:
        """Count the provider requests of a sampling call the task gave up
        on (its host was lost) when it finally resolves: ``provider_calls``
        counts every request made, whatever ended it."""
        try:
            result = await sampling
        except ActivityError as err:
            self._count_failed_attempts(err)
        except asyncio.CancelledError:
            pass
        else:
            self._n.provider_calls += result.attempt

    def _count_failed_attempts(self, err: ActivityError) -> None:
        # Every request, whatever ended the call (timeouts included).
        self._n.provider_calls += sampling_requests(err)

    async def _handlers_done(self) -> None:
        """Wait for every handler before the run completes, releasing the
        event stream's polls first: a watcher's poll waits for an event
        that will never come once ``task_finished`` is out — e.g. a poll a
        ``temporal workflow reset`` re-applied from a longer branch, for
        an offset this run never reaches. Released, it returns what there
        is (the watcher reads the rest with a Query, from the closed run)."""
        if workflow.patched(RELEASE_POLLS_PATCH):
            self._stream.detach_pollers()
        await workflow.wait_condition(workflow.all_handlers_finished)

    # ------------------------------------------------- shared handlers

    def _set_host_state(self, state: str) -> None:
        self._state = state
        self._upsert(state)

    def _upsert(self, status: str) -> None:
        """Upsert the search attributes (the thread kinds say which)."""
        raise NotImplementedError

    def _host_attribute(self) -> str | None:
        """``StoplineHost``'s value: the held host, ``""`` while none, and
        ``None`` (left unset) for a history recorded before placement."""
        if not self._fleet:
            return None
        return self._host.host_id if self._host else ""

    async def _wait_for_message(self) -> End | None:
        """Wait for the next user message; a host lost meanwhile is
        recovered (moved, or the thread stops) — never a silent hang."""
        while True:
            await workflow.wait_condition(
                lambda: bool(self._inbox) or self._host_gone() or self._move_requested
            )
            if self._inbox:
                return None
            if self._host_gone():
                end = await self._recover_host(self._why_host_gone())
            else:
                end = await self._maybe_move()
            if end is not None:
                return end
            self._set_host_state("waiting")

    async def _interrupt(self) -> InterruptResult:
        """The ``interrupt`` Update (DESIGN §3): abort the running turn once.

        A second interrupt while the first's abort runs adds nothing; it
        waits for that abort and reports it (``joined``), so every caller
        returns only once the marker is fsynced — before
        :data:`INTERRUPT_JOINS_PATCH` it returned at once, saying no turn
        was running.
        """
        joining = (
            self._interrupt_pending and self._state == "running" and not self._continuing
            and workflow.patched(INTERRUPT_JOINS_PATCH)
        )
        if not joining and (self._state != "running" or self._interrupt_pending or self._continuing):
            ending = self._state not in ("running", "waiting", "waiting_for_host")
            return InterruptResult(interrupted=False, last_seq=self._flushed_seq, ended=ending)
        self._interrupt_pending = True
        target = self._n.aborts_done + 1
        # bounded by the run's end: a task_stop may end the task first
        await workflow.wait_condition(lambda: self._n.aborts_done >= target or self._result is not None)
        if self._n.aborts_done < target:
            return InterruptResult(interrupted=False, last_seq=self._flushed_seq, ended=True)
        return InterruptResult(
            interrupted=not joining,
            joined=joining,
            aborted_calls=list(self._n.aborted),
            kept_calls=list(self._n.kept),
            last_seq=self._flushed_seq,
        )

    def _status(self) -> TaskStatus:
        ref = self._refusal_info()
        return TaskStatus(
            task_id=workflow.info().workflow_id,
            state=self._state if self._state != "finishing" else "running",  # type: ignore[arg-type]
            round=self._n.rounds,
            rows=self._next_seq - 1,
            result=self._result,
            refusal=ref,
            stop_reason=self._result.reason if self._result else None,
            note=refusal.NOT_CONTINUABLE if (ref and self._kind != "chat") else None,
            host=self._host,
        )

    def _carry(self, stream_state: Any) -> ThreadCarry:
        return ThreadCarry(
            next_seq=self._next_seq,
            flushed_seq=self._flushed_seq,
            rounds=self._n.rounds,
            provider_calls=self._n.provider_calls,
            final_text=self._n.final_text,
            last_tool=self._n.last_tool,
            accepted_upto=self._accepted_upto,
            unaccepted_increments=list(self._unaccepted),
            refusal_stop=self._refusal_stop,
            children=[c.info for c in self._children.values()],
            inbox=list(self._inbox),
            runs=self._runs + 1,
            notified=self._notified,
            stream_state=stream_state,
            host=self._host,
            shells=dict(self._shells),
        )

    def _trim_stream(self) -> None:
        """Keep only the last :data:`STREAM_ITEMS_CARRIED` events across
        continue-as-new: the stream's log would otherwise travel whole in
        every next run's input and grow it without bound. A watcher further
        behind resumes from the oldest kept event."""
        state = self._stream.get_state()
        end = state.base_offset + len(state.log)
        self._stream.truncate(max(state.base_offset, end - STREAM_ITEMS_CARRIED))

    def _should_continue_as_new(self) -> bool:
        info = workflow.info()
        return info.is_continue_as_new_suggested() or (
            info.get_current_history_length() >= self._inp.limits.continue_as_new_after_events
        )


def _failure(handle: Any) -> BaseException | None:
    """The exception a finished handle ended with, if any."""
    if handle.cancelled():
        return None
    return handle.exception()
