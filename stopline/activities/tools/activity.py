"""The ``stopline.tool`` activity: one tool call, heartbeating, cancellable.

Why this module exists: it is the thin Temporal adapter around
:func:`.registry.run_tool`. The call runs as a unit of this worker's
registry of running calls (:mod:`stopline.activities.running`, key
``call:<call id>``), which is how an interrupt reaches it: the workflow
pushes a cancel to this host and the registry delivers it at once (DESIGN
§3). Temporal's own cancel — delivered on a heartbeat response, so within
one heartbeat interval — reaches the same unit the same way, once; it is
the fallback when the push cannot be delivered. Heartbeats themselves only
prove liveness (:func:`activities._heartbeat.heartbeating`); their details
say whether the call has reached its terminal state (``{"terminal": bool}``).

How a cancel ends: the foreground shell catches ``CancelledError``, SIGTERMs
its process group, SIGKILLs it after ``kill_grace_s`` and *returns*
``RespondToModel(aborted=True, terminal=False)`` with the output so far. A
cancel that lands anywhere else (a handler that does not own its
cancellation, a unit cancelled before it started) is caught here: a call
that already has its result returns it (terminal; the real result is kept,
DESIGN §3 step 2), otherwise an aborted result is returned. So this
activity always *completes* with a ``RespondToModel`` / ``Fatal``; it never
reports itself cancelled. The workflow decides whether a late result is
used (DESIGN §3 step 3).

What it must never do: re-raise a cancel (the result would be lost), retry
a tool (a tool call is never silently re-run, DESIGN §5), or do work other
than through :func:`run_tool`.
"""

from __future__ import annotations

import asyncio
import time

import structlog
from temporalio import activity

from stopline.activities._heartbeat import heartbeating
from stopline.activities.running import call_key, current
from stopline.core.contracts import TOOL_ACTIVITY, Fatal, RespondToModel, ToolCallInput

from ._context import CallProgress
from .procs import uncancel_current_task
from .registry import run_tool
from .shell import _abort_cause

log = structlog.get_logger("stopline.tools")


@activity.defn(name=TOOL_ACTIVITY)
async def tool_activity(inp: ToolCallInput) -> RespondToModel | Fatal:
    """Run one tool call under heartbeats; always return an outcome.

    Args:
        inp: The call.

    Returns:
        The tool's outcome (see :func:`run_call`).
    """
    progress = CallProgress()
    outcome: RespondToModel | Fatal | None = None
    try:
        async with heartbeating(details=lambda: {"terminal": progress.terminal}):
            outcome = await run_call(inp, progress)
    except asyncio.CancelledError:
        if outcome is None:
            raise
        uncancel_current_task()  # the cancel came after the outcome: keep it
    return outcome


async def run_call(inp: ToolCallInput, progress: CallProgress | None = None) -> RespondToModel | Fatal:
    """Run one tool call as a unit of this worker's registry; always return an outcome.

    The body of ``stopline.tool``, also used by the sampling activity when
    it runs a round's calls itself (:class:`stopline.core.contracts.RoundTools`).
    The caller heartbeats. The text of a ``RespondToModel`` is staged for
    its row (``call-<id>``): it enters history once, as this outcome
    (DESIGN §5).

    Args:
        inp: The call.
        progress: Where the call says whether it reached its terminal state.

    Returns:
        The tool's outcome (see :func:`activities.tools.run_tool`). After a
        cancel: ``aborted=True, terminal=False`` unless the call had already
        reached its terminal state, whose real result is returned instead.
    """
    with structlog.contextvars.bound_contextvars(
        task_id=inp.task_id, round=inp.round, tool=inp.call.name, call_id=inp.call.id
    ):
        outcome = await _run(inp, progress or CallProgress())
        if isinstance(outcome, RespondToModel):
            from stopline.activities.ledger import default_store  # ledger imports tools: import late

            # In memory, synchronous: no cancel can land half-way through it.
            default_store().stage(inp.task_id, f"call-{inp.call.id}", {"text": outcome.text})
        match outcome:
            case RespondToModel():
                log.info("tool_call", ok=outcome.ok, aborted=outcome.aborted, elapsed_s=outcome.elapsed_s)
            case Fatal():
                log.error("tool_call_fatal", reason=outcome.reason)
        return outcome


async def _run(inp: ToolCallInput, progress: CallProgress) -> RespondToModel | Fatal:
    started = time.monotonic()
    outcome: RespondToModel | Fatal | None = None
    try:
        calls = current().calls
        work = run_tool(inp, progress=progress)
        if calls is None:
            outcome = await work
        else:
            outcome = await calls.run(inp.task_id, call_key(inp.call.id), work)
    except asyncio.CancelledError:
        uncancel_current_task()
        if outcome is None:
            elapsed = time.monotonic() - started
            outcome = RespondToModel(
                ok=True,
                aborted=True,
                terminal=False,
                elapsed_s=round(elapsed, 3),
                text=(
                    f"{_abort_cause()} after {elapsed:.1f}s; the tool {inp.call.name} "
                    "may have partly run."
                ),
            )
    return outcome
