"""Process groups: find their members, signal them, end them, remember them.

Why this module exists: a foreground ``shell`` call owns one process group
(it is started with ``start_new_session=True``) and DESIGN §3 requires the
whole group to be gone when the call returns — after a normal exit, a
timeout, or a user interrupt (SIGTERM first so cleanup traps run, SIGKILL
after the grace). While a call runs its group is recorded on disk so the
workflow's hard-abort step and crash recovery (another activity, maybe
another worker process) can SIGKILL it: :func:`kill_call_groups`.

What it must never do: signal a group it was not told about (no killing by
name, no walking other sessions), or block the event loop waiting for a
process (:func:`terminate_group` polls with ``asyncio.sleep``; the ``_sync``
variant is for plain threads and short graces only).

A sandboxed foreground call (:mod:`.sandbox`) is stopped the same way
in spirit — SIGTERM, grace, SIGKILL — but through its sandbox
(:func:`terminate_sandbox`): SIGTERM to the sandbox's session, SIGKILL to its
PID 1, which takes its whole PID namespace with it. Its record names the
``bwrap`` process's own group, so :func:`kill_call_groups` kills both kinds
alike (``bwrap --die-with-parent``: its death kills the sandbox).

"Member" means a live, non-zombie process whose process group id is the
group's: a zombie has nothing left to kill, and in a container whose PID 1
never reaps, zombies of re-parented children would otherwise look alive
forever.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

import psutil

from stopline.settings import Settings, load_settings

from ._state import call_record_path, read_json, write_json_atomic

#: Seconds between checks while waiting for a group to empty.
POLL_S = 0.005
#: The longest interval between full member scans (a walk of ``/proc``:
#: ~8 ms with ~100 processes on a small VM, more on a busy host) while
#: waiting for a group to empty (:class:`_GroupWatch`).
SCAN_S = 0.05
#: Seconds to wait for SIGKILLed processes to disappear before giving up.
KILL_SETTLE_S = 1.0

GroupEnd = Literal["gone", "SIGTERM", "SIGKILL"]


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """``(state, pgrp)`` of ``pid`` from ``/proc/<pid>/stat``; ``None`` if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    fields = raw[raw.rfind(b")") + 2 :].split()
    try:
        return fields[0].decode(), int(fields[2])
    except (IndexError, ValueError):
        return None


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes in process group ``pgid``.

    Args:
        pgid: Process group id.

    Returns:
        Their pids (empty when the group is gone).
    """
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return []
    except PermissionError:
        pass  # exists, owned by someone else: still report its members
    members: list[int] = []
    if os.path.isdir("/proc"):
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            st = _proc_stat(int(entry))
            if st is not None and st[1] == pgid and st[0] not in ("Z", "X"):
                members.append(int(entry))
        return members
    for proc in psutil.process_iter():  # pragma: no cover - non-Linux fallback
        try:
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                members.append(proc.pid)
        except (psutil.Error, OSError):
            continue
    return members


def _no_group(pgid: int) -> bool:
    """Whether no process (not even a zombie) is left in group ``pgid``."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _live_member(pid: int, pgid: int) -> bool:
    """Whether ``pid`` is a live (non-zombie) process of group ``pgid``."""
    st = _proc_stat(pid)
    return st is not None and st[1] == pgid and st[0] not in ("Z", "X")


class _GroupWatch:
    """Repeated "has group ``pgid`` emptied?" checks while waiting on it.

    Each check is the signal-0 probe first (a group entirely gone is seen in
    microseconds); then the members the last walk of ``/proc`` found are
    re-read one by one, and one still alive answers "no". Only when none is
    (they died, or are zombies nobody reaped yet) is ``/proc`` walked again,
    for members forked since and for a group left with only zombies — and
    then at most at doubling intervals from :data:`POLL_S` up to
    :data:`SCAN_S`. A walk costs ~8 ms with ~100 processes and blocks the
    worker's event loop; walking on a timer alone still took most of a
    SIGTERM-ignoring call's grace at 50 busy tasks.

    Args:
        pgid: The group.
    """

    def __init__(self, pgid: int) -> None:
        self.pgid = pgid
        self.known: list[int] = []
        self.due = 0.0
        self.interval = POLL_S
        # a group with no live member stays so: only a member can fork into it
        self.empty = False

    def rearm(self) -> None:
        """Allow a walk at the next check (call right after signalling)."""
        self.due, self.interval = 0.0, POLL_S

    def emptied(self) -> bool:
        """Whether no live process is left in the group."""
        if self.empty or _no_group(self.pgid):
            self.empty = True
            return True
        if any(_live_member(pid, self.pgid) for pid in self.known):
            return False
        now = time.monotonic()
        if now < self.due:
            return False
        self.due, self.interval = now + self.interval, min(self.interval * 2, SCAN_S)
        self.known = group_members(self.pgid)
        self.empty = not self.known
        return self.empty


def signal_group(pgid: int, sig: int) -> bool:
    """Send ``sig`` to every process in group ``pgid``.

    Returns:
        ``True`` when the signal was delivered, ``False`` when the group no
        longer exists (or is not ours to signal).
    """
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


async def terminate_group(
    pgid: int,
    grace_s: float,
    *,
    reap: Callable[[], object] | None = None,
    hurry: Callable[[], bool] | None = None,
) -> GroupEnd:
    """SIGTERM the group, wait up to ``grace_s`` seconds for it to empty, then SIGKILL.

    DESIGN §3: TERM first so ``trap ... TERM`` cleanup handlers run (TERM goes
    to the whole group, so a foreground ``sleep`` a script waits on dies too
    and the script's trap runs), KILL at the end of the grace.

    A second cancellation while waiting skips the rest of the grace and
    goes straight to SIGKILL (this coroutine swallows it: the group must be
    gone whatever happens to the caller).

    Args:
        pgid: Process group id.
        grace_s: Seconds between SIGTERM and SIGKILL.
        reap: Called on every check (e.g. ``Popen.poll``) so a leader that
            exited is reaped.
        hurry: When it returns ``True``, stop waiting and SIGKILL now.

    Returns:
        ``"gone"`` if the group was already empty, ``"SIGTERM"`` if it emptied
        within the grace, ``"SIGKILL"`` if it had to be killed.
    """
    if reap is not None:
        reap()
    watch = _GroupWatch(pgid)
    if watch.emptied():
        return "gone"
    signal_group(pgid, signal.SIGTERM)
    watch.rearm()
    deadline = time.monotonic() + grace_s
    cut_short = False
    while True:
        if reap is not None:
            reap()
        if watch.emptied():
            return "SIGTERM"
        if cut_short or time.monotonic() >= deadline or (hurry is not None and hurry()):
            break
        try:
            await asyncio.sleep(min(POLL_S, max(deadline - time.monotonic(), 0)))
        except asyncio.CancelledError:
            uncancel_current_task()
            cut_short = True
    signal_group(pgid, signal.SIGKILL)
    watch.rearm()
    settle = time.monotonic() + KILL_SETTLE_S
    while time.monotonic() < settle:
        if reap is not None:
            reap()
        if watch.emptied():
            break
        try:
            await asyncio.sleep(POLL_S)
        except asyncio.CancelledError:
            uncancel_current_task()
            break
    return "SIGKILL"


def terminate_groups_sync(
    pgids: Iterable[int], grace_s: float, *, reap: Callable[[], object] | None = None
) -> dict[int, GroupEnd]:
    """Blocking :func:`terminate_group` for several groups sharing one grace.

    For plain (non-async) callers such as :func:`close_unattended_shells`;
    blocks for at most ``grace_s`` + :data:`KILL_SETTLE_S` seconds.

    Returns:
        pgid -> how it ended (see :func:`terminate_group`).
    """
    result: dict[int, GroupEnd] = {}
    live = []
    for pgid in pgids:
        if group_members(pgid) and signal_group(pgid, signal.SIGTERM):
            live.append(pgid)
        else:
            result[pgid] = "gone"
    deadline = time.monotonic() + grace_s
    while live:
        if reap is not None:
            reap()
        for pgid in [p for p in live if not group_members(p)]:
            result[pgid] = "SIGTERM"
            live.remove(pgid)
        if not live or time.monotonic() >= deadline:
            break
        time.sleep(POLL_S)
    for pgid in live:
        signal_group(pgid, signal.SIGKILL)
        result[pgid] = "SIGKILL"
    settle = time.monotonic() + KILL_SETTLE_S
    while live and time.monotonic() < settle:
        if reap is not None:
            reap()
        live = [p for p in live if group_members(p)]
        if live:
            time.sleep(POLL_S)
    return result


# ---------------------------------------------------------------------------
# A foreground call's bubblewrap sandbox (see .sandbox).
# ---------------------------------------------------------------------------


def sandbox_init_pid(bwrap_pid: int) -> int | None:
    """Host pid of a sandbox's PID 1: the one child of bubblewrap's monitor process.

    Args:
        bwrap_pid: The ``bwrap`` process the worker started.

    Returns:
        The pid, or ``None`` when there is none (not yet created, or gone).
    """
    try:
        with open(f"/proc/{bwrap_pid}/task/{bwrap_pid}/children", encoding="ascii") as f:
            children = f.read().split()
    except OSError:
        try:
            children = [str(c.pid) for c in psutil.Process(bwrap_pid).children()]
        except psutil.Error:
            return None
    return int(children[0]) if children else None


def _alive(pid: int) -> bool:
    st = _proc_stat(pid)
    return st is not None and st[0] not in ("Z", "X")


def kill_sandbox(bwrap_pid: int, init_pid: int | None) -> None:
    """SIGKILL a foreground sandbox: its PID 1 (the kernel then kills everything
    in its PID namespace) and the ``bwrap`` monitor (whose death also kills
    PID 1: ``--die-with-parent``)."""
    if init_pid is not None:
        try:
            os.kill(init_pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    signal_group(bwrap_pid, signal.SIGKILL)


async def terminate_sandbox(
    bwrap_pid: int,
    grace_s: float,
    *,
    exited: Callable[[], bool],
    init_pid: int | None = None,
) -> GroupEnd:
    """SIGTERM a foreground sandbox's command, wait up to ``grace_s``, then SIGKILL it all.

    DESIGN §3 in a sandbox: SIGTERM goes to the sandbox's session (created by
    ``--new-session``; its id is the sandbox's PID 1, which ignores it as a
    namespace's init does): the command and its process group get it, and
    the supervisor, which defers it, then stops what the command left
    behind. At the end of the grace, :func:`kill_sandbox`. Returns once the
    ``bwrap`` process has exited and the sandbox's PID 1 is gone (a
    cancellation while waiting goes straight to SIGKILL, as in
    :func:`terminate_group`).

    Args:
        bwrap_pid: The ``bwrap`` process.
        grace_s: Seconds between SIGTERM and SIGKILL.
        exited: Whether ``bwrap`` has exited (reaps it, e.g. ``Popen.poll``).
        init_pid: The sandbox's PID 1 when known (bubblewrap's ``--info-fd``);
            else looked up while ``bwrap`` runs.

    Returns:
        ``"gone"``, ``"SIGTERM"`` or ``"SIGKILL"`` as :func:`terminate_group`.
    """
    init = init_pid if init_pid is not None else sandbox_init_pid(bwrap_pid)
    if exited():
        end: GroupEnd = "gone"
    else:
        end = "SIGKILL"
        if init is not None:
            signal_group(init, signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            while True:
                if exited():
                    end = "SIGTERM"
                    break
                if time.monotonic() >= deadline:
                    break
                try:
                    await asyncio.sleep(min(POLL_S, max(deadline - time.monotonic(), 0)))
                except asyncio.CancelledError:
                    uncancel_current_task()
                    break
        if end == "SIGKILL":
            kill_sandbox(bwrap_pid, init)
    settle = time.monotonic() + KILL_SETTLE_S
    while time.monotonic() < settle and not exited():
        try:
            await asyncio.sleep(POLL_S)
        except asyncio.CancelledError:
            uncancel_current_task()
            break
    if init is not None:
        await wait_gone(init, max(settle - time.monotonic(), 0.0))
    return end


async def wait_gone(pid: int, timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` seconds for ``pid`` (not necessarily our child) to end.

    Through a pidfd where the kernel has them (readable the moment the
    process ends: no polling delay added to every call), else by polling.

    Returns:
        ``True`` when it is gone (or a zombie).
    """
    if not _alive(pid):
        return True
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        deadline = time.monotonic() + timeout_s
        while _alive(pid):
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(POLL_S)
        return True
    loop = asyncio.get_running_loop()
    ended = asyncio.Event()
    try:
        loop.add_reader(pidfd, ended.set)
        try:
            await asyncio.wait_for(ended.wait(), timeout_s)
        except TimeoutError:
            pass
        except asyncio.CancelledError:
            uncancel_current_task()
    finally:
        loop.remove_reader(pidfd)
        os.close(pidfd)
    return not _alive(pid)


def uncancel_current_task() -> None:
    """Undo one ``Task.cancel()`` we deliberately swallow (keeps ``asyncio.timeout`` honest)."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        task.uncancel()


def pipe_holders(fd: int) -> list[int]:
    """Pids (other than ours) holding the other end of the pipe read through ``fd``.

    Best effort via ``/proc/<pid>/fd``; used only to tell the model which
    process escaped the group (``setsid``) while keeping the output pipe.
    """
    try:
        ino = os.fstat(fd).st_ino
    except OSError:
        return []
    target = f"pipe:[{ino}]"
    me = os.getpid()
    holders: list[int] = []
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return []
    for pid in pids:
        if pid == me:
            continue
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for name in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{name}") == target:
                    holders.append(pid)
                    break
            except OSError:
                continue
    return holders


# ---------------------------------------------------------------------------
# Per-call records: what the hard abort and crash recovery kill.
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class CallRecord:
    """The process group of a running foreground call (as stored on disk).

    A pid names a process only on one host, in one boot, in one PID
    namespace: the record carries all three, and only a worker of the same
    host, boot and namespace ever signals it (DESIGN §7).
    """

    pgid: int
    pid: int
    started_at: float
    host_id: str = ""
    boot_id: str = ""
    pid_ns: str = ""


def _ours(data: dict, owner: tuple[str, str, str]) -> bool:
    """Whether a record was written by this host, in this boot and namespace."""
    return (data.get("host_id"), data.get("boot_id"), data.get("pid_ns")) == owner


def record_call(
    settings: Settings, task_id: str, call_id: str, *, pid: int, pgid: int, **extra: object
) -> CallRecord:
    """Write ``<procs_dir>/<task_id>/<call_id>.json`` for a call that just spawned.

    For a sandboxed call the group is the ``bwrap`` process's own: killing
    it kills the sandbox (``--die-with-parent``), so :func:`kill_call_groups`
    treats both kinds alike.

    Args:
        settings: Where the state lives.
        task_id: Owning task.
        call_id: The tool call.
        pid: Leader pid.
        pgid: Its process group id.
        **extra: More JSON fields for the record (e.g. ``sandbox=True``).

    Returns:
        The record written (``started_at`` in Unix seconds).
    """
    from stopline.activities.host import boot_id, host_id_for, pid_namespace

    rec = CallRecord(
        pgid=pgid, pid=pid, started_at=time.time(),
        host_id=host_id_for(settings.home), boot_id=boot_id(), pid_ns=pid_namespace(),
    )
    write_json_atomic(
        call_record_path(settings, task_id, call_id),
        {**extra, "pgid": rec.pgid, "pid": rec.pid, "started_at": rec.started_at,
         "host_id": rec.host_id, "boot_id": rec.boot_id, "pid_ns": rec.pid_ns},
    )
    return rec


def forget_call(settings: Settings, task_id: str, call_id: str) -> None:
    """Remove a call's record (the call returned and its group is gone)."""
    try:
        call_record_path(settings, task_id, call_id).unlink()
    except FileNotFoundError:
        pass


def _pid_reused(pid: int, started_at: float) -> bool:
    """Whether ``pid`` now names a process started after the recorded one."""
    try:
        return psutil.Process(pid).create_time() > started_at + 2.0
    except psutil.Error:
        return False


def kill_call_groups(
    task_id: str, call_ids: list[str], *, settings: Settings | None = None
) -> list[int]:
    """SIGKILL the recorded process groups of ``call_ids`` and forget them.

    The irreversible step of an abort (DESIGN §3: at the end of the grace,
    nothing may go on writing to disk) and of crash recovery (a worker that
    died left its calls' groups running). Synchronous and quick: one
    ``killpg`` per record, no waiting.

    Args:
        task_id: Owning task.
        call_ids: Tool call ids; ids without a record (finished calls,
            calls that never spawned a process) are skipped.
        settings: Where state lives; default :func:`load_settings`.

    Returns:
        The pgids that were signalled (groups already gone are not listed).
        A record another host, boot or PID namespace wrote is never acted on
        (its pid means another process here) and is left in place.
    """
    settings = settings or load_settings()
    from stopline.activities.host import boot_id, host_id_for, pid_namespace

    owner = (host_id_for(settings.home), boot_id(), pid_namespace())
    signalled: list[int] = []
    for call_id in call_ids:
        path = call_record_path(settings, task_id, call_id)
        data = read_json(path)
        if data is not None and not _ours(data, owner):
            continue
        if data is not None:
            try:
                pgid = int(data["pgid"])
                started_at = float(data.get("started_at", 0.0))
            except (KeyError, TypeError, ValueError):
                pgid = 0
                started_at = 0.0
            if (
                pgid > 1
                and not _pid_reused(pgid, started_at)
                and group_members(pgid)
                and signal_group(pgid, signal.SIGKILL)
            ):
                signalled.append(pgid)
        try:
            path.unlink()
        except FileNotFoundError:
            pass
    return signalled


def reap_orphan_calls(settings: Settings | None = None) -> list[int]:
    """SIGKILL the groups of foreground calls a dead worker of this host left.

    Run once when a worker starts on a home it holds the lock of: every
    record there belongs to a process that is gone, so every call it names
    is lost (DESIGN §5) and its group must not go on writing. Records of
    another boot name processes that no longer exist and are removed;
    records of another PID namespace are left alone (not ours to read).

    Returns:
        The pgids that were signalled.
    """
    settings = settings or load_settings()
    from stopline.activities.host import boot_id, host_id_for, pid_namespace

    owner = (host_id_for(settings.home), boot_id(), pid_namespace())
    signalled: list[int] = []
    root = settings.procs_dir
    for path in sorted(root.glob("*/*.json")) if root.is_dir() else []:
        data = read_json(path)
        if data is None:
            continue
        if data.get("host_id") == owner[0] and data.get("boot_id") != owner[1]:
            path.unlink(missing_ok=True)  # a previous boot: its processes are gone
            continue
        if not _ours(data, owner):
            continue
        signalled += kill_call_groups(path.parent.name, [path.stem], settings=settings)
    return signalled
