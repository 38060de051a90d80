"""What runs on this host, by task: the registry a pushed cancel reaches (DESIGN §3).

Why this module exists: Temporal delivers its own activity cancel only as the
answer to a heartbeat, so a cancel that must arrive within a 100 ms grace
would need heartbeats every few milliseconds — load on the server and, on
Temporal Cloud, a billed Action each. Instead an interrupt or ``task_stop``
is *pushed*: the workflow schedules the control activity
:func:`cancel_calls` on the host queue of the task's calls, and the worker
that runs it cancels them here, in process, at once. Heartbeats are left to
prove liveness only, at most every ``STOPLINE_HEARTBEAT_THROTTLE_S``.
Temporal's cancel stays the fallback when the push cannot be delivered.

Pieces:

- :class:`RunningCalls` — one per worker process: cancellable units
  (asyncio tasks) registered under ``(task id, key)``, cancelled by task or
  key, waited for. Generic on purpose: anything host-side that belongs to a
  task can register (a tool call is ``call:<id>``, a sampling call
  ``sample:<round>``, see :func:`call_key` / :func:`sampling_key`).
- :func:`cancel_calls` — the ``stopline.cancel_calls`` activity.
- :class:`HostConfig` / :func:`current` — which registry and heartbeat
  interval the worker running an activity uses; set per activity by the
  worker's interceptor (``stopline.worker.interceptors.HostActivities``),
  which lives worker-side so importing activity code (the CLI reads the
  ledger through it) does not import ``temporalio.worker``.

A unit's cancel is the same ``CancelledError`` Temporal's cancel would
raise, delivered once whichever path comes first: a tool SIGTERMs its
process group, waits the grace, SIGKILLs it and returns what it captured
(``stopline.activities.tools.shell``); a sampling call drops its request.

What it must never do: cancel a unit of another task, cancel anything on a
key it was not given, or block the event loop (``cancel`` and ``register``
return at once; ``run`` and ``wait`` only await).
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import Awaitable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import structlog
from temporalio import activity

from stopline.core.contracts import CANCEL_CALLS_ACTIVITY, CancelCallsInput, CancelCallsResult

log = structlog.get_logger("stopline.running")

T = TypeVar("T")

#: Seconds a cancel of a key that is not (yet) running is remembered, so a
#: unit registering after the push arrived — the control activity overtook
#: the call's own start — is cancelled the moment it registers.
TOMBSTONE_TTL_S = 120.0


def call_key(call_id: str) -> str:
    """Registry key of a tool call's activity (``call:<call id>``)."""
    return f"call:{call_id}"


def sampling_key(round_: int) -> str:
    """Registry key of a round's sampling activity (``sample:<round>``)."""
    return f"sample:{round_}"


@dataclass(eq=False)
class Unit:
    """One registered, cancellable unit of host-side work.

    Attributes:
        task_id: Owning task (workflow id).
        key: Its key within the task.
        task: The asyncio task that is cancelled.
        started: ``time.monotonic()`` at registration.
        cancel_reason: Why it was cancelled; ``None`` while it was not.
        ended: Set when the unit left the registry.
    """

    task_id: str
    key: str
    task: asyncio.Task[Any]
    started: float = field(default_factory=time.monotonic)
    cancel_reason: str | None = None
    ended: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def cancelled(self) -> bool:
        """Whether a cancel was delivered to it (by any path)."""
        return self.cancel_reason is not None

    def cancel(self, reason: str) -> bool:
        """Cancel the unit's task once; later calls do nothing.

        Returns:
            ``True`` if this call delivered the cancel.
        """
        if self.cancel_reason is not None:
            return False
        self.cancel_reason = reason
        self.task.cancel(reason)
        return True


class RunningCalls:
    """The running calls (and other units) of this worker process, by task.

    All methods must be called from the worker's event loop.

    Args:
        tombstone_ttl_s: See :data:`TOMBSTONE_TTL_S`.
    """

    def __init__(self, *, tombstone_ttl_s: float = TOMBSTONE_TTL_S) -> None:
        self._units: dict[tuple[str, str], list[Unit]] = {}
        self._tombstones: dict[tuple[str, str], tuple[float, str]] = {}
        self._ttl = tombstone_ttl_s

    @contextmanager
    def register(
        self, task_id: str, key: str, task: asyncio.Task[Any] | None = None, *,
        pass_on_late_cancel: bool = False,
    ) -> Iterator[Unit]:
        """Register ``task`` (default: the current task) for the block.

        A cancel pushed for this key shortly before (see
        :data:`TOMBSTONE_TTL_S`) is delivered at once.

        Args:
            task_id: Owning task.
            key: The unit's key within the task.
            task: The asyncio task a cancel goes to.
            pass_on_late_cancel: A cancel that reaches the unit after its
                work is done is remembered for the key's next unit, like one
                that came before a start (a round's sampling hands it to the
                round's tool calls, DESIGN §1). Off for keys a model names
                (call ids may repeat across rounds).

        Yields:
            The :class:`Unit`.

        Raises:
            RuntimeError: Outside a running asyncio task.
        """
        task = task or asyncio.current_task()
        if task is None:
            raise RuntimeError("RunningCalls.register needs a running asyncio task")
        k = (task_id, key)
        unit = Unit(task_id, key, task)
        self._units.setdefault(k, []).append(unit)
        tomb = self._tombstones.pop(k, None)
        if tomb is not None and tomb[0] > time.monotonic():
            unit.cancel(tomb[1])
        try:
            yield unit
        finally:
            units = self._units.get(k, [])
            if unit in units:
                units.remove(unit)
            if not units:
                self._units.pop(k, None)
                if pass_on_late_cancel and unit.cancelled and task.done() and not task.cancelled():
                    # the cancel came after the work was done: remember it like
                    # one that came before a start, so the key's next unit (a
                    # round's tool calls after its sampling) is cancelled too
                    self._tombstones[k] = (time.monotonic() + self._ttl, unit.cancel_reason or "")
            unit.ended.set()

    async def run(self, task_id: str, key: str, work: Awaitable[T], *, pass_on_late_cancel: bool = False) -> T:
        """Run ``work`` as a registered unit and return its result.

        ``work`` runs in its own asyncio task, so a cancel of the caller —
        Temporal's activity cancel, a worker shutdown — and a pushed cancel
        reach it the same way, once: whichever comes first is delivered, the
        other does nothing. The caller's own cancel is absorbed here (the
        unit decides how to end: a tool returns an aborted result).

        Args:
            task_id: Owning task.
            key: The unit's key.
            work: A coroutine or future.
            pass_on_late_cancel: See :meth:`register`.

        Returns:
            What ``work`` returned.

        Raises:
            asyncio.CancelledError: If ``work`` ended by raising it (it did
                not handle the cancel itself). Whether Temporal asked for it
                is ``temporalio.activity.is_cancelled()``; if not, the cancel
                was pushed.
            Exception: Whatever ``work`` raised.
        """
        inner = asyncio.ensure_future(work)
        with self.register(task_id, key, inner, pass_on_late_cancel=pass_on_late_cancel) as unit:
            while not inner.done():
                try:
                    await asyncio.wait({inner})
                except asyncio.CancelledError:
                    me = asyncio.current_task()
                    if me is not None:
                        me.uncancel()
                    unit.cancel("the activity was cancelled")
            return inner.result()

    def cancel(self, task_id: str, keys: list[str] | None = None, *, reason: str) -> list[str]:
        """Cancel a task's units: all of them, or those under ``keys``.

        A listed key with no running unit is remembered for
        :data:`TOMBSTONE_TTL_S` seconds and cancelled when it registers.

        Args:
            task_id: The task.
            keys: Keys to cancel; ``None`` for every unit of the task.
            reason: Why (logged, and the ``CancelledError``'s message).

        Returns:
            The keys that had running units, now cancelled.
        """
        now = time.monotonic()
        self._tombstones = {k: v for k, v in self._tombstones.items() if v[0] > now}
        if keys is None:
            keys = sorted({k for (t, k) in self._units if t == task_id})
        hit: list[str] = []
        for key in keys:
            units = self._units.get((task_id, key))
            if units:
                for unit in list(units):
                    unit.cancel(reason)
                hit.append(key)
            else:
                self._tombstones[(task_id, key)] = (now + self._ttl, reason)
        return hit

    async def wait(
        self, task_id: str, keys: list[str] | None = None, *, timeout_s: float | None = None
    ) -> bool:
        """Wait until a task's units (all, or those under ``keys``) have ended.

        Args:
            task_id: The task.
            keys: Keys to wait for; ``None`` for every unit of the task.
            timeout_s: Give up after this many seconds; ``None``: no limit.

        Returns:
            ``True`` when none of them is running any more, ``False`` on timeout.
        """
        units = [
            u
            for (t, k), us in self._units.items()
            if t == task_id and (keys is None or k in keys)
            for u in us
        ]
        if not units:
            return True
        waiters = [asyncio.ensure_future(u.ended.wait()) for u in units]
        try:
            _, pending = await asyncio.wait(waiters, timeout=timeout_s)
        finally:
            for w in waiters:
                w.cancel()
        return not pending

    def running(self, task_id: str | None = None) -> list[tuple[str, str]]:
        """``(task id, key)`` of every running unit (of one task, if given)."""
        return sorted(k for k, us in self._units.items() if us and (task_id is None or k[0] == task_id))


#: The registry of this process (activities run outside a stopline worker,
#: e.g. under ``ActivityEnvironment``, use it too).
PROCESS_CALLS = RunningCalls()


@dataclass(frozen=True)
class HostConfig:
    """What an activity learns from the worker that runs it.

    Attributes:
        heartbeat_interval_s: Seconds between heartbeats
            (``Settings.heartbeat_throttle_s``).
        calls: The registry a pushed cancel reaches; ``None`` when the push
            path is off (``STOPLINE_PUSH_CANCEL=0``): calls are then cancelled
            only through Temporal's heartbeat-borne cancel.
    """

    heartbeat_interval_s: float = 5.0
    calls: RunningCalls | None = PROCESS_CALLS


_current: contextvars.ContextVar[HostConfig] = contextvars.ContextVar(
    "stopline_host_config", default=HostConfig()
)


def current() -> HostConfig:
    """The :class:`HostConfig` of the worker running the current activity."""
    return _current.get()


@contextmanager
def using(config: HostConfig) -> Iterator[None]:
    """Set ``config`` as :func:`current` for the block (the worker's
    interceptor wraps every activity in it)."""
    token = _current.set(config)
    try:
        yield
    finally:
        _current.reset(token)


@contextmanager
def configured(config: HostConfig) -> Iterator[HostConfig]:
    """Use ``config`` for activities run in this block outside a worker
    (``temporalio.testing.ActivityEnvironment``: tests, benchmarks)."""
    with using(config):
        yield config


@activity.defn(name=CANCEL_CALLS_ACTIVITY)
async def cancel_calls(inp: CancelCallsInput) -> CancelCallsResult:
    """Cancel a task's running calls in this worker process (the push cancel).

    Returns at once: each cancelled unit ends on its own (a tool: SIGTERM to
    its group, grace, SIGKILL, then its activity completes with an aborted
    result; a sampling call: its request is dropped and its activity fails
    without retry). A key with nothing running is remembered briefly, in
    case its activity starts here just after.

    Args:
        inp: Task id, tool call ids, sampling round, further keys.

    Returns:
        Which keys had running units here and which did not.
    """
    calls = current().calls
    keys = [call_key(c) for c in inp.call_ids]
    if inp.sampling_round is not None:
        keys.append(sampling_key(inp.sampling_round))
    keys += list(inp.keys)
    hit = calls.cancel(inp.task_id, keys, reason=inp.reason) if calls is not None else []
    missing = [k for k in keys if k not in hit]
    log.info("cancel_pushed", task_id=inp.task_id, cancelled=hit, not_running=missing)
    return CancelCallsResult(cancelled=hit, not_running=missing)
