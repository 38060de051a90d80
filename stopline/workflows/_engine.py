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
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.contrib.workflow_streams import WorkflowStream
from temporalio.exceptions import ActivityError, ApplicationError, ChildWorkflowError
from temporalio.workflow import ParentClosePolicy

with workflow.unsafe.imports_passed_through():
    from pydantic import ValidationError

    from stopline.core import policies, refusal
    from stopline.core.contracts import (
        AGENT_TASK_WORKFLOW,
        EVENTS_TOPIC,
        LEDGER_FLUSH_ACTIVITY,
        SAMPLE_ACTIVITY,
        TASK_MESSAGE_ACTIVITY,
        TOOL_ACTIVITY,
        AgentTaskInput,
        AgentTaskResult,
        ChildInfo,
        Fatal,
        InterruptResult,
        LedgerFlushInput,
        LedgerRow,
        ModelCandidate,
        RefusalInfo,
        RespondToModel,
        RowKind,
        SampleInput,
        SamplingResult,
        TaskEvent,
        TaskLimits,
        TaskMessageInput,
        TaskStatus,
        ThreadCarry,
        ToolCall,
        ToolCallInput,
        ToolOutcome,
    )
    from stopline.core.task_tools import (
        TASK_TOOL_NAMES,
        TaskIdArgs,
        TaskMessageArgs,
        TaskStartArgs,
        TaskWaitArgs,
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

#: Events kept in the workflow stream across continue-as-new.
STREAM_ITEMS_CARRIED = 200

#: Returned by a step whose turn a user interrupt aborted.
ABORTED = object()


@dataclass
class End:
    """How a turn (and, for a task, the task) ends."""

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
class _Child:
    info: ChildInfo
    handle: Any = None


@dataclass
class _Counters:
    rounds: int = 0
    provider_calls: int = 0
    aborts_done: int = 0
    final_text: str = ""
    last_tool: str | None = None
    last_tool_args: str | None = None
    last_tool_outcome: str | None = None
    changed_paths: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)


class TurnEngine:
    """Ledger state, the turn loop, the abort path and sub-tasks.

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
        self._n = _Counters()
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
        self._refusal_stop: dict[str, Any] | None = carry.refusal_stop if carry else None
        self._turn_text = ""
        self._children: dict[str, _Child] = {
            c.task_id: _Child(c) for c in (carry.children if carry else [])
        }
        self._runs = carry.runs if carry else 1
        self._continuing = False
        self._notified = carry.notified if carry else False
        self._staged: dict[int, str] = {}  # seq -> staging key (DESIGN §5)
        self._inflight_sampling: Any = None
        self._inflight_calls: list[_RunningCall] = []

    # ------------------------------------------------------------ the turn

    async def _run_turn(self) -> End | None:
        """Run rounds until the turn ends; ``None`` when a user interrupted it."""
        limits: TaskLimits = self._inp.limits
        self._quarantine_used = 0
        self._turn_text = ""
        while True:
            await self._at_round_boundary()
            self._drain_inbox()
            if self._n.rounds >= limits.max_rounds:
                return End("stopped", f"max rounds ({limits.max_rounds}) reached")
            self._n.rounds += 1
            self._publish("turn_started")
            sampling = self._start_sampling()
            self._inflight_sampling = sampling
            await workflow.wait_condition(lambda: self._interrupt_pending or sampling.done())
            self._inflight_sampling = None
            if self._interrupt_pending:
                await self._abort_turn(sampling, [])
                return None
            try:
                result: SamplingResult = sampling.result()
            except ActivityError as err:
                self._count_failed_attempts(err)
                return End("failed", _activity_failure_reason(err))
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
            text = result.text if result.text.strip() else ""  # never store an empty message
            if text or result.tool_calls:
                row = self._append("assistant", text=text, tool_calls=list(result.tool_calls))
                if text == result.text:  # exactly what the sampling activity staged
                    self._staged[row.seq] = f"round-{self._n.rounds}"
                if text:
                    self._n.final_text = text
                    self._turn_text = text
                    self._publish("assistant_text", text=text)
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

    def _start_sampling(self) -> Any:
        pending = self._pending_rows()
        self._sampled_upto = self._next_seq - 1
        limits: TaskLimits = self._inp.limits
        cand = self._candidates[self._candidate]
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
            ),
            result_type=SamplingResult,
            task_queue=self._inp.host_task_queue,
            start_to_close_timeout=timedelta(seconds=limits.sampling_timeout_s),
            heartbeat_timeout=timedelta(seconds=limits.heartbeat_timeout_s),
            retry_policy=SAMPLING_RETRY,
            cancellation_type=workflow.ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
            summary=f"sample round {self._n.rounds} ({cand.model})",
        )

    # ------------------------------------------------------------- refusal

    def _on_refusal(self, result: SamplingResult) -> End | None:
        """Apply the disposition matrix (seed 000 §2); ``None`` means sample again."""
        ref = result.refusal
        assert ref is not None
        self._append(
            "refusal",
            model_visible=False,
            meta={"provider": ref.provider, "category": ref.category, "round": self._n.rounds,
                  "candidate": self._candidate, "persisted": result.raw_stop_reason == "persisted"},
        )
        self._publish("refusal", text=f"{ref.provider} {ref.category or ''}".strip())
        d = refusal.disposition(
            self._kind,
            unaccepted_increments=len(self._unaccepted),
            quarantine_retries_used=self._quarantine_used,
            quarantine_retries=self._inp.quarantine_retries,
            candidates=len(self._candidates),
            skipped=frozenset(self._skipped),
            current=self._candidate,
            reprobes_used=self._reprobes,
            reprobe_limit=self._inp.reprobe_limit,
        )
        match d.action:
            case "quarantine_retry":
                if self._unaccepted:
                    self._append("quarantine", model_visible=False, meta={"seqs": list(self._unaccepted)})
                    self._unaccepted = []
                self._quarantine_used += 1
                return None
            case "switch_candidate" | "reprobe":
                self._skipped.add(self._candidate)
                if d.action == "reprobe":
                    self._reprobes += 1
                self._candidate = d.candidate or 0
                self._publish("fallback", text=self._candidates[self._candidate].model)
                return None
            case "stop" | "freeze":
                return self._stop_refused(result)
            case "stop_notify":
                end = self._stop_refused(result)
                if self._notified:
                    return end  # one critical notification per episode, not per message
                self._notified = True
                self._append(
                    "notification",
                    model_visible=False,
                    text=(
                        f"critical: {ref.provider} refused this thread's request after "
                        f"{self._quarantine_used} quarantined retr"
                        f"{'y' if self._quarantine_used == 1 else 'ies'}. The thread is "
                        f"stopped; it will not switch model by itself. To recover, a "
                        f"person switches the model, or starts fresh in a new thread "
                        f"without the old history."
                    ),
                    meta={"severity": "critical"},
                )
                self._publish("notification", text="refusal: quarantine exhausted; needs a person")
                return end

    def _stop_refused(self, result: SamplingResult) -> End:
        """Stop where the refusal landed; keep the scene (seed 000 §3)."""
        ref = result.refusal
        assert ref is not None
        if result.text:
            self._append("assistant", text=result.text)
            self._n.final_text = result.text
            self._turn_text = result.text
        self._refusal_stop = {
            "provider": ref.provider,
            "category": ref.category,
            "round": self._n.rounds,
            "tool": self._n.last_tool,
        }
        self._append("provider-refusal-stop", model_visible=False, meta=dict(self._refusal_stop))
        category = f" ({ref.category})" if ref.category else ""
        return End("stopped", f"refused by {ref.provider}{category}", refused=True)

    def _accept_increments(self) -> None:
        """The provider accepted the request: its increments are accepted."""
        self._notified = False
        self._accepted_upto = self._sampled_upto
        self._unaccepted = [s for s in self._unaccepted if s > self._sampled_upto]

    # --------------------------------------------------------------- tools

    async def _run_tools(self, calls: list[ToolCall]) -> End | object | None:
        """Run a turn's tool calls concurrently; append each result as it arrives.

        A child ending early (one call timing out or failing) never cancels
        its siblings or the turn: each result is just data (seed 002).

        Returns:
            ``End`` for a ``Fatal`` outcome, :data:`ABORTED` when a user
            interrupt aborted the turn, else ``None``.
        """
        running: list[_RunningCall] = []
        for call in calls:
            if call.name in TASK_TOOL_NAMES:
                handle: Any = asyncio.create_task(self._run_task_tool(call))
            else:
                handle = self._start_tool_activity(call)
            running.append(_RunningCall(call, handle, workflow.now()))
            self._n.last_tool = call.name
            self._n.last_tool_args = call.raw_arguments
            self._publish("tool_call_started", call_id=call.id, tool_name=call.name)

        self._inflight_calls = running
        fatal: Fatal | None = None
        lost: list[str] = []
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
                return ABORTED
            for r in running:
                if r.settled or not r.handle.done():
                    continue
                r.settled = True
                outcome = self._tool_outcome(r)
                if _lost(r.handle):
                    lost.append(r.call.id)
                match outcome:
                    case RespondToModel():
                        self._append_tool_result(r.call, outcome, staged=not _lost(r.handle))
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
            await self._flush(kill_calls=lost)
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
            ),
            result_type=ToolOutcome,
            task_queue=self._inp.host_task_queue,
            start_to_close_timeout=timedelta(seconds=limits.tool_timeout_s + 60),
            heartbeat_timeout=timedelta(seconds=limits.heartbeat_timeout_s),
            retry_policy=TOOL_RETRY,
            cancellation_type=workflow.ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
            summary=f"{call.name} ({call.id})",
        )

    def _tool_outcome(self, r: _RunningCall) -> RespondToModel | Fatal:
        """The outcome of a finished tool call; a lost one becomes a receipt."""
        try:
            return r.handle.result()
        except ActivityError as err:
            # The activity never reported (worker crash, heartbeat timeout):
            # never re-run silently — tell the model (DESIGN §5).
            return RespondToModel(
                text=policies.lost_receipt(r.call, _activity_failure_reason(err)), ok=False
            )
        except Exception as err:  # a sub-task tool raised: a tool result, not a turn failure
            return RespondToModel(text=f"tool {r.call.name} raised {type(err).__name__}: {err}", ok=False)

    # ----------------------------------------------------------- sub-tasks

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
        child_id = f"{parent}.sub{len(self._children) + 1}"
        limits = self._inp.limits.model_copy(
            update={"max_rounds": args.max_rounds} if args.max_rounds else {}
        )
        model = args.model or self._inp.model
        base_url = args.base_url if args.model else (args.base_url or self._inp.base_url)
        handle = await workflow.start_child_workflow(
            AGENT_TASK_WORKFLOW,
            AgentTaskInput(
                prompt=args.prompt,
                model=model,
                base_url=base_url,
                workspace=self._inp.workspace,
                limits=limits,
                host_task_queue=self._inp.host_task_queue,
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
        child = _Child(ChildInfo(task_id=child_id), handle)
        self._children[child_id] = child
        asyncio.create_task(self._await_child(child))
        return RespondToModel(text=f"started task {child_id} (model {model})")

    async def _await_child(self, child: _Child) -> None:
        """Deliver a child's result exactly once, as a task-result row."""
        try:
            result: AgentTaskResult = await child.handle
        except ChildWorkflowError as err:
            result = AgentTaskResult(
                task_id=child.info.task_id, status="failed", reason=_activity_failure_reason(err)
            )
        child.info.settled = True
        child.info.result = result
        self._deliver(child)

    def _deliver(self, child: _Child) -> None:
        if child.info.delivered or child.info.result is None:
            return
        result = child.info.result
        if result.refused and result.refusal is not None:
            stop = refusal.RefusalStop(
                provider=result.refusal.provider, category=result.refusal.category,
                round=result.refusal.round, tool=result.refusal.tool,
            )
            text = refusal.refusal_receipt(stop, result.final_text)
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
            task_queue=self._inp.host_task_queue,
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
                await workflow.get_external_workflow_handle(args.id).cancel()
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
        2. Grace. Each activity owns the grace from the moment the cancel
           reaches it (its next heartbeat, ~20 ms): a tool SIGTERMs its
           group, waits ``kill_grace_s`` (= the grace), SIGKILLs it and
           reports what it captured; sampling drops its request at once. A
           call that reached its terminal state returns its real result:
           kept. The workflow waits for those answers, bounded by a server
           timer of the grace — Temporal fires sub-second timers after about
           a second, so that bound only matters for an activity that never
           answers (its worker died; the flush below kills its group).
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
        handles = ([sampling] if sampling else []) + [r.handle for r in running]
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
                self._append_tool_result(r.call, outcome, staged=True)
                kept.append(r.call.id)
                continue
            if _lost(r.handle):
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
        # 4. flush (fsync) before the event.
        await self._flush(kill_calls=kill)
        self._n.kept, self._n.aborted = kept, aborted
        self._publish("turn_aborted", text="turn aborted by user")
        self._interrupt_pending = False
        self._n.aborts_done += 1

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

    # ------------------------------------------------------------- ledger

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

    def _append(self, kind: RowKind, *, model_visible: bool = True, **fields: Any) -> LedgerRow:
        row = LedgerRow(
            seq=self._next_seq,
            kind=kind,
            round=self._n.rounds,
            model_visible=model_visible,
            at=workflow.now(),
            **fields,
        )
        self._next_seq += 1
        self._rows.append(row)
        return row

    def _append_tool_result(self, call: ToolCall, outcome: RespondToModel, *, staged: bool = False) -> None:
        """Append a tool result row.

        ``staged``: the text is exactly what the tool activity returned (and
        staged on the host), so the row travels to the ledger file by
        reference, not again as content (DESIGN §5). Sub-task tools run in
        the workflow and stage nothing.
        """
        meta: dict[str, Any] = {"elapsed_s": round(outcome.elapsed_s, 3)}
        if outcome.aborted:
            meta["aborted"] = True
        if outcome.output_ref:
            meta["output_ref"] = outcome.output_ref
        row = self._append(
            "tool_result",
            text=outcome.text,
            call_id=call.id,
            tool_name=call.name,
            ok=outcome.ok,
            meta=meta,
        )
        if staged and call.name not in TASK_TOOL_NAMES:
            self._staged[row.seq] = f"call-{call.id}"
        self._n.last_tool_outcome = outcome.text
        if outcome.ok and call.name in ("write_file", "apply_patch") and call.arguments:
            self._n.changed_paths.extend(_written_paths(call))
        self._publish(
            "tool_call_finished", call_id=call.id, tool_name=call.name, ok=outcome.ok,
            text=outcome.text[:200],
        )

    def _pending_rows(self) -> list[LedgerRow]:
        """Rows not yet in the ledger file, as the flushing activity gets them:
        a staged row without its content (the host has it), the rest whole."""
        self._staged = {k: v for k, v in self._staged.items() if k > self._flushed_seq}
        out = []
        for r in self._rows:
            if r.seq <= self._flushed_seq:
                continue
            key = self._staged.get(r.seq)
            if key is None:
                out.append(r)
            else:
                out.append(r.model_copy(update={
                    "text": None, "tool_calls": [], "meta": {**r.meta, "staged": key},
                }))
        return out

    def _drain_inbox(self) -> None:
        for kind, text in self._increments_inbox:
            row = self._append("increment", text=text, meta={"increment": True, "source": kind})
            self._unaccepted.append(row.seq)
        self._increments_inbox.clear()
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

    # ------------------------------------------------- shared handlers

    async def _interrupt(self) -> InterruptResult:
        if self._state != "running" or self._interrupt_pending or self._continuing:
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
        )

    def _refusal_info(self) -> RefusalInfo | None:
        if self._refusal_stop is None:
            return None
        return RefusalInfo(**self._refusal_stop)

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

    def _children_running(self) -> bool:
        return any(not c.info.settled for c in self._children.values())


def _written_paths(call: ToolCall) -> list[str]:
    args = call.arguments or {}
    if call.name == "write_file" and isinstance(args.get("path"), str):
        return [args["path"]]
    patch = args.get("patch")
    if isinstance(patch, str):
        return [
            line[4:].strip().removeprefix("b/")
            for line in patch.splitlines()
            if line.startswith("+++ ") and "/dev/null" not in line
        ]
    return []


def _lost(handle: Any) -> bool:
    """Whether a finished tool activity failed without reporting (lost)."""
    if not handle.done() or handle.cancelled():
        return False
    return isinstance(handle.exception(), ActivityError)


def _settled_outcome(handle: Any) -> RespondToModel | Fatal | None:
    """The outcome of a handle that finished with a value; else ``None``."""
    if not handle.done() or handle.cancelled():
        return None
    try:
        return handle.result()
    except Exception:  # failed (lost, or a sub-task tool raised): no value to keep
        return None


def _activity_failure_reason(err: BaseException) -> str:
    """A one-line reason from an activity/child failure (provider, status, what)."""
    cause: BaseException | None = getattr(err, "cause", None)
    parts = []
    while cause is not None:
        text = str(getattr(cause, "message", cause))
        if text and text not in parts:  # a re-raised cause repeats its message
            parts.append(text)
        cause = getattr(cause, "cause", None)
    return "; ".join(parts) or str(err)
