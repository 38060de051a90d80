"""Heartbeat from a background loop while an activity works: liveness only.

Why this module exists: a heartbeat tells Temporal the worker running a call
is alive; without one a crashed worker's call is noticed only at its
start-to-close timeout. One helper does it; call sites never heartbeat by
hand (STYLE rule 5).

What heartbeats are *not* for here: delivering an interrupt. Temporal
answers a heartbeat with "cancel requested", which is why agent frameworks
heartbeat every few milliseconds — but every heartbeat that reaches the
server is load and, on Temporal Cloud, a billed Action (at 20 ms: ~46 RPC/s,
~166,000 Actions and ~$8 per hour of each running call at $50 per million).
stopline pushes cancels to the host instead (:mod:`stopline.activities.running`,
DESIGN §3), so the loop beats once per ``STOPLINE_HEARTBEAT_THROTTLE_S``
(default 5 s: 0.2 RPC/s, 720 Actions and $0.036 per hour of a running call)
and Temporal's heartbeat-borne cancel remains the fallback, arriving within
one interval.

Costs per heartbeat, kept small: one ``details()`` call and one payload
conversion by the SDK; the first beat goes out one interval after the call
starts (a call shorter than that sends none), so the rate over any window
stays within one per interval.

What it must never do: beat more often than the worker's throttle (the SDK
would convert each beat's details and then drop it), or less often than a
third of the activity's heartbeat timeout (one late beat must not time a
live call out).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from temporalio import activity

from stopline.activities.running import current
from stopline.core.policies import HEARTBEAT_TIMEOUT_FRACTION

#: A heartbeat goes out at least this often relative to the heartbeat timeout
#: (a third of it: one delayed or lost beat does not time out a live call).
TIMEOUT_FRACTION = HEARTBEAT_TIMEOUT_FRACTION


def interval_for(configured_s: float, heartbeat_timeout_s: float | None) -> float:
    """Seconds between heartbeats for one activity.

    Args:
        configured_s: The worker's interval (``Settings.heartbeat_throttle_s``).
        heartbeat_timeout_s: The activity's heartbeat timeout, if it has one.

    Returns:
        ``configured_s``, lowered to a third of the heartbeat timeout when
        that is shorter (a durability test's 1 s timeout: one beat per 0.33 s).
    """
    if heartbeat_timeout_s:
        return min(configured_s, heartbeat_timeout_s * TIMEOUT_FRACTION)
    return configured_s


@asynccontextmanager
async def heartbeating(
    details: Callable[[], Any] | None = None,
    *,
    interval_s: float | None = None,
) -> AsyncIterator[None]:
    """Heartbeat every interval for the duration of the block.

    Args:
        details: Called before each heartbeat; its return value is sent as the
            heartbeat details (e.g. ``{"terminal": False}``: whether the call
            has reached its terminal state). ``None`` sends no details.
        interval_s: Seconds between heartbeats; default: the worker's
            (:func:`stopline.activities.running.current`), bounded by the
            activity's heartbeat timeout (:func:`interval_for`).

    Yields:
        Nothing; leave the block to stop heartbeating.

    Raises:
        RuntimeError: If used outside an activity.
    """
    if not activity.in_activity():
        raise RuntimeError("heartbeating() must run inside an activity")
    if interval_s is None:
        timeout = activity.info().heartbeat_timeout
        interval_s = interval_for(
            current().heartbeat_interval_s, timeout.total_seconds() if timeout else None
        )

    async def _beat() -> None:
        while True:
            await asyncio.sleep(interval_s)
            if details is None:
                activity.heartbeat()
            else:
                activity.heartbeat(details())

    task = asyncio.create_task(_beat())
    try:
        yield
    finally:
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
