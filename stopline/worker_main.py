"""The worker process: ``python worker.py`` / ``python -m stopline.worker_main``.

Runs the workflow worker and the host-bound activity worker against
``TEMPORAL_ADDRESS``, or against the embedded dev server when it is unset
(starting it, and stopping it again on exit, if it was not running).

SIGTERM and SIGINT shut the worker down gracefully: in-flight activities get
``WORKER_SHUTDOWN_GRACE_S`` to finish; a shutdown is never recorded as a user
interrupt — an activity that does not finish in time is retried (sampling) or
reported lost (tool) on the next worker (DESIGN §5).
"""

from __future__ import annotations

import asyncio
import signal

import structlog

from stopline.logging import configure_logging
from stopline.runtime import build_workers, connect, dev_server, start_dev_server
from stopline.settings import load_settings


async def run_worker() -> None:
    """Run the workers until SIGTERM / SIGINT."""
    settings = load_settings()
    configure_logging(settings)
    log = structlog.get_logger("stopline.worker")
    started_server = False
    address = settings.temporal_address
    if not address:
        was_running = dev_server(settings).pid() is not None
        address = start_dev_server(settings)
        started_server = not was_running
    client = await connect(settings, address=address)
    workers = build_workers(client, settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info(
        "worker_started", address=address, task_queue=settings.task_queue,
        host_task_queue=settings.resolved_host_task_queue(),
    )
    runs = [asyncio.create_task(w.run()) for w in workers]
    waiter = asyncio.create_task(stop.wait())
    await asyncio.wait([waiter, *runs], return_when=asyncio.FIRST_COMPLETED)
    log.info("worker_stopping")
    await asyncio.gather(*(w.shutdown() for w in workers), return_exceptions=True)
    for r in runs:
        if r.done() and r.exception() is not None:
            log.error("worker_failed", error=str(r.exception()))
    if started_server:
        dev_server(settings).stop()
    log.info("worker_stopped")


def main() -> None:
    """Entry point."""
    asyncio.run(run_worker())


if __name__ == "__main__":
    main()
