"""Cost of a round on Temporal, against the same loop run in-process.

What is measured: a task of ``--rounds`` sampling rounds (default 50) against
a zero-delay scripted model on the Anthropic wire: ``rounds - 1`` responses
each with one ``list_dir`` call on an empty workspace (``entry(...,
repeat=rounds - 1)``), then a final text response. Reported, as the median
over ``--repeats`` runs (default 3):

- ms per round: wall time from ``start_workflow`` to the result, divided by
  the rounds;
- workflow history events per round, history bytes per round (protobuf
  ``ByteSize()`` summed over the events, and ``len(history.to_json())``),
  and the bytes of the first vs the last rounds (equal when history grows
  linearly with rounds, DESIGN §5);
- activity round trips per round (``ActivityTaskScheduled`` events / rounds)
  and workflow tasks per round (``WorkflowTaskScheduled`` events / rounds).

Baseline, in the same run: the same turn loop as a plain Python loop, no
Temporal server. It calls the same activity functions
(``activities.sampling.sample``, ``activities.tools.tool_activity``,
``activities.ledger.ledger_flush``) through
``temporalio.testing.ActivityEnvironment`` with the same inputs, building
ledger rows the way the workflow does and using the same pure policies
(``stopline.core.policies.untriaged_calls``). So the provider adapter, real HTTP to
the scripted server, SSE parsing, the fsynced ledger file and the tools all
run; what is missing is Temporal: server round trips, workflow tasks,
history, and payload (de)serialization through the data converter.

Both run in this process against their own scripted server; runs alternate
(Temporal, baseline, Temporal, ...) after one short warm-up run of each,
which is not counted. Everything started is stopped at the end: the dev
server, the worker, scripted servers, and the temp ``$STOPLINE_HOME``.

Run: ``.venv/bin/python bench/bench_rounds.py [--rounds 50] [--repeats 3]``
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from _common import (
    console,
    dev_server,
    fresh_queue,
    fresh_workspace,
    median,
    running,
    start_task,
    stopline_home,
    task_input,
)
from rich.table import Table
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client
from temporalio.testing import ActivityEnvironment

from stopline.activities.ledger import LedgerStore, ledger_flush
from stopline.activities.sampling import sample
from stopline.activities.tools import tool_activity
from stopline.core import policies
from stopline.core.contracts import (
    SAMPLE_ACTIVITY,
    Fatal,
    LedgerFlushInput,
    LedgerRow,
    RespondToModel,
    SampleInput,
    ToolCallInput,
)
from stopline.settings import load_settings
from stopline.testing.scripted import ScriptedServer, anthropic_message, entry, scenario
from stopline.worker.runtime import build_workers

#: The tool set the workflow offers a top-level task (``workflows/_engine.py``).
TOOLSET = "workspace+tasks"


def rounds_scenario(rounds: int) -> dict[str, Any]:
    """``rounds - 1`` rounds of one ``list_dir`` call, then a final answer."""
    return scenario(
        "anthropic",
        entry(anthropic_message(tool_calls=[("ls", "list_dir", {"path": "."})]), repeat=rounds - 1),
        entry(anthropic_message("done: the workspace is empty")),
    )


@dataclass
class Run:
    """One measured task."""

    seconds: float
    rounds: int
    ledger_rows: int
    events: int = 0
    proto_bytes: int = 0
    json_bytes: int = 0
    activities: int = 0
    workflow_tasks: int = 0
    round_bytes: list[int] = field(default_factory=list)
    last_request: Any = None  # the body of the last request the scripted model got

    @property
    def ms_per_round(self) -> float:
        return self.seconds * 1000 / self.rounds


def ledger_rows(home: Path, task_id: str) -> int:
    return len(LedgerStore.read_path(LedgerStore(home / "ledger").path(task_id)))


# ------------------------------------------------------------------ Temporal


def bytes_per_round(events: Any) -> list[int]:
    """History bytes of each round: from one sampling activity's scheduling to the next."""
    out: list[int] = []
    for e in events:
        if (
            e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
            and e.activity_task_scheduled_event_attributes.activity_type.name == SAMPLE_ACTIVITY
        ):
            out.append(0)
        if out:
            out[-1] += e.ByteSize()
    return out


async def temporal_run(client: Client, task_queue: str, home: Path, rounds: int) -> Run:
    """One task on the dev server; its history is fetched after it ends."""
    with ScriptedServer(rounds_scenario(rounds)) as server:
        t0 = time.perf_counter()
        handle = await start_task(
            client, task_queue, server, fresh_workspace(home), max_rounds=rounds + 10
        )
        result = await handle.result()
        seconds = time.perf_counter() - t0
        last_request = server.requests()[-1]["body"]
    if result.status != "completed" or result.rounds != rounds:
        raise RuntimeError(f"Temporal run ended {result.status} after {result.rounds} rounds: {result.reason}")
    history = await handle.fetch_history()
    kinds = [e.event_type for e in history.events]
    return Run(
        seconds=seconds,
        rounds=result.rounds,
        ledger_rows=ledger_rows(home, handle.id),
        events=len(history.events),
        proto_bytes=sum(e.ByteSize() for e in history.events),
        json_bytes=len(history.to_json()),
        activities=kinds.count(EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED),
        workflow_tasks=kinds.count(EventType.EVENT_TYPE_WORKFLOW_TASK_SCHEDULED),
        round_bytes=bytes_per_round(history.events)[:-1],  # the last one holds the task's end too
        last_request=last_request,
    )


# ---------------------------------------------------------- in-process loop


async def inprocess_loop(
    task_id: str, server: ScriptedServer, workspace: Path, client: Client
) -> tuple[int, int]:
    """The workflow's turn loop without Temporal: same activities, same rows
    (the sampling activity's refusal guard reads visibility through ``client``).

    Returns:
        ``(rounds, activity calls)``.
    """
    inp = task_input(server, workspace, "unused", max_rounds=10**6)
    limits = inp.limits
    env = ActivityEnvironment(client=client)
    rows: list[LedgerRow] = []
    flushed = 0
    calls = 0

    def append(kind: Any, rnd: int, **fields: Any) -> None:
        rows.append(LedgerRow(seq=len(rows) + 1, kind=kind, round=rnd, at=datetime.now(UTC), **fields))

    def append_result(call: Any, rnd: int, outcome: RespondToModel) -> None:
        meta = {"elapsed_s": round(outcome.elapsed_s, 3)}
        append("tool_result", rnd, text=outcome.text, call_id=call.id, tool_name=call.name,
               ok=outcome.ok, meta=meta)

    append("prompt", 0, text=inp.prompt)
    rnd = 0
    while rnd < limits.max_rounds:
        rnd += 1
        upto = rows[-1].seq
        result = await env.run(sample, SampleInput(
            task_id=task_id, model=inp.model, base_url=inp.base_url, pending_rows=rows[flushed:],
            upto_seq=upto, system=inp.system, toolset=TOOLSET, max_tokens=limits.max_tokens,
            stream=inp.stream,
        ))
        calls += 1
        flushed = upto
        if result.text or result.tool_calls:
            append("assistant", rnd, text=result.text, tool_calls=list(result.tool_calls))
        if not result.tool_calls:
            break
        blocked = policies.untriaged_calls(result)
        for call in result.tool_calls:
            if call.id in blocked:
                append_result(call, rnd, RespondToModel(text=blocked[call.id], ok=False))
        runnable = [c for c in result.tool_calls if c.id not in blocked]
        outcomes = await asyncio.gather(*(
            env.run(tool_activity, ToolCallInput(
                task_id=task_id, call=c, workspace=inp.workspace, timeout_s=limits.tool_timeout_s,
                kill_grace_s=limits.interrupt_grace_s,
            ))
            for c in runnable
        ))
        calls += len(runnable)
        for call, outcome in zip(runnable, outcomes, strict=True):
            if isinstance(outcome, Fatal):
                raise RuntimeError(f"tool {call.name} failed: {outcome.reason}")
            append_result(call, rnd, outcome)
    # the task's end, as the workflow records it (hidden from the model)
    append("system", rnd, text="task completed: the model ended its turn", model_visible=False,
           meta={"outcome": "completed", "refused": False})
    await env.run(ledger_flush, LedgerFlushInput(task_id=task_id, rows=rows[flushed:], close_shells=True))
    return rnd, calls + 1


async def inprocess_run(home: Path, rounds: int, client: Client) -> tuple[Run, int]:
    """One task through :func:`inprocess_loop`; also returns its activity calls."""
    task_id = f"inproc-{uuid.uuid4().hex[:12]}"
    with ScriptedServer(rounds_scenario(rounds)) as server:
        t0 = time.perf_counter()
        done, calls = await inprocess_loop(task_id, server, fresh_workspace(home), client)
        seconds = time.perf_counter() - t0
        last_request = server.requests()[-1]["body"]
    if done != rounds:
        raise RuntimeError(f"in-process run made {done} rounds, expected {rounds}")
    run = Run(seconds=seconds, rounds=done, ledger_rows=ledger_rows(home, task_id), last_request=last_request)
    return run, calls


# ---------------------------------------------------------------- reporting


def report(args: argparse.Namespace, temporal: list[Run], local: list[Run], local_calls: int) -> None:
    def med(runs: list[Run], f: Any) -> float:
        return median([f(r) for r in runs])

    def per_round(runs: list[Run], f: Any) -> float:
        return med(runs, lambda r: f(r) / r.rounds)

    t_ms, b_ms = med(temporal, lambda r: r.ms_per_round), med(local, lambda r: r.ms_per_round)
    k = max(1, min(10, len(temporal[0].round_bytes) // 2))
    same_request = temporal[0].last_request == local[0].last_request
    table = Table(
        title=f"{args.rounds}-round task, zero-delay scripted model (anthropic wire, streamed), "
        f"one list_dir call per round — median of {args.repeats} runs",
        caption="Temporal: dev server + in-process worker (stopline.worker.runtime.build_workers). "
        "Baseline: the same activities driven by a plain loop through ActivityEnvironment.",
    )
    table.add_column("metric", no_wrap=True)
    table.add_column("Temporal", justify="right")
    table.add_column("in-process baseline", justify="right")
    table.add_column("Temporal − baseline", justify="right")
    rows = [
        ("ms per round", f"{t_ms:.1f}", f"{b_ms:.1f}", f"+{t_ms - b_ms:.1f} ms (×{t_ms / b_ms:.2f})"),
        ("  each run", ", ".join(f"{r.ms_per_round:.1f}" for r in temporal),
         ", ".join(f"{r.ms_per_round:.1f}" for r in local), ""),
        ("task wall time", f"{med(temporal, lambda r: r.seconds):.2f} s",
         f"{med(local, lambda r: r.seconds):.2f} s", ""),
        ("history events / round", f"{per_round(temporal, lambda r: r.events):.1f}", "—", ""),
        ("history bytes / round (protobuf)", f"{per_round(temporal, lambda r: r.proto_bytes):,.0f}", "—", ""),
        ("history bytes / round (JSON)", f"{per_round(temporal, lambda r: r.json_bytes):,.0f}", "—", ""),
        (f"  protobuf bytes, first {k} vs last {k} rounds",
         f"{med(temporal, lambda r: sum(r.round_bytes[:k]) / k):,.0f} vs "
         f"{med(temporal, lambda r: sum(r.round_bytes[-k:]) / k):,.0f}", "—", ""),
        ("activity round trips / round (ActivityTaskScheduled)",
         f"{per_round(temporal, lambda r: r.activities):.2f}",
         f"0 ({local_calls / args.rounds:.2f} direct calls)", ""),
        ("workflow tasks / round (WorkflowTaskScheduled)",
         f"{per_round(temporal, lambda r: r.workflow_tasks):.2f}", "0", ""),
        ("history totals: events / protobuf bytes",
         f"{med(temporal, lambda r: r.events):.0f} / {med(temporal, lambda r: r.proto_bytes):,.0f}", "—", ""),
        ("ledger rows written (must match)", str(temporal[0].ledger_rows), str(local[0].ledger_rows), ""),
        ("last provider request body (must match)", "", "",
         "[green]identical[/]" if same_request else "[red]differs[/]"),
    ]
    for row in rows:
        table.add_row(*row)
    console.print(table)


async def main(args: argparse.Namespace) -> None:
    with stopline_home() as home:
        async with dev_server() as env:
            client = env.client
            queue = fresh_queue("rounds")
            workers = build_workers(client, load_settings(), task_queue=queue)
            async with running(workers):
                console.print(f"[dim]warm-up ({args.warmup_rounds} rounds each, not counted)…[/]")
                await temporal_run(client, queue, home, args.warmup_rounds)
                await inprocess_run(home, args.warmup_rounds, client)
                temporal: list[Run] = []
                local: list[Run] = []
                local_calls = 0
                for i in range(args.repeats):
                    temporal.append(await temporal_run(client, queue, home, args.rounds))
                    run, local_calls = await inprocess_run(home, args.rounds, client)
                    local.append(run)
                    console.print(
                        f"[dim]repeat {i + 1}/{args.repeats}: Temporal {temporal[-1].ms_per_round:.1f} "
                        f"ms/round, in-process {run.ms_per_round:.1f} ms/round[/]"
                    )
    if {r.ledger_rows for r in temporal} | {r.ledger_rows for r in local} != {temporal[0].ledger_rows}:
        console.print("[red]ledger row counts differ between runs: the loops did not do the same work[/]")
    report(args, temporal, local, local_calls)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=50, help="sampling rounds per task (default 50)")
    p.add_argument("--repeats", type=int, default=3, help="measured runs of each (default 3)")
    p.add_argument("--warmup-rounds", type=int, default=5, help="rounds of the uncounted warm-up run")
    args = p.parse_args()
    if args.rounds < 2 or args.repeats < 1 or args.warmup_rounds < 2:
        p.error("--rounds and --warmup-rounds must be ≥ 2, --repeats ≥ 1")
    return args


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
