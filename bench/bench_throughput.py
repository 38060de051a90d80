"""Throughput and CPU per round: stopline vs a naive Temporal loop, 1 / 10 / 50 concurrent tasks.

What is measured, per concurrency level N (default 1, 10, 50): N tasks of
``--rounds`` rounds each (default 20: 19 rounds of one ``list_dir`` call on
an empty workspace, then a final answer) against zero-delay scripted models
(Anthropic wire; one scripted server per task, in this process), started
together; then

- rounds/s: N × rounds / wall time from the first start to the last result;
- worker CPU ms per round: user + system CPU of the worker process (psutil)
  over the level, divided by N × rounds;
- server CPU ms per round: the same for the dev server's process;
- client CPU ms per round: the same for this process — the scripted model
  servers and the Temporal client, which share the machine's cores with
  the worker and the dev server (so a loop whose model traffic costs the
  scripted servers more is slowed by it too).

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
- naive-host: the same loop with its activities on a second task
  queue, as stopline's host-bound activities are (DESIGN §7): each goes
  through matching (AddActivityTask, a poll) — the cost of binding work to
  a host, apart from stopline's own.

Every run — one loop at one level — has a dev server and a worker of its
own, started for it, warmed up with one uncounted 5-round task and
stopped after it: a dev server slows as it holds more finished workflows
(in-memory persistence; 15–40% over a nine-run sequence), so a shared one
favoured whichever loop ran first. At each level the loops run
``--repeats`` times (default 3), in rotated order (balanced only when the
repeats are a multiple of the loops), and each figure is the median of its
repeats (the lower middle run for an even count). "× naive" divides those medians; "× naive,
paired" is the median, over repeats, of each repeat's own ratio (the
loops of one repeat run a minute or two apart, so a machine whose speed
drifts over the benchmark — this shared one swings by 30% — moves both). Goal: at 50
concurrent tasks stopline's rounds/s ≥ 1.0× the naive loop's, by both. The load average is printed before and after, and
with each run (2-core machine: figures taken above ~1.5 are skewed by
other work).

Everything started is stopped by its own handle: worker subprocesses
(SIGTERM by PID), scripted servers, the dev server, the temp
``$STOPLINE_HOME``.

Run: ``.venv/bin/python bench/bench_throughput.py [--levels 1,10,50] [--rounds 20] [--repeats 3] [--loops stopline,naive]``
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import statistics
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
    client_cpu_s: float

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
NAIVE_HOST_QUEUE = "naive-host"

Runner = Callable[[Client, str, Path, ScriptedServer, int], Awaitable[int]]


async def run_level(
    client: Client, queue: str, home: Path, run: Runner, loop: str, tasks: int, rounds: int,
    worker: WorkerProcess, server_pid: int,
) -> Level:
    servers = [ScriptedServer(rounds_scenario(rounds)).start() for _ in range(tasks)]
    try:
        w0, s0, c0 = worker.cpu_seconds(), cpu_seconds(server_pid), cpu_seconds(os.getpid())
        t0 = time.perf_counter()
        done = await asyncio.gather(*(run(client, queue, home, s, rounds) for s in servers))
        seconds = time.perf_counter() - t0
        w1, s1, c1 = worker.cpu_seconds(), cpu_seconds(server_pid), cpu_seconds(os.getpid())
    finally:
        for s in servers:
            s.stop()
    return Level(loop, tasks, sum(done), seconds, w1 - w0, s1 - s0, c1 - c0)


LOOPS = ("stopline", "naive", NAIVE_HOST_QUEUE)


def loop_worker(name: str, address: str, home: Path) -> tuple[WorkerProcess, str, Runner]:
    """The worker subprocess of one loop, its task queue, and its task runner."""
    naive = [sys.executable, str(REPO / "bench" / "_naive.py"), address]
    if name == "stopline":
        q = fresh_queue("tp-stopline")
        return stopline_worker(address, home, q, home / "logs" / f"{q}.log"), q, stopline_task
    if name == "naive":
        q = fresh_queue("tp-naive")
        return WorkerProcess([*naive, q], {}, home / "logs" / f"{q}.log"), q, naive_task
    q = fresh_queue("tp-naive2")
    return (
        WorkerProcess([*naive, q, "--activity-queue", f"{q}-host"], {}, home / "logs" / f"{q}.log"),
        q, functools.partial(naive_task, activity_queue=f"{q}-host"),
    )


async def one_run(home: Path, name: str, tasks: int, rounds: int) -> Level:
    """One loop at one level on a dev server and worker of its own."""
    async with dev_server() as env:
        address = env.client.service_client.config.target_host
        server_pid = dev_server_pid(env)
        worker, queue, run = loop_worker(name, address, home)
        try:
            await worker.ready()
            await run_level(env.client, queue, home, run, name, 1, 5, worker, server_pid)  # warm-up
            return await run_level(env.client, queue, home, run, name, tasks, rounds, worker, server_pid)
        finally:
            worker.stop()


async def main(args: argparse.Namespace) -> None:
    console.print(f"[dim]before: {load_average()}[/]")
    results: dict[tuple[str, int], list[Level]] = {}
    with stopline_home() as home:
        for n in args.levels:
            runs: dict[str, list[Level]] = {name: [] for name in args.loops}
            for rep in range(args.repeats):
                shift = rep % len(args.loops)  # each loop takes each place in turn
                for name in args.loops[shift:] + args.loops[:shift]:
                    lvl = await one_run(home, name, n, args.rounds)
                    runs[name].append(lvl)
                    console.print(
                        f"[dim]{name} × {n} (run {rep + 1}): {lvl.rounds_per_s:.1f} rounds/s, worker "
                        f"{lvl.ms_per_round(lvl.worker_cpu_s):.1f} ms/round, server "
                        f"{lvl.ms_per_round(lvl.server_cpu_s):.1f} ms/round, client "
                        f"{lvl.ms_per_round(lvl.client_cpu_s):.1f} ms/round · {load_average()}[/]"
                    )
            results.update({(name, n): levels for name, levels in runs.items()})
    report(args, results)


def paired_ratio(runs: list[Level], naive: list[Level]) -> float:
    """Median over repeats of a loop's rounds/s over the naive loop's in the
    same repeat (run minutes apart at most, so a machine that speeds up or
    slows down over the benchmark — a shared host does — moves both)."""
    # the lower middle with an even count, as median_level takes
    return statistics.median_low(r.rounds_per_s / n.rounds_per_s for r, n in zip(runs, naive, strict=True))


def report(args: argparse.Namespace, results: dict[tuple[str, int], list[Level]]) -> None:
    table = Table(
        title=f"{args.rounds}-round tasks, zero-delay scripted model, one list_dir call per round: "
        f"stopline vs a naive Temporal loop (each in its own worker process; median of {args.repeats} runs)",
    )
    for col in ("concurrent tasks", "loop", "rounds/s", "× naive", "× naive, paired", "worker CPU ms/round",
                "server CPU ms/round", "total CPU ms/round", "client CPU ms/round", "wall s"):
        table.add_column(col, justify="left" if col in ("loop",) else "right")
    loops = args.loops
    for n in args.levels:
        naive = median_level(results["naive", n])
        for loop in loops:
            r = median_level(results[loop, n])
            table.add_row(
                str(n) if loop == "stopline" else "", loop, f"{r.rounds_per_s:.1f}",
                f"{r.rounds_per_s / naive.rounds_per_s:.2f}×",
                f"{paired_ratio(results[loop, n], results['naive', n]):.2f}×",
                f"{r.ms_per_round(r.worker_cpu_s):.1f}", f"{r.ms_per_round(r.server_cpu_s):.1f}",
                f"{r.ms_per_round(r.worker_cpu_s + r.server_cpu_s):.1f}",
                f"{r.ms_per_round(r.client_cpu_s):.1f}", f"{r.seconds:.1f}",
                end_section=loop == loops[-1],
            )
    console.print(table)
    top = max(args.levels)
    medians = median_level(results["stopline", top]).rounds_per_s / median_level(results["naive", top]).rounds_per_s
    paired = paired_ratio(results["stopline", top], results["naive", top])
    verdict = "[green]met[/]" if min(medians, paired) >= 1.0 else "[red]MISSED[/]"
    console.print(
        f"goal: at {top} concurrent tasks, stopline ≥ 1.0× the naive loop's rounds/s → "
        f"{medians:.2f}× (medians), {paired:.2f}× (paired) {verdict}"
    )
    console.print(f"after: {load_average()}")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--levels", default="1,10,50", help="concurrency levels, comma-separated (default 1,10,50)")
    p.add_argument("--rounds", type=int, default=20, help="rounds per task (default 20)")
    p.add_argument("--repeats", type=int, default=3, help="runs of each loop per level; the median is shown (default 3)")
    p.add_argument("--loops", default=",".join(LOOPS),
                   help=f"loops to run, comma-separated; stopline and naive always (default {','.join(LOOPS)})")
    args = p.parse_args()
    args.levels = [int(x) for x in args.levels.split(",") if x.strip()]
    args.loops = tuple(dict.fromkeys(x.strip() for x in args.loops.split(",") if x.strip()))
    if not {"stopline", "naive"} <= set(args.loops) <= set(LOOPS):
        p.error(f"--loops: stopline and naive, and optionally {NAIVE_HOST_QUEUE!r}")
    if args.rounds < 2 or not args.levels or min(args.levels) < 1 or args.repeats < 1:
        p.error("--rounds must be ≥ 2, --repeats ≥ 1 and every level ≥ 1")
    return args


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
