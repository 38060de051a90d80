"""What the turn engine's parts share: retry policies, patch ids, the
stand-ins for calls a round ran, and the pure helpers that read activity
handles. The plain records (how a turn ends, running calls, counters) are
in :mod:`stopline.core.turn_state`, passed through the sandbox.

Deterministic code only (DESIGN §1): imported by workflow code in the sandbox.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError, TimeoutError, TimeoutType

with workflow.unsafe.imports_passed_through():
    from stopline.core.contracts import (
        SAMPLE_ACTIVITY,
        SAMPLING_DROPPED_ERROR,
        Fatal,
        RespondToModel,
        SamplingResult,
        ToolCall,
    )
    from stopline.core.policies import ROUND_TOOLS_DETAILS_KEY

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
#: ``workflow.patched`` id of "an interrupted sampling call stays in flight
#: while its abort runs": before it, a ``task_stop`` landing in the same
#: moment as the interrupt cut the abort short and found nothing to abort,
#: so a round whose calls the sampling activity ran was never recorded.
ABORT_SURVIVES_STOP_PATCH = "stopline-abort-survives-stop"
#: ``workflow.patched`` id of "a second interrupt waits for the first's
#: abort and reports it": before it, that interrupt returned at once saying
#: no turn was running, while the turn was being aborted.
INTERRUPT_JOINS_PATCH = "stopline-interrupt-joins"
#: ``workflow.patched`` id of "a run's end releases its stream polls": before
#: it, a poll for an offset the run never reached (a reset re-applies a
#: watcher's polls from the longer branch) kept the run open for ever.
RELEASE_POLLS_PATCH = "stopline-release-polls-at-end"
#: ``workflow.patched`` id of "the sampling activity runs a round's host
#: tool calls" (DESIGN §1): before it, every tool call was its own activity.
ROUND_TOOLS_PATCH = "stopline-round-tools"

#: Seconds beyond a heartbeat interval (``policies.HEARTBEAT_TIMEOUT_FRACTION``
#: of the heartbeat timeout) for the cancelled activity's answer to arrive.
CANCEL_ANSWER_MARGIN_S = 2.0

#: Events kept in the workflow stream across continue-as-new.
STREAM_ITEMS_CARRIED = 200

#: Returned by a step whose turn a user interrupt aborted.
ABORTED = object()


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


class Resolved:
    """A settled stand-in for an activity handle: a tool call the sampling
    activity ran itself (DESIGN §1), so the turn's settle and abort paths
    treat it as a finished ``stopline.tool`` activity.

    Args:
        value: The call's outcome, when it has one.
        error: The failure it stands for (the round's worker was lost).
    """

    def __init__(self, value: Any = None, error: BaseException | None = None) -> None:
        self._value, self._error = value, error

    def done(self) -> bool:
        return True

    def cancelled(self) -> bool:
        return False

    def cancel(self) -> bool:
        return False

    def exception(self) -> BaseException | None:
        return self._error

    def result(self) -> Any:
        if self._error is not None:
            raise self._error
        return self._value


class Unanswered(Resolved):
    """A stand-in for a call that did not answer: its activity handle, had it
    been one, would still be running (its result is never waited for)."""

    def done(self) -> bool:
        return False


def lost_round_error(why: str) -> ActivityError:
    """The failure a tool call stands for when the sampling activity that ran
    it was lost without answering (its record was read from Temporal): it
    reads like a lost ``stopline.tool`` activity (:func:`is_lost`)."""
    err = ActivityError(
        "round tool calls lost", scheduled_event_id=0, started_event_id=0, identity="",
        activity_type=SAMPLE_ACTIVITY, activity_id="", retry_state=None,
    )
    err.__cause__ = ApplicationError(f"the sampling activity running them was lost: {why}")
    return err


def recorded_round(err: BaseException) -> SamplingResult | None:
    """The response a lost sampling attempt recorded before running its
    round's tool calls (``stopline.activities.round_tools``), if any.

    Found in the failure's details (the next attempt's
    ``ROUND_TOOLS_LOST_ERROR``) or, when Temporal ended the call with a
    timeout, in its last heartbeat's details.
    """
    found = _details(err).get(ROUND_TOOLS_DETAILS_KEY) if isinstance(err, ActivityError) else None
    if not isinstance(found, dict):
        return None
    try:
        return SamplingResult.model_validate(found)
    except Exception:  # not ours: no recorded round
        return None


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
