"""Regenerate the committed replay histories in ``tests/histories/``.

``tests/test_replay.py`` replays every ``tests/histories/*.json`` against the
current workflow code in CI: a change that would break tasks already running
(a nondeterminism error after a worker restart) fails the suite. These files
are the recorded histories it replays. Each comes from really running one
scenario — real dev server, real worker, real scripted provider over HTTP,
real shell processes — so they are the shape production writes.

Usage (from the repository root)::

    .venv/bin/python tests/histories/make_histories.py            # all scenarios
    .venv/bin/python tests/histories/make_histories.py interrupted  # some

Each scenario writes ``tests/histories/<name>.json`` (the workflow id is
``<name>``, which is how ``stopline.replay.load_history`` names a file's
workflow). A history is written only after it replays against the current
code, so a broken scenario never lands a broken file.

When to regenerate: only when a workflow change is *meant* to be
incompatible with running tasks (after draining them). Otherwise a failing
replay means the change needs ``workflow.patched(...)`` — regenerating would
hide exactly the bug the test exists to catch. New scenarios (a refused task,
a continued-as-new task) are added by writing an ``async def`` below that
takes a :class:`Ctx` and returns the finished task's handle, and listing it
in :data:`SCENARIOS`; then run the script with its name.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from temporalio.client import Client, WorkflowHandle  # noqa: E402
from temporalio.contrib.pydantic import pydantic_data_converter  # noqa: E402
from temporalio.testing import WorkflowEnvironment  # noqa: E402

from stopline.core.contracts import InterruptResult, TaskStatus  # noqa: E402
from stopline.replay import replay  # noqa: E402
from stopline.worker.runtime import build_workers, temporal_binary  # noqa: E402
from stopline.testing.scripted import ScriptedServer, anthropic_message, entry, scenario  # noqa: E402
from stopline.core.search_attributes import ALL as SEARCH_ATTRIBUTES  # noqa: E402
from stopline.settings import load_settings  # noqa: E402
from tests.conftest import start_task  # noqa: E402

OUT = Path(__file__).resolve().parent


@dataclass
class Ctx:
    """What a scenario gets: a client, a task queue its workers serve, a fresh
    workspace, and a factory for scripted provider servers (stopped after)."""

    client: Client
    task_queue: str
    task_id: str
    workspace: Path
    servers: list[ScriptedServer] = field(default_factory=list)

    def scripted(self, scen: dict[str, Any]) -> ScriptedServer:
        """Start a scripted provider server for this scenario."""
        server = ScriptedServer(scen).start()
        self.servers.append(server)
        return server

    async def start(self, server: ScriptedServer, prompt: str, **limits: Any) -> WorkflowHandle[Any, Any]:
        """Start the scenario's task (workflow id = the scenario name)."""
        return await start_task(
            self.client, self.task_queue, server, self.workspace, prompt, task_id=self.task_id, **limits
        )


async def _wait_for_file(path: Path, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not (path.exists() and path.read_text().strip()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        await asyncio.sleep(0.02)


async def _wait_state(handle: WorkflowHandle[Any, Any], state: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (await handle.query("status", result_type=TaskStatus)).state != state:
        if time.monotonic() > deadline:
            raise TimeoutError(f"task never reached {state}")
        await asyncio.sleep(0.05)


# ---------------------------------------------------------------------------
# Scenarios: each runs one task to its end and returns its handle.
# ---------------------------------------------------------------------------


async def completed(ctx: Ctx) -> WorkflowHandle[Any, Any]:
    """A task that runs a tool, reads its output and ends its turn."""
    server = ctx.scripted(scenario(
        "anthropic",
        entry(anthropic_message(
            "listing", tool_calls=[("c1", "shell", {"command": "echo hello > out.txt; cat out.txt"})]
        )),
        entry(anthropic_message("the file says hello; done")),
    ))
    handle = await ctx.start(server, "write hello to out.txt and show it", round_tools=False)
    result = await handle.result()
    assert result.status == "completed", result
    return handle


async def _quick_and_slow_interrupted(ctx: Ctx, **limits: Any) -> WorkflowHandle[Any, Any]:
    server = ctx.scripted(scenario(
        "anthropic",
        entry(anthropic_message(tool_calls=[
            ("a", "shell", {"command": "echo quick"}),
            ("b", "shell", {"command": "echo $$ > pid; sleep 100"}),
        ])),
        entry(anthropic_message("ok, stopped")),
    ))
    handle = await ctx.start(server, "run the quick and the slow command", interrupt_grace_s=0.1, **limits)
    await _wait_for_file(ctx.workspace / "pid")
    await asyncio.sleep(0.3)  # let the quick call finish: it keeps its result
    res = await handle.execute_update("interrupt", result_type=InterruptResult)
    assert res.interrupted and res.aborted_calls == ["b"] and res.kept_calls == ["a"], res
    await _wait_state(handle, "waiting")
    await handle.execute_update("message", "never mind, stop there")
    result = await handle.result()
    assert result.status == "completed", result
    return handle


async def interrupted(ctx: Ctx) -> WorkflowHandle[Any, Any]:
    """A turn interrupted mid-tool (one call finished, one aborted), then a
    user message, and the task completes; each call its own activity."""
    return await _quick_and_slow_interrupted(ctx, round_tools=False)


async def refused(ctx: Ctx) -> WorkflowHandle[Any, Any]:
    """A task that runs a tool, then is stopped by a provider refusal."""
    server = ctx.scripted(scenario(
        "anthropic",
        entry(anthropic_message("looking", tool_calls=[("c1", "list_dir", {})])),
        entry(anthropic_message("I started on it.", stop_reason="refusal",
                                stop_details={"category": "cyber"})),
    ))
    handle = await ctx.start(server, "inspect the workspace")
    result = await handle.result()
    assert result.status == "stopped" and result.refused, result
    return handle


async def continued_as_new(ctx: Ctx) -> WorkflowHandle[Any, Any]:
    """The first run of a long task that continued-as-new (ends with the
    ContinueAsNew event carrying the ledger by reference)."""
    server = ctx.scripted(scenario(
        "anthropic",
        entry(anthropic_message(tool_calls=[("c", "list_dir", {})]), repeat=11),
        entry(anthropic_message("done")),
    ))
    handle = await ctx.start(server, "list the directory a dozen times", continue_as_new_after_events=60)
    result = await handle.result()
    assert result.status == "completed" and result.rounds == 12, result
    first = ctx.client.get_workflow_handle(ctx.task_id, run_id=handle.result_run_id)
    return first


async def subtask_refused(ctx: Ctx) -> WorkflowHandle[Any, Any]:
    """A parent that starts a sub-task, which a refusal stops, and waits for it."""
    child = ctx.scripted(scenario(
        "anthropic", entry(anthropic_message(stop_reason="refusal"))
    ))
    child_id = f"{ctx.task_id}.sub1"
    parent = ctx.scripted(scenario(
        "anthropic",
        entry(anthropic_message(tool_calls=[("ts", "task_start", {
            "prompt": "look into it", "model": "anthropic:scripted", "base_url": child.url,
        })])),
        entry(anthropic_message(tool_calls=[("tw", "task_wait", {"ids": [child_id]})])),
        entry(anthropic_message("the sub-task was refused")),
    ))
    handle = await ctx.start(parent, "delegate the inspection")
    result = await handle.result()
    assert result.status == "completed", result
    return handle


async def round_tools(ctx: Ctx) -> WorkflowHandle[Any, Any]:
    """Rounds whose calls the sampling activity ran (DESIGN §1): two calls in
    one round, then one, then the answer."""
    server = ctx.scripted(scenario(
        "anthropic",
        entry(anthropic_message("two at once", tool_calls=[
            ("a", "shell", {"command": "echo one > one.txt"}), ("b", "list_dir", {}),
        ])),
        entry(anthropic_message(tool_calls=[("c", "read_file", {"path": "one.txt"})])),
        entry(anthropic_message("one.txt says one; done")),
    ))
    handle = await ctx.start(server, "write one.txt, list, read it")
    result = await handle.result()
    assert result.status == "completed" and result.rounds == 3, result
    return handle


async def round_tools_interrupted(ctx: Ctx) -> WorkflowHandle[Any, Any]:
    """The same interrupt, in a round whose calls its sampling activity runs
    (aborted by push: one call finished, one aborted)."""
    return await _quick_and_slow_interrupted(ctx)


#: Every scenario, by the name of the file it writes.
SCENARIOS: dict[str, Callable[[Ctx], Awaitable[WorkflowHandle[Any, Any]]]] = {
    "completed": completed,
    "interrupted": interrupted,
    "refused": refused,
    "continued_as_new": continued_as_new,
    "subtask_refused": subtask_refused,
    "round_tools": round_tools,
    "round_tools_interrupted": round_tools_interrupted,
}


# ---------------------------------------------------------------------------


async def _run_one(client: Client, name: str) -> Path:
    with tempfile.TemporaryDirectory(prefix=f"stopline-history-{name}-") as tmp:
        home = Path(tmp) / "home"
        workspace = Path(tmp) / "workspace"
        home.mkdir()
        workspace.mkdir()
        os.environ["STOPLINE_HOME"] = str(home)  # activities read it per call
        task_queue = f"histories-{name}"
        workers = build_workers(client, load_settings(), task_queue=task_queue)
        runs = [asyncio.create_task(w.run()) for w in workers]
        ctx = Ctx(client=client, task_queue=task_queue, task_id=name, workspace=workspace)
        try:
            handle = await SCENARIOS[name](ctx)
            history = await handle.fetch_history()
        finally:
            await asyncio.gather(*(w.shutdown() for w in workers), return_exceptions=True)
            for r in runs:
                if not r.done():
                    r.cancel()
            for s in ctx.servers:
                s.stop()
    outcome = await replay(history, pydantic_data_converter)
    if not outcome.ok:
        raise RuntimeError(f"{name}: the fresh history does not replay: {outcome.describe()}")
    path = OUT / f"{name}.json"
    path.write_text(history.to_json() + "\n")
    return path


async def main(names: list[str]) -> None:
    """Run the named scenarios (all when empty) on a private dev server."""
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise SystemExit(f"unknown scenario(s) {unknown}; known: {sorted(SCENARIOS)}")
    for var in ("ANTHROPIC_API_KEY", "OPENAI_API_KEY", "STOPLINE_CODEC_KEY"):
        os.environ.pop(var, None)  # histories must never hold a secret or ciphertext
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=temporal_binary(),
        data_converter=pydantic_data_converter,
        ui=False,
        dev_server_log_level="error",
        search_attributes=SEARCH_ATTRIBUTES,
    )
    try:
        for name in names or list(SCENARIOS):
            path = await _run_one(env.client, name)
            print(f"wrote {path.relative_to(REPO)}")
    finally:
        await env.shutdown()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
