"""Interrupt latency: from sending the ``interrupt`` Update until it returns.

What is measured: the wall time of ``handle.execute_update("interrupt",
result_type=InterruptResult)`` — the Update returns only after every call of
the turn is settled (kept or aborted), the aborted calls' process groups are
SIGKILLed and the ledger is fsynced. Median and p95 (nearest rank) over
``--tries`` tries (default 20) for three cases:

- a cooperative tool: ``shell`` running ``exec sleep 100`` (dies on SIGTERM);
- a SIGTERM-ignoring tool: ``trap '' TERM; while true; do sleep 0.05; done``
  (only the hard abort's SIGKILL ends it);
- an in-flight sampling call: the scripted server holds its answer
  (``delay_s: 30``).

How: each try is a fresh task (fresh workspace, fresh scripted server) on a
task queue fresh per case and worker; the tool command first writes ``$$``
(its process group id) to ``pid`` in the workspace, and the interrupt is sent
once that file exists (for sampling: once the server has the request), plus
``--settle`` seconds. When the Update returns, every miss of these is counted
as a violation: no live (non-zombie) process is left in the tool's process
group (psutil); the ledger file's last row is ``turn_aborted``; the result
says ``interrupted`` with the expected aborted calls. The history then tells
whether the workflow's grace timer fired (the hard abort ran on it) or was
cancelled (every call settled first), and how long it took to fire. The task
is then terminated.

Baseline, in the same run: the same workflow and activities on a worker built
with the SDK's default heartbeat throttles (``max_heartbeat_throttle_interval``
60 s, ``default_heartbeat_throttle_interval`` 30 s; with the 5 s heartbeat
timeout the SDK then sends a heartbeat at most every 4 s) instead of
stopline's 20 ms — the heartbeat response is how Temporal delivers a cancel to
a running activity. ``--baseline-tries`` (default 5) tries per case; a try
whose Update has not returned after ``--cap`` seconds counts as ``>cap``.

Goal (seed 002): p95 ≤ grace + 150 ms (grace ``--grace``, default 0.1 s).

Everything started is stopped: tasks (terminated), workers, scripted
servers, the dev server, the temp ``$STOPLINE_HOME``, and any tool process a
violation left behind (SIGKILL of that recorded group).

Run: ``.venv/bin/python bench/bench_interrupt.py [--tries 20] [--baseline-tries 5]``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import psutil
from _common import (
    console,
    dev_server,
    fmt_ms,
    fresh_queue,
    fresh_workspace,
    median,
    p95,
    read_nonempty,
    running,
    start_task,
    stopline_home,
    wait_until,
)
from rich.table import Table
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client
from temporalio.service import RPCError
from temporalio.worker import Worker

from stopline.activities.ledger import LedgerStore, ledger_flush
from stopline.activities.sampling import sample
from stopline.activities.tools import tool_activity
from stopline.core.contracts import InterruptResult
from stopline.settings import load_settings
from stopline.testing.scripted import ScriptedServer, anthropic_message, entry, scenario
from stopline.worker.runtime import WORKER_SHUTDOWN_GRACE_S, build_workers
from stopline.workflows.agent_task import AgentTask

# Each tool is followed by the pid it prints ($$): run tools unconfined, where
# that pid is the host's (a sandboxed call has its own PID namespace;
# bench/bench_sandbox.py measures the sandbox).
os.environ.setdefault("STOPLINE_SANDBOX", "off")


@dataclass(frozen=True)
class Case:
    """What the turn is doing when the interrupt arrives."""

    name: str
    command: str | None  # a tool's shell command; None: a held sampling call

    def scenario(self) -> dict[str, Any]:
        if self.command is None:
            return scenario("anthropic", entry(anthropic_message("must never be stored"), delay_s=30))
        call = ("c1", "shell", {"command": self.command})
        return scenario("anthropic", entry(anthropic_message("working", tool_calls=[call])))


CASES = [
    Case("cooperative tool (exec sleep 100)", "echo $$ > pid; exec sleep 100"),
    Case("SIGTERM-ignoring tool", "echo $$ > pid; trap '' TERM; while true; do sleep 0.05; done"),
    Case("in-flight sampling (delay_s 30)", None),
]


@dataclass
class Mode:
    """A worker configuration under test."""

    name: str
    workers: Callable[[Client, str], list[Worker]]
    tries: int


def stopline_workers(client: Client, queue: str) -> list[Worker]:
    """What stopline runs: ``build_workers`` (heartbeat throttle 20 ms)."""
    return build_workers(client, load_settings(), task_queue=queue)


def sdk_default_workers(client: Client, queue: str) -> list[Worker]:
    """The same workflow and activities with the SDK's default heartbeat throttles."""
    return [
        Worker(
            client,
            task_queue=queue,
            workflows=[AgentTask],
            activities=[sample, tool_activity, ledger_flush],
            graceful_shutdown_timeout=timedelta(seconds=WORKER_SHUTDOWN_GRACE_S),
        )
    ]


@dataclass
class Try:
    """One interrupt: its latency (``inf`` past the cap) and what was wrong.

    ``timer_s`` is how long the workflow's grace timer took to fire, from the
    history (``TimerStarted`` → ``TimerFired``); ``None`` when every call
    settled before it fired (the timer was cancelled).
    """

    seconds: float
    problems: list[str] = field(default_factory=list)
    timer_s: float | None = None


async def grace_timer_s(handle: Any) -> float | None:
    """Seconds between the grace timer's start and its firing; ``None`` if it never fired."""
    started = fired = None
    for e in (await handle.fetch_history()).events:
        at = e.event_time.ToDatetime().timestamp()
        if e.event_type == EventType.EVENT_TYPE_TIMER_STARTED:
            started = at
        elif e.event_type == EventType.EVENT_TYPE_TIMER_FIRED and started is not None:
            fired = at
    return None if fired is None or started is None else fired - started


def group_alive(pgid: int) -> list[int]:
    """Live, non-zombie processes in process group ``pgid`` (psutil)."""
    alive = []
    for p in psutil.process_iter(["pid", "status"]):
        try:
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                alive.append(p.pid)
        except (ProcessLookupError, psutil.Error):
            continue
    return alive


def last_ledger_kind(home: Path, task_id: str) -> str | None:
    path = LedgerStore(home / "ledger").path(task_id)
    rows = LedgerStore.read_path(path) if path.exists() else []
    return rows[-1].kind if rows else None


async def one_try(client: Client, queue: str, home: Path, case: Case, args: argparse.Namespace) -> Try:
    """Start a task, interrupt it at the right moment, time and check the Update."""
    ws = fresh_workspace(home)
    pgid: int | None = None
    with ScriptedServer(case.scenario()) as server:
        handle = await start_task(client, queue, server, ws, interrupt_grace_s=args.grace)
        try:
            if case.command is not None:
                pgid = int(await wait_until(lambda: read_nonempty(ws / "pid"), what="the tool's pid file"))
            else:
                await wait_until(lambda: server.request_count() >= 1, what="the sampling request")
            await asyncio.sleep(args.settle)
            t0 = time.perf_counter()
            try:
                res = await asyncio.wait_for(
                    handle.execute_update("interrupt", result_type=InterruptResult), args.cap
                )
            except TimeoutError:
                return Try(math.inf, [f"Update not returned after {args.cap:g} s"])
            took = time.perf_counter() - t0
            problems = []
            if pgid is not None and (alive := group_alive(pgid)):
                problems.append(f"process group {pgid} still alive at return: pids {alive}")
            if (kind := last_ledger_kind(home, handle.id)) != "turn_aborted":
                problems.append(f"ledger's last row is {kind!r}, not 'turn_aborted'")
            expected = ["c1"] if case.command is not None else []
            if not res.interrupted or res.aborted_calls != expected:
                problems.append(f"unexpected result {res.model_dump()}")
            return Try(took, problems, await grace_timer_s(handle))
        finally:
            with contextlib.suppress(RPCError):
                await handle.terminate()
            if pgid is not None and group_alive(pgid):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pgid, signal.SIGKILL)  # a violation left it: we started it, we end it


async def measure(client: Client, home: Path, mode: Mode, case: Case, args: argparse.Namespace) -> list[Try]:
    queue = fresh_queue("interrupt")
    async with running(mode.workers(client, queue)):
        tries = []
        for _ in range(mode.tries):
            tries.append(await one_try(client, queue, home, case, args))
    lat = [t.seconds for t in tries]
    console.print(
        f"[dim]{mode.name} · {case.name}: median {fmt_ms(median(lat), args.cap)}, "
        f"p95 {fmt_ms(p95(lat), args.cap)}[/]"
    )
    return tries


# ---------------------------------------------------------------- reporting


def report(args: argparse.Namespace, modes: list[Mode], results: dict[tuple[str, str], list[Try]]) -> None:
    goal_s = args.grace + 0.150
    ours = modes[0]
    lat = lambda mode, case: [t.seconds for t in results[mode.name, case.name]]  # noqa: E731

    table = Table(
        title=f"Interrupt latency: Update sent → returned with every call settled "
        f"(grace {args.grace * 1000:.0f} ms; goal p95 ≤ {goal_s * 1000:.0f} ms)",
    )
    for col in ("case", "worker", "tries", "median", "p95", "max", "grace timer fired¹", "goal"):
        table.add_column(col, justify="left" if col in ("case", "worker") else "right")
    for case in CASES:
        for mode in modes:
            tries = results[mode.name, case.name]
            fired = [t.timer_s for t in tries if t.timer_s is not None]
            timer = f"{len(fired)}/{len(tries)}" + (f", after {fmt_ms(median(fired))}" if fired else "")
            goal = ("[green]met[/]" if p95(lat(mode, case)) <= goal_s else "[red]missed[/]")
            table.add_row(
                case.name if mode is ours else "", mode.name, str(len(tries)),
                *(fmt_ms(f(lat(mode, case)), args.cap) for f in (median, p95, max)), timer, goal,
                end_section=mode is modes[-1],
            )
    console.print(table)
    console.print(
        f"workers: {ours.name} = stopline.worker.runtime.build_workers (heartbeat throttle 20 ms), {ours.tries} tries "
        f"per case; {modes[1].name} = same workflow and activities, SDK default heartbeat throttles "
        f"(60 s max / 30 s default → one heartbeat per 4 s with the 5 s heartbeat timeout), "
        f"{modes[1].tries} tries per case."
    )
    console.print(
        f"¹ tries whose hard abort ran on the workflow's {args.grace * 1000:.0f} ms grace timer (some call "
        "had not settled), with the timer's median start→fired time from the history; otherwise every "
        "call settled first and the timer was cancelled."
    )

    checks = Table(title="Checks at the moment the Update returned: violations / tries")
    checks.add_column("case")
    for mode in modes:
        checks.add_column(mode.name, justify="right")
    details: list[str] = []
    for case in CASES:
        row = [case.name]
        for mode in modes:
            tries = results[mode.name, case.name]
            bad = [t for t in tries if t.problems]
            row.append(f"{len(bad)} / {len(tries)}")
            details += [f"{mode.name} · {case.name}: {p}" for t in bad for p in t.problems]
        checks.add_row(*row)
    console.print(checks)
    console.print(
        "checked per try: no live process left in the tool's process group (psutil); the ledger "
        "file's last row is turn_aborted; interrupted=True with the expected aborted_calls"
    )
    for line in details:
        console.print(f"[red]violation[/] {line}")
    console.print(f"violations: {len(details)}")
    for case in CASES:
        p = p95(lat(ours, case))
        verdict = "[green]met[/]" if p <= goal_s else "[red]MISSED[/]"
        console.print(
            f"goal p95 ≤ grace + 150 ms = {goal_s * 1000:.0f} ms · {case.name}: "
            f"p95 {fmt_ms(p, args.cap)} → {verdict}"
        )


async def main(args: argparse.Namespace) -> None:
    modes = [
        Mode("stopline worker (20 ms)", stopline_workers, args.tries),
        Mode("SDK default throttles", sdk_default_workers, args.baseline_tries),
    ]
    results: dict[tuple[str, str], list[Try]] = {}
    with stopline_home() as home:
        async with dev_server() as env:
            for case in CASES:
                for mode in modes:
                    results[mode.name, case.name] = await measure(env.client, home, mode, case, args)
    report(args, modes, results)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tries", type=int, default=20, help="tries per case, stopline worker (default 20)")
    p.add_argument("--baseline-tries", type=int, default=5, help="tries per case, SDK defaults (default 5)")
    p.add_argument("--grace", type=float, default=0.1, help="interrupt grace in seconds (default 0.1)")
    p.add_argument("--cap", type=float, default=30.0, help="a try slower than this is >cap (default 30)")
    p.add_argument("--settle", type=float, default=0.1,
                   help="seconds between the call running and the interrupt (default 0.1)")
    args = p.parse_args()
    if args.tries < 1 or args.baseline_tries < 1 or args.grace < 0 or args.cap <= 0:
        p.error("tries must be ≥ 1, grace ≥ 0, cap > 0")
    return args


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
