"""A round's tool calls run by the sampling activity that produced them.

Why this module exists: the tool calls of a task run on its host's own task
queue (DESIGN §7), where Temporal cannot hand an activity to a worker
together with the workflow task that scheduled it (eager dispatch needs the
workflow's own queue). Each activity there is a trip through matching: a
round of "sample, then run the tools" as two activities cost about twice a
naive loop's server time (``bench/bench_throughput.py``). When every call of
a response runs on the host anyway
(:func:`stopline.core.policies.round_tool_calls`), the sampling activity
runs them itself: one activity per round (DESIGN §1). The sampling activity
also leaves a call to its own activity when its arguments hold a configured
secret (the workflow sees the mask there and runs none of it) or when the
calls might outlast the sampling bounds that remain.

What keeps the stop semantics whole:

- Before any call starts, the response is recorded with Temporal: a
  heartbeat whose details carry it, sent directly and awaited (the SDK's own
  heartbeats are throttled and may be lost with the worker). A round whose
  calls only read (:func:`stopline.core.policies.round_needs_record`) is not:
  lost with its worker, it hides nothing, and its sampling is retried like
  any lost model call. A worker lost
  after that point leaves its response in the activity's last heartbeat
  details; the next attempt does not sample again but fails with
  :data:`~stopline.core.contracts.ROUND_TOOLS_LOST_ERROR` carrying it, and
  the workflow records the response and a "lost" receipt per call — never a
  silent re-run (DESIGN §5). This is one heartbeat RPC per such round (a
  Temporal Cloud Action, as the tool activity it replaces was).
- The calls run exactly as the ``stopline.tool`` activity runs them
  (:func:`stopline.activities.tools.activity.run_call`): each a unit of the
  worker's registry under ``call:<id>``, output staged, aborted results on a
  cancel.
- A cancel of the round — pushed for ``sample:<round>`` (the workflow does
  not know the calls yet) or Temporal's activity cancel — is handed to every
  call; each ends as a cancelled tool call does (SIGTERM, grace, SIGKILL,
  what it captured), and the activity *returns* the outcomes, so the
  workflow records each call's one result before its ``turn_aborted``
  marker (DESIGN §3). A cancel that reached the round before its calls
  started runs none of them.

What it must never do: start a call that may change something before the
response is recorded, or re-run a call of a recorded round on a retry.
"""

from __future__ import annotations

import asyncio
from typing import Any

from temporalio import activity
from temporalio.client import AsyncActivityCancelledError
from temporalio.exceptions import ApplicationError

from stopline.activities._heartbeat import heartbeating
from stopline.activities.running import call_key, current, sampling_key
from stopline.activities.tools.activity import run_call
from stopline.activities.tools.procs import uncancel_current_task
from stopline.core.contracts import (
    ROUND_TOOLS_LOST_ERROR,
    Fatal,
    RespondToModel,
    SampleInput,
    SamplingResult,
    ToolCall,
)
from stopline.core.policies import ROUND_TOOLS_DETAILS_KEY, recorded_response, round_needs_record


def raise_if_lost(info: activity.Info) -> None:
    """Fail an attempt that follows one which started its round's calls.

    Raises:
        ApplicationError: Non-retryable, type
            :data:`~stopline.core.contracts.ROUND_TOOLS_LOST_ERROR`,
            ``details[0]`` the earlier attempt's recorded details: the
            workflow records its response and a "lost" receipt per call.
    """
    earlier = recorded_response(info.heartbeat_details)
    if earlier is None:
        return
    raise ApplicationError(
        "the worker running this round's tool calls was lost; they may have partly run "
        "and are not run again",
        earlier,
        type=ROUND_TOOLS_LOST_ERROR,
        non_retryable=True,
    )


async def run_round_tools(
    inp: SampleInput, result: SamplingResult, calls: list[ToolCall], beat: dict[str, Any], *, beaten: bool
) -> dict[str, RespondToModel | Fatal] | None:
    """Record the response, then run its calls concurrently; every call gets an outcome.

    Args:
        inp: The sampling input (``round_tools`` set).
        result: The response whose calls these are.
        calls: :func:`~stopline.core.policies.round_tool_calls` of it.
        beat: The sampling heartbeat's details (``attempt``, ``requests``);
            the recorded response is added to it, and every later heartbeat
            of the activity carries it.
        beaten: Whether the activity has heartbeated through the SDK
            already (its throttle may hold a beat without the response,
            which is then replaced before the direct one is sent).

    Returns:
        Each call's outcome by call id; ``None`` when a cancel reached the
        round before its calls started (none ran).
    """
    registry = current().calls
    guard = asyncio.ensure_future(asyncio.Event().wait())  # stands for the round in the registry
    try:
        if registry is not None:
            with registry.register(inp.task_id, sampling_key(inp.round), guard) as unit:
                if unit.cancelled:
                    return None  # the interrupt came between the response and its calls
                return await _record_and_run(inp, result, calls, beat, beaten, guard)
        return await _record_and_run(inp, result, calls, beat, beaten, guard)
    finally:
        guard.cancel()


async def _record_and_run(
    inp: SampleInput, result: SamplingResult, calls: list[ToolCall], beat: dict[str, Any],
    beaten: bool, guard: asyncio.Future[Any],
) -> dict[str, RespondToModel | Fatal] | None:
    settings = inp.round_tools
    assert settings is not None
    info = activity.info()
    beat[ROUND_TOOLS_DETAILS_KEY] = result.model_dump(mode="json", exclude={"tool_outcomes"})
    beat["round"] = inp.round
    if beaten:
        activity.heartbeat(dict(beat))  # replaces a throttled beat without the response
    try:
        if round_needs_record(calls):
            await activity.client().get_async_activity_handle(task_token=info.task_token).heartbeat(dict(beat))
    except asyncio.CancelledError:
        uncancel_current_task()
        return None  # cancelled before any call started: none runs
    except AsyncActivityCancelledError:
        # Temporal asked for a cancel first (the host was given up, or an
        # abort): the thread may already have moved on; none runs
        return None
    if guard.done():
        return None
    registry = current().calls
    tasks = {
        c.id: asyncio.ensure_future(run_call(settings.call_input(inp.task_id, c, inp.round)))
        for c in calls
    }
    handed = False

    def hand_cancel(reason: str) -> None:
        nonlocal handed
        if handed:
            return
        handed = True
        if registry is not None:
            registry.cancel(inp.task_id, [call_key(i) for i in tasks], reason=reason)
        else:
            for t in tasks.values():
                t.cancel(reason)

    async with heartbeating(lambda: dict(beat)):
        while not all(t.done() for t in tasks.values()):
            waiting = {t for t in tasks.values() if not t.done()}
            if not guard.done():
                waiting.add(guard)
            try:
                await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:
                # Temporal's cancel (or a worker shutdown): the same as a push
                uncancel_current_task()
                guard.cancel()
                hand_cancel("the activity was cancelled")
                continue
            if guard.done():
                hand_cancel(_guard_reason(guard))
    return {i: t.result() for i, t in tasks.items()}  # each call logged its own line


def _guard_reason(guard: asyncio.Future[Any]) -> str:
    try:
        guard.result()
    except asyncio.CancelledError as e:
        return str(e.args[0]) if e.args else "the round was cancelled"
    return "the round was cancelled"
