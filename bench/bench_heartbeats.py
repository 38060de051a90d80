"""Heartbeat RPCs per running activity, counted from the workers' own metrics,
and what they cost on Temporal Cloud.

What is measured: ``--calls`` tasks (default 5) per worker, each in one long
tool call (stopline: a ``shell`` running ``sleep``; the baselines: a tool
activity sleeping), all running at once; over a ``--window`` of seconds
(default 30) after every call is running, the increase of the worker's
``temporal_request{operation="RecordActivityTaskHeartbeat"}`` counter — the
heartbeat RPCs its Temporal runtime sent, read from its Prometheus endpoint —
divided by the window and the tasks, and by the activities each task runs
meanwhile (a stopline task: its call and its host session, DESIGN §7). From
that rate: Temporal Cloud Actions per hour of one task in a running call
(every heartbeat that reaches the server is an Action) and dollars per hour
at ``--price`` per million Actions (default $50).

Side by side, in one run, each worker in its own process on the same dev
server, all counting over the same window:

- stopline, defaults (``STOPLINE_HEARTBEAT_THROTTLE_S`` 5 s; cancels pushed);
- stopline, 20 ms mode (``STOPLINE_HEARTBEAT_THROTTLE_S=0.02``: the old
  heartbeat-borne cancel);
- a naive Temporal loop as the SDK's cancellation sample writes it
  (``activity.heartbeat()`` every second, heartbeat timeout 2 s, the SDK's
  default throttles: ``bench/_naive.py``);
- an agent framework's default: heartbeat-less activities (only a
  start-to-close timeout, as pydantic-ai's Temporal integration configures
  its activities unless told otherwise) — no heartbeats, and so no cancel
  reaches a running call before it ends.

Goal: stopline's default ≤ 0.2 heartbeat RPC/s per running activity.

Everything started is stopped by its own handle: worker subprocesses
(SIGTERM by PID), the tool processes the tasks left (by their recorded
process groups), the tasks (terminated), the dev server, the temp
``$STOPLINE_HOME``.

Run: ``.venv/bin/python bench/bench_heartbeats.py [--calls 5] [--window 30]``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from _common import (
    REPO,
    WorkerProcess,
    console,
    dev_server,
    fresh_queue,
    fresh_workspace,
    kill_recorded_groups,
    load_average,
    prometheus_sum,
    start_task,
    stopline_home,
    stopline_worker,
    wait_until,
)
from _naive import NAIVE_WORKFLOW, LoopInput
from rich.table import Table
from temporalio.client import Client, WorkflowHandle
from temporalio.service import RPCError

from stopline.testing.scripted import ScriptedServer, anthropic_message, entry, scenario
from stopline.worker.runtime import free_port

HEARTBEAT_OP = "RecordActivityTaskHeartbeat"


@dataclass
class Mode:
    """One worker configuration under test."""

    name: str
    kind: str  # "stopline" | "naive"
    settings: dict[str, Any]
    cancel_reaches: str
    heartbeat: str = "none"  # naive loop only
    #: Activities running per task while its call runs: a stopline task also
    #: holds its host through a host session, which heartbeats too (§7).
    activities: int = 1


MODES = [
    Mode("stopline (default: 5 s)", "stopline", {}, "at once (pushed); fallback ≤ 5 s", activities=2),
    Mode("stopline 20 ms mode", "stopline", {"heartbeat_throttle_s": 0.02}, "≤ 20 ms (heartbeat)",
         activities=2),
    Mode("naive loop, SDK sample pattern", "naive", {}, "≤ 1.6 s (heartbeat)", heartbeat="sample"),
    Mode("framework default (no heartbeats)", "naive", {}, "never while it runs"),
]


@dataclass
class Running:
    mode: Mode
    worker: WorkerProcess
    queue: str
    metrics: str
    handles: list[WorkflowHandle[Any, Any]]
    servers: list[ScriptedServer]


async def start_mode(client: Client, home: Path, mode: Mode, args: argparse.Namespace) -> Running:
    address = client.service_client.config.target_host
    queue = fresh_queue("hb")
    bind = f"127.0.0.1:{free_port()}"
    log = home / "logs" / f"{queue}.log"
    if mode.kind == "stopline":
        # one worker per STOPLINE_HOME (a host's home is its own)
        worker = stopline_worker(address, home / queue, queue, log, metrics_bind=bind, **mode.settings)
    else:
        worker = WorkerProcess(
            [sys.executable, str(REPO / "bench" / "_naive.py"), address, queue, "--metrics", bind], {}, log
        )
    await worker.ready()
    run = Running(mode, worker, queue, f"http://{bind}/metrics", [], [])
    run_s = args.window + 30
    for _ in range(args.calls):
        ws = fresh_workspace(home)
        server = ScriptedServer(scenario(
            "anthropic",
            entry(anthropic_message(tool_calls=[("c1", "shell", {"command": f"touch running; sleep {run_s}"})])),
        )).start()
        run.servers.append(server)
        if mode.kind == "stopline":
            run.handles.append(await start_task(client, queue, server, ws))
            await wait_until(lambda: (ws / "running").exists(), what="the tool call")
        else:
            run.handles.append(await client.start_workflow(
                NAIVE_WORKFLOW,
                LoopInput(url=server.url, workspace=str(ws), max_rounds=2, tool_run_s=run_s,
                          heartbeat=mode.heartbeat),
                id=f"naive-{uuid.uuid4().hex[:12]}", task_queue=queue,
            ))
    return run


async def heartbeats(run: Running) -> float:
    async with httpx.AsyncClient() as http:
        text = (await http.get(run.metrics)).text
    return prometheus_sum(text, "temporal_request", operation=HEARTBEAT_OP)


async def main(args: argparse.Namespace) -> None:
    console.print(f"[dim]before: {load_average()}[/]")
    rates: dict[str, float] = {}
    with stopline_home() as home:
        async with dev_server() as env:
            runs: list[Running] = []
            try:
                for mode in MODES:
                    runs.append(await start_mode(env.client, home, mode, args))
                await asyncio.sleep(2.0)  # every activity is running (naive: scheduled and started)
                before = [await heartbeats(r) for r in runs]
                console.print(f"[dim]counting over {args.window:g} s…[/]")
                await asyncio.sleep(args.window)
                after = [await heartbeats(r) for r in runs]
                for r, b, a in zip(runs, before, after, strict=True):
                    rates[r.mode.name] = (a - b) / args.window / args.calls
            finally:
                for r in runs:
                    for h in r.handles:
                        with contextlib.suppress(RPCError):
                            await h.terminate()
                    r.worker.stop()
                    for s in r.servers:
                        s.stop()
                    kill_recorded_groups(home / r.queue)
    report(args, rates)


def report(args: argparse.Namespace, rates: dict[str, float]) -> None:
    table = Table(
        title=f"Heartbeat RPCs, from each worker's temporal_request{{operation=\"{HEARTBEAT_OP}\"}} "
        f"over {args.window:g} s, {args.calls} tasks per worker each in one long tool call",
    )
    for col in ("worker", "running activities per task", "heartbeat RPC/s per task",
                "RPC/s per running activity", "Cloud Actions/hour per task",
                f"$/hour per task at ${args.price:g}/M", "a cancel reaches a running call"):
        table.add_column(col, justify="left" if col in ("worker", "a cancel reaches a running call") else "right")
    for mode in MODES:
        rate = rates[mode.name]
        per_hour = rate * 3600
        table.add_row(mode.name, str(mode.activities), f"{rate:.3f}", f"{rate / mode.activities:.3f}",
                      f"{per_hour:,.0f}", f"${per_hour * args.price / 1e6:.4f}", mode.cancel_reaches)
    console.print(table)
    console.print(
        "a stopline task runs two activities while its call runs: the call (one heartbeat per "
        "STOPLINE_HEARTBEAT_THROTTLE_S, 5 s) and its host session (one per host_lost_after_s / 3, "
        "10 s; DESIGN §7)"
    )
    ours = rates[MODES[0].name] / MODES[0].activities
    verdict = "[green]met[/]" if ours <= 0.2 else "[red]MISSED[/]"
    console.print(f"goal: ≤ 0.2 heartbeat RPC/s per running activity at the defaults → {ours:.3f} {verdict}")
    old = rates[MODES[1].name]
    if rates[MODES[0].name] > 0:
        console.print(f"stopline default vs 20 ms mode: {old / rates[MODES[0].name]:,.0f}× fewer heartbeat RPCs per task")
    console.print(f"after: {load_average()}")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=5, help="running calls per worker (default 5)")
    p.add_argument("--window", type=float, default=30.0, help="counting window in seconds (default 30)")
    p.add_argument("--price", type=float, default=50.0, help="$ per million Cloud Actions (default 50)")
    args = p.parse_args()
    if args.calls < 1 or args.window < 10:
        p.error("--calls ≥ 1 and --window ≥ 10 s")
    return args


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
