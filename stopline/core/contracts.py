"""What crosses the workflow boundary: the one contracts module both sides import.

Every activity input is one pydantic model, so a field can be added later
without breaking running workflows' history (add fields with defaults; never
rename or remove one — that is a history-compatibility event).

This module does no I/O and imports nothing that does: workflow code imports
it inside the sandbox. Values go through ``temporalio.contrib.pydantic``'s
data converter.

Never put a secret here: API keys are read from the environment by the
activities that need them (DESIGN §5), so no model below has a field for one.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from temporalio.contrib.workflow_streams import WorkflowStreamState

# ---------------------------------------------------------------------------
# Names that must stay stable (greppable; changing one breaks running tasks).
# ---------------------------------------------------------------------------

#: Default task queue for workflows and sampling activities.
DEFAULT_TASK_QUEUE = "stopline"
#: Workflow type names.
AGENT_TASK_WORKFLOW = "AgentTask"
CHAT_THREAD_WORKFLOW = "ChatThread"
#: Activity names.
SAMPLE_ACTIVITY = "stopline.sample"
TOOL_ACTIVITY = "stopline.tool"
LEDGER_FLUSH_ACTIVITY = "stopline.ledger_flush"
TASK_MESSAGE_ACTIVITY = "stopline.task_message"
HOST_SESSION_ACTIVITY = "stopline.host_session"
LIST_HOSTS_ACTIVITY = "stopline.list_hosts"
ROUND_RECORD_ACTIVITY = "stopline.round_record"
#: Signal a host session sends its task when it has claimed the host.
HOST_CLAIMED_SIGNAL = "stopline_host_claimed"
#: The file in a workspace whose content names it across hosts (DESIGN §7).
WORKSPACE_MARKER_FILE = ".stopline-workspace"
#: The control activity of the push cancel (DESIGN §3): runs on the host of a
#: task's calls and cancels them there.
CANCEL_CALLS_ACTIVITY = "stopline.cancel_calls"
#: ``ApplicationError.type`` of a sampling call a pushed cancel dropped
#: (non-retryable; the request was sent, so it counts as a provider call).
SAMPLING_DROPPED_ERROR = "SamplingDropped"
#: ``ApplicationError.type`` of a round whose tool calls started in the
#: sampling activity (:class:`RoundTools`) and whose worker was lost before
#: it reported them (non-retryable: they are never run again, DESIGN §5).
ROUND_TOOLS_LOST_ERROR = "RoundToolsLost"
#: The workflow-streams topic that carries :class:`TaskEvent`.
EVENTS_TOPIC = "events"


def pool_task_queue(task_queue: str) -> str:
    """The pool's task queue for workflows on ``task_queue`` (DESIGN §7).

    Every host polls it for host sessions, at most its capacity at once: a
    task placed through the pool lands on a host with room.
    """
    return f"{task_queue}-pool"


def host_task_queue(task_queue: str, host_id: str) -> str:
    """One host's own task queue (Temporal's worker-specific task queues).

    Sampling, tool calls, ledger writes and cancels of a task placed on the
    host run here, so they reach the disk and processes that host holds.
    """
    return f"{task_queue}-host-{host_id}"


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=False)


# ---------------------------------------------------------------------------
# Conversation: provider-neutral shapes built from ledger rows.
# ---------------------------------------------------------------------------


class ToolCall(_Model):
    """One tool call the model asked for.

    Attributes:
        id: The provider's call id (Anthropic ``tool_use.id``, OpenAI
            ``tool_calls[].id`` / Responses ``call_id``).
        name: Tool name.
        arguments: Parsed JSON object, or ``None`` when the arguments did not
            parse (then ``parse_error`` says why and the call is never run).
        raw_arguments: The arguments exactly as the provider sent them (a
            JSON string), kept so the next request can echo them back.
        parse_error: Why ``raw_arguments`` is not a JSON object, if it is not.
    """

    id: str
    name: str
    arguments: dict[str, Any] | None = None
    raw_arguments: str = "{}"
    parse_error: str | None = None


class TextPart(_Model):
    """Plain text in a message."""

    type: Literal["text"] = "text"
    text: str


class ToolUsePart(_Model):
    """An assistant's tool call inside a message."""

    type: Literal["tool_use"] = "tool_use"
    call: ToolCall


class ToolResultPart(_Model):
    """The result of one tool call, sent back in a user-role message.

    Attributes:
        call_id: The :class:`ToolCall` id this answers.
        text: What the model reads.
        is_error: ``True`` when the call itself could not be made
            (``RespondToModel.ok`` is ``False``).
    """

    type: Literal["tool_result"] = "tool_result"
    call_id: str
    text: str
    is_error: bool = False


Part = Annotated[TextPart | ToolUsePart | ToolResultPart, Field(discriminator="type")]


class Message(_Model):
    """One provider-neutral conversation message.

    ``role`` is ``user`` or ``assistant``; tool results travel in ``user``
    messages (Anthropic's shape; the OpenAI adapters split them into
    ``role: tool`` messages / ``function_call_output`` items).
    """

    role: Literal["user", "assistant"]
    parts: list[Part]


class ToolSpec(_Model):
    """A tool as offered to the model: name, description, JSON Schema input."""

    name: str
    description: str
    input_schema: dict[str, Any]


class ActivityTool(_Model):
    """One of the team's own activities, offered to the model as a tool.

    Built with :func:`stopline.activity_tool` from the activity function (its
    name, its docstring, its pydantic input model's JSON schema); a task names
    the ones it may use in its input (``ThreadInput.tools``), so a new tool
    needs no redeploy of stopline. The model's arguments become the
    activity's input; what it returns is the tool result the model reads.

    Outcomes follow DESIGN §2: a returned value is a tool result; an
    exception the activity raises is a tool result with ``ok=false`` and the
    task goes on; only an ``ApplicationError`` of type
    :data:`FATAL_TOOL_ERROR` (raise :class:`stopline.FatalToolError`) stops
    the turn and fails the task. An interrupt cancels it like any call
    (Temporal's cancel, delivered on its heartbeat; then the grace, then an
    aborted receipt).

    Attributes:
        name: Tool name the model calls (unique among the task's tools).
        description: What the tool does, for the model.
        input_schema: JSON Schema of the arguments (the input model's).
        activity: The activity type name to run.
        task_queue: Task queue of the worker that runs it; ``None``: the
            task's workflow task queue.
        start_to_close_s: Start-to-close timeout of one call, seconds.
        heartbeat_timeout_s: Heartbeat timeout, seconds (``None``: none; an
            activity that heartbeats learns of an interrupt sooner).
        max_attempts: Attempts per call (default 1: a tool call runs at most
            once, DESIGN §2).
    """

    name: str
    description: str
    input_schema: dict[str, Any]
    activity: str
    task_queue: str | None = None
    start_to_close_s: float = 300.0
    heartbeat_timeout_s: float | None = None
    max_attempts: int = 1

    def spec(self) -> ToolSpec:
        """The tool as offered to the model."""
        return ToolSpec(name=self.name, description=self.description, input_schema=self.input_schema)


#: ``ApplicationError.type`` a tool activity raises to stop the turn and fail
#: the task (DESIGN §2's ``Fatal``): the engine itself is broken, not the call.
FATAL_TOOL_ERROR = "StoplineFatalToolError"


class Refusal(_Model):
    """The provider's refusal verdict on a request (seed 000; DESIGN §4).

    Attributes:
        provider: Provider id (``anthropic``, ``openai``, ...).
        category: The provider's category when given (e.g. ``cyber_policy``,
            ``content_filter``), else ``None``.
        detail: The provider's own explanation when given (Anthropic
            ``stop_details``, OpenAI ``refusal`` text). Kept in the task's
            own ledger only; never forwarded to a parent.
    """

    provider: str
    category: str | None = None
    detail: str | None = None


class Usage(_Model):
    """Token counts reported by the provider (0 when not reported)."""

    input_tokens: int = 0
    output_tokens: int = 0


StopReason = Literal["end_turn", "tool_use", "max_tokens", "refusal", "other"]


class SamplingResult(_Model):
    """What one sampling call (model call) produced.

    A refusal is a *result* (``stop_reason == "refusal"`` and ``refusal`` set),
    never an exception, so Temporal retries nothing (seed 000).

    Attributes:
        provider: Provider id that answered.
        model: Model name as sent.
        text: The assistant's text for this turn ("" when none).
        tool_calls: Tool calls in the order the model made them.
        stop_reason: Normalized: ``end_turn`` | ``tool_use`` | ``max_tokens``
            (Anthropic ``max_tokens``, OpenAI ``length`` /
            ``max_output_tokens``) | ``refusal`` | ``other``.
        raw_stop_reason: The provider's own value (Anthropic ``stop_reason``,
            OpenAI ``finish_reason`` / Responses ``status``).
        refusal: Set iff the provider refused.
        usage: Token counts.
        attempt: Which attempt of the sampling activity produced this (the
            earlier ones reached the provider too: ``provider_calls``).
        tool_outcomes: Set when the activity ran the response's tool calls
            itself (:class:`RoundTools`): each call's outcome by call id,
            exactly as the ``stopline.tool`` activity would have returned it
            (an aborted call's is ``aborted=True, terminal=False``). ``None``:
            no call ran here; the workflow runs them.
    """

    provider: str
    model: str
    text: str = ""
    tool_calls: list[ToolCall] = Field(default_factory=list)
    stop_reason: StopReason = "end_turn"
    raw_stop_reason: str | None = None
    refusal: Refusal | None = None
    usage: Usage = Field(default_factory=Usage)
    attempt: int = 1
    tool_outcomes: dict[str, ToolOutcome] | None = None


# ---------------------------------------------------------------------------
# Tool outcomes: data, not exceptions (seed 002; DESIGN §2).
# ---------------------------------------------------------------------------


class RespondToModel(_Model):
    """The model sees ``text`` as the tool result.

    ``ok=True``: the handler finished (the process ran, whatever its exit code,
    timed out, or was denied — the text says what happened). ``ok=False``: the
    call itself could not be made (bad arguments, program not found, patch
    context mismatch, path outside the workspace, handler raised).

    Attributes:
        text: What the model reads (already capped, head + tail).
        ok: See above.
        terminal: ``True`` when the call reached its terminal state (process
            exited, file written). ``False`` only for an aborted call.
        aborted: ``True`` when a user interrupt ended the call before it was
            terminal; ``text`` then holds the output captured so far.
        elapsed_s: Wall time of the call in seconds.
        output_ref: Path (relative to the ledger store) of the full output
            when it was larger than the inline cap; ``None`` otherwise.
        unconfined_reason: Set when the call ran a command outside the
            sandbox: why (no bubblewrap on the host and the task allows it,
            or the operator turned the sandbox off). The workflow records it
            as a ledger row (DESIGN §2).
    """

    kind: Literal["respond"] = "respond"
    text: str
    ok: bool = True
    terminal: bool = True
    aborted: bool = False
    elapsed_s: float = 0.0
    output_ref: str | None = None
    unconfined_reason: str | None = None


class Fatal(_Model):
    """The engine itself is broken; the turn ends and the task fails.

    Only for: a response without the expected shape, a failed task join
    (seed 002: the deepest of the three thresholds).
    """

    kind: Literal["fatal"] = "fatal"
    reason: str


ToolOutcome = Annotated[RespondToModel | Fatal, Field(discriminator="kind")]
SamplingResult.model_rebuild()


class ToolRunSettings(_Model):
    """How a task's tool calls run on its host (the task's limits, per call).

    Attributes:
        workspace: Absolute path of the task's workspace; every path the tool
            touches must resolve inside it.
        timeout_s: Per-call timeout in seconds (foreground processes).
        kill_grace_s: Seconds between SIGTERM and SIGKILL when the call is
            cancelled or times out.
        output_cap_bytes: Inline cap for the text the model sees; more is
            kept head + tail and the whole output stored beside the ledger.
        network: The task lets commands use the host's network (the
            sandbox has none otherwise).
        allow_unconfined: Where the sandbox cannot run, run commands
            unconfined (with a ledger row saying so) instead of refusing them.
        env: Environment variables the task passes to its tool processes
            (besides ``PATH``, locale, ``TERM`` and ``HOME``).
    """

    workspace: str
    timeout_s: float = 120.0
    kill_grace_s: float = 0.1
    output_cap_bytes: int = 16_384
    network: bool = False
    allow_unconfined: bool = False
    env: dict[str, str] = Field(default_factory=dict)


class ToolCallInput(ToolRunSettings):
    """Input of the ``stopline.tool`` activity (one tool call): the
    :class:`ToolRunSettings` and

    Attributes:
        task_id: Owning task (workflow id).
        call: The tool call to run (``arguments`` already parsed).
        round: Sampling round the call belongs to (bound into log lines).
    """

    task_id: str
    call: ToolCall
    round: int = 0


class RoundTools(ToolRunSettings):
    """How the sampling activity runs the round's tool calls itself (DESIGN §1, §3).

    Sent with :class:`SampleInput` so a round whose calls all run on the
    task's host costs one activity, not two: the activity samples, and when
    :func:`stopline.core.policies.round_tool_calls` allows it, records the
    response in a heartbeat (so a lost worker never hides a call that may
    have run) and runs the calls as the ``stopline.tool`` activity would.
    The :class:`ToolRunSettings` and

    Attributes:
        elsewhere: Names of tools that do not run on the host (the task's own
            activity tools); a response calling one runs no call here.
    """

    elsewhere: list[str] = Field(default_factory=list)

    def call_input(self, task_id: str, call: ToolCall, round_: int) -> ToolCallInput:
        """The ``stopline.tool`` input of one of the round's calls."""
        return ToolCallInput(
            task_id=task_id, call=call, round=round_,
            **self.model_dump(exclude={"elsewhere"}),
        )


class RoundRecordInput(_Model):
    """Input of ``stopline.round_record``: which task's in-flight round to read.

    Attributes:
        workflow_id: The task.
        run_id: Its run.
    """

    workflow_id: str
    run_id: str


class RoundRecord(_Model):
    """What Temporal holds of a task's running sampling activity (DESIGN §1, §7).

    Attributes:
        pending: A sampling activity is pending.
        started: An attempt of it is running (or was, when its cancel was
            requested); ``False``: it waits to be picked up (a retry for a
            host that is gone).
        attempt: Its attempt number.
        response: The response an attempt recorded before running its
            round's tool calls (its heartbeat), if any.
        recorded_attempt: The attempt that recorded it.
        requests: Provider requests the call had made when it recorded it
            (``provider_calls`` counts them).
    """

    pending: bool = False
    started: bool = False
    attempt: int = 0
    response: SamplingResult | None = None
    recorded_attempt: int = 0
    requests: int = 0

    @property
    def calls_lost(self) -> bool:
        """The attempt that ran the recorded calls is over (its worker was
        lost: a retry waits for a worker, or runs)."""
        return not self.started or self.attempt > self.recorded_attempt


class CancelCallsInput(_Model):
    """Input of ``stopline.cancel_calls``: which running calls of a task to cancel.

    The push half of an interrupt or ``task_stop`` (DESIGN §3): the workflow
    schedules it on the host queue of the task's calls, and the worker hands
    it to its registry of running calls (``stopline.activities.running``).

    Attributes:
        task_id: The task (workflow id) whose calls to cancel.
        call_ids: Tool call ids of the turn's unfinished tool activities.
        sampling_round: Round of the in-flight sampling call, if any.
        keys: Further registry keys (other host-side units of the task).
        reason: Why, in a log line's words.
    """

    task_id: str
    call_ids: list[str] = Field(default_factory=list)
    sampling_round: int | None = None
    keys: list[str] = Field(default_factory=list)
    reason: str = "user interrupt"


class CancelCallsResult(_Model):
    """What ``stopline.cancel_calls`` found on the host.

    Attributes:
        cancelled: Registry keys of units that were running and are now
            cancelled (each ends on its own: TERM, grace, KILL for a tool).
        not_running: Keys with no running unit in this worker process (it
            finished, never started here, or starts later — then it is
            cancelled the moment it registers).
    """

    cancelled: list[str] = Field(default_factory=list)
    not_running: list[str] = Field(default_factory=list)


# ---------------------------------------------------------------------------
# Ledger: the append-only transcript (DESIGN §3, §5).
# ---------------------------------------------------------------------------

RowKind = Literal[
    "prompt",
    "user_message",
    "assistant",
    "tool_result",
    "turn_aborted",
    "system",
    "task_result",
    "provider-refusal-stop",
    "notification",
    "increment",
    "quarantine",
    "refusal",
    "host_lost",
]


class LedgerRow(_Model):
    """One append-only ledger row.

    Attributes:
        seq: 1-based position in the task's ledger; rows are written in seq
            order and a seq is never written twice.
        kind: What the row is.
        round: Sampling round the row belongs to (0 before the first).
        model_visible: Whether the model sees it in later requests.
        at: Workflow time (``workflow.now()``) when appended.
        text: Prompt / assistant text / tool result text / marker text.
        tool_calls: For ``assistant`` rows: the calls the model made.
        call_id: For ``tool_result`` rows: the call answered.
        tool_name: For ``tool_result`` rows: the tool's name.
        ok: For ``tool_result`` rows: :attr:`RespondToModel.ok`.
        meta: Small extra facts (aborted, elapsed_s, output_ref, status...).
    """

    seq: int
    kind: RowKind
    round: int = 0
    model_visible: bool = True
    at: datetime | None = None
    text: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)
    call_id: str | None = None
    tool_name: str | None = None
    ok: bool | None = None
    meta: dict[str, Any] = Field(default_factory=dict)


class LedgerFlushInput(_Model):
    """Input of ``stopline.ledger_flush``: append rows, fsync, optionally kill.

    Attributes:
        task_id: The task whose ledger file to append to.
        rows: Rows to append, in seq order. Rows whose seq is already in the
            file are skipped (a retried flush never writes twice).
        kill_calls: Tool call ids whose process groups must be gone when the
            activity returns (SIGKILL): the irreversible step of an abort.
        close_shells: Close the task's still-running background shells (a
            task that completes normally; never a refused one — seed 000 §3).
        release_session: End the task's host session on this host (the task
            is done with the host; its capacity slot is free at once).
    """

    task_id: str
    rows: list[LedgerRow] = Field(default_factory=list)
    kill_calls: list[str] = Field(default_factory=list)
    close_shells: bool = False
    release_session: bool = False


class SampleInput(_Model):
    """Input of ``stopline.sample``: a reference to the transcript, not a copy.

    The activity first appends ``pending_rows`` to the ledger file (so ledger
    writes cost no extra round trip), then reads the transcript up to
    ``upto_seq`` from the ledger store and sends it (DESIGN §5: history grows
    linearly).

    Attributes:
        task_id: Task id; locates the ledger file.
        model: ``provider:model`` (e.g. ``anthropic:claude-sonnet-4-5``).
        base_url: Provider base URL override (OpenAI-compatible servers, the
            scripted server). Not a secret.
        pending_rows: Rows accepted since the last flush.
        upto_seq: Last ledger seq the request must include.
        system: System prompt ("" for the default).
        tools: Tools offered explicitly; empty: the named ``toolset``.
        toolset: Name of the activity-side tool set to offer (keeps the tool
            schemas out of every round's history).
        max_tokens: Output token limit sent to the provider.
        temperature: Sampling temperature sent to the provider; ``None``
            sends none (the provider's default).
        top_p: Nucleus sampling sent to the provider; ``None`` sends none.
        stream: Ask for SSE streaming.
        watched: Someone followed the task's events as the round started
            (a poll of its event stream was in flight): the text is
            published as it forms (``stopline.activities.deltas``).
            Unwatched, publishing starts only once the call has gone on for
            a while — each publish is a Signal, a workflow task and a billed
            Action, for nobody in a short call; the whole message is an
            event when it arrives either way.
        thread_kind: ``task`` | ``chat`` | ``fix``. A *task* whose ledger
            already holds a ``provider-refusal-stop`` row is answered with that
            refusal and no provider call (a reset or re-drive never reaches
            the provider again — seed 000 §5).
        round: Sampling round (bound into log lines).
        chain_id: The run chain (``workflow.info().first_execution_run_id``:
            shared by continue-as-new runs and by runs a reset made): a
            refusal stop anywhere in the chain answers a *task*'s sampling
            with that refusal, whatever this host's disk holds (DESIGN §4, §7).
        extra_tools: The task's own activity tools (``ThreadInput.tools``),
            offered besides the ``toolset``.
        round_tools: Set when the activity may run the response's tool calls
            itself (:class:`RoundTools`); ``None``: it only samples.
    """

    task_id: str
    model: str
    base_url: str | None = None
    pending_rows: list[LedgerRow] = Field(default_factory=list)
    upto_seq: int
    system: str = ""
    tools: list[ToolSpec] = Field(default_factory=list)
    toolset: str = "workspace"
    max_tokens: int = 4096
    stream: bool = True
    thread_kind: str = "task"
    round: int = 0
    chain_id: str = ""
    extra_tools: list[ToolSpec] = Field(default_factory=list)
    temperature: float | None = None
    top_p: float | None = None
    round_tools: RoundTools | None = None
    watched: bool = True


# ---------------------------------------------------------------------------
# Placement: hosts, claims, sessions (DESIGN §7).
# ---------------------------------------------------------------------------


class HostClaim(_Model):
    """A host a task holds: who it is and how to reach it.

    Attributes:
        host_id: Stable host id, created once in the host's ``STOPLINE_HOME``
            (``h-`` and 12 hex digits); survives restarts and new hostnames.
        task_queue: The host's own task queue (:func:`host_task_queue`).
        hostname: The machine's name when it claimed (for people; not an id).
        boot_id: The kernel's boot id when it claimed (a reboot changes it).
        instance: Id of the worker process that claimed (a restart changes it).
        workspace_marker: Id read from (or written to) the workspace's
            ``.stopline-workspace`` file: another host holding the same path
            with the same marker reaches the same workspace.
        claim_id: The session this claim answers (stale claims are ignored).
    """

    host_id: str
    task_queue: str
    hostname: str = ""
    boot_id: str = ""
    instance: str = ""
    workspace_marker: str | None = None
    claim_id: str = ""


class HostSessionInput(_Model):
    """Input of ``stopline.host_session``: claim a host and hold it.

    Attributes:
        task_id: The task (workflow id).
        run_id: Its run (the claim Signal targets this run).
        claim_id: Echoed in the claim, so a late claim of an abandoned session
            is ignored.
        workspace: Absolute workspace path; it must exist on the host.
        require_marker: When set, the host's workspace must carry this marker
            (a task moving to another host after its own was lost).
        parent_task_id: A sub-task's parent: when the parent holds this host,
            the sub-task shares its capacity slot.
        heartbeat_s: Seconds between the session's heartbeats (liveness).
    """

    task_id: str
    run_id: str
    claim_id: str
    workspace: str
    require_marker: str | None = None
    parent_task_id: str | None = None
    heartbeat_s: float = 10.0


class ListHostsInput(_Model):
    """Input of ``stopline.list_hosts``.

    Attributes:
        task_queue: The workflow task queue whose hosts to list.
        max_age_s: Hosts whose workers have not polled for longer are left
            out (a dead host's poller lingers on the server for minutes).
    """

    task_queue: str
    max_age_s: float = 90.0


class HostInfo(_Model):
    """A live host as ``stopline.list_hosts`` and ``stopline hosts`` see it.

    Attributes:
        host_id: Stable host id.
        task_queue: Its own task queue.
        hostname: Its machine name.
        capacity: Tasks it takes at once.
        identity: The worker identity its pollers report.
        last_seen: When its worker last polled the workflow task queue.
    """

    host_id: str
    task_queue: str
    hostname: str = ""
    capacity: int | None = None
    identity: str = ""
    last_seen: datetime | None = None


# ---------------------------------------------------------------------------
# The task.
# ---------------------------------------------------------------------------


class ModelCandidate(_Model):
    """A model a fix task may switch to: ``provider:model`` and its base URL."""

    model: str
    base_url: str | None = None


class ChildInfo(_Model):
    """A sub-task a thread started (carried over continue-as-new)."""

    task_id: str
    settled: bool = False
    delivered: bool = False
    result: AgentTaskResult | None = None


class ThreadCarry(_Model):
    """What the next run needs after continue-as-new; the ledger by reference.

    The rows themselves stay in the ledger file (the sampling activity reads
    them there); only counters and small sets travel in history.
    """

    next_seq: int
    flushed_seq: int
    rounds: int = 0
    provider_calls: int = 0
    final_text: str = ""
    last_tool: str | None = None
    accepted_upto: int = 0
    unaccepted_increments: list[int] = Field(default_factory=list)
    refusal_stop: RefusalStop | None = None
    children: list[ChildInfo] = Field(default_factory=list)
    inbox: list[str] = Field(default_factory=list)
    runs: int = 1
    notified: bool = False
    stream_state: WorkflowStreamState | None = None
    host: HostClaim | None = None
    shells: dict[str, str] = Field(default_factory=dict)


class TaskLimits(_Model):
    """Limits of one task.

    Attributes:
        max_rounds: Sampling rounds before the task stops (status ``stopped``).
        tool_timeout_s: Per-tool-call timeout in seconds.
        interrupt_grace_s: Grace between cancel request and hard abort,
            seconds (seed 002: 100 ms).
        max_tokens: Output token limit per sampling call (sent always:
            Anthropic requires it).
        sampling_timeout_s: start-to-close timeout of one sampling attempt.
        sampling_total_timeout_s: schedule-to-close timeout of one sampling
            call, all attempts and retry waits included: the longest a round
            can wait for a provider before the task fails (15 minutes).
        temperature: Sampling temperature, 0-2; ``None``: the provider's
            default (Anthropic, OpenAI: 1; llama.cpp: 0.8).
        top_p: Nucleus sampling, (0, 1]; ``None``: the provider's default.
        heartbeat_timeout_s: Heartbeat timeout of sampling and tool
            activities: a worker that dies is noticed after this long.
            Heartbeats only prove liveness (cancels are pushed, DESIGN §3);
            activities heartbeat at most every third of it.
        continue_as_new_after_events: Continue-as-new at a round boundary
            once the run's history has this many events (or when Temporal
            suggests it), carrying the ledger by reference.
        tool_output_cap_bytes: Tool output kept inline (head + tail) in the
            result the model sees and in history; the whole output is stored
            beside the ledger and referenced (``output_ref``).
        host_lost_after_s: A host whose session sends no heartbeat for this
            long is lost (DESIGN §7); it is also the schedule-to-start bound
            of every activity on the host's queue.
        claim_timeout_s: How long a claim on one named host (a pinned task,
            the same host after a restart, a candidate when moving) may wait
            for that host to pick it up.
        placement_timeout_s: How long a task may wait for any host of the
            pool (all full, or none running) before it stops.
        tool_network: Commands may use the host's network (default: the
            sandbox has no network; README, "The sandbox").
        allow_unconfined: On a host where the sandbox cannot run, run
            commands unconfined (each such call gets a ledger row saying so)
            instead of refusing them.
        tool_env: Environment variables passed to every tool process. Their
            values are task input: they enter workflow history (encrypted with
            the payload codec when it is on), so pass no secret here.
        round_tools: A response whose tool calls all run on the host has
            them run by its sampling activity — one activity per round
            instead of one plus one per call (DESIGN §1). ``False``: every
            call is its own ``stopline.tool`` activity (each shown apart in
            Temporal's UI, at the cost of a trip through matching per call).
    """

    max_rounds: int = 50
    tool_timeout_s: float = 120.0
    interrupt_grace_s: float = 0.1
    max_tokens: int = Field(default=4096, ge=1)
    sampling_timeout_s: float = 600.0
    heartbeat_timeout_s: float = 30.0
    continue_as_new_after_events: int = 10_000
    tool_output_cap_bytes: int = 16_384
    host_lost_after_s: float = 30.0
    claim_timeout_s: float = 10.0
    placement_timeout_s: float = 3600.0
    tool_network: bool = False
    allow_unconfined: bool = False
    round_tools: bool = True
    tool_env: dict[str, str] = Field(default_factory=dict)
    sampling_total_timeout_s: float = Field(default=900.0, gt=0)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)


class ThreadInput(_Model):
    """What every thread (task or chat) is started with.

    Attributes:
        model: ``provider:model``.
        workspace: Absolute workspace directory on the tool host.
        limits: See :class:`TaskLimits`.
        base_url: Provider base URL override (not a secret).
        host_task_queue: Only read when replaying a history recorded before
            placement (tools, sampling and ledger writes ran on this fixed
            queue); a task now claims a host (DESIGN §7).
        host: Pin the task to this host id (``stopline hosts`` lists them);
            ``None``: any host of the pool.
        parent_task_id: For a sub-task: its parent, whose host it is pinned
            to by default and whose capacity slot it shares.
        system: System prompt; a default is used when empty.
        stream: Stream sampling responses (SSE).
        route: ``chat`` | ``subagent`` (refusal disposition, seed 000 §2).
        execution_scope: ``thread`` | ``worker``: anything with worker scope
            is a *task*, even on a chat route.
        usage_source: Usage source; one starting with ``fix:`` marks a fix
            task (the only kind that may switch model after a refusal).
        candidates: Further candidate models, in order (fix tasks only).
        quarantine_retries: Retries after quarantining an unaccepted
            increment (chat and fix threads).
        reprobe_limit: Re-probes of a skipped provider before a fix task
            freezes.
        carry: State carried over continue-as-new; ``None`` on a fresh start.
        tools: The team's own activities the model may call as tools
            (:class:`ActivityTool`; sub-tasks get them too).
    """

    model: str
    workspace: str
    limits: TaskLimits = Field(default_factory=TaskLimits)
    base_url: str | None = None
    host_task_queue: str = DEFAULT_TASK_QUEUE
    host: str | None = None
    parent_task_id: str | None = None
    system: str = ""
    stream: bool = True
    route: Literal["chat", "subagent"] = "subagent"
    execution_scope: Literal["thread", "worker"] = "worker"
    usage_source: str = "cli"
    candidates: list[ModelCandidate] = Field(default_factory=list)
    quarantine_retries: int = 3
    reprobe_limit: int = 1
    carry: ThreadCarry | None = None
    tools: list[ActivityTool] = Field(default_factory=list)


class AgentTaskInput(ThreadInput):
    """Input of the ``AgentTask`` workflow: a :class:`ThreadInput` and the
    user's task (``prompt``). Route ``subagent``, scope ``worker`` by default:
    a task (seed 000 §2)."""

    prompt: str


TaskStatusName = Literal["completed", "stopped", "failed"]

#: ``ApplicationError.type`` a failed task's workflow fails with; its first
#: detail is the task's :class:`AgentTaskResult`.
TASK_FAILED_ERROR = "StoplineTaskFailed"


class AgentTaskResult(_Model):
    """Result of the ``AgentTask`` workflow.

    Attributes:
        task_id: Workflow id.
        status: ``completed`` (model ended its turn) | ``stopped`` (max
            rounds, refusal, user stop) | ``failed`` (engine error).
        refused: ``True`` when a provider refusal stopped it (seed 000).
        reason: Why it ended, in words.
        rounds: Sampling rounds made.
        final_text: The assistant's last text.
        provider_calls: Sampling activity executions that reached the
            provider (retries included).
        host_id: The host the task held when it ended (``None``: none).
        unflushed_rows: Ledger rows no host could take when the task ended
            (its host was lost): they enter history here, so the transcript
            served from Temporal is whole (DESIGN §7).
        undelivered_messages: User messages the task accepted (``message``
            Update) but ended before the model saw them: reported here, and
            in a ledger row, instead of being lost silently.
    """

    task_id: str
    status: TaskStatusName
    refused: bool = False
    reason: str = ""
    rounds: int = 0
    final_text: str = ""
    provider_calls: int = 0
    refusal: RefusalStop | None = None
    evidence: dict[str, Any] | None = None
    host_id: str | None = None
    unflushed_rows: list[LedgerRow] = Field(default_factory=list)
    undelivered_messages: list[str] = Field(default_factory=list)

    @classmethod
    def from_failure(cls, err: BaseException | None) -> AgentTaskResult | None:
        """The result a failed task's workflow carries in its failure.

        A task that fails ends its workflow as *failed* (so the Temporal UI
        and a team's alerting count it), with an ``ApplicationError`` of type
        :data:`TASK_FAILED_ERROR` whose first detail is this result. Walks the
        cause chain of a ``WorkflowFailureError`` / ``ChildWorkflowError``.

        Returns:
            The result, or ``None`` when ``err`` is not a failed task's.
        """
        while err is not None:
            if getattr(err, "type", None) == TASK_FAILED_ERROR:
                details = getattr(err, "details", None) or ()
                if details:
                    return cls.model_validate(details[0])
            err = getattr(err, "cause", None) or err.__cause__
        return None


class RefusalStop(_Model):
    """Where a refusal stopped a thread — the one shape of a refusal stop.

    The same model is the workflow's state, the ``provider-refusal-stop``
    ledger row's ``meta``, the value carried over continue-as-new, the
    result's ``refusal`` and what a parent's receipt is rendered from. Only
    where it stopped, never why in the provider's words or what triggered
    it (seed 000 §4): a parent, a status query and a CLI may all see it.

    Attributes:
        provider: Provider id.
        category: The provider's category, if given (``cyber_policy`` …).
        round: Sampling round of the refusal.
        tool: Name of the last tool the thread called, if any.
    """

    provider: str
    category: str | None = None
    round: int = 0
    tool: str | None = None


#: The name the result and status fields had before there was one model.
RefusalInfo = RefusalStop


class TaskStatus(_Model):
    """What the ``status`` Query (and ``task_status``) returns.

    Attributes:
        refusal: Provider, category and round when a refusal stopped it.
        stop_reason: Why it stopped, when it did.
        note: For a refused task, the sentence saying it cannot be continued
            with ``task_message`` (seed 000 §5).
        host: The host the task holds (``None`` while it waits for one).
    """

    task_id: str
    state: Literal["running", "waiting", "waiting_for_host", "completed", "stopped", "failed"]
    round: int
    rows: int
    result: AgentTaskResult | None = None
    refusal: RefusalStop | None = None
    stop_reason: str | None = None
    note: str | None = None
    host: HostClaim | None = None


EventKind = Literal[
    "turn_started",
    "assistant_text",
    "tool_call_started",
    "tool_call_finished",
    "turn_aborted",
    "turn_finished",
    "task_finished",
    "refusal",
    "notification",
    "fallback",
    "task_result",
    "task_wait_done",
    "host_claimed",
    "host_lost",
    "assistant_delta",
    "tool_args_delta",
]


class TaskEvent(_Model):
    """One event on the task's workflow stream (topic :data:`EVENTS_TOPIC`).

    Attributes:
        kind: What happened.
        round: Round it happened in.
        text: Assistant text, or a short summary.
        call_id: Tool call id for tool events.
        tool_name: Tool name for tool events.
        ok: Tool result ``ok`` for ``tool_call_finished``.
        last_seq: Ledger seq the event refers to (rows up to it are in the
            ledger file when the event is ``turn_aborted`` or
            ``task_finished``).
        result: The task result, on ``task_finished``.
        attempt: The sampling attempt a delta belongs to
            (``assistant_delta`` / ``tool_args_delta``, published by the
            sampling activity while the model generates): a retried call
            streams again from the start, so a watcher drops the deltas of
            an earlier attempt. Deltas never reach the ledger; the whole
            message arrives as ``assistant_text`` (and the tool calls as
            ``tool_call_started``).
    """

    kind: EventKind
    round: int = 0
    text: str = ""
    call_id: str | None = None
    tool_name: str | None = None
    ok: bool | None = None
    last_seq: int = 0
    result: AgentTaskResult | None = None
    attempt: int = 0


class InterruptResult(_Model):
    """What the ``interrupt`` Update returns.

    Attributes:
        interrupted: ``True`` when a running turn was aborted by this call;
            ``False`` when no turn was running or an interrupt was already
            in progress (idempotent: nothing was added).
        aborted_calls: Tool call ids that got an "aborted by user" receipt.
        kept_calls: Tool call ids that had finished and kept their results.
        last_seq: Last ledger seq, fsynced to the ledger file before return.
        ended: ``True`` when the task ended (a ``task_stop``) before the
            interrupt could abort its turn: the stop aborted it instead.
        joined: ``True`` when an interrupt already in progress aborted the
            turn: this call waited for that abort to finish (marker fsynced,
            process groups gone) and reports its calls; it added nothing.
    """

    interrupted: bool
    aborted_calls: list[str] = Field(default_factory=list)
    kept_calls: list[str] = Field(default_factory=list)
    last_seq: int = 0
    ended: bool = False
    joined: bool = False


class MessageAck(_Model):
    """What the ``message`` Update returns: the message was accepted."""

    accepted: bool = True
    state: str = "running"


class TaskMessageInput(_Model):
    """Input of ``stopline.task_message``: send a sub-task a message."""

    task_id: str
    text: str


class ChatThreadInput(ThreadInput):
    """Input of the ``ChatThread`` workflow (a long-lived conversation).

    A chat thread's route is ``chat`` and its scope ``thread`` unless set
    otherwise (then refusal disposition treats it as a task — seed 000 §2).
    """

    route: Literal["chat", "subagent"] = "chat"
    execution_scope: Literal["thread", "worker"] = "thread"
    usage_source: str = "chat"


ChildInfo.model_rebuild()
ThreadCarry.model_rebuild()
ThreadInput.model_rebuild()
AgentTaskInput.model_rebuild()
ChatThreadInput.model_rebuild()
