"""The ``stopline`` command line.

Commands: ``up`` / ``down`` (embedded dev server + worker in the
background), ``run`` (start a task and follow it; ``--detach`` is
``task_start``), ``status`` (``task_status``), ``message``
(``task_message``), ``wait`` (``task_wait``), ``stop`` (``task_stop``),
``interrupt``, ``chat``, ``transcript``, ``list``, ``demo``,
``scripted-server``, ``worker``, ``history export``, ``replay``,
``search-attributes register``, ``gc``.

``run`` without ``up`` starts what it needs (dev server, worker, a scripted
server for ``--model scripted:FILE``) and stops what it started when the task
ends; with ``--detach`` they keep running until ``stopline down`` (the
scripted server exits by itself once the task is closed). Everything is
stopped by its own PID, never by name.

Exit codes of ``run`` / ``demo``: 0 completed, 1 failed, 3 stopped, 2 usage
or set-up error, 130 detached by a second Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable
from contextlib import AsyncExitStack
from datetime import timedelta
from importlib import resources
from pathlib import Path
from typing import Any

from rich.console import Console

from stopline.core.contracts import (
    AGENT_TASK_WORKFLOW,
    EVENTS_TOPIC,
    AgentTaskInput,
    AgentTaskResult,
    InterruptResult,
    LedgerRow,
    TaskEvent,
    TaskLimits,
    TaskStatus,
)
from stopline.core.errors import StoplineError
from stopline.settings import Settings, load_settings

console = Console(highlight=False, soft_wrap=True)
err_console = Console(stderr=True, highlight=False, soft_wrap=True)

EXIT_CODES = {"completed": 0, "failed": 1, "stopped": 3}


class UsageError(StoplineError):
    """A command-line or set-up problem; printed, exit code 2."""


# ---------------------------------------------------------------------------
# Runtime: what a command needs running, and stopping what it started.
# ---------------------------------------------------------------------------


async def _runtime(settings: Settings, stack: AsyncExitStack, *, keep: bool) -> str:
    """Ensure a Temporal server and a worker; register cleanup of what we start.

    With ``TEMPORAL_ADDRESS`` set, nothing is started (a worker must be
    running there: ``python worker.py``).

    Returns:
        The Temporal address.
    """
    from stopline.worker import runtime

    configured = runtime.configured_address(settings)
    if configured:
        return configured
    server = runtime.dev_server(settings)
    worker = runtime.background_worker(settings)
    server_running = server.pid() is not None
    address = runtime.start_dev_server(settings)
    if not server_running and not keep:
        stack.callback(server.stop)
    if worker.pid() is None:
        runtime.start_background_worker(settings, address)
        if not keep:
            stack.callback(worker.stop)
    return address


def _start_scripted(
    settings: Settings, scenario_path: Path, task_id: str, address: str, stack: AsyncExitStack
) -> tuple[str, str]:
    """Start a scripted server for one task; it exits when the task closes.

    Returns:
        ``(model_ref, base_url)`` for the task input.
    """
    from stopline.activities.providers.registry import WIRE_TO_PROVIDER
    from stopline.secrets import service_env
    from stopline.testing.scripted import load_scenario
    from stopline.worker.runtime import Managed

    scenario = load_scenario(scenario_path)
    run_dir = settings.home / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    ready = run_dir / f"scripted-{task_id}.port"
    ready.unlink(missing_ok=True)
    managed = Managed("scripted", run_dir / f"scripted-{task_id}.pid", run_dir / f"scripted-{task_id}.log")
    with managed.log_file.open("ab") as log:
        proc = subprocess.Popen(
            [
                sys.executable, "-m", "stopline.cli", "scripted-server",
                "--scenario", str(scenario_path), "--port", "0",
                "--ready-file", str(ready), "--exit-when-task-done", task_id,
                "--temporal-address", address,
            ],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, env=service_env(),  # it needs no key
        )
    managed.pid_file.write_text(str(proc.pid))
    stack.callback(managed.stop, 5.0)
    import time

    deadline = time.monotonic() + 20
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise UsageError(f"scripted server did not start; see {managed.log_file}")
        time.sleep(0.05)
    port = int(ready.read_text().strip())
    ready.unlink(missing_ok=True)
    return f"{WIRE_TO_PROVIDER[scenario['wire']]}:scripted", f"http://127.0.0.1:{port}"


def _check_model(model: str, settings: Settings) -> None:
    """Reject a malformed model ref before a task starts; warn on a missing key.

    The key is read by the worker from its own environment, so a missing key
    here is only a warning (the worker may have it).
    """
    if model.startswith("scripted:"):
        path = Path(model.split(":", 1)[1])
        if not path.is_file():
            raise UsageError(f"scenario file {path} does not exist")
        return
    from stopline.activities.providers.registry import parse_model_ref

    try:
        provider, _ = parse_model_ref(model)
    except ValueError as e:
        raise UsageError(str(e)) from None
    key = settings.anthropic_api_key if provider == "anthropic" else settings.openai_api_key
    if key is None and provider != "openai-compat" and not settings.temporal_address:
        name = "ANTHROPIC_API_KEY" if provider == "anthropic" else "OPENAI_API_KEY"
        err_console.print(
            f"[yellow]warning: {name} is not set; the worker will get 401s or network "
            f"errors (retried by Temporal, then the task fails)[/yellow]"
        )


async def _client(settings: Settings, address: str | None = None) -> Any:
    from stopline.worker.runtime import configured_address, connect

    if configured_address(settings):
        # a configured cluster: its address, TLS, mTLS and API key come from
        # the environment and the temporal CLI's config file (envconfig)
        return await connect(settings)
    return await connect(settings, address=address or _address(settings))


def _address(settings: Settings) -> str:
    from stopline.worker.runtime import dev_server

    if dev_server(settings).pid() is None:
        raise UsageError("no Temporal server: run `stopline up` or set TEMPORAL_ADDRESS")
    return f"127.0.0.1:{settings.dev_server_port}"


# ---------------------------------------------------------------------------
# Following a task.
# ---------------------------------------------------------------------------


def _print_event(ev: TaskEvent) -> None:
    if ev.kind == "turn_started":
        console.print(f"[dim]── round {ev.round}[/dim]")
    elif ev.kind == "assistant_text":
        console.print(f"[bold]assistant:[/bold] {ev.text}")
    elif ev.kind == "tool_call_started":
        console.print(f"  [cyan]▶ {ev.tool_name}[/cyan] [dim]{ev.call_id}[/dim]")
    elif ev.kind == "tool_call_finished":
        first = ev.text.splitlines()[0] if ev.text else ""
        if first.startswith("aborted"):
            mark = "[yellow]⊘[/yellow]"
        else:
            mark = "[green]✓[/green]" if ev.ok else "[red]✗[/red]"
        console.print(f"  {mark} {ev.tool_name}: [dim]{first[:120]}[/dim]")
    elif ev.kind == "turn_aborted":
        console.print("[yellow]turn aborted by user[/yellow]")
    elif ev.kind == "task_finished":
        console.print(f"[bold]task finished:[/bold] {ev.text}")


async def _follow(client: Any, task_id: str, on_event: Callable[[TaskEvent], None]) -> None:
    """Print a task's events until ``task_finished``."""
    from temporalio.contrib.workflow_streams import WorkflowStreamClient

    stream = WorkflowStreamClient.create(client, task_id)
    topic = stream.topic(EVENTS_TOPIC, type=TaskEvent)
    async for item in topic.subscribe(poll_cooldown=timedelta(milliseconds=50)):
        on_event(item.data)
        if item.data.kind == "task_finished":
            return


def _print_result(result: AgentTaskResult, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result.model_dump(include={
            "task_id", "status", "refused", "reason", "rounds", "provider_calls"
        })))
    else:
        color = {"completed": "green", "failed": "red", "stopped": "yellow"}[result.status]
        console.print(
            f"[{color}]{result.status}[/{color}] {result.task_id}: {result.reason} "
            f"(rounds {result.rounds}, provider calls {result.provider_calls})"
        )


async def _run_task(
    settings: Settings,
    *,
    prompt: str,
    model: str,
    workspace: Path,
    limits: TaskLimits,
    detach: bool,
    as_json: bool,
    quiet_events: bool = False,
    task_id: str | None = None,
    host: str | None = None,
) -> int:
    task_id = task_id or f"task-{uuid.uuid4().hex[:12]}"
    # The workspace lives on the host that runs the tools; that host checks
    # it when it claims the task. Only with the embedded server (this
    # machine is the host) is a missing directory known here, early.
    if not settings.temporal_address and not workspace.is_dir():
        raise UsageError(f"workspace {workspace} is not a directory")
    _check_model(model, settings)
    async with AsyncExitStack() as stack:
        address = await _runtime(settings, stack, keep=detach)
        base_url = None
        if model.startswith("scripted:"):
            model, base_url = _start_scripted(
                settings, Path(model.split(":", 1)[1]).resolve(), task_id, address, stack
            )
            if detach:
                stack.pop_all()  # the scripted server exits by itself when the task closes
        client = await _client(settings, address)
        handle = await client.start_workflow(
            AGENT_TASK_WORKFLOW,
            AgentTaskInput(
                prompt=prompt, model=model, workspace=str(workspace.resolve()),
                limits=limits, base_url=base_url, host=host,
            ),
            id=task_id,
            task_queue=settings.task_queue,
            result_type=AgentTaskResult,
        )
        if detach:
            if as_json:
                print(json.dumps({"task_id": task_id, "status": "running"}))
            else:
                console.print(f"started {task_id} (detached); follow with `stopline status {task_id}`")
            return 0
        if not as_json:
            console.print(f"task [bold]{task_id}[/bold] on {address}")
        outcome = await _follow_with_interrupts(client, handle, task_id, quiet_events or as_json)
        if outcome == "detached":
            console.print(f"detached; {task_id} keeps waiting. `stopline message {task_id} TEXT` continues it.")
            stack.pop_all()
            return 130
        from stopline.worker.runtime import task_result

        result = await task_result(handle)
        _print_result(result, as_json)
        return EXIT_CODES[result.status]


async def _follow_with_interrupts(client: Any, handle: Any, task_id: str, quiet: bool) -> str:
    """Follow events; first Ctrl-C interrupts the turn, the second detaches."""
    loop = asyncio.get_running_loop()
    presses = 0
    detach = asyncio.Event()

    def on_sigint() -> None:
        nonlocal presses
        presses += 1
        if presses == 1:
            err_console.print("[yellow]interrupting the turn (Ctrl-C again to detach)…[/yellow]")
            loop.create_task(_send_interrupt(handle))
        else:
            detach.set()

    loop.add_signal_handler(signal.SIGINT, on_sigint)
    try:
        follow = asyncio.create_task(_follow(client, task_id, (lambda e: None) if quiet else _print_event))
        stop = asyncio.create_task(detach.wait())
        done, _ = await asyncio.wait([follow, stop], return_when=asyncio.FIRST_COMPLETED)
        for t in (follow, stop):
            if t not in done:
                t.cancel()
        if stop in done:
            return "detached"
        follow.result()
        return "finished"
    finally:
        loop.remove_signal_handler(signal.SIGINT)


async def _send_interrupt(handle: Any) -> None:
    res: InterruptResult = await handle.execute_update("interrupt", result_type=InterruptResult)
    err_console.print(
        f"[yellow]interrupted[/yellow]: aborted {len(res.aborted_calls)} call(s), kept "
        f"{len(res.kept_calls)}; the task waits for `stopline message {handle.id} TEXT`"
    )


# ---------------------------------------------------------------------------
# Commands.
# ---------------------------------------------------------------------------


def cmd_up(args: argparse.Namespace, settings: Settings) -> int:
    """`stopline up`: start the embedded dev server and a background worker."""
    from stopline.worker import runtime

    if settings.temporal_address:
        raise UsageError("TEMPORAL_ADDRESS is set: run `python worker.py` against it instead")
    address = runtime.start_dev_server(settings)
    pid = runtime.start_background_worker(settings, address)
    console.print(f"Temporal dev server on {address} (UI http://127.0.0.1:{settings.dev_server_ui_port})")
    console.print(f"worker pid {pid}; logs in {settings.home / 'run'}")
    return 0


def cmd_down(args: argparse.Namespace, settings: Settings) -> int:
    """`stopline down`: stop what `up` (or a detached run or chat) started, by PID."""
    from stopline.worker import runtime

    stopped_worker = runtime.background_worker(settings).stop()
    stopped_server = runtime.dev_server(settings).stop()
    run_dir = settings.home / "run"
    for pid_file in sorted(run_dir.glob("scripted-*.pid")) if run_dir.is_dir() else []:
        runtime.Managed("scripted", pid_file, pid_file.with_suffix(".log")).stop(5.0)
    console.print(
        f"worker {'stopped' if stopped_worker else 'not running'}; "
        f"dev server {'stopped' if stopped_server else 'not running'}"
    )
    return 0


def _tool_env(pairs: list[str] | None) -> dict[str, str]:
    """``--tool-env NAME=VALUE`` flags as a dict."""
    env: dict[str, str] = {}
    for pair in pairs or []:
        name, sep, value = pair.partition("=")
        if not sep or not name or not name.replace("_", "").isalnum():
            raise UsageError(f"--tool-env takes NAME=VALUE, got {pair!r}")
        env[name] = value
    return env


def _limits(args: argparse.Namespace) -> TaskLimits:
    """Task limits from flags, falling back to the settings (environment).

    Raises:
        UsageError: A limit out of range (e.g. ``--temperature 3``).
    """
    from pydantic import ValidationError

    settings = load_settings()
    kw: dict[str, Any] = {
        "interrupt_grace_s": settings.interrupt_grace_s,
        "heartbeat_timeout_s": settings.heartbeat_timeout_s,
        "sampling_timeout_s": settings.sampling_timeout_s,
        "sampling_total_timeout_s": settings.sampling_total_timeout_s,
        "tool_output_cap_bytes": settings.tool_output_cap_bytes,
        "host_lost_after_s": settings.host_lost_after_s,
        "tool_network": settings.tool_network or bool(getattr(args, "network", False)),
        "allow_unconfined": settings.allow_unconfined or bool(getattr(args, "allow_unconfined", False)),
        "tool_env": _tool_env(getattr(args, "tool_env", None)),
        "max_tokens": settings.max_tokens,
        "temperature": settings.temperature,
        "top_p": settings.top_p,
    }
    flags = {
        "max_rounds": "max_rounds", "tool_timeout": "tool_timeout_s", "grace": "interrupt_grace_s",
        "max_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p",
    }
    for flag, field in flags.items():
        value = getattr(args, flag, None)
        if value is not None:
            kw[field] = value
    try:
        return TaskLimits(**kw)
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}" for err in e.errors()
        )
        raise UsageError(f"bad task limits: {problems}") from None


def _add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    """``--max-tokens``, ``--temperature``, ``--top-p`` (defaults: the settings)."""
    parser.add_argument("--max-tokens", type=int,
                        help="output token limit per model call (default $STOPLINE_MAX_TOKENS or 4096)")
    parser.add_argument("--temperature", type=float,
                        help="sampling temperature 0-2 (default $STOPLINE_TEMPERATURE, else the provider's)")
    parser.add_argument("--top-p", type=float,
                        help="nucleus sampling, (0, 1] (default $STOPLINE_TOP_P, else the provider's)")


def cmd_run(args: argparse.Namespace, settings: Settings) -> int:
    """`stopline run`: start a task, follow its events, print the result."""
    return asyncio.run(_run_task(
        settings, prompt=args.prompt, model=args.model, workspace=Path(args.workspace),
        limits=_limits(args), detach=args.detach, as_json=args.json, host=args.host,
    ))


def cmd_demo(args: argparse.Namespace, settings: Settings) -> int:
    """`stopline demo`: run the bundled demo task on a copy of the sample workspace."""
    data = resources.files("stopline.data") / "demo"
    work = Path(tempfile.mkdtemp(prefix="stopline-demo-"))
    with resources.as_file(data / "workspace") as src:
        shutil.copytree(src, work / "workspace")
    with resources.as_file(data / "scenario.json") as scen:
        scenario = work / "scenario.json"
        shutil.copy(scen, scenario)
    task_id = f"demo-{uuid.uuid4().hex[:8]}"
    if not args.json:
        console.print(f"demo workspace: {work / 'workspace'}")
    code = asyncio.run(_run_task(
        settings,
        prompt="The tests in this workspace fail. Find the bug, fix it, and make the tests pass.",
        model=f"scripted:{scenario}", workspace=work / "workspace",
        # the bundled scenario in a throw-away copy: it may run unconfined
        # where the sandbox cannot (the ledger says so)
        limits=TaskLimits(
            max_rounds=10, interrupt_grace_s=settings.interrupt_grace_s, allow_unconfined=True
        ),
        detach=False, as_json=args.json, task_id=task_id,
    ))
    if not args.json:
        console.print(f"workspace:  {work / 'workspace'}")
        console.print(f"transcript: {settings.ledger_dir / task_id / 'ledger.jsonl'}")
    return code


async def _handle(settings: Settings, task_id: str) -> tuple[Any, Any]:
    client = await _client(settings)
    return client, client.get_workflow_handle(task_id, result_type=AgentTaskResult)


def cmd_status(args: argparse.Namespace, settings: Settings) -> int:
    """`stopline status`: the task's state, refusal and result (the ``status`` Query)."""
    async def go() -> int:
        _, handle = await _handle(settings, args.id)
        desc = await handle.describe()
        try:
            st: TaskStatus | None = await handle.query("status", result_type=TaskStatus)
        except Exception as err:  # no worker to answer, or it cannot decode
            st = None
            err_console.print(f"[yellow]no worker answered the status query ({err}); "
                              f"is one running? (`stopline up`)[/yellow]")
        out = {
            "task_id": args.id,
            "workflow_status": desc.status.name if desc.status else None,
            "state": _shown_status(st.state, desc.status) if st else _shown_status(None, desc.status),
            "round": st.round if st else None,
            "rows": st.rows if st else None,
            "result": st.result.model_dump(mode="json") if st and st.result else None,
            "refusal": st.refusal.model_dump() if st and st.refusal else None,
            "stop_reason": st.stop_reason if st else None,
            "note": st.note if st else None,
            "host": (
                {"host_id": st.host.host_id, "hostname": st.host.hostname} if st and st.host else None
            ),
        }
        if args.json:
            print(json.dumps(out))
        else:
            for k, v in out.items():
                console.print(f"{k:16} {json.dumps(v) if isinstance(v, dict) else v}", markup=False)
        return 0

    return asyncio.run(go())


def _print_rows(rows: list[LedgerRow], as_json: bool) -> None:
    for row in rows:
        if as_json:
            print(row.model_dump_json())
            continue
        vis = "" if row.model_visible else " [dim](hidden from model)[/dim]"
        head = f"[bold]#{row.seq} r{row.round} {row.kind}[/bold]{vis}"
        if row.kind == "tool_result":
            head += f" {row.tool_name} {row.call_id} ok={row.ok}"
        console.print(head)
        if row.text:
            console.print(row.text, markup=False)
        for call in row.tool_calls:
            console.print(f"  → {call.name}({call.raw_arguments[:300]})", markup=False)


def cmd_transcript(args: argparse.Namespace, settings: Settings) -> int:
    """`stopline transcript`: a task's ledger, rebuilt from its Temporal history.

    Served through Temporal, not read from a host's disk (DESIGN §7): it
    works from any machine that reaches the server, whichever host ran the
    task and whatever that host's disk still holds. ``--all-runs`` also
    shows the branches resets abandoned, one run at a time, for audit.
    """
    from temporalio.service import RPCError

    from stopline.activities.history import rows_from_history
    from stopline.core.search_attributes import literal

    async def go() -> int:
        client = await _client(settings)
        if not args.all_runs:
            try:
                rows = await rows_from_history(client, args.id, None)
            except RPCError as err:
                raise UsageError(f"no task {args.id}: {err.message}") from None
            _print_rows(rows, args.json)
            return 0
        runs = [wf async for wf in client.list_workflows(f"WorkflowId = {literal(args.id)}")]
        if not runs:
            raise UsageError(f"no task {args.id}")
        latest = runs[0].run_id
        for wf in sorted(runs, key=lambda w: w.start_time):
            rows = await rows_from_history(client, args.id, wf.run_id)
            label = "current" if wf.run_id == latest else (wf.status.name.lower() if wf.status else "?")
            if args.json:
                print(json.dumps({"run_id": wf.run_id, "run": label, "rows": len(rows)}))
            else:
                console.print(f"[bold]── run {wf.run_id} ({label}, started {wf.start_time:%Y-%m-%d %H:%M:%S})[/bold]")
            _print_rows(rows, args.json)
        return 0

    return asyncio.run(go())


def cmd_move(args: argparse.Namespace, settings: Settings) -> int:
    """`stopline move ID [--to HOST]`: move a task to another host (the ``move`` Update).

    For an operator with a stuck task: one waiting for a host that will not
    come (re-target it), or one on a host that must be drained. The target
    must hold the same workspace; a task that cannot move stays put.
    """
    from temporalio.client import WorkflowUpdateFailedError

    async def go() -> int:
        _, handle = await _handle(settings, args.id)
        try:
            said = await handle.execute_update("move", args.to, result_type=str)
        except WorkflowUpdateFailedError as err:
            raise UsageError(str(getattr(err.cause, "message", None) or err.cause or err)) from None
        console.print(said)
        return 0

    return asyncio.run(go())


def cmd_hosts(args: argparse.Namespace, settings: Settings) -> int:
    """`stopline hosts`: the live hosts of the pool and how many tasks each holds.

    Hosts are read from Temporal's own view of who polls the workflow task
    queue (each worker's identity names its host id); the task counts from
    the ``StoplineHost`` search attribute of running workflows.
    """
    from stopline.activities.host import describe_hosts
    from stopline.core.search_attributes import literal

    async def go() -> int:
        client = await _client(settings)
        hosts = await describe_hosts(client, settings.task_queue, max_age_s=args.max_age)
        rows = []
        for h in hosts:
            count = await client.count_workflows(
                f"StoplineHost = {literal(h.host_id)} AND ExecutionStatus = 'Running'"
            )
            rows.append({
                "host_id": h.host_id, "hostname": h.hostname, "capacity": h.capacity,
                "tasks": count.count, "task_queue": h.task_queue,
                "last_seen": h.last_seen.isoformat() if h.last_seen else None,
            })
        if args.json:
            for r in rows:
                print(json.dumps(r))
            return 0
        if not rows:
            console.print(f"no live host polls task queue {settings.task_queue}")
            return 0
        console.print(f"{'HOST':16} {'HOSTNAME':24} {'TASKS':>9}  LAST SEEN")
        for r in rows:
            cap = r["capacity"] if r["capacity"] is not None else "?"
            console.print(f"{r['host_id']:16} {r['hostname']:24} {str(r['tasks']) + '/' + str(cap):>9}  {r['last_seen']}")
        return 0

    return asyncio.run(go())


def _shown_status(recorded: str | None, execution: Any) -> str:
    """What to call a task's state: what it recorded, unless its workflow
    ended without recording an ending (terminated, cancelled, timed out):
    then that, since a ``running`` search attribute would be a lie."""
    from temporalio.client import WorkflowExecutionStatus

    ended = execution is not None and execution != WorkflowExecutionStatus.RUNNING
    if recorded and not (ended and recorded in ("running", "waiting", "waiting_for_host")):
        return recorded
    return execution.name.lower() if execution is not None else "?"


def cmd_list(args: argparse.Namespace, settings: Settings) -> int:
    """Tasks and chat threads with their outcome (from search attributes)."""
    from stopline.core import search_attributes as sa
    from stopline.core.contracts import CHAT_THREAD_WORKFLOW

    async def go() -> int:
        client = await _client(settings)
        query = f"WorkflowType IN ('{AGENT_TASK_WORKFLOW}', '{CHAT_THREAD_WORKFLOW}')"
        async for wf in client.list_workflows(query):
            attrs = wf.typed_search_attributes
            row = {
                "id": wf.id,
                "kind": attrs.get(sa.KIND) or ("chat" if wf.workflow_type == CHAT_THREAD_WORKFLOW else "task"),
                "status": _shown_status(attrs.get(sa.STATUS), wf.status),
                "refused": bool(attrs.get(sa.REFUSED)),
                "model": attrs.get(sa.MODEL),
                "started": wf.start_time.isoformat(),
            }
            if args.json:
                print(json.dumps(row))
            else:
                tag = " refused" if row["refused"] else ""
                console.print(
                    f"{row['id']:32} {row['kind']:5} {row['status'] + tag:16} "
                    f"{wf.start_time:%Y-%m-%d %H:%M:%S}  {row['model'] or ''}"
                )
        return 0

    return asyncio.run(go())


def cmd_interrupt(args: argparse.Namespace, settings: Settings) -> int:
    """`stopline interrupt`: send the ``interrupt`` Update (aborts the current turn only)."""
    async def go() -> int:
        _, handle = await _handle(settings, args.id)
        res = await handle.execute_update("interrupt", result_type=InterruptResult)
        print(res.model_dump_json() if args.json else (
            f"interrupted: aborted {res.aborted_calls}, kept {res.kept_calls}"
            if res.interrupted else "no turn was running; nothing changed"
        ))
        return 0

    return asyncio.run(go())


def cmd_message(args: argparse.Namespace, settings: Settings) -> int:
    """`stopline message`: task_message — refused for a task a refusal stopped."""
    from stopline.activities.ledger import LedgerStore
    from stopline.activities.tasks import TaskNotContinuable, send_task_message

    async def go() -> int:
        client = await _client(settings)
        try:
            ack = await send_task_message(client, LedgerStore(settings.ledger_dir), args.id, args.text)
        except TaskNotContinuable as err:
            raise UsageError(str(err)) from None
        console.print(f"message accepted (task {ack.state})")
        return 0

    return asyncio.run(go())


def cmd_wait(args: argparse.Namespace, settings: Settings) -> int:
    """``task_wait`` from the CLI: wait until every task settles (or timeout)."""
    from stopline.worker.runtime import task_result

    async def go() -> int:
        client = await _client(settings)
        worst = 0
        results = {}
        for task_id in args.ids:
            handle = client.get_workflow_handle(task_id, result_type=AgentTaskResult)
            try:
                result = await asyncio.wait_for(task_result(handle), args.timeout)
            except asyncio.TimeoutError:
                results[task_id] = {"status": "running"}
                worst = max(worst, 4)
                continue
            results[task_id] = result.model_dump(mode="json", exclude={"final_text"})
            worst = max(worst, EXIT_CODES[result.status])
        if args.json:
            print(json.dumps(results))
        else:
            for task_id, r in results.items():
                tag = " (refused)" if r.get("refused") else ""
                console.print(f"{task_id}: {r['status']}{tag} {r.get('reason', '')}")
        return worst

    return asyncio.run(go())


def cmd_stop(args: argparse.Namespace, settings: Settings) -> int:
    """``task_stop`` from the CLI: cancel a task, print where it stopped."""
    from temporalio.service import RPCError

    from stopline.worker.runtime import task_result

    async def go() -> int:
        client = await _client(settings)
        handle = client.get_workflow_handle(args.id, result_type=AgentTaskResult)
        try:
            await handle.cancel()
        except RPCError:
            pass  # already closed: its result says where it stopped
        result = await asyncio.wait_for(task_result(handle), 60)
        body: dict[str, Any] = {
            "task_id": args.id, "status": result.status, "refused": result.refused,
            "reason": result.reason, "evidence": result.evidence,
        }
        if result.refused:
            from stopline.core.refusal import NOT_CONTINUABLE

            body["note"] = NOT_CONTINUABLE
        print(json.dumps(body, indent=None if args.json else 1))
        return 0

    return asyncio.run(go())


def cmd_chat(args: argparse.Namespace, settings: Settings) -> int:
    """A chat thread: start one (or use ``--thread``), send messages, print
    each turn. Without TEXT, reads one message per line from stdin."""
    from stopline.core.contracts import CHAT_THREAD_WORKFLOW, ChatThreadInput
    from stopline.workflows.chat_thread import TurnOutcome

    async def go() -> int:
        async with AsyncExitStack() as stack:
            # a thread outlives this command: what we start keeps running
            address = await _runtime(settings, stack, keep=True)
            client = await _client(settings, address)
            thread_id = args.thread or f"chat-{uuid.uuid4().hex[:8]}"
            if not args.thread:
                _check_model(args.model, settings)
                model, base_url = args.model, None
                if model.startswith("scripted:"):
                    model, base_url = _start_scripted(
                        settings, Path(model.split(":", 1)[1]).resolve(), thread_id, address, stack
                    )
                    stack.pop_all()
                await client.start_workflow(
                    CHAT_THREAD_WORKFLOW,
                    ChatThreadInput(
                        model=model, base_url=base_url, workspace=str(Path(args.workspace).resolve()),
                        limits=_limits(args),
                    ),
                    id=thread_id, task_queue=settings.task_queue,
                )
                console.print(f"thread [bold]{thread_id}[/bold] (continue with --thread {thread_id})")
            handle = client.get_workflow_handle(thread_id)
            for source_text in args.increment or []:
                source, _, text = source_text.partition(":")
                await handle.execute_update("increment", args=[source, text])
            texts = [args.text] if args.text else (line.rstrip("\n") for line in sys.stdin)
            code = 0
            for text in texts:
                if not text.strip():
                    continue
                out: TurnOutcome = await handle.execute_update("ask", text, result_type=TurnOutcome)
                if out.final_text:
                    console.print(f"[bold]assistant:[/bold] {out.final_text}")
                tag = " (refused)" if out.refused else ""
                console.print(f"[dim]turn {out.turn}: {out.status}{tag} — {out.reason}[/dim]")
                code = EXIT_CODES.get(out.status, 0)
            if args.close:
                await handle.signal("close")
            return code

    return asyncio.run(go())


def cmd_scripted_server(args: argparse.Namespace, settings: Settings) -> int:
    """`stopline scripted-server`: serve a scenario until signalled or the task closes."""
    from stopline.testing.scripted import serve

    exit_when = None
    if args.exit_when_task_done:
        exit_when = _task_closed_probe(settings, args.exit_when_task_done, args.temporal_address)
    serve(args.scenario, host=args.host, port=args.port, ready_file=args.ready_file, exit_when=exit_when)
    return 0


def _task_closed_probe(settings: Settings, task_id: str, address: str | None) -> Callable[[], bool]:
    """A blocking check: has the task's workflow closed (or never appeared)?"""
    import time

    started = time.monotonic()
    loop = asyncio.new_event_loop()
    state: dict[str, Any] = {}

    async def closed() -> bool:
        from temporalio.client import WorkflowExecutionStatus
        from temporalio.service import RPCError

        if "client" not in state:
            state["client"] = await _client(settings, address)
        try:
            desc = await state["client"].get_workflow_handle(task_id).describe()
        except RPCError:
            return time.monotonic() - started > 60  # never started
        return desc.status != WorkflowExecutionStatus.RUNNING

    def probe() -> bool:
        try:
            return loop.run_until_complete(closed())
        except Exception:
            return time.monotonic() - started > 60
    return probe


def cmd_gc(args: argparse.Namespace, settings: Settings) -> int:
    """`stopline gc`: remove finished tasks' blobs, staged rows and shell logs (keeps running ones')."""
    from stopline.activities.retention import GcReport, collect, workflow_closed_probe

    async def go() -> int:
        client = await _client(settings)
        probe = workflow_closed_probe(client)
        # a home shared by several hosts holds one home per slot (STOPLINE_HOME_SLOTS)
        homes = [settings.home] + [
            settings.home / f"slot-{i}" for i in range(1, settings.home_slots + 1)
            if (settings.home / f"slot-{i}").is_dir()
        ]
        report = GcReport()
        for home in homes:
            part = await collect(
                settings.model_copy(update={"home": home}), probe,
                older_than_s=args.older_than_days * 86400,
            )
            for name in ("removed_tasks", "kept_running", "kept_unknown", "kept_shells"):
                getattr(report, name).extend(getattr(part, name))
            report.freed_bytes += part.freed_bytes
        if args.json:
            print(json.dumps(dataclasses.asdict(report)))
        else:
            console.print(
                f"removed the files of {len(report.removed_tasks)} finished task(s), "
                f"{report.freed_bytes} bytes; kept {len(report.kept_running)} running, "
                f"{len(report.kept_unknown)} unknown, {len(report.kept_shells)} running shell(s)"
            )
        return 0

    return asyncio.run(go())


def cmd_worker(args: argparse.Namespace, settings: Settings) -> int:
    """`stopline worker`: run a worker in the foreground."""
    from stopline.worker.main import main as worker_main

    worker_main([])
    return 0


def cmd_history_export(args: argparse.Namespace, settings: Settings) -> int:
    """``stopline history export ID [FILE]``: write a task's history as JSON."""
    from temporalio.service import RPCError

    from stopline.replay import export_history

    async def go() -> int:
        client = await _client(settings)
        path = Path(args.file or f"{args.id}.json")
        try:
            history = await export_history(client, args.id, path, run_id=args.run_id)
        except RPCError as err:
            raise UsageError(f"cannot fetch the history of {args.id}: {err}") from None
        console.print(f"wrote {len(history.events)} events of {args.id} (run {history.run_id}) to {path}")
        return 0

    return asyncio.run(go())


def cmd_replay(args: argparse.Namespace, settings: Settings) -> int:
    """``stopline replay ID|FILE``: replay a history against the current code.

    A path to an existing file (or one ending in ``.json``) is read; anything
    else is a task id whose history is fetched from the server. Exit 0 when
    it replays, 1 on nondeterminism or another replay failure.
    """
    from temporalio.runtime import Runtime, TelemetryConfig
    from temporalio.service import RPCError

    from stopline.replay import fetch_history, load_history, replay
    from stopline.worker.codec import data_converter

    async def go() -> int:
        target = Path(args.target)
        if target.is_file() or args.target.endswith(".json"):
            if not target.is_file():
                raise UsageError(f"no such history file: {target}")
            history = load_history(target, args.workflow_id)
        else:
            try:
                history = await fetch_history(await _client(settings), args.target, args.run_id)
            except RPCError as err:
                raise UsageError(f"cannot fetch the history of {args.target}: {err}") from None
        # A runtime without core logging: the core would also print the
        # failure as a WARN line; the outcome below says it once, clearly.
        quiet = Runtime(telemetry=TelemetryConfig(logging=None))
        outcome = await replay(history, data_converter(settings), runtime=quiet, debug_mode=args.debug)
        if args.json:
            print(json.dumps(outcome.__dict__))
        else:
            from rich.markup import escape

            color = "green" if outcome.ok else "red"
            console.print(f"[{color}]{escape(outcome.describe())}[/{color}]")
        return 0 if outcome.ok else 1

    return asyncio.run(go())


def cmd_search_attributes_register(args: argparse.Namespace, settings: Settings) -> int:
    """``stopline search-attributes register``: add stopline's search attributes.

    Idempotent. With ``--wait S`` it retries for up to ``S`` seconds while the
    server or namespace is not there yet (a compose stack starting up).
    """
    import time

    from stopline.core.search_attributes import SearchAttributeTypeConflict, register

    async def go() -> int:
        deadline = time.monotonic() + args.wait
        while True:
            try:
                client = await _client(settings)
                done = await register(client, args.namespace)
                break
            except SearchAttributeTypeConflict as err:
                raise UsageError(str(err)) from None
            except Exception as err:  # server or namespace not up yet
                if time.monotonic() >= deadline:
                    raise UsageError(f"could not register search attributes: {err}") from None
                err_console.print(f"waiting for Temporal: {err}", markup=False, style="dim")
                await asyncio.sleep(2.0)
        for name, state in done.items():
            console.print(f"{name:18} {state}")
        return 0

    return asyncio.run(go())


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (one sub-command per verb)."""
    p = argparse.ArgumentParser(
        prog="stopline",
        description="Durable LLM agent tasks on Temporal: every way a turn ends is recorded.",
        epilog="Exit codes of run/demo/wait: 0 completed, 1 failed, 3 stopped, 2 usage error, "
        "4 wait timed out with a task still running, 130 detached by a second Ctrl-C.",
    )
    p.add_argument("--home", help="state directory (default $STOPLINE_HOME or ~/.stopline)")
    sub = p.add_subparsers(dest="command", required=True)

    sub.add_parser("up", help="start the embedded Temporal dev server and a worker").set_defaults(fn=cmd_up)
    sub.add_parser("down", help="stop what `up` started").set_defaults(fn=cmd_down)

    r = sub.add_parser("run", help="start a task and follow it")
    r.add_argument("prompt")
    r.add_argument("--model", default="anthropic:claude-sonnet-4-5",
                   help="provider:model (anthropic, openai, openai-responses, openai-compat) or scripted:FILE")
    r.add_argument("--workspace", default=".", help="directory the tools work in (default: here)")
    r.add_argument("--max-rounds", type=int, help="sampling rounds before the task stops (default 50)")
    r.add_argument("--tool-timeout", type=float, help="per-tool timeout, seconds")
    r.add_argument("--grace", type=float, help="interrupt grace period, seconds (default 0.1)")
    r.add_argument("--host", help="run on this host id (see `stopline hosts`); default: any host with room")
    r.add_argument("--network", action="store_true",
                   help="let the task's commands use the network (the sandbox has none by default)")
    r.add_argument("--allow-unconfined", action="store_true",
                   help="where the sandbox cannot run, run commands unconfined instead of refusing them")
    r.add_argument("--tool-env", action="append", metavar="NAME=VALUE",
                   help="an environment variable for the task's tools (repeatable; enters history)")
    _add_sampling_flags(r)
    r.add_argument("--detach", action="store_true", help="start the task and return (task_start)")
    r.add_argument("--json", action="store_true", help="print the result object as the last line")
    r.set_defaults(fn=cmd_run)

    d = sub.add_parser("demo", help="run the bundled demo task on the embedded server")
    d.add_argument("--json", action="store_true")
    d.set_defaults(fn=cmd_demo)

    for name, fn, hlp in (
        ("status", cmd_status, "a task's state"),
        ("transcript", cmd_transcript, "a task's ledger, from its Temporal history"),
        ("interrupt", cmd_interrupt, "abort a task's current turn"),
    ):
        c = sub.add_parser(name, help=hlp)
        c.add_argument("id")
        c.add_argument("--json", action="store_true")
        if name == "transcript":
            c.add_argument("--all-runs", action="store_true",
                           help="every run of the task, the branches resets abandoned included")
        c.set_defaults(fn=fn)

    mv = sub.add_parser("move", help="move a task to another host (an operator's tool for a stuck task)")
    mv.add_argument("id")
    mv.add_argument("--to", metavar="HOST", help="the target host id (default: any other live host)")
    mv.set_defaults(fn=cmd_move)

    hs = sub.add_parser("hosts", help="the live hosts of the pool and the tasks each holds")
    hs.add_argument("--json", action="store_true")
    hs.add_argument("--max-age", type=float, default=90.0, metavar="S",
                    help="leave out hosts not seen for S seconds (default 90)")
    hs.set_defaults(fn=cmd_hosts)

    m = sub.add_parser("message", help="send a task a user message")
    m.add_argument("id")
    m.add_argument("text")
    m.set_defaults(fn=cmd_message)

    w = sub.add_parser("wait", help="wait until tasks settle (task_wait)")
    w.add_argument("ids", nargs="+")
    w.add_argument("--timeout", type=float, default=600.0, help="seconds")
    w.add_argument("--json", action="store_true")
    w.set_defaults(fn=cmd_wait)

    st = sub.add_parser("stop", help="stop a task and print where it stopped (task_stop)")
    st.add_argument("id")
    st.add_argument("--json", action="store_true")
    st.set_defaults(fn=cmd_stop)

    ch = sub.add_parser("chat", help="talk in a chat thread (started if --thread is not given)")
    ch.add_argument("text", nargs="?", help="the message; without it, one message per stdin line")
    ch.add_argument("--thread", help="an existing thread id")
    ch.add_argument("--model", default="anthropic:claude-sonnet-4-5", help="provider:model or scripted:FILE")
    ch.add_argument("--workspace", default=".")
    ch.add_argument("--increment", action="append", metavar="SOURCE:TEXT",
                    help="an external increment (inbox summary, event) sent with the next request")
    ch.add_argument("--close", action="store_true", help="close the thread after this message")
    _add_sampling_flags(ch)
    ch.set_defaults(fn=cmd_chat)

    ls = sub.add_parser("list", help="list tasks and chat threads with their outcome")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(fn=cmd_list)
    sub.add_parser("worker", help="run a worker in the foreground").set_defaults(fn=cmd_worker)

    g = sub.add_parser("gc", help="remove finished tasks' full outputs, staged rows and shell logs")
    g.add_argument("--older-than-days", type=float, default=0.0, metavar="D",
                   help="only tasks whose files last changed at least D days ago (default: any)")
    g.add_argument("--json", action="store_true")
    g.set_defaults(fn=cmd_gc)

    s = sub.add_parser("scripted-server", help="serve a scenario's recorded provider responses")
    s.add_argument("--scenario", required=True)
    s.add_argument("--port", type=int, default=0)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--ready-file")
    s.add_argument("--exit-when-task-done", metavar="TASK_ID")
    s.add_argument("--temporal-address")
    s.set_defaults(fn=cmd_scripted_server)

    h = sub.add_parser("history", help="task histories").add_subparsers(dest="history_command", required=True)
    he = h.add_parser("export", help="write a task's event history as JSON (for `stopline replay`)")
    he.add_argument("id")
    he.add_argument("file", nargs="?", help="output file (default ID.json)")
    he.add_argument("--run-id", help="a specific run (default: the latest)")
    he.set_defaults(fn=cmd_history_export)

    rp = sub.add_parser("replay", help="replay a history against the current code; exit 1 on nondeterminism")
    rp.add_argument("target", metavar="ID|FILE", help="a task id, or a history JSON file")
    rp.add_argument("--run-id", help="with an id: a specific run (default: the latest)")
    rp.add_argument("--workflow-id", help="with a file: the workflow id (default: the file name)")
    rp.add_argument("--debug", action="store_true",
                    help="no deadlock detection: for stepping through workflow code in a debugger")
    rp.add_argument("--json", action="store_true")
    rp.set_defaults(fn=cmd_replay)

    sa = sub.add_parser("search-attributes", help="stopline's custom search attributes").add_subparsers(
        dest="sa_command", required=True
    )
    sar = sa.add_parser("register", help="register them on the Temporal cluster (idempotent)")
    sar.add_argument("--namespace", help="default $TEMPORAL_NAMESPACE")
    sar.add_argument("--wait", type=float, default=0.0, metavar="S",
                     help="retry for up to S seconds while the server is not ready")
    sar.set_defaults(fn=cmd_search_attributes_register)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``stopline`` console script."""
    from stopline.secrets import make_undumpable

    # this process holds the keys it read from its environment: keep
    # /proc/<pid>/environ and its memory from other processes of the user
    make_undumpable()
    args = build_parser().parse_args(argv)
    settings = load_settings(home=Path(args.home) if args.home else None)
    from stopline.logging import configure_logging

    configure_logging(settings)
    from temporalio.client import WorkflowFailureError
    from temporalio.service import RPCError

    try:
        return int(args.fn(args, settings) or 0)
    except UsageError as e:
        err_console.print(f"[red]error:[/red] {e}", markup=True)
        return 2
    except RPCError as e:  # unknown task id, a closed workflow, no server
        err_console.print(f"[red]error:[/red] {e.message}")
        return 2
    except WorkflowFailureError as e:  # e.g. a thread cancelled before it could record it
        err_console.print(f"[red]error:[/red] the workflow ended without a result: {e.cause or e}")
        return 1
    except (ValueError, FileNotFoundError) as e:  # a bad scenario/history file, model ref
        err_console.print(f"[red]error:[/red] {e}")
        return 2
    except KeyboardInterrupt:
        return 130


def entry() -> None:
    """Console-script entry: run :func:`main`, then leave without finalization.

    The Temporal SDK's native threads can abort a finalizing interpreter
    ("Fatal Python error: PyGILState_Release"), which would turn a good exit
    code into SIGABRT. Everything is flushed first; nothing else is pending.
    """
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    entry()
