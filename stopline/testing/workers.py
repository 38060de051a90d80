"""Running Temporal workers for the length of a block, and waiting on a condition.

Tests and benchmarks that run stopline's workers in their own process (the
workers of :func:`stopline.worker.runtime.build_workers`, or a team's own)
start them, do their work, and must stop them on success and on failure
alike; this is that block, once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from temporalio.worker import Worker

_W = TypeVar("_W", bound=Sequence[Worker])

#: Seconds to wait for the workers' shutdown (their graceful-shutdown grace
#: for running activities, then the cancel) before giving up on it.
SHUTDOWN_WAIT_S = 60.0
#: Seconds to wait for the workers' run tasks to end after their shutdown.
RUN_END_WAIT_S = 10.0

log = logging.getLogger("stopline.testing")


@asynccontextmanager
async def running_workers(workers: _W) -> AsyncIterator[_W]:
    """Run ``workers`` for the block; shut each down after, also when the block raises.

    The shutdown is bounded (:data:`SHUTDOWN_WAIT_S`, then the run tasks are
    cancelled and given :data:`RUN_END_WAIT_S`): a worker that does not stop
    is logged and left, never a teardown that hangs.

    Args:
        workers: Workers not yet running (e.g. from ``build_workers``).

    Yields:
        The same workers.
    """
    runs = [asyncio.create_task(w.run()) for w in workers]
    try:
        yield workers
    finally:
        shutdowns = asyncio.gather(*(w.shutdown() for w in workers), return_exceptions=True)
        try:
            await asyncio.wait_for(shutdowns, SHUTDOWN_WAIT_S)
        except asyncio.TimeoutError:
            log.warning("workers did not shut down within %g s; going on without them", SHUTDOWN_WAIT_S)
        for r in runs:
            if not r.done():
                r.cancel()
        # bounded: a run that does not end once shut down and cancelled must
        # not hold the caller (a test's teardown) for ever
        if runs:
            await asyncio.wait(runs, timeout=RUN_END_WAIT_S)


async def wait_until(
    predicate: Callable[[], Any], timeout_s: float = 20.0, what: str = "", interval_s: float = 0.02
) -> Any:
    """Poll ``predicate`` until it returns something truthy; return that.

    Args:
        predicate: Called every ``interval_s`` seconds, from this event loop.
        timeout_s: Give up after this many seconds.
        what: Named in the error.
        interval_s: Seconds between calls.

    Raises:
        AssertionError: ``predicate`` stayed falsy for ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what or predicate!r}")
        await asyncio.sleep(interval_s)
