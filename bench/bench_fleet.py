"""Fleet benchmark (DESIGN §7): what placement costs at a task's start, and how
long a dead host takes to become a visible outcome.

1. Placement latency. ``start_workflow`` → the first model request reaching
   the scripted provider, 20 tasks one after another, for stopline (the task
   claims a host through a host session on the pool's queue, then samples on
   the host's own queue) and for the same workflow with placement cut out —
   it samples at once on a fixed host queue, as every task did before
   placement (a bench-only subclass, ``AgentTaskDirect``). Both on one dev
   server, one in-process host.
2. Host death → visible outcome, at the default bounds
   (``host_lost_after_s`` 30 s, ``claim_timeout_s`` 10 s): host processes
   (own home, own UTS and mount namespace) each running one task mid-tool are
   SIGKILLed for good; the time until the task's search attributes show the
   outcome — ``StoplineStatus = stopped`` when no other host has the
   workspace, ``StoplineHost`` = the surviving host when one has it — is
   measured from the kill. 10 of each, five hosts at a time.

Run: ``.venv/bin/python bench/bench_fleet.py`` (about 4 minutes).
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from rich.table import Table
from temporalio import workflow
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import (  # noqa: E402
    console,
    dev_server,
    fmt_ms,
    fresh_queue,
    fresh_workspace,
    median,
    p95,
    running,
    stopline_home,
    task_input,
)
from stopline.activities.host import host_id_for  # noqa: E402
from stopline.core import search_attributes as sa  # noqa: E402
from stopline.core.contracts import AgentTaskInput, AgentTaskResult, TaskLimits  # noqa: E402
from stopline.settings import load_settings  # noqa: E402
from stopline.testing.scripted import ScriptedServer, anthropic_message, entry, scenario  # noqa: E402
from stopline.workflows.agent_task import AgentTask  # noqa: E402
from stopline.worker.runtime import build_workers  # noqa: E402
from tests._worker_proc import WorkerProc, kill_leftover_tool_groups, server_address  # noqa: E402

STARTS = 20
DEATHS = 10
BATCH = 5


@workflow.defn(name="AgentTaskDirect")
class AgentTaskDirect(AgentTask):
    """Today's task without placement: samples at once on ``host_task_queue``."""

    @workflow.init
    def __init__(self, inp: AgentTaskInput) -> None:
        super().__init__(inp)

    @workflow.run
    async def run(self, inp: AgentTaskInput) -> AgentTaskResult:
        return await super().run(inp)

    async def _place(self) -> Any:
        self._fleet = False
        return None


async def _first_request_s(client: Any, workflow_type: str, queue: str, server: ScriptedServer,
                           inp: Any) -> float:
    before = server.request_count()
    t0 = time.time()
    handle = await client.start_workflow(workflow_type, inp, id=f"start-{uuid.uuid4().hex[:10]}",
                                         task_queue=queue, result_type=AgentTaskResult)
    while server.request_count() == before:
        await asyncio.sleep(0.002)
    at = server.requests()[before]["received_at"]
    await handle.result()
    return at - t0


async def placement_latency(home: Path) -> dict[str, list[float]]:
    async with dev_server() as env:
        client = env.client
        queue, direct_queue = fresh_queue("place"), fresh_queue("direct")
        workers = build_workers(client, load_settings(), task_queue=queue)
        host_queue = workers[-1].task_queue
        # a bench-only workflow class, so no sandbox (it lives in this script)
        direct = Worker(client, task_queue=direct_queue, workflows=[AgentTaskDirect],
                        workflow_runner=UnsandboxedWorkflowRunner())
        out: dict[str, list[float]] = {"stopline (claims a host)": [], "direct queue (before placement)": []}
        body = entry(anthropic_message("done"), repeat=2 * STARTS + 4)
        with ScriptedServer(scenario("anthropic", body)) as server:
            async with running([*workers, direct]):
                ws = fresh_workspace(home)
                for warm in range(2):  # one of each first: imports, caches
                    await _first_request_s(client, "AgentTask", queue, server, task_input(server, ws, queue))
                    inp = task_input(server, ws, queue).model_copy(update={"host_task_queue": host_queue})
                    await _first_request_s(client, "AgentTaskDirect", direct_queue, server, inp)
                for _ in range(STARTS):
                    out["stopline (claims a host)"].append(await _first_request_s(
                        client, "AgentTask", queue, server, task_input(server, ws, queue)))
                    inp = task_input(server, ws, queue).model_copy(update={"host_task_queue": host_queue})
                    out["direct queue (before placement)"].append(await _first_request_s(
                        client, "AgentTaskDirect", direct_queue, server, inp))
    return out


async def _one_batch(client: Any, address: str, queue: str, root: Path, *, shared: bool) -> list[float]:
    """BATCH hosts, each running one task mid-tool, killed together."""
    private = root / f"private-{uuid.uuid4().hex[:6]}"
    private.mkdir(parents=True)
    survivor = WorkerProc(address, root / f"home-b-{uuid.uuid4().hex[:6]}", queue,
                          root / "logs" / f"b-{uuid.uuid4().hex[:6]}.log", hostname="survivor",
                          hide=() if shared else (private,))
    survivor.home.mkdir(parents=True)
    hosts: list[WorkerProc] = []
    servers = [ScriptedServer(scenario("anthropic",
        entry(anthropic_message(tool_calls=[("c1", "shell", {"command": "touch started; sleep 600"})])),
        entry(anthropic_message("done")))).start() for _ in range(BATCH)]
    try:
        survivor.start()
        for i in range(BATCH):
            h = WorkerProc(address, root / f"home-{uuid.uuid4().hex[:6]}", queue,
                           root / "logs" / f"a{i}-{uuid.uuid4().hex[:6]}.log", hostname=f"doomed-{i}")
            h.home.mkdir(parents=True)
            hosts.append(h.start())
        await asyncio.gather(survivor.wait_ready(), *(h.wait_ready() for h in hosts))
        handles, workspaces = [], []
        for h, server in zip(hosts, servers):
            ws = private / uuid.uuid4().hex[:8]
            ws.mkdir()
            workspaces.append(ws)
            inp = task_input(server, ws, queue).model_copy(update={"host": host_id_for(h.home)})
            handles.append(await client.start_workflow(
                "AgentTask", inp, id=f"death-{uuid.uuid4().hex[:10]}", task_queue=queue,
                result_type=AgentTaskResult))
        deadline = time.monotonic() + 60
        while not all((ws / "started").exists() for ws in workspaces):
            if time.monotonic() > deadline:
                raise TimeoutError("tools did not start")
            await asyncio.sleep(0.05)
        killed = time.monotonic()
        for h in hosts:
            h.kill()
            kill_leftover_tool_groups(h.home)
        doomed = {host_id_for(h.home) for h in hosts}
        seen: dict[int, float] = {}
        while len(seen) < len(handles) and time.monotonic() - killed < 180:
            for i, handle in enumerate(handles):
                if i in seen:
                    continue
                attrs = (await handle.describe()).typed_search_attributes
                host = attrs.get(sa.HOST)
                if attrs.get(sa.STATUS) == "stopped" or (host and host not in doomed):
                    seen[i] = time.monotonic() - killed
            await asyncio.sleep(0.25)
        return [seen.get(i, float("inf")) for i in range(len(handles))]
    finally:
        for h in [*hosts, survivor]:
            h.stop()
            kill_leftover_tool_groups(h.home)
        for s in servers:
            s.stop()


async def host_death(home: Path) -> dict[str, list[float]]:
    async with dev_server() as env:
        client = env.client
        queue = fresh_queue("death")
        address = server_address(client)
        out: dict[str, list[float]] = {"no other host has the workspace -> stopped": [],
                                       "a host shares the workspace -> moved": []}
        for _ in range(DEATHS // BATCH):
            out["no other host has the workspace -> stopped"] += await _one_batch(
                client, address, queue, home, shared=False)
            out["a host shares the workspace -> moved"] += await _one_batch(
                client, address, queue, home, shared=True)
    return out


def _table(title: str, rows: dict[str, list[float]], cap_s: float = 180.0) -> Table:
    t = Table(title=title)
    for col in ("case", "n", "median", "p95", "max"):
        t.add_column(col, justify="right" if col != "case" else "left")
    for name, xs in rows.items():
        t.add_row(name, str(len(xs)), fmt_ms(median(xs), cap_s), fmt_ms(p95(xs), cap_s),
                  fmt_ms(max(xs) if xs else float("nan"), cap_s))
    return t


async def main() -> None:
    defaults = TaskLimits()
    console.print(f"load average before: {os.getloadavg()}")
    with stopline_home() as home:
        starts = await placement_latency(home)
        console.print(_table(f"start_workflow -> first model request ({STARTS} tasks each)", starts))
        a, b = (median(xs) for xs in starts.values())
        console.print(f"placement adds {1000 * (a - b):.1f} ms at the median per task start")
        console.print(f"load average: {os.getloadavg()}")
        deaths = await host_death(home)
        console.print(_table(
            f"host SIGKILLed for good -> the task's outcome visible in its search attributes "
            f"(host_lost_after_s {defaults.host_lost_after_s:g}, claim_timeout_s "
            f"{defaults.claim_timeout_s:g}; {DEATHS} each)", deaths))
    console.print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    asyncio.run(main())
