"""The worker process: ``python worker.py`` / ``python -m stopline.worker.main``.

Runs the workflow worker and the host-bound activity worker against
``TEMPORAL_ADDRESS``, or against the embedded dev server when it is unset
(starting it, and stopping it again on exit, if it was not running).

SIGTERM and SIGINT shut the worker down gracefully: in-flight activities get
``STOPLINE_WORKER_SHUTDOWN_GRACE_S`` (default 10 s) to finish; a shutdown is
never recorded as a user interrupt. A tool call still running when the grace
ends is stopped (its process group TERMed, then KILLed) and its result says
it was aborted because the worker shut down and may have partly run; a
sampling call is retried on the next worker (DESIGN §5).

With ``STOPLINE_METRICS_BIND`` set the worker serves the SDK's metrics for
Prometheus there (``stopline.worker.telemetry``).
"""

from __future__ import annotations

import asyncio
import os
import signal

import structlog

from stopline.worker.codec import codec_from_settings
from stopline.logging import configure_logging
from stopline.worker.runtime import (
    build_workers,
    configured_address,
    connect,
    dev_server,
    start_dev_server,
)
from stopline.settings import load_settings
from stopline.worker.telemetry import build_runtime


def _undumpable() -> None:
    """Make this process non-dumpable (Linux ``PR_SET_DUMPABLE`` 0).

    Tool processes run as the worker's user; without this, a tool could read
    the worker's environment — API keys included — from
    ``/proc/<worker pid>/environ``. Non-dumpable processes' ``/proc`` files
    belong to root, so this holds when the worker runs as a normal user (as
    in ``docker-compose.yml``); a worker running as root cannot be shielded
    from tools running as root.
    """
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 4
    except (OSError, AttributeError):
        pass


async def run_worker() -> None:
    """Run the workers until SIGTERM / SIGINT."""
    _undumpable()
    settings = load_settings()
    configure_logging(settings)
    log = structlog.get_logger("stopline.worker")
    # One runtime per process: it owns the Prometheus listener (if any).
    # Built first, so a bad or taken address fails before anything starts.
    metrics_runtime = build_runtime(settings)
    codec_from_settings(settings)  # a malformed STOPLINE_CODEC_KEY fails here too
    # One worker per home: the host id lives there (DESIGN §7). The lock is
    # held for the life of this process; the kernel drops it if we die.
    from stopline.activities.host import identity, take_home
    from stopline.activities.tools.procs import reap_orphan_calls

    home, _lock = take_home(settings.home, settings.home_slots)
    if home != settings.home:
        # activities read their settings per call: they must see the slot
        os.environ["STOPLINE_HOME"] = str(home)
        settings = load_settings()
    host = identity(settings)
    reaped = reap_orphan_calls(settings)
    if reaped:
        log.warning("reaped_orphan_calls", pgids=reaped)
    started_server = False
    address = configured_address(settings)
    embedded = None
    if not address:
        was_running = dev_server(settings).pid() is not None
        address = embedded = start_dev_server(settings)
        started_server = not was_running
    # a configured cluster: TLS, mTLS, API key from envconfig; the embedded
    # server: a plain connection to the address we started
    client = await connect(settings, address=embedded, runtime=metrics_runtime)
    workers = build_workers(client, settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info(
        "worker_started", address=address, task_queue=settings.task_queue,
        host_id=host.host_id, hostname=host.hostname, capacity=settings.host_capacity,
        host_task_queue=workers[-1].task_queue,
        metrics=f"http://{settings.metrics_bind}/metrics" if metrics_runtime else None,
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


def main(argv: list[str] | None = None) -> None:
    """Entry point. Exits without interpreter finalization, which the
    Temporal SDK's native threads can abort ("PyGILState_Release")."""
    import os
    import sys

    import argparse

    argparse.ArgumentParser(
        prog="worker.py",
        description=(
            "Run a stopline worker: workflows on $STOPLINE_TASK_QUEUE, tools, sampling and "
            "ledger writes on this host's queue. Against $TEMPORAL_ADDRESS, or the embedded "
            "dev server when unset. Configuration: environment (see README, Configuration)."
        ),
    ).parse_args(argv)
    code = 0
    try:
        asyncio.run(run_worker())
    except Exception as err:  # reported, then a non-zero exit
        print(f"worker failed: {err}", file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
