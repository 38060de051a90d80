"""Throughput and CPU per round: stopline vs a naive Temporal loop, 1 / 10 / 50 concurrent tasks.

What is measured, per concurrency level N (default 1, 10, 50): N tasks of
``--rounds`` rounds each (default 20: 19 rounds of one ``list_dir`` call on
an empty workspace, then a final answer) against zero-delay scripted models
(Anthropic wire; one scripted server per task, in this process), started
together; then

- rounds/s: N × rounds / wall time from the first start to the last result;
- worker CPU ms per round: user + system CPU of the worker process (psutil)
  over the level, divided by N × rounds;
- server CPU ms per round: the same for the dev server's process.

Two loops, each in its own worker subprocess (so its CPU is its own; the
scripted servers and this client run here):

- stopline: ``python -m stopline.worker.main`` (the ``AgentTask`` workflow:
  ledger, events, search attributes, abort and refusal paths; streamed
  sampling; default settings, JSON logs). Its activities run on the host's
  own task queue (DESIGN §7), so none is dispatched eagerly; at the
  defaults a round whose calls all run on the host is one activity — the
  sampling activity runs the calls, after recording the response in a
  heartbeat (DESIGN §1);
- naive: ``bench/_naive.py`` — a minimal workflow calling a model activity
  (the whole conversation as input, one non-streamed request) and a tool
  activity per round, no ledger: the floor of a round on Temporal. Its
  activities share the workflow's task queue, so the server hands each one
  out eagerly with the workflow task that scheduled it;
- naive, host queue: the same loop with its activities on a second task
  queue, as stopline's host-bound activities are (DESIGN §7): each goes
  through matching (AddActivityTask, a poll) — the cost of binding work to
  a host, apart from stopline's own.

Levels run in order, after one uncounted warm-up task of each loop; at each
level the loops run one after the other, ``--repeats`` times (default 3),
the order rotated on every repeat (a dev server that has served more is a
little slower: with 3 repeats each loop runs once first, once second and
once last), and each figure is the median of its repeats. Goal: at 50 concurrent tasks stopline's rounds/s ≥
1.0× the naive loop's. The load average is printed before and after, and
with each run (2-core machine: figures taken above ~1.5 are skewed by
other work).

Everything started is stopped by its own handle: worker subprocesses
(SIGTERM by PID), scripted servers, the dev server, the temp
``$STOPLINE_HOME``.

Run: ``.venv/bin/python bench/bench_throughput.py [--levels 1,10,50] [--rounds 20] [--repeats 3]``
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _common import (
    REPO,
    WorkerProcess,
    console,
    cpu_seconds,
    dev_server,
    dev_server_pid,
    fresh_queue,
    fresh_workspace,
    load_average,
    start_task,
    stopline_home,
    stopline_worker,
)
from _naive import NAIVE_WORKFLOW, LoopInput
from rich.table import Table
from temporalio.client import Client

from stopline.testing.scripted import ScriptedServer, anthropic_message, entry, scenario


def rounds_scenario(rounds: int) -> dict[str, Any]:
    """``rounds - 1`` rounds of one ``list_dir`` call, then a final answer."""
    return scenario(
        "anthropic",
        entry(anthropic_message(tool_calls=[("ls", "list_dir", {"path": "."})]), repeat=rounds - 1),
        entry(anthropic_message("done: the workspace is empty")),
    )


@dataclass
class Level:
    """One loop at one concurrency level."""

    loop: str
    tasks: int
    rounds: int
    seconds: float
    worker_cpu_s: float
    server_cpu_s: float

    @property
    def rounds_per_s(self) -> float:
        return self.rounds / self.seconds

    def ms_per_round(self, cpu_s: float) -> float:
        return cpu_s * 1000 / self.rounds


def median_level(levels: list[Level]) -> Level:
    """One loop's runs at one level: the run with the median rounds/s (its
    own CPU figures with it, so a row is one real run)."""
    ranked = sorted(levels, key=lambda lvl: lvl.rounds_per_s)
    return ranked[(len(ranked) - 1) // 2]


async def stopline_task(client: Client, queue: str, home: Path, server: ScriptedServer, rounds: int) -> int:
    handle = await start_task(client, queue, server, fresh_workspace(home), max_rounds=rounds + 5)
    result = await handle.result()
    if result.status != "completed" or result.rounds != rounds:
        raise RuntimeError(f"stopline task ended {result.status} after {result.rounds} rounds: {result.reason}")
    return result.rounds


async def naive_task(client: Client, queue: str, home: Path, server: ScriptedServer, rounds: int,
                     activity_queue: str | None = None) -> int:
    done = await client.execute_workflow(
        NAIVE_WORKFLOW,
        LoopInput(url=server.url, workspace=str(fresh_workspace(home)), max_rounds=rounds + 5,
                  activity_queue=activity_queue),
        id=f"naive-{uuid.uuid4().hex[:12]}",
        task_queue=queue,
        result_type=int,
    )
    if done != rounds:
        raise RuntimeError(f"naive loop made {done} rounds, expected {rounds}")
    return done


#: The naive loop with its activities on a second task queue, as host-bound
#: activities are (DESIGN §7): no eager dispatch.
NAIVE_HOST_QUEUE = "naive, host queue"

Runner = Callable[[Client, str, Path, ScriptedServer, int], Awaitable[int]]


async def run_level(
    client: Client, queue: str, home: Path, run: Runner, loop: str, tasks: int, rounds: int,
    worker: WorkerProcess, server_pid: int,
) -> Level:
    servers = [ScriptedServer(rounds_scenario(rounds)).start() for _ in range(tasks)]
    try:
        w0, s0 = worker.cpu_seconds(), cpu_seconds(server_pid)
        t0 = time.perf_counter()
        done = await asyncio.gather(*(run(client, queue, home, s, rounds) for s in servers))
        seconds = time.perf_counter() - t0
        w1, s1 = worker.cpu_seconds(), cpu_seconds(server_pid)
    finally:
        for s in servers:
            s.stop()
    return Level(loop, tasks, sum(done), seconds, w1 - w0, s1 - s0)


async def main(args: argparse.Namespace) -> None:
    console.print(f"[dim]before: {load_average()}[/]")
    results: list[Level] = []
    with stopline_home() as home:
        async with dev_server() as env:
            client = env.client
            address = client.service_client.config.target_host
            server_pid = dev_server_pid(env)
            sq, nq, hq = fresh_queue("tp-stopline"), fresh_queue("tp-naive"), fresh_queue("tp-naive2")
            naive = [sys.executable, str(REPO / "bench" / "_naive.py"), address]
            workers = {
                "stopline": (stopline_worker(address, home, sq, home / "logs" / "stopline.log"), sq, stopline_task),
                "naive": (WorkerProcess([*naive, nq], {}, home / "logs" / "naive.log"), nq, naive_task),
                NAIVE_HOST_QUEUE: (
                    WorkerProcess([*naive, hq, "--activity-queue", f"{hq}-host"], {}, home / "logs" / "naive2.log"),
                    hq, functools.partial(naive_task, activity_queue=f"{hq}-host"),
                ),
            }
            try:
                for w, _, _ in workers.values():
                    await w.ready()
                for name, (w, q, run) in workers.items():  # warm-up, not counted
                    await run_level(client, q, home, run, name, 1, 5, w, server_pid)
                for n in args.levels:
                    runs: dict[str, list[Level]] = {name: [] for name in workers}
                    for rep in range(args.repeats):
                        order = list(workers.items())
                        shift = rep % len(order)  # each loop takes each place in turn
                        for name, (w, q, run) in order[shift:] + order[:shift]:
                            lvl = await run_level(client, q, home, run, name, n, args.rounds, w, server_pid)
                            runs[name].append(lvl)
                            console.print(
                                f"[dim]{name} × {n} (run {rep + 1}): {lvl.rounds_per_s:.1f} rounds/s, worker "
                                f"{lvl.ms_per_round(lvl.worker_cpu_s):.1f} ms/round, server "
                                f"{lvl.ms_per_round(lvl.server_cpu_s):.1f} ms/round · {load_average()}[/]"
                            )
                    results.extend(median_level(levels) for levels in runs.values())
            finally:
                for w, _, _ in workers.values():
                    w.stop()
    report(args, results)


def report(args: argparse.Namespace, results: list[Level]) -> None:
    by = {(r.loop, r.tasks): r for r in results}
    table = Table(
        title=f"{args.rounds}-round tasks, zero-delay scripted model, one list_dir call per round: "
        f"stopline vs a naive Temporal loop (each in its own worker process; median of {args.repeats} runs)",
    )
    for col in ("concurrent tasks", "loop", "rounds/s", "× naive", "worker CPU ms/round",
                "server CPU ms/round", "total CPU ms/round", "wall s"):
        table.add_column(col, justify="left" if col in ("loop",) else "right")
    loops = ("stopline", "naive", NAIVE_HOST_QUEUE)
    for n in args.levels:
        naive = by["naive", n]
        for loop in loops:
            r = by[loop, n]
            table.add_row(
                str(n) if loop == "stopline" else "", loop, f"{r.rounds_per_s:.1f}",
                f"{r.rounds_per_s / naive.rounds_per_s:.2f}×",
                f"{r.ms_per_round(r.worker_cpu_s):.1f}", f"{r.ms_per_round(r.server_cpu_s):.1f}",
                f"{r.ms_per_round(r.worker_cpu_s + r.server_cpu_s):.1f}", f"{r.seconds:.1f}",
                end_section=loop == loops[-1],
            )
    console.print(table)
    top = max(args.levels)
    ratio = by["stopline", top].rounds_per_s / by["naive", top].rounds_per_s
    verdict = "[green]met[/]" if ratio >= 1.0 else "[red]MISSED[/]"
    console.print(f"goal: at {top} concurrent tasks, stopline ≥ 1.0× the naive loop's rounds/s → {ratio:.2f}× {verdict}")
    console.print(f"after: {load_average()}")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--levels", default="1,10,50", help="concurrency levels, comma-separated (default 1,10,50)")
    p.add_argument("--rounds", type=int, default=20, help="rounds per task (default 20)")
    p.add_argument("--repeats", type=int, default=3, help="runs of each loop per level; the median is shown (default 3)")
    args = p.parse_args()
    args.levels = [int(x) for x in args.levels.split(",") if x.strip()]
    if args.rounds < 2 or not args.levels or min(args.levels) < 1 or args.repeats < 1:
        p.error("--rounds must be ≥ 2, --repeats ≥ 1 and every level ≥ 1")
    return args


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
