"""Pure policies: what the workflow decides, as functions with no I/O.

Workflows call these; unit tests call them directly without Temporal
(``tests/test_policies.py``). Nothing here may do I/O, read a clock, or
import anything that does: this module is imported inside the workflow
sandbox.

- :func:`rows_to_messages` / :func:`validate_conversation`: the transcript as
  the provider will see it, and the check that it is valid (every tool call
  has exactly one result, no empty assistant message — DESIGN §3).
- :func:`untriaged_calls`: which tool calls of a turn must not run
  (truncated output, unparsable arguments — DESIGN §3).
- Receipt texts: aborted call, lost call, the ``turn_aborted`` marker
  (seed 002: honest, append-only).
"""

from __future__ import annotations

import json
import re
from typing import Any

from stopline.core.contracts import (
    LedgerRow,
    Message,
    SamplingResult,
    TextPart,
    ToolCall,
    ToolResultPart,
    ToolUsePart,
)
from stopline.core.errors import StoplineError
from stopline.core.task_tools import TASK_TOOL_NAMES


class ConversationInvalid(StoplineError, ValueError):
    """The transcript would be rejected by a provider (or lies to the model)."""


#: What a secret value is replaced with wherever text leaves a process
#: (``stopline.secrets``). Inert in a shell, JSON and a regex: a command that
#: carried a key reads ``echo __REDACTED__``, never a glob like ``***``.
REDACTED = "__REDACTED__"


def rows_to_messages(rows: list[LedgerRow]) -> list[Message]:
    """Build the provider-neutral conversation from ledger rows.

    Only ``model_visible`` rows are used. ``assistant`` rows become assistant
    messages (text, then tool calls); ``tool_result`` rows become
    ``tool_result`` parts; every other visible row (prompt, user message,
    ``turn_aborted`` marker, receipts, task results, external increments)
    becomes user text — a quarantined increment as a neutral placeholder.
    Consecutive user-side rows merge into one user message with tool results
    first (Anthropic Messages API: tool_result blocks lead the user turn).

    Args:
        rows: Ledger rows in seq order.

    Returns:
        Messages alternating user / assistant.

    The parts are built with ``model_construct``: every field comes from a
    validated :class:`LedgerRow`, and validating them again cost a third of
    this function, which runs over the whole transcript every round
    (bench/bench_throughput.py).
    """
    from stopline.core.refusal import QUARANTINE_PLACEHOLDER

    messages: list[Message] = []
    pending_results: list[ToolResultPart] = []
    pending_text: list[TextPart] = []
    # Quarantine is itself an appended row naming the increments it withholds
    # (seed 000 §2); nothing earlier is rewritten.
    quarantined = {
        int(seq) for r in rows if r.kind == "quarantine" for seq in r.meta.get("seqs", [])
    }

    def flush_user() -> None:
        if pending_results or pending_text:
            messages.append(Message.model_construct(role="user", parts=[*pending_results, *pending_text]))
            pending_results.clear()
            pending_text.clear()

    for row in rows:
        if not row.model_visible:
            continue
        if row.kind == "assistant":
            parts: list[TextPart | ToolUsePart] = []
            if row.text:
                parts.append(TextPart.model_construct(text=row.text))
            parts.extend(ToolUsePart.model_construct(call=c) for c in row.tool_calls)
            if parts:
                flush_user()
                messages.append(Message.model_construct(role="assistant", parts=list(parts)))
        elif row.kind == "tool_result":
            pending_results.append(
                ToolResultPart.model_construct(
                    call_id=row.call_id or "",
                    text=row.text or "",
                    is_error=row.ok is False,
                )
            )
        elif row.seq in quarantined:
            pending_text.append(TextPart.model_construct(text=QUARANTINE_PLACEHOLDER))
        elif row.text:
            pending_text.append(TextPart.model_construct(text=row.text))
    flush_user()
    return messages


def validate_conversation(messages: list[Message]) -> None:
    """Check a conversation is valid for every provider before sampling.

    Rules (DESIGN §3): it starts with a user message; roles alternate; no
    assistant message is empty; every tool call has exactly one result, in
    the user message right after it; no result answers an unknown call; it
    ends with a user message.

    Args:
        messages: Output of :func:`rows_to_messages`.

    Raises:
        ConversationInvalid: Naming the first rule broken.
    """
    if not messages:
        raise ConversationInvalid("conversation is empty")
    if messages[0].role != "user":
        raise ConversationInvalid("conversation must start with a user message")
    for i, msg in enumerate(messages):
        if i and messages[i - 1].role == msg.role:
            raise ConversationInvalid(f"messages {i - 1} and {i} are both {msg.role}")
        if msg.role == "assistant":
            if not any(
                isinstance(p, ToolUsePart) or (isinstance(p, TextPart) and p.text.strip())
                for p in msg.parts
            ):
                raise ConversationInvalid(f"assistant message {i} is empty")
            calls = [p.call.id for p in msg.parts if isinstance(p, ToolUsePart)]
            if len(set(calls)) != len(calls):
                raise ConversationInvalid(f"assistant message {i} repeats a tool call id")
            following = messages[i + 1] if i + 1 < len(messages) else None
            results = (
                [p.call_id for p in following.parts if isinstance(p, ToolResultPart)]
                if following
                else []
            )
            for cid in calls:
                n = results.count(cid)
                if n != 1:
                    raise ConversationInvalid(
                        f"tool call {cid} in message {i} has {n} results (needs exactly 1)"
                    )
            extra = set(results) - set(calls)
            if extra:
                raise ConversationInvalid(
                    f"message {i + 1} has results for unknown calls {sorted(extra)}"
                )
        elif i == 0 and any(isinstance(p, ToolResultPart) for p in msg.parts):
            raise ConversationInvalid(f"message {i} has tool results with no calls before it")
    if messages[-1].role != "user":
        raise ConversationInvalid("conversation must end with a user message before sampling")


def untriaged_calls(result: SamplingResult) -> dict[str, str]:
    """Tool calls of a turn that must not run, with the error the model sees.

    A turn cut at ``max_tokens`` / ``length`` runs none of its tools; a turn
    with any call whose arguments did not parse runs none either (its input
    was truncated or malformed) — DESIGN §3. A refused turn has no tool calls
    (adapters drop them; seed 000). A call whose arguments held a secret —
    replaced with :data:`REDACTED` in the sampling result before the
    workflow saw it (DESIGN §5) — does not run: it would run with the mask
    in the secret's place.

    Args:
        result: The sampling result.

    Returns:
        ``{call_id: error text}``; empty when every call may run.
    """
    if not result.tool_calls:
        return {}
    if result.stop_reason == "max_tokens":
        return {
            c.id: (
                f"Not run: the model's output was cut off at the token limit "
                f"(stop_reason {result.raw_stop_reason or 'max_tokens'}), so the input of "
                f"{c.name} may be truncated. Send the call again, smaller."
            )
            for c in result.tool_calls
        }
    broken = [c for c in result.tool_calls if c.arguments is None]
    if not broken:
        return {
            c.id: (
                f"Not run: the arguments of {c.name} held a secret value (a configured API or "
                f"codec key), which stopline replaces with {REDACTED} before it is recorded, so "
                f"the call cannot be made as written. Tools never receive secrets; do it "
                f"without the key."
            )
            for c in result.tool_calls
            if REDACTED in c.raw_arguments or REDACTED in json.dumps(c.arguments, ensure_ascii=False)
        }
    out: dict[str, str] = {}
    for c in result.tool_calls:
        if c.arguments is None:
            out[c.id] = (
                f"Not run: the arguments of {c.name} are not a JSON object "
                f"({c.parse_error or 'unparsable'}); the input was truncated or malformed."
            )
        else:
            out[c.id] = (
                f"Not run: another call in the same turn had truncated or malformed "
                f"arguments, so no call of this turn was run. Send {c.name} again."
            )
    return out


def response_shape_problem(result: SamplingResult) -> str | None:
    """Why a sampling result is malformed beyond what a tool result can fix.

    Two tool calls with one id cannot each get exactly one result (DESIGN
    §3): the response is an engine error (seed 002: "the data does not have
    the expected shape"), decided before any of its calls runs.

    Returns:
        The problem in words, or ``None`` for a well-formed result.
    """
    ids = [c.id for c in result.tool_calls]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        return f"tool call ids repeat within one response: {dupes}"
    if any(not c.id for c in result.tool_calls):
        return "a tool call has an empty id"
    return None


def round_tool_calls(result: SamplingResult, elsewhere: frozenset[str] | set[str]) -> list[ToolCall]:
    """The tool calls the sampling activity may run itself, in one round (DESIGN §1).

    All or none: a response runs its calls in the sampling activity only
    when the workflow would run every one of them on the task's host, at
    once and unchanged — no refusal, a well-formed response
    (:func:`response_shape_problem`), no call held back
    (:func:`untriaged_calls`), and no call of a tool that runs elsewhere (a
    sub-task tool runs in the workflow; the task's own activity tools on
    their queue). Anything else is the workflow's to decide, as before.

    Args:
        result: The sampling result.
        elsewhere: Names of the task's tools that do not run on the host
            (its own activity tools); sub-task tools are added here.

    Returns:
        The calls to run, in the response's order; empty: run none here.
    """
    if result.refusal is not None or not result.tool_calls:
        return []
    if response_shape_problem(result) is not None or untriaged_calls(result):
        return []
    if any(c.name in TASK_TOOL_NAMES or c.name in elsewhere for c in result.tool_calls):
        return []
    return list(result.tool_calls)


#: The host's tools that only read (a file, a directory, a background
#: shell's state and log): a call of theirs leaves nothing behind.
READ_ONLY_TOOLS = frozenset({"read_file", "list_dir", "shell_status"})


def round_needs_record(calls: list[ToolCall]) -> bool:
    """Whether a round's calls must be recorded with Temporal before they run
    (DESIGN §1, §5): a call that may change something must never be hidden
    by a lost worker. A round that only reads hides nothing when its worker
    is lost — Temporal retries its sampling as it would any lost model call —
    so it is spared that heartbeat RPC (a billed Action, and about a tenth of
    a round's server time).

    Args:
        calls: The round's calls (:func:`round_tool_calls`).

    Returns:
        ``False`` only when every call is of a :data:`READ_ONLY_TOOLS` tool.
    """
    return any(c.name not in READ_ONLY_TOOLS for c in calls)


#: An activity heartbeats at least every this fraction of its heartbeat
#: timeout (one late beat does not time a live call out), so Temporal's
#: cancel, which answers a heartbeat, reaches a live one within it.
HEARTBEAT_TIMEOUT_FRACTION = 1 / 3

#: Key of the recorded response in the sampling activity's heartbeat details.
ROUND_TOOLS_DETAILS_KEY = "round_tools"


def recorded_response(heartbeat_details: Any) -> dict[str, Any] | None:
    """The response an earlier attempt recorded before running its calls.

    Args:
        heartbeat_details: ``activity.info().heartbeat_details`` (a sequence;
            the first item is the sampling activity's details dict).

    Returns:
        The recorded details (``{"attempt", "requests", "round_tools": {...}}``)
        or ``None`` when no attempt reached its calls.
    """
    if not heartbeat_details:
        return None
    first = heartbeat_details[0]
    if isinstance(first, dict) and isinstance(first.get(ROUND_TOOLS_DETAILS_KEY), dict):
        return first
    return None


def aborted_receipt(call: ToolCall, elapsed_s: float, output_so_far: str = "") -> str:
    """Text of the result for a tool call a user interrupt aborted (seed 002).

    Args:
        call: The aborted call.
        elapsed_s: Seconds from the call's start to the abort.
        output_so_far: Output captured before the abort (already capped).

    Returns:
        The model-visible result text.
    """
    text = (
        f"aborted by user after {elapsed_s:.1f}s: {call.name} did not finish and "
        f"may have partly run (files may be partly written)."
    )
    if output_so_far.strip():
        text += f"\nOutput before the abort:\n{output_so_far}"
    return text


def lost_receipt(call: ToolCall, why: str) -> str:
    """Text of the result for a tool call lost with its worker (DESIGN §5).

    The call is never re-run silently: the model is told and decides.

    Args:
        call: The lost call.
        why: The failure Temporal reported (e.g. heartbeat timeout).

    Returns:
        The model-visible result text.
    """
    return (
        f"lost: the worker running {call.name} stopped before it reported a result "
        f"({why}). The call may have partly run; it was not run again. Check its "
        f"effects before repeating it."
    )


def background_shell_id(task_id: str, call_id: str) -> str:
    """The id of the background shell a ``shell`` call with ``background``
    starts: ``sh-`` + 8 hex digits, stable per (task, call), so the workflow
    knows it without reading the tool's output."""
    import hashlib

    return "sh-" + hashlib.sha1(f"{task_id}\0{call_id}".encode()).hexdigest()[:8]


def host_lost_marker(host_id: str, hostname: str, why: str, shells: list[str]) -> str:
    """The model-visible ``host_lost`` row (DESIGN §7).

    Says plainly what went with the host: calls that had not reported got
    "lost" receipts just before this row; background shells it ran are
    gone from this task's reach.

    Args:
        host_id: The lost host's id.
        hostname: Its machine name when it claimed the task.
        why: What showed the loss.
        shells: Ids of background shells the task had started there.

    Returns:
        The row's text.
    """
    text = (
        "<host_lost>\n"
        f"The host running this task ({host_id}, {hostname or 'unknown name'}) was lost: {why}. "
        "Tool calls that had not reported a result are marked 'lost' above; they may have "
        "partly run. If the task continues, it continues on another host that reaches the "
        "same workspace: check the files before repeating work."
    )
    if shells:
        text += (
            f" Background shells started there ({', '.join(shells)}) are gone from this "
            "task's reach: shell_status and shell_kill no longer find them."
        )
    return text + "\n</host_lost>"


def host_lost_receipt(call: ToolCall, host_id: str) -> str:
    """Text of the result for a tool call whose host was lost (DESIGN §7).

    Args:
        call: The call that had not reported.
        host_id: The lost host.

    Returns:
        The model-visible result text.
    """
    return (
        f"lost: the host {host_id} running {call.name} was lost before the call reported a "
        f"result. The call may have partly run; it was not run again. Check its effects "
        f"before repeating it."
    )


TURN_ABORTED_TEXT = (
    "<turn_aborted>\n"
    "The user interrupted the previous turn on purpose. Tool calls that finished "
    "before the interrupt kept their real results; calls marked 'aborted by user' "
    "may have partly run. Background shells started earlier may still be running "
    "(check them with shell_status). Wait for the user's next message before "
    "continuing.\n"
    "</turn_aborted>"
)


def turn_aborted_marker() -> str:
    """The model-visible ``turn_aborted`` marker text (seed 002; DESIGN §3)."""
    return TURN_ABORTED_TEXT


def cap_text(text: str, limit: int) -> str:
    """Keep ``text`` under ``limit`` characters, head and tail, marking the cut.

    Args:
        text: Any text.
        limit: Maximum characters kept (at least 64).

    Returns:
        ``text`` unchanged when short enough, else head + marker + tail.
    """
    limit = max(64, limit)
    if len(text) <= limit:
        return text
    half = limit // 2
    omitted = len(text) - 2 * half
    return f"{text[:half]}\n[... {omitted} characters omitted ...]\n{text[-half:]}"


_FROM_WORKFLOW = re.compile(
    r"^Cancel requested by workflow with run id (?P<run>\S+) with reason: ?(?P<reason>.*)$", re.S
)


def cancel_stop_reason(reason: str | None) -> str:
    """The stop reason of a thread that ended on a workflow cancel request.

    A cancel is named as a cancel (``stopline stop``, ``task_stop``, a
    parent's end, ``stopline down`` and ``temporal workflow cancel`` are all
    Temporal workflow cancels), with the reason its sender gave
    (``workflow.cancellation_reason()``), so a result never claims a stop
    came from somewhere it did not.

    Args:
        reason: The cancel request's reason: ``None`` when no cancel request
            arrived, ``""`` when it gave none.

    Returns:
        One sentence for the result's ``reason``.
    """
    if reason is None:
        return "stopped: its run was cancelled"
    # A cancel from another workflow (a parent's task_stop or end) reaches
    # the target as the server's sentence around the sender's reason.
    m = _FROM_WORKFLOW.match(reason)
    if m:
        reason = m["reason"] or f"sent by workflow run {m['run']}"
    reason = reason.strip()
    if not reason:
        return "cancelled by a workflow cancel request (no reason given)"
    return f"cancelled by a workflow cancel request: {reason}"


def undelivered_note(texts: list[str]) -> str:
    """The ledger row's text for messages a thread accepted but never delivered.

    Args:
        texts: The messages, in the order they were accepted.

    Returns:
        What happened to them, in one paragraph (each message quoted, capped).
    """
    quoted = "; ".join(repr(cap_text(t, 200)) for t in texts)
    return (
        f"{len(texts)} message(s) accepted while the task ran were never delivered to the "
        f"model: the task ended first. Undelivered: {quoted}"
    )
