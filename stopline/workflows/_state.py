"""State shared by the turn engine's parts: outcomes, running calls, counters,
retry policies, and the pure helpers that read activity handles.

Deterministic code only (DESIGN §1): imported by workflow code in the sandbox.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError, TimeoutError, TimeoutType

with workflow.unsafe.imports_passed_through():
    from stopline.core.contracts import (
        SAMPLING_DROPPED_ERROR,
        ChildInfo,
        Fatal,
        RespondToModel,
        ToolCall,
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
#: A pushed cancel (DESIGN §3) is tried once: by the time a retry ran, the
#: grace and Temporal's own cancel have long decided the turn.
PUSH_CANCEL_RETRY = RetryPolicy(maximum_attempts=1)
#: How long a pushed cancel may wait for its host to pick it up and run it.
PUSH_CANCEL_TIMEOUT = timedelta(seconds=30)
#: ``workflow.patched`` id of the push cancel: histories recorded before it
#: (an abort that issued only Temporal cancels) replay without it.
PUSH_CANCEL_PATCH = "push-cancel"
#: ``workflow.patched`` id of "an interrupted turn's calls are done with":
#: before it, a ``task_stop`` after an interrupt aborted the same calls again
#: and wrote their receipts and the marker twice.
ABORT_ONCE_PATCH = "stopline-abort-once"
#: ``workflow.patched`` id of "a run's end releases its stream polls": before
#: it, a poll for an offset the run never reached (a reset re-applies a
#: watcher's polls from the longer branch) kept the run open for ever.
RELEASE_POLLS_PATCH = "stopline-release-polls-at-end"

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
    #: The thread cannot go on at all (no host reaches its workspace): a
    #: chat thread ends too, not just the turn.
    final: bool = False


@dataclass
class RunningCall:
    """A tool call of the current turn: its activity (or sub-task) handle."""

    call: ToolCall
    handle: Any
    started_at: datetime
    settled: bool = False


@dataclass
class Child:
    """A sub-task this thread started, with its child-workflow handle."""

    info: ChildInfo
    handle: Any = None


@dataclass
class Counters:
    """What the thread counts and remembers across rounds."""

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


def written_paths(call: ToolCall) -> list[str]:
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


def is_lost(handle: Any) -> bool:
    """Whether a finished tool activity failed without reporting (lost)."""
    if not handle.done() or handle.cancelled():
        return False
    return isinstance(handle.exception(), ActivityError)


def is_dropped_sampling(err: BaseException) -> bool:
    """Whether a sampling activity failed because a pushed cancel dropped it."""
    cause = getattr(err, "cause", None)
    return isinstance(cause, ApplicationError) and cause.type == SAMPLING_DROPPED_ERROR


def settled_outcome(handle: Any) -> RespondToModel | Fatal | None:
    """The outcome of a handle that finished with a value; else ``None``."""
    if not handle.done() or handle.cancelled():
        return None
    try:
        return handle.result()
    except Exception:  # failed (lost, or a sub-task tool raised): no value to keep
        return None


def activity_failure_reason(err: BaseException) -> str:
    """A one-line reason from an activity/child failure (provider, status, what)."""
    cause: BaseException | None = getattr(err, "cause", None)
    parts = []
    while cause is not None:
        text = str(getattr(cause, "message", cause))
        if text and text not in parts:  # a re-raised cause repeats its message
            parts.append(text)
        cause = getattr(cause, "cause", None)
    return "; ".join(parts) or str(err)


def _timeout_text(kind: TimeoutType | None, attempt_s: float | None, total_s: float | None) -> str:
    if kind == TimeoutType.START_TO_CLOSE:
        bound = f" ({attempt_s:g} s)" if attempt_s else ""
        return f"no answer within one attempt's start-to-close timeout{bound}"
    if kind == TimeoutType.SCHEDULE_TO_CLOSE:
        bound = f" {total_s:g} s" if total_s else ""
        return f"the call's total time bound ran out (schedule-to-close{bound})"
    if kind == TimeoutType.HEARTBEAT:
        return "the worker running it stopped heartbeating (lost)"
    if kind == TimeoutType.SCHEDULE_TO_START:
        return "no worker picked it up (schedule-to-start)"
    return "timed out"


def _details(err: ActivityError) -> dict[str, Any]:
    """What the sampling activity said about its attempts: the failure's
    details, or — when Temporal ended it with a timeout — its last heartbeat's."""
    cause = err.cause
    found: Any = None
    if isinstance(cause, ApplicationError) and cause.details:
        found = cause.details[0]
    elif isinstance(cause, TimeoutError) and cause.last_heartbeat_details:
        found = cause.last_heartbeat_details[0]
    return found if isinstance(found, dict) else {}


def sampling_requests(err: ActivityError) -> int:
    """Provider requests a failed sampling call made, whatever ended it.

    The sampling activity carries ``{"attempt", "requests"}`` in its failure
    details and in every heartbeat, so a timeout (which carries only the last
    heartbeat's details) is counted too. Nothing said: one request.
    """
    details = _details(err)
    value = details.get("requests", details.get("attempt"))
    return value if isinstance(value, int) and value >= 0 else 1


def sampling_failure_reason(
    err: ActivityError,
    model_ref: str,
    *,
    attempt_timeout_s: float | None = None,
    total_timeout_s: float | None = None,
) -> str:
    """A failed sampling call's reason: provider, model, attempts, status and
    the last cause, in one line.

    Args:
        err: The sampling activity's failure.
        model_ref: ``provider:model`` the call was made to.
        attempt_timeout_s: The call's start-to-close timeout (named when it
            is the cause).
        total_timeout_s: Its schedule-to-close timeout (likewise).

    Returns:
        e.g. ``"openai-compat:smollm2 failed after 1 attempt (1 provider
        request); status HTTP 400; last cause: openai-compat HTTP 400:
        exceed_context_size_error: ..."``.
    """
    details = _details(err)
    attempt = details.get("attempt")
    attempts = attempt if isinstance(attempt, int) else 1
    requests = sampling_requests(err)
    status = details.get("status")
    if isinstance(err.cause, TimeoutError):
        # Earliest first: a schedule-to-close timeout wraps the attempt's.
        chain: list[str] = []
        cause: BaseException | None = err.cause
        while cause is not None:
            if isinstance(cause, TimeoutError):
                chain.append(_timeout_text(cause.type, attempt_timeout_s, total_timeout_s))
            else:
                chain.append(str(getattr(cause, "message", cause)))
            cause = getattr(cause, "cause", None)
        last = "; then ".join(reversed(chain))
        status_text = "none (timed out)"
    else:
        last = activity_failure_reason(err)
        status_text = f"HTTP {status}" if isinstance(status, int) else "none"
    plural = "s" if attempts != 1 else ""
    rplural = "s" if requests != 1 else ""
    return (
        f"{model_ref} failed after {attempts} attempt{plural} ({requests} provider request{rplural}); "
        f"status {status_text}; last cause: {last}"
    )
