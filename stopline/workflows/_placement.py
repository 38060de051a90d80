"""Placement: which host a thread runs its work on, and what happens when
that host is lost (DESIGN §7).

A thread claims a host by starting a *host session* (the
``stopline.host_session`` activity, :mod:`stopline.activities.host`): on the
pool's task queue when any host will do, on one host's own queue when the
thread is pinned (a user's pin, a sub-task on its parent's host, the thread's
next run after continue-as-new, a move after a loss). The host that takes the
session checks the workspace, takes a capacity slot and Signals the claim;
the session then heartbeats for as long as the thread holds the host. The
claim (host id, its own queue, the workspace marker) is workflow state,
carried over continue-as-new: sampling, tool calls, ledger writes and cancels
go to that queue, so nothing about the machine that *started* the task
decides where it runs.

The session's heartbeats are the host's liveness. When they stop — the
session times out after ``host_lost_after_s`` — or an activity on the host's
queue is never picked up (its schedule-to-start bound), the host is lost:
:meth:`PlacementMixin._recover_host` appends one model-visible ``host_lost``
row (the unfinished calls already got "lost" receipts), publishes a
``host_lost`` event, and tries to move: the same host (a restarted worker on
the same home comes back under the same id) and every other live host, at
once, each asked to prove it holds the same workspace (the marker). The first
to claim wins. None: the thread ends ``stopped`` with "host H lost; workspace
unavailable". Never a hang: every wait here is bounded.

Deterministic code only.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, TimeoutType
from temporalio.exceptions import TimeoutError as ActivityTimeout

from stopline.workflows._state import activity_failure_reason

with workflow.unsafe.imports_passed_through():
    from stopline.core import policies
    from stopline.core.contracts import (
        HOST_CLAIMED_SIGNAL,
        HOST_SESSION_ACTIVITY,
        LIST_HOSTS_ACTIVITY,
        HostClaim,
        HostInfo,
        HostSessionInput,
        ListHostsInput,
        TaskLimits,
        host_task_queue,
        pool_task_queue,
    )
    from stopline.core.turn_state import Counters, End

#: ``workflow.patched`` id of placement: histories recorded before it ran
#: every host activity on the input's fixed ``host_task_queue``.
FLEET_PATCH = "stopline-fleet-placement"

#: What a host session returns when its worker shuts down gracefully
#: (``stopline.activities.host.SESSION_SHUTDOWN``).
SESSION_SHUTDOWN = "shutdown"
#: Why a host is gone when its worker shut down (it may come back).
WORKER_SHUT_DOWN = "its worker shut down"

#: A host session is never retried: a failed session is a lost host.
SESSION_RETRY = RetryPolicy(maximum_attempts=1)
#: How long a host session may run (it ends when the thread releases it).
SESSION_LIFETIME = timedelta(days=3650)


class HostLost(Exception):
    """Workflow-internal control flow: the thread's host is gone.

    Raised from a wait on the host's queue, caught by the thread's loop,
    which calls :meth:`PlacementMixin._recover_host`. Never escapes a
    workflow (it would fail the workflow task).

    Attributes:
        why: What showed the loss, in words.
    """

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


class PlacementMixin:
    """Claiming a host, watching it, and moving when it is lost."""

    _inp: Any
    _n: Counters
    _state: str

    def _init_placement(self, carry: Any) -> None:
        self._host: HostClaim | None = carry.host if carry else None
        self._session: Any = None
        self._claims: dict[str, HostClaim] = {}
        self._fleet = False
        self._releasing = False
        self._lost_why: str | None = None
        self._move_requested = False
        self._move_target: str | None = None
        #: background shell id -> host id that runs it
        self._shells: dict[str, str] = dict(carry.shells) if carry else {}

    # ------------------------------------------------------------ queries

    def _host_queue(self) -> str:
        """The task queue of the host this thread's work runs on."""
        if not self._fleet:
            return self._inp.host_task_queue
        if self._host is None:
            raise HostLost("the thread holds no host")
        return self._host.task_queue

    def _host_gone(self) -> bool:
        """Whether the held host is lost: its session ended, or an activity
        on its queue was never picked up."""
        if not self._fleet or self._releasing:
            return False
        return self._lost_why is not None or (self._session is not None and self._session.done())

    def _host_gone_now(self) -> bool:
        """Whether to stop waiting for calls on the host: it is lost, and not
        merely draining — a worker shutting down gracefully lets its calls
        finish or report first (they end on their own, bounded by their
        heartbeat timeout), and its tasks wait for it to come back."""
        return self._host_gone() and self._why_host_gone() != WORKER_SHUT_DOWN

    def _mark_host_lost(self, why: str) -> None:
        """Record that the held host is lost (the thread's loop recovers)."""
        if self._lost_why is None:
            self._lost_why = why

    def _why_host_gone(self) -> str:
        """What showed that the host is lost, in words."""
        if self._lost_why is not None:
            return self._lost_why
        limits: TaskLimits = self._inp.limits
        session = self._session
        if session is not None and session.done() and not session.cancelled():
            err = session.exception()
            if isinstance(err, ActivityError) and isinstance(err.cause, ActivityTimeout):
                return f"its host session sent no heartbeat for {limits.host_lost_after_s:g}s"
            if err is not None:
                return f"its host session failed: {activity_failure_reason(err)}"
            if session.result() == SESSION_SHUTDOWN:
                return WORKER_SHUT_DOWN
        return "its host session ended"

    def _host_label(self) -> str:
        host = self._host
        return f"{host.host_id} ({host.hostname})" if host else "(none)"

    def _host_bound(self) -> dict[str, Any]:
        """Extra options of every activity on the host's queue: a
        schedule-to-start bound, so a host whose worker is gone is noticed
        even before its session times out."""
        if not self._fleet:
            return {}
        limits: TaskLimits = self._inp.limits
        return {"schedule_to_start_timeout": timedelta(seconds=limits.host_lost_after_s)}

    # --------------------------------------------------------- the claim

    @workflow.signal(name=HOST_CLAIMED_SIGNAL)
    def _on_host_claimed(self, claim: HostClaim) -> None:
        """A host session claimed a host for this run (stale claims wait
        here unused; their sessions are cancelled)."""
        self._claims[claim.claim_id] = claim

    def _start_session(self, queue: str, *, marker: str | None, schedule_to_start_s: float | None) -> tuple[str, Any]:
        limits: TaskLimits = self._inp.limits
        info = workflow.info()
        claim_id = str(workflow.uuid4())
        handle = workflow.start_activity(
            HOST_SESSION_ACTIVITY,
            HostSessionInput(
                task_id=info.workflow_id,
                run_id=info.run_id,
                claim_id=claim_id,
                workspace=self._inp.workspace,
                require_marker=marker,
                parent_task_id=self._inp.parent_task_id,
                heartbeat_s=max(1.0, limits.host_lost_after_s / 3),
            ),
            result_type=str,
            task_queue=queue,
            start_to_close_timeout=SESSION_LIFETIME,
            schedule_to_start_timeout=(
                timedelta(seconds=schedule_to_start_s) if schedule_to_start_s else None
            ),
            heartbeat_timeout=timedelta(seconds=limits.host_lost_after_s),
            retry_policy=SESSION_RETRY,
            cancellation_type=workflow.ActivityCancellationType.TRY_CANCEL,
            summary=f"host session on {queue}",
        )
        return claim_id, handle

    async def _claim_one_of(
        self, queues: list[str], *, marker: str | None, schedule_to_start_s: float | None,
        wait_s: float, movable: bool = False,
    ) -> tuple[HostClaim | None, str]:
        """Start a session on each queue at once; the first claim wins.

        Args:
            queues: Host queues (or the pool's) to try.
            marker: Workspace marker the host must hold (``None``: any).
            schedule_to_start_s: How long each session may wait to be
                picked up (``None``: no bound, e.g. the pool's queue).
            wait_s: How long to wait for a claim in all.
            movable: An operator's ``move`` stops the wait (placement).

        Returns:
            ``(claim, "")``, or ``(None, why)`` when none claimed in ``wait_s``.
        """
        tries = [self._start_session(q, marker=marker, schedule_to_start_s=schedule_to_start_s)
                 for q in queues]

        def claimed() -> tuple[str, Any] | None:
            for claim_id, handle in tries:
                if claim_id in self._claims:
                    return claim_id, handle
            return None

        try:
            await workflow.wait_condition(
                lambda: claimed() is not None or all(h.done() for _, h in tries)
                or (movable and self._move_requested),
                timeout=timedelta(seconds=wait_s),
            )
        except asyncio.TimeoutError:
            pass
        won = claimed()
        for claim_id, handle in tries:
            if won is None or handle is not won[1]:
                if not handle.done():
                    handle.cancel()
        if won is None:
            reasons = [_session_failure(h) for _, h in tries if h.done()]
            why = "; ".join(r for r in reasons if r) or f"no host claimed the task within {wait_s:g}s"
            return None, why
        self._session = won[1]
        return self._claims.pop(won[0]), ""

    async def _place(self) -> End | None:
        """Claim this run's host (DESIGN §7); ``End`` when the thread cannot start.

        A thread carried over continue-as-new reclaims its own host (the host
        hands its slot over); a pinned thread (a user's pin, a sub-task)
        claims its host's own queue; any other thread the pool's.
        """
        self._fleet = workflow.patched(FLEET_PATCH)
        if not self._fleet:
            return None
        limits: TaskLimits = self._inp.limits
        info = workflow.info()
        carried = self._host
        self._host = None
        if carried is not None:
            claim, why = await self._claim_one_of(
                [carried.task_queue], marker=carried.workspace_marker,
                schedule_to_start_s=limits.claim_timeout_s, wait_s=limits.claim_timeout_s,
            )
            if claim is None:
                self._host = carried
                end = await self._recover_host(f"it did not take the task's next run back ({why})")
                return end
        else:
            self._set_host_state("waiting_for_host")
            pin = self._inp.host
            while True:
                if self._move_requested:  # an operator re-targeted the waiting task
                    pin, self._move_requested = self._move_target, False
                if pin:
                    claim, why = await self._claim_one_of(
                        [host_task_queue(info.task_queue, pin)], marker=None,
                        schedule_to_start_s=limits.claim_timeout_s,
                        wait_s=limits.placement_timeout_s, movable=True,
                    )
                else:
                    claim, why = await self._claim_one_of(
                        [pool_task_queue(info.task_queue)], marker=None, schedule_to_start_s=None,
                        wait_s=limits.placement_timeout_s, movable=True,
                    )
                if claim is not None or not self._move_requested:
                    break
            if claim is None:
                where = f"host {pin} did not take the task" if pin else "no host took the task"
                return End("stopped", f"{where}: {why}", final=True)
        self._took(claim)
        return None

    # ----------------------------------------------------------- a move

    @workflow.update(name="move")
    async def _move(self, host: str | None = None) -> str:
        """Move the task to another host (an operator's ``stopline move``).

        Takes effect at once while the task waits for a host, else at its
        next round boundary (or while it waits for a message): the current
        host gets the pending rows and its slot back, the target (``host``,
        or any other live host) must hold the same workspace. A task that
        cannot move stays where it was.

        Returns:
            What will happen, in words.
        """
        self._move_requested, self._move_target = True, host or None
        where = f"to host {host}" if host else "to another host"
        if self._host is None:
            return f"the task waits for a host; it now waits {where}"
        return f"the task moves {where} at its next round boundary"

    @_move.validator
    def _validate_move(self, host: str | None = None) -> None:
        if self._state not in ("running", "waiting", "waiting_for_host"):
            raise ValueError(f"task is {self._state}; there is nothing to move")
        if not self._fleet:
            raise ValueError("this task was started before placement; it cannot move")

    async def _maybe_move(self) -> End | None:
        """Apply an operator's move, if one is pending (DESIGN §7)."""
        if not self._move_requested or self._host is None:
            return None
        target, self._move_requested = self._move_target, False
        old = self._host
        if target == old.host_id:
            return None
        limits: TaskLimits = self._inp.limits
        info = workflow.info()
        self._releasing = True
        try:
            await self._flush(release=True)  # the old host gets the rows and its slot back
        except HostLost:
            pass
        finally:
            self._releasing = False
        self._host, self._session, self._lost_why = None, None, None
        self._set_host_state("waiting_for_host")
        if target:
            queues = [host_task_queue(info.task_queue, target)]
        else:
            queues = [h.task_queue for h in await self._live_hosts() if h.host_id != old.host_id]
        claim, why = (None, "no other live host") if not queues else await self._claim_one_of(
            queues, marker=old.workspace_marker, schedule_to_start_s=limits.claim_timeout_s,
            wait_s=limits.claim_timeout_s + 5,
        )
        moved = claim is not None
        if claim is None:
            claim, _ = await self._claim_one_of(
                [old.task_queue], marker=old.workspace_marker,
                schedule_to_start_s=limits.claim_timeout_s, wait_s=limits.claim_timeout_s + 5,
            )
            if claim is None:
                self._host = old
                return await self._recover_host(f"it was left for a move that failed ({why})")
        self._took(claim)
        if not moved:
            self._append("system", model_visible=False, meta={"host_id": old.host_id},
                         text=f"move from {old.host_id} failed ({why}); the task stays there")
            return None
        shells = sorted(s for s, h in self._shells.items() if h == old.host_id)
        for s in shells:
            del self._shells[s]
        if shells:
            self._append(
                "host_lost",
                text=policies.host_lost_marker(old.host_id, old.hostname, "an operator moved the task", shells),
                meta={"host_id": old.host_id, "why": "moved", "shells": shells},
            )
        self._append("system", model_visible=False,
                     text=f"moved from host {old.host_id} to {claim.host_id} by an operator",
                     meta={"host_id": claim.host_id, "moved_from": old.host_id})
        return None

    async def _live_hosts(self) -> list[HostInfo]:
        """The live hosts of this workflow task queue (an activity any host runs)."""
        limits: TaskLimits = self._inp.limits
        info = workflow.info()
        try:
            return await workflow.execute_activity(
                LIST_HOSTS_ACTIVITY,
                ListHostsInput(task_queue=info.task_queue, max_age_s=3 * limits.host_lost_after_s),
                result_type=list[HostInfo],
                task_queue=info.task_queue,
                start_to_close_timeout=timedelta(seconds=30),
                retry_policy=RetryPolicy(maximum_attempts=3),
                summary="list live hosts",
            )
        except ActivityError:
            return []

    def _took(self, claim: HostClaim) -> None:
        self._host = claim
        self._set_host_state("running")
        self._publish("host_claimed", text=f"{claim.host_id} ({claim.hostname})")

    # ----------------------------------------------------------- the loss

    def _lost_host_of(self, err: BaseException) -> bool:
        """Whether an activity failure means the host's worker is gone: it
        was never picked up within the schedule-to-start bound."""
        if not self._fleet or not isinstance(err, ActivityError):
            return False
        cause = err.cause
        return isinstance(cause, ActivityTimeout) and cause.type == TimeoutType.SCHEDULE_TO_START

    async def _recover_host(self, why: str) -> End | None:
        """The held host is gone: wait for it, move, or stop (DESIGN §7).

        A host whose worker shut down gracefully (a deploy, a pod moved with
        its volume) first gets a full ``host_lost_after_s`` to come back
        under the same id; if it does, the thread goes on with a hidden
        ``system`` row and nothing lost. Otherwise the host is lost: the
        caller has already given every unfinished call on it its "lost"
        receipt; one model-visible ``host_lost`` row says so (and which
        background shells went with it), ``host_lost`` is published, and the
        same host and every other live host are asked at once, each required
        to hold the same workspace (its marker). The first to claim wins.

        Returns:
            ``None`` when the thread continues on a host; ``End(stopped,
            final)`` when no host can reach its workspace.
        """
        old = self._host
        session = self._session
        self._host, self._session, self._lost_why = None, None, None
        if session is not None and not session.done():
            session.cancel()
        if old is None:
            return End("stopped", f"the task holds no host ({why})", final=True)
        self._set_host_state("waiting_for_host")
        limits: TaskLimits = self._inp.limits
        if why == WORKER_SHUT_DOWN and old.workspace_marker:
            claim, _ = await self._claim_one_of(
                [old.task_queue], marker=old.workspace_marker,
                schedule_to_start_s=limits.host_lost_after_s, wait_s=limits.host_lost_after_s + 5,
            )
            if claim is not None:
                self._took(claim)
                self._append(
                    "system", model_visible=False,
                    text=f"host {old.host_id} restarted; the task goes on there",
                    meta={"host_id": old.host_id, "why": why},
                )
                return None
            why = f"{why} and did not come back within {limits.host_lost_after_s:g}s"
        shells = sorted(s for s, h in self._shells.items() if h == old.host_id)
        for s in shells:
            del self._shells[s]
        self._append(
            "host_lost",
            text=policies.host_lost_marker(old.host_id, old.hostname, why, shells),
            meta={"host_id": old.host_id, "hostname": old.hostname, "why": why, "shells": shells},
        )
        self._publish("host_lost", text=f"{old.host_id} ({old.hostname}): {why}")
        if not old.workspace_marker:
            return End(
                "stopped", f"host {old.host_id} ({old.hostname}) lost; workspace unavailable "
                f"(it carries no workspace marker)", final=True,
            )
        hosts = await self._live_hosts()
        queues = [old.task_queue] + [h.task_queue for h in hosts if h.host_id != old.host_id]
        claim, reason = await self._claim_one_of(
            queues, marker=old.workspace_marker, schedule_to_start_s=limits.claim_timeout_s,
            wait_s=limits.claim_timeout_s + 5,
        )
        if claim is None:
            return End(
                "stopped",
                f"host {old.host_id} ({old.hostname}) lost; workspace unavailable ({reason})",
                final=True,
            )
        self._took(claim)
        self._append(
            "system", model_visible=False,
            text=f"continued on host {claim.host_id} ({claim.hostname}) after losing {old.host_id}",
            meta={"host_id": claim.host_id, "moved_from": old.host_id},
        )
        return None

    # ------------------------------------------------------------- hooks

    def _set_host_state(self, state: str) -> None:
        """Set the thread state while placement waits (subclasses upsert
        the search attributes)."""
        self._state = state


def _session_failure(handle: Any) -> str:
    """Why a finished host session did not claim (``""`` when cancelled)."""
    if handle.cancelled():
        return ""
    err = handle.exception()
    if err is None:
        return ""
    if isinstance(err, ActivityError):
        cause = err.cause
        if isinstance(cause, ActivityTimeout) and cause.type == TimeoutType.SCHEDULE_TO_START:
            return "no worker of that host picked it up"
        if isinstance(cause, ActivityTimeout) and cause.type == TimeoutType.HEARTBEAT:
            return "its worker stopped answering before the claim was made (the host is down?)"
        return activity_failure_reason(err)
    return str(err)
