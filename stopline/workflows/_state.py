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
from temporalio.exceptions import ActivityError, ApplicationError

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
