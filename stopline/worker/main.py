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

At start the worker says whether tool commands will run sandboxed
(``stopline.activities.tools.sandbox``): ``sandbox_ready``, or a warning
``sandbox_unavailable`` with the reason — then each task's
``allow_unconfined`` decides. Every ``retention_days / 4`` (at most hourly)
it removes finished tasks' full outputs, staged rows and shell logs older
than ``STOPLINE_RETENTION_DAYS`` (``stopline.activities.retention``).
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal
from pathlib import Path
from typing import Any

import structlog
from temporalio.client import Client

from stopline.activities.tools.sandbox import sandbox_status
from stopline.logging import configure_logging
from stopline.secrets import make_undumpable
from stopline.settings import Settings, load_settings
from stopline.worker.codec import codec_from_settings
from stopline.worker.runtime import (
    acquire_embedded,
    build_workers,
    configured_address,
    connect,
    release_embedded,
)
from stopline.worker.telemetry import worker_runtime


def take_secrets() -> None:
    """Read secrets handed over on a pipe (``STOPLINE_SECRETS_FD``) into this process's settings.

    A worker started by the CLI gets its provider and codec keys this way
    (``stopline.worker.runtime._spawn``), so they are not in its initial
    environment, which ``/proc/<pid>/environ`` shows for its whole life.
    Setting them in ``os.environ`` later does not change that file; every
    process the worker spawns gets an explicit environment (tools: an
    allowlist; the dev server: without secrets).
    """
    import json

    from stopline.worker.runtime import SECRETS_FD_ENV

    raw = os.environ.pop(SECRETS_FD_ENV, None)
    if not raw:
        return
    fd = int(raw)
    chunks = []
    try:
        while data := os.read(fd, 65536):
            chunks.append(data)
    finally:
        os.close(fd)
    for name, value in json.loads(b"".join(chunks) or b"{}").items():
        os.environ[str(name)] = str(value)


async def _retention_loop(client: Client, settings: Settings, log: Any) -> None:
    """Apply ``retention_days`` now and then, for as long as the worker runs."""
    from stopline.activities.retention import collect, workflow_closed_probe

    if settings.retention_days <= 0:
        return
    every = min(settings.retention_days * 86400 / 4, 3600.0)
    closed = workflow_closed_probe(client)
    while True:
        try:
            report = await collect(settings, closed, older_than_s=settings.retention_days * 86400)
            if report.removed_tasks:
                log.info("retention", removed_tasks=len(report.removed_tasks), freed_bytes=report.freed_bytes)
        except Exception as err:  # noqa: BLE001 - housekeeping must not stop the worker
            log.warning("retention_failed", error=str(err))
        await asyncio.sleep(every)


#: Seconds between checks that this worker still holds its home (DESIGN §7).
HOME_CHECK_S = 5.0


async def _watch_home(lock: Any, home: Path, stop: asyncio.Event, log: Any) -> None:
    """Stop the worker when its ``STOPLINE_HOME`` is deleted or replaced under it.

    The lock file went with the home, so the next worker on that path would
    take it while this one still served it: two processes as one host. This
    one stops gracefully instead (its tasks wait for it, then move, DESIGN
    §7), and says why.
    """
    while not stop.is_set():
        await asyncio.sleep(HOME_CHECK_S)
        if not lock.intact():
            log.error("home_lost", home=str(home),
                      consequence="this worker stops; its tasks move to another host (or to it, restarted)")
            stop.set()
            return


#: How long a starting worker waits for the embedded server to answer: the
#: embedded runtime starts the server and the worker at once.
CONNECT_WAIT_S = 60.0
#: Set by the embedded runtime for the background worker it starts together
#: with the server (``stopline.worker.runtime.start_background_worker``):
#: seconds to wait for the server to answer.
CONNECT_WAIT_ENV = "STOPLINE_CONNECT_WAIT_S"


async def _connect_when_up(
    settings: Settings, address: str | None, runtime: Any, log: Any, wait_s: float
) -> Client:
    """Connect, retrying for up to ``wait_s`` while the server is starting."""
    from stopline.core.errors import ConfigError

    deadline = asyncio.get_running_loop().time() + wait_s
    said = False
    while True:
        try:
            return await connect(settings, address=address, runtime=runtime)
        except ConfigError:
            raise  # no address, a malformed profile: waiting will not help
        except Exception as err:
            if asyncio.get_running_loop().time() >= deadline:
                if wait_s <= 0:
                    raise
                raise RuntimeError(f"Temporal did not answer within {wait_s:g}s: {err}") from None
            if not said:
                log.info("waiting_for_temporal", address=address or configured_address(settings))
                said = True
            await asyncio.sleep(0.2)


#: Allocations between young garbage collections in the worker process
#: (CPython's default is 700); see :func:`run_worker`.
GC_YOUNG_THRESHOLD = 20_000

async def run_worker() -> None:
    """Run the workers until SIGTERM / SIGINT."""
    make_undumpable()
    take_secrets()
    settings = load_settings()
    configure_logging(settings)
    log = structlog.get_logger("stopline.worker")
    # One runtime per process: it owns the Prometheus listener (if any) and
    # forwards the core's logs into ours. Built first, so a bad or taken
    # address fails before anything starts.
    runtime = worker_runtime(settings)
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
    sandbox = sandbox_status(settings)
    if sandbox.available:
        log.info("sandbox_ready", sandbox=sandbox.detail)
    else:
        log.warning(
            "sandbox_unavailable", reason=sandbox.detail,
            consequence="shell calls of tasks without allow_unconfined are refused; "
            "tasks with it run commands unconfined, with a ledger row per call",
        )
    lease = None
    address = configured_address(settings)
    embedded = None
    if not address:
        # The embedded server, shared: this worker leases it like any
        # command, and the last lease out stops it (runtime.acquire_embedded).
        held = await acquire_embedded(settings, with_worker=False)
        address = embedded = held.address
        lease = held.lease
    # a configured cluster: TLS, mTLS, API key from envconfig; the embedded
    # server: a plain connection to the address we started
    # The embedded server may still be starting (this worker's lease, or the
    # CLI started us together with it and said so): wait for it, bounded. A
    # configured cluster that does not answer is an error at once.
    wait_s = CONNECT_WAIT_S if embedded is not None else float(os.environ.pop(CONNECT_WAIT_ENV, "0") or 0)
    client = await _connect_when_up(settings, embedded, runtime, log, wait_s)
    workers = build_workers(client, settings)
    # Everything imported and built so far lives as long as the process:
    # keep it out of the garbage collector's full passes, which otherwise
    # rescan it every few rounds (~1 ms of CPU per round at 50 busy tasks).
    gc.freeze()
    # A young collection every 700 allocations (the default) caught the
    # objects of every in-flight round — 50 tasks' requests, rows and
    # payloads — before they died, and promoted them into full passes:
    # 0.76 ms of CPU per round at 50 busy tasks. Every 20,000, most are
    # freed by reference counting first: 0.17 ms (bench/bench_throughput.py).
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info(
        "worker_started", address=address, task_queue=settings.task_queue,
        host_id=host.host_id, hostname=host.hostname, capacity=settings.host_capacity,
        host_task_queue=workers[-1].task_queue,
        metrics=f"http://{settings.metrics_bind}/metrics" if settings.metrics_bind else None,
    )
    runs = [asyncio.create_task(w.run()) for w in workers]
    housekeeping = asyncio.create_task(_retention_loop(client, settings, log))
    watchdog = asyncio.create_task(_watch_home(_lock, home, stop, log))
    waiter = asyncio.create_task(stop.wait())
    await asyncio.wait([waiter, *runs], return_when=asyncio.FIRST_COMPLETED)
    log.info("worker_stopping")
    housekeeping.cancel()
    watchdog.cancel()
    await asyncio.gather(*(w.shutdown() for w in workers), return_exceptions=True)
    for r in runs:
        if r.done() and r.exception() is not None:
            log.error("worker_failed", error=str(r.exception()))
    if lease is not None:
        await release_embedded(settings, lease)
    log.info("worker_stopped")
    if watchdog.done() and not watchdog.cancelled() and not _lock.intact():
        from stopline.core.errors import HostError

        raise HostError(f"its STOPLINE_HOME {home} was removed or replaced while it ran; "
                        f"start it again (a new home is a new host)")


def main(argv: list[str] | None = None) -> None:
    """Entry point. Exits without interpreter finalization, which the
    Temporal SDK's native threads can abort ("PyGILState_Release")."""
    import argparse
    import sys

    argparse.ArgumentParser(
        prog="worker.py",
        description=(
            "Run a stopline worker: workflows on $STOPLINE_TASK_QUEUE, tools, sampling and "
            "ledger writes on this host's queue. Against $TEMPORAL_ADDRESS, or the embedded "
            "dev server when unset. Configuration: environment (see README, Configuration)."
        ),
    ).parse_args(argv)
    from stopline.activities.host import HostInUse
    from stopline.core.errors import ConfigError

    code = 0
    try:
        asyncio.run(run_worker())
    except (ConfigError, HostInUse) as err:  # set-up: exit 2, as the CLI's usage errors
        print(f"worker failed: {err}", file=sys.stderr)
        code = 2
    except Exception as err:  # reported, then a non-zero exit
        print(f"worker failed: {err}", file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
