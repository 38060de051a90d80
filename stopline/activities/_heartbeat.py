"""Heartbeat from a background loop while an activity works.

Heartbeats are how Temporal delivers an activity cancel to the worker: the
server answers a heartbeat with "cancel requested" and the SDK raises
``asyncio.CancelledError`` inside the activity. So a sampling or tool
activity must heartbeat often *whether or not it is producing output* — a
tool silently sleeping must still learn of an interrupt within the grace
period (DESIGN §3). One helper does it; call sites never heartbeat by hand.

The worker's ``max_heartbeat_throttle_interval`` (see ``worker.py``) must be
at most this loop's interval, or the SDK would hold heartbeats back.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from temporalio import activity

#: Seconds between heartbeats (20 ms: a cancel reaches the activity well
#: within the default 100 ms interrupt grace on a local server).
DEFAULT_INTERVAL_S = 0.02


@asynccontextmanager
async def heartbeating(
    details: Callable[[], Any] | None = None,
    *,
    interval_s: float = DEFAULT_INTERVAL_S,
) -> AsyncIterator[None]:
    """Heartbeat every ``interval_s`` seconds for the duration of the block.

    Args:
        details: Called before each heartbeat; its return value is sent as the
            heartbeat details (e.g. ``{"terminal": False}``: whether the call
            has reached its terminal state). ``None`` sends no details.
        interval_s: Seconds between heartbeats.

    Yields:
        Nothing; leave the block to stop heartbeating.

    Raises:
        RuntimeError: If used outside an activity.
    """
    if not activity.in_activity():
        raise RuntimeError("heartbeating() must run inside an activity")

    async def _beat() -> None:
        while True:
            if details is None:
                activity.heartbeat()
            else:
                activity.heartbeat(details())
            await asyncio.sleep(interval_s)

    task = asyncio.create_task(_beat())
    try:
        yield
    finally:
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
