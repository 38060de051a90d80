"""This host: its stable identity, the one worker that may serve it, its
workspace markers, and the host sessions through which tasks claim it.

Why this module exists (DESIGN §7): a task must reach the disk and the
processes of the host that holds its workspace, whichever machine started it
and however often the worker restarts or the pod is renamed. So a host is
named by an id created once in its ``STOPLINE_HOME`` (not by its hostname),
serves its own task queue (``<task queue>-host-<host id>``, Temporal's
worker-specific task queues), and a task claims it by running a *host
session*: one long activity, started on the pool's queue (any host with room
takes it) or on one host's own queue (a pinned task, the same task after
continue-as-new, a task moving after its host was lost). The session

- checks the workspace exists here (and, when moving, carries the same
  ``.stopline-workspace`` marker: the same shared volume, not a namesake);
- takes one of the host's capacity slots (a sub-task shares its parent's; a
  task's next run takes over its previous run's);
- tells the workflow which host it got (a Signal: the claim);
- then heartbeats until the task releases it. Its heartbeats are the host's
  liveness: when they stop, Temporal times the session out and the task
  learns its host is lost, within ``host_lost_after_s``.

What it must never do: let two worker processes serve one home at once (the
home lock), act on another host's processes, or hold a capacity slot for a
task that has ended (a session whose workflow has closed is cancelled by its
next heartbeat; a finishing task releases its session at once).
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import re
import socket
import uuid
import weakref
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import structlog
from temporalio import activity
from temporalio.exceptions import ApplicationError

from stopline.core.contracts import (
    HOST_CLAIMED_SIGNAL,
    HOST_SESSION_ACTIVITY,
    LIST_HOSTS_ACTIVITY,
    ROUND_RECORD_ACTIVITY,
    SAMPLE_ACTIVITY,
    RoundRecord,
    RoundRecordInput,
    SamplingResult,
    WORKSPACE_MARKER_FILE,
    HostClaim,
    HostInfo,
    HostSessionInput,
    ListHostsInput,
    host_task_queue,
)
from stopline.core.errors import HostError
from stopline.settings import Settings, load_settings

log = structlog.get_logger("stopline.host")

#: ApplicationError type of a session that cannot reach the task's workspace.
WORKSPACE_UNAVAILABLE = "WorkspaceUnavailable"
#: What a host session returns when its worker shuts down gracefully.
SESSION_SHUTDOWN = "shutdown"
#: Id of this worker process (a restart changes it; the host id does not).
INSTANCE = uuid.uuid4().hex[:12]


class HostInUse(HostError):
    """Another live worker process already serves this ``STOPLINE_HOME``."""


@dataclass(frozen=True)
class HostIdentity:
    """Who this host is.

    Attributes:
        host_id: ``h-`` and 12 hex digits, created once in
            ``$STOPLINE_HOME/host.json``.
        hostname: The machine's current name (for people).
        boot_id: The kernel's boot id (``/proc/sys/kernel/random/boot_id``);
            ``""`` where there is none.
        pid_ns: This process's PID namespace (``/proc/self/ns/pid`` link);
            a pid means a process only inside its namespace.
    """

    host_id: str
    hostname: str
    boot_id: str
    pid_ns: str


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return ""


def boot_id() -> str:
    """The kernel's boot id, ``""`` when unavailable (a reboot changes it)."""
    return _read_text("/proc/sys/kernel/random/boot_id")


def pid_namespace() -> str:
    """This process's PID namespace, e.g. ``pid:[4026531836]`` (``""`` if unknown)."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


_identities: dict[Path, str] = {}


def host_id_for(home: Path) -> str:
    """The host id kept in ``home/host.json``, created there on first use.

    Creation is atomic: the file is written whole under a temporary name and
    hard-linked into place (``link`` fails if the name exists), so two
    processes racing on a new home agree on one id and no reader ever sees
    a half-written file.

    Args:
        home: ``STOPLINE_HOME``.

    Returns:
        The id (``h-`` and 12 hex digits).

    Raises:
        HostError: ``host.json`` exists but is not a host file.
    """
    home = Path(home)
    path = home / "host.json"
    cached = _identities.get(home)
    if cached is not None and path.exists():
        return cached
    home.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        new = {"host_id": f"h-{uuid.uuid4().hex[:12]}",
               "created_at": datetime.now(timezone.utc).isoformat()}
        tmp = home / f".host.json.{os.getpid()}.{uuid.uuid4().hex[:6]}"
        with open(tmp, "w") as f:
            json.dump(new, f)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)  # whole, or not at all; the loser reads the winner's
        except FileExistsError:
            pass
        finally:
            tmp.unlink(missing_ok=True)
    try:
        host_id = str(json.loads(path.read_text())["host_id"])
    except (OSError, ValueError, KeyError) as err:
        raise HostError(f"{path} is not a stopline host file ({err}); remove it to get a new host id") from None
    _identities[home] = host_id
    return host_id


def identity(settings: Settings | None = None) -> HostIdentity:
    """This host's identity (the id from ``settings.home``)."""
    settings = settings or load_settings()
    return HostIdentity(
        host_id=host_id_for(settings.home),
        hostname=socket.gethostname(),
        boot_id=boot_id(),
        pid_ns=pid_namespace(),
    )


class HomeLock:
    """Holds ``$STOPLINE_HOME/run/worker.lock`` while one worker serves the home.

    An ``flock``: the kernel drops it when the process dies, so a crashed
    worker never blocks the next one.
    """

    def __init__(self, home: Path) -> None:
        self.path = Path(home) / "run" / "worker.lock"
        self._fd: int | None = None

    def acquire(self) -> HomeLock:
        """Take the lock.

        Raises:
            HostInUse: Another live process holds it (its pid is named).
        """
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            home = self.path.parent.parent
            raise HostInUse(
                f"another stopline worker (pid {holder}) already serves {home} as host "
                f"{host_id_for(home)}; one worker per STOPLINE_HOME (give this one its own "
                f"STOPLINE_HOME, or stop the other first)"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._fd = fd
        return self

    def intact(self) -> bool:
        """Whether the lock file this process holds is still the one at its
        path: ``False`` once the home was deleted or replaced under a live
        worker (a later worker could then take the home while this one still
        serves it). Reads only metadata (two ``stat`` calls)."""
        if self._fd is None:
            return False
        try:
            return os.fstat(self._fd).st_ino == os.stat(self.path).st_ino
        except OSError:
            return False

    def release(self) -> None:
        """Drop the lock (also dropped by the kernel when the process ends)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def take_home(home: Path, slots: int) -> tuple[Path, HomeLock]:
    """Lock this worker's home: ``home`` itself, or the first free slot.

    Args:
        home: ``STOPLINE_HOME``.
        slots: 0 for ``home`` itself; N > 0 for the first of
            ``home/slot-1`` … ``home/slot-N`` that no live worker holds.

    Returns:
        The home this worker serves and its held lock.

    Raises:
        HostInUse: ``home`` (or every slot) is held by a live worker.
    """
    if slots <= 0:
        return home, HomeLock(home).acquire()
    for i in range(1, slots + 1):
        slot = Path(home) / f"slot-{i}"
        try:
            return slot, HomeLock(slot).acquire()
        except HostInUse:
            continue
    raise HostInUse(f"all {slots} host homes under {home} are held by live workers "
                    f"(raise STOPLINE_HOME_SLOTS)")


def workspace_marker(workspace: Path, *, create: bool) -> str | None:
    """The id in ``workspace/.stopline-workspace``, written there first if asked.

    Args:
        workspace: The workspace directory.
        create: Write a new marker when there is none.

    Returns:
        The marker, or ``None`` when there is none (and none could be written,
        e.g. a read-only workspace).
    """
    path = workspace / WORKSPACE_MARKER_FILE
    try:
        return path.read_text().strip() or None
    except FileNotFoundError:
        pass
    except OSError:
        return None
    if not create:
        return None
    marker = f"w-{uuid.uuid4().hex[:12]}"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return workspace_marker(workspace, create=False)
    except OSError:
        return None
    with os.fdopen(fd, "w") as f:
        f.write(marker + "\n")
    return marker


# ---------------------------------------------------------------------------
# Host sessions.
# ---------------------------------------------------------------------------


@dataclass
class _Held:
    """A task's hold on this host."""

    task_id: str
    released: asyncio.Event
    permit: bool
    transferred: bool = False


_live_hosts: weakref.WeakSet[HostSessions] = weakref.WeakSet()


class HostSessions:
    """The host-session activity of one host, with its capacity.

    Register :meth:`session` on the pool's worker (with
    ``max_concurrent_activities`` = capacity, so a full host stops taking
    pool work) and on the host's own worker (pinned claims).

    Args:
        settings: Host settings (home, capacity).
        task_queue: The workflow task queue this host serves (its own queue
            is derived from it).
    """

    def __init__(self, settings: Settings, task_queue: str) -> None:
        self.settings = settings
        self.identity = identity(settings)
        self.capacity = max(1, settings.host_capacity)
        self.task_queue = host_task_queue(task_queue, self.identity.host_id)
        self._slots = asyncio.Semaphore(self.capacity)
        self._held: dict[str, _Held] = {}
        _live_hosts.add(self)

    def held(self) -> list[str]:
        """Task ids holding this host now."""
        return sorted(self._held)

    def release(self, task_id: str) -> bool:
        """End a task's session now (its task finished): frees its slot.

        Returns:
            ``True`` when the task held this host.
        """
        held = self._held.get(task_id)
        if held is None:
            return False
        held.released.set()
        return True

    async def _hold(self, inp: HostSessionInput) -> _Held:
        previous = self._held.get(inp.task_id)
        if previous is not None:
            # The task's next run (continue-as-new) or a re-claim after a
            # restart of its workflow: take over the slot, no new one.
            previous.transferred = True
            previous.released.set()
            held = _Held(inp.task_id, asyncio.Event(), permit=previous.permit)
        elif inp.parent_task_id and inp.parent_task_id in self._held:
            held = _Held(inp.task_id, asyncio.Event(), permit=False)  # shares the parent's
        else:
            await self._slots.acquire()
            held = _Held(inp.task_id, asyncio.Event(), permit=True)
        self._held[inp.task_id] = held
        return held

    def _drop(self, held: _Held) -> None:
        if self._held.get(held.task_id) is held:
            del self._held[held.task_id]
        if held.permit and not held.transferred:
            self._slots.release()

    @activity.defn(name=HOST_SESSION_ACTIVITY)
    async def session(self, inp: HostSessionInput) -> str:
        """Claim this host for a task and hold it until released (DESIGN §7).

        Args:
            inp: The task, its run, the claim id, its workspace.

        Returns:
            How the session ended: ``released`` (the task is done with the
            host), ``transferred`` (the task's next run holds it now),
            ``gone`` (the workflow run no longer exists), ``shutdown`` (this
            worker is shutting down: the task waits for it to come back).

        Raises:
            ApplicationError: ``WorkspaceUnavailable`` (non-retryable) when
                the workspace does not exist here, or does not carry the
                required marker.
            asyncio.CancelledError: When the task cancels the session.
        """
        workspace = Path(inp.workspace)
        if not workspace.is_dir():
            raise ApplicationError(
                f"workspace {inp.workspace} does not exist on host {self.identity.host_id} "
                f"({self.identity.hostname})",
                type=WORKSPACE_UNAVAILABLE, non_retryable=True,
            )
        marker = workspace_marker(workspace, create=inp.require_marker is None)
        if inp.require_marker is not None and marker != inp.require_marker:
            raise ApplicationError(
                f"host {self.identity.host_id} ({self.identity.hostname}) has {inp.workspace} "
                f"but not the same workspace (marker {marker or 'missing'}, need "
                f"{inp.require_marker})",
                type=WORKSPACE_UNAVAILABLE, non_retryable=True,
            )
        beat = asyncio.create_task(_heartbeat_every(inp.heartbeat_s))
        try:
            held = await self._hold(inp)
            try:
                claim = HostClaim(
                    host_id=self.identity.host_id,
                    task_queue=self.task_queue,
                    hostname=self.identity.hostname,
                    boot_id=self.identity.boot_id,
                    instance=INSTANCE,
                    workspace_marker=marker,
                    claim_id=inp.claim_id,
                )
                client = activity.client()
                try:
                    await client.get_workflow_handle(inp.task_id, run_id=inp.run_id).signal(
                        HOST_CLAIMED_SIGNAL, claim
                    )
                except Exception as err:  # the run closed before we claimed: nothing to hold
                    log.info("host_claim_undelivered", task_id=inp.task_id, error=str(err))
                    return "gone"
                log.info("host_claimed", task_id=inp.task_id, claim_id=inp.claim_id)
                released = asyncio.ensure_future(held.released.wait())
                shutdown = asyncio.ensure_future(activity.wait_for_worker_shutdown())
                try:
                    await asyncio.wait([released, shutdown], return_when=asyncio.FIRST_COMPLETED)
                finally:
                    released.cancel()
                    shutdown.cancel()
                if held.released.is_set():
                    return "transferred" if held.transferred else "released"
                # The worker is draining (SIGTERM): say so, so the task waits
                # for this host to come back before it looks elsewhere.
                return SESSION_SHUTDOWN
            finally:
                self._drop(held)
        finally:
            beat.cancel()


async def _heartbeat_every(interval_s: float) -> None:
    """Heartbeat now and then every ``interval_s``: the host's liveness."""
    while True:
        activity.heartbeat()
        await asyncio.sleep(interval_s)


def release_session(task_id: str) -> bool:
    """Release a task's host session on whichever host object holds it in
    this process (the flush activity at a task's end).

    Returns:
        ``True`` when a session was released.
    """
    return any(h.release(task_id) for h in list(_live_hosts))


# ---------------------------------------------------------------------------
# Which hosts are alive.
# ---------------------------------------------------------------------------

_IDENTITY = re.compile(r"^(?P<pid>\d+)@(?P<hostname>\S+) stopline-host=(?P<host>\S+)(?: capacity=(?P<cap>\d+))?")


def worker_identity(host: HostIdentity, capacity: int) -> str:
    """The identity this host's workers report to Temporal.

    ``stopline hosts`` and a moving task read it back from the pollers of
    the workflow task queue (:func:`describe_hosts`).
    """
    return f"{os.getpid()}@{host.hostname} stopline-host={host.host_id} capacity={capacity}"


async def describe_hosts(client: Any, task_queue: str, *, max_age_s: float = 90.0) -> list[HostInfo]:
    """The hosts polling ``task_queue``, from Temporal's own view of its pollers.

    Args:
        client: A connected client.
        task_queue: The workflow task queue.
        max_age_s: Leave out hosts not seen for this long.

    Returns:
        One entry per host id (the most recently seen poller), newest first.
    """
    from temporalio.api.enums.v1 import TaskQueueType
    from temporalio.api.taskqueue.v1 import TaskQueue
    from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest

    resp = await client.workflow_service.describe_task_queue(
        DescribeTaskQueueRequest(
            namespace=client.namespace,
            task_queue=TaskQueue(name=task_queue),
            task_queue_type=TaskQueueType.TASK_QUEUE_TYPE_WORKFLOW,
        )
    )
    now = datetime.now(timezone.utc)
    hosts: dict[str, HostInfo] = {}
    for poller in resp.pollers:
        m = _IDENTITY.match(poller.identity)
        if m is None:
            continue
        seen = poller.last_access_time.ToDatetime(tzinfo=timezone.utc)
        if now - seen > timedelta(seconds=max_age_s):
            continue
        info = HostInfo(
            host_id=m["host"],
            task_queue=host_task_queue(task_queue, m["host"]),
            hostname=m["hostname"],
            capacity=int(m["cap"]) if m["cap"] else None,
            identity=poller.identity,
            last_seen=seen,
        )
        known = hosts.get(info.host_id)
        if known is None or (known.last_seen and seen > known.last_seen):
            hosts[info.host_id] = info
    return sorted(hosts.values(), key=lambda h: h.last_seen or now, reverse=True)


@activity.defn(name=LIST_HOSTS_ACTIVITY)
async def list_hosts(inp: ListHostsInput) -> list[HostInfo]:
    """The live hosts of a workflow task queue (a task looking for a new host).

    Runs on the workflow task queue: any worker can answer, whichever host
    was lost.
    """
    return await describe_hosts(activity.client(), inp.task_queue, max_age_s=inp.max_age_s)


@activity.defn(name=ROUND_RECORD_ACTIVITY)
async def round_record(inp: RoundRecordInput) -> RoundRecord:
    """What a task's running sampling activity recorded with Temporal (DESIGN §1).

    The workflow asks before it gives up on a sampling activity that runs a
    round's tool calls and has not answered — its host is lost — because
    only Temporal still holds that activity's last heartbeat, and with it the
    response whose calls may have run; a cancel would end a retry waiting
    for the gone host at once, details and all. Runs on the workflow task
    queue: any worker can answer, whichever host was lost.

    Returns:
        The pending sampling activity's state and recorded response;
        ``pending=False`` when there is none.
    """
    from temporalio.api.enums.v1 import PendingActivityState

    from stopline.core.policies import ROUND_TOOLS_DETAILS_KEY, recorded_response

    client = activity.client()
    desc = await client.get_workflow_handle(inp.workflow_id, run_id=inp.run_id).describe()
    for pending in desc.raw_description.pending_activities:
        if pending.activity_type.name != SAMPLE_ACTIVITY:
            continue
        response, by, requests = None, 0, 0
        if pending.heartbeat_details.payloads:
            recorded = recorded_response(await client.data_converter.decode(pending.heartbeat_details.payloads))
            if recorded is not None:
                response = SamplingResult.model_validate(recorded[ROUND_TOOLS_DETAILS_KEY])
                by = recorded.get("attempt") if isinstance(recorded.get("attempt"), int) else 0
                requests = recorded.get("requests") if isinstance(recorded.get("requests"), int) else 0
        started = pending.state in (
            PendingActivityState.PENDING_ACTIVITY_STATE_STARTED,
            PendingActivityState.PENDING_ACTIVITY_STATE_CANCEL_REQUESTED,
        )
        return RoundRecord(
            pending=True, started=started, attempt=pending.attempt, response=response, recorded_attempt=by,
            requests=requests,
        )
    return RoundRecord()
