"""The ``stopline`` command line.

Commands: ``up`` / ``down`` (embedded dev server + worker in the
background), ``run`` (start a task and follow it; ``--detach`` is
``task_start``), ``follow`` (re-attach to a task's events), ``status``
(``task_status``), ``message`` (``task_message``), ``wait`` (``task_wait``),
``stop`` (``task_stop``), ``interrupt``, ``chat``, ``transcript``, ``list``,
``hosts``, ``move``, ``demo``, ``scripted-server``, ``worker``, ``history
export``, ``replay``, ``search-attributes register``, ``gc``.

Without a configured Temporal address (``TEMPORAL_ADDRESS``, or a profile
in the ``temporal`` CLI's config file), ``run`` / ``chat`` / ``demo`` share one
embedded dev server and this home's one worker: each holds a lease on them
while it runs and the last one out stops them, unless ``up``, a detached
run or a chat thread pinned them (``stopline.worker.runtime``). Everything
is stopped by its own PID, never by name.

What a person reads is true: an error is one line naming what is wrong
(no worker, no key to decode, server unreachable, no worker for this task's
queue) and the exit code says the same. Exit codes: 0 completed, 1 failed,
3 stopped, 2 usage or set-up error, 4 ``wait`` timed out, 130 detached by a
second Ctrl-C, 141 output pipe closed (``stopline list | head``).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import re
import shutil
import signal
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
from rich.live import Live
from rich.markup import escape
from rich.text import Text

from stopline.core.contracts import (
    AGENT_TASK_WORKFLOW,
    CHAT_THREAD_WORKFLOW,
    EVENTS_TOPIC,
    AgentTaskInput,
    AgentTaskResult,
    InterruptResult,
    LedgerRow,
    TaskEvent,
    TaskLimits,
    TaskStatus,
    pool_task_queue,
)
from stopline.core.errors import StoplineError
from stopline.settings import Settings, load_settings

class _Console(Console):
    """rich's console, but a closed stdout pipe is a ``BrokenPipeError`` for
    :func:`main` to answer (quietly, exit 141), not rich's own exit 1."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        _silence_stdout()
        raise BrokenPipeError


console = _Console(highlight=False, soft_wrap=True)
err_console = Console(stderr=True, highlight=False, soft_wrap=True)

EXIT_CODES = {"completed": 0, "failed": 1, "stopped": 3}
#: Exit code when stdout's reader went away (128 + SIGPIPE), as for `ls | head`.
EXIT_PIPE = 141
#: Pollers seen within this many seconds count as live workers. An idle
#: worker's long poll lasts up to ~70 s before it polls again.
POLLER_MAX_AGE_S = 90.0
#: How long a Query may take before the CLI says the worker did not answer.
QUERY_TIMEOUT = timedelta(seconds=10)
#: The cancel reasons the CLI sends (recorded in the task's result).
STOP_REASON = "`stopline stop`"
DOWN_REASON = "`stopline down` shut the embedded Temporal server down"


class UsageError(StoplineError):
    """A command-line or set-up problem; printed, exit code 2."""


# ---------------------------------------------------------------------------
# Connecting, and saying truly why something does not answer.
# ---------------------------------------------------------------------------

_quiet_runtime: Any = None


def _runtime_without_core_logs() -> Any:
    """One Temporal runtime for the CLI, without the core's log lines: a
    connection problem is reported once, as one line, not as Rust retry
    warnings."""
    global _quiet_runtime
    if _quiet_runtime is None:
        from temporalio.runtime import Runtime, TelemetryConfig

        _quiet_runtime = Runtime(telemetry=TelemetryConfig(logging=None))
    return _quiet_runtime


def _configured(settings: Settings) -> str | None:
    """The configured Temporal address (``TEMPORAL_ADDRESS`` or the temporal
    CLI's config profile); ``None``: the embedded server is used."""
    from stopline.worker.runtime import configured_address

    return configured_address(settings)


def _address(settings: Settings) -> str:
    configured = _configured(settings)
    if configured:
        return configured
    from stopline.worker.runtime import dev_server

    if dev_server(settings).pid() is None:
        raise UsageError(
            "no Temporal server: the embedded one is not running (`stopline up` starts it) "
            "and TEMPORAL_ADDRESS is unset"
        )
    return f"127.0.0.1:{settings.dev_server_port}"


async def _client(settings: Settings, address: str | None = None, *, embedded: bool = False) -> Any:
    """A connected client; an unreachable server or a bad key is a UsageError.

    Args:
        settings: Settings.
        address: The address to use (default: the configured one, else the
            embedded server's).
        embedded: ``address`` is the embedded dev server's, whatever is
            configured (``down`` and the end of a lease talk to it alone).
    """
    from stopline.core.errors import ConfigError
    from stopline.worker.codec import CodecKeyError
    from stopline.worker.runtime import connect

    target = address or _address(settings)
    # a configured cluster: its address, TLS, mTLS and API key come from the
    # environment and the temporal CLI's config file (envconfig); the
    # embedded server: a plain connection to it
    explicit = target if embedded or not _configured(settings) else None
    try:
        return await connect(settings, address=explicit, runtime=_runtime_without_core_logs())
    except (CodecKeyError, ConfigError) as err:
        raise UsageError(str(err)) from None
    except Exception as err:  # the connect error of the core: one line is enough
        raise UsageError(f"cannot reach the Temporal server at {target}: {_first_line(err)}") from None


def _first_line(err: BaseException) -> str:
    text = str(getattr(err, "message", None) or err) or type(err).__name__
    return text.strip().splitlines()[0]


def _raise_if_undecodable(err: BaseException) -> None:
    """Raise a UsageError naming the decode problem when ``err`` is one."""
    decode = _decode_problem(err)
    if decode is not None:
        raise UsageError(decode) from None


def _decode_problem(err: BaseException) -> str | None:
    """Why a payload could not be decoded, when that is what ``err`` is.

    Encrypted payloads without the key (or with another key) surface as a
    converter error somewhere in the exception's chain.
    """
    from stopline.worker.codec import ENCODING, CodecKeyError

    seen: set[int] = set()
    stack: list[BaseException | None] = [err]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, CodecKeyError):
            return (
                f"cannot decode the task's payloads ({_first_line(e)}): set STOPLINE_CODEC_KEY "
                f"(and STOPLINE_CODEC_PREVIOUS_KEYS) to the keys its workers use"
            )
        if ENCODING.decode() in str(e):
            return (
                "cannot decode the task's payloads: they are encrypted and this command has no "
                "key; set STOPLINE_CODEC_KEY to the key its workers use"
            )
        stack += [e.__cause__, e.__context__, getattr(e, "cause", None)]
    return None


async def _recent_pollers(client: Any, queue: str, *, activity: bool = False) -> int:
    """How many workers polled ``queue`` recently (workflow or activity pollers)."""
    from datetime import datetime, timezone

    from temporalio.api.enums.v1 import TaskQueueType
    from temporalio.api.taskqueue.v1 import TaskQueue
    from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest

    kind = TaskQueueType.TASK_QUEUE_TYPE_ACTIVITY if activity else TaskQueueType.TASK_QUEUE_TYPE_WORKFLOW
    resp = await client.workflow_service.describe_task_queue(
        DescribeTaskQueueRequest(namespace=client.namespace, task_queue=TaskQueue(name=queue),
                                 task_queue_type=kind)
    )
    now = datetime.now(timezone.utc)
    return sum(
        1 for p in resp.pollers
        if (now - p.last_access_time.ToDatetime(tzinfo=timezone.utc)).total_seconds() < POLLER_MAX_AGE_S
    )


async def _no_worker(client: Any, settings: Settings, task_queue: str) -> str | None:
    """Why nothing will answer for a task on ``task_queue``, or ``None``.

    Distinguishes no worker at all from workers that poll another queue
    than this task's.
    """
    if await _recent_pollers(client, task_queue):
        return None
    configured = _configured(settings)
    start = "`stopline up`" if not configured else f"`stopline-worker` with TEMPORAL_ADDRESS={configured}"
    if task_queue != settings.task_queue and await _recent_pollers(client, settings.task_queue):
        return (
            f"no worker polls this task's queue {task_queue} (workers poll {settings.task_queue}); "
            f"start one with STOPLINE_TASK_QUEUE={task_queue}"
        )
    return f"no worker is running: nothing polls task queue {task_queue} (start one: {start})"


async def bounded_update(handle: Any, update: str, *args: Any, **bounds: Any) -> Any:
    """:func:`stopline.activities.tasks.bounded_update`, imported when first
    used (the CLI's start-up imports stay light)."""
    from stopline.activities.tasks import bounded_update as bounded

    return await bounded(handle, update, *args, **bounds)


async def _describe(handle: Any) -> Any:
    """``describe()``; an unknown id is a UsageError."""
    from temporalio.service import RPCError, RPCStatusCode

    try:
        return await handle.describe()
    except RPCError as err:
        if err.status == RPCStatusCode.NOT_FOUND:
            raise UsageError(f"no task {handle.id}") from None
        raise


async def _query_status(client: Any, settings: Settings, handle: Any, desc: Any) -> TaskStatus:
    """The ``status`` Query, or a UsageError saying truly why there is none."""
    from temporalio.service import RPCError

    problem = await _no_worker(client, settings, desc.task_queue)
    if problem is not None:
        raise UsageError(f"{problem}; the status of {handle.id} is answered by a worker")
    try:
        return await handle.query("status", result_type=TaskStatus, rpc_timeout=QUERY_TIMEOUT)
    except Exception as err:
        _raise_if_undecodable(err)
        if isinstance(err, RPCError):
            raise UsageError(f"the worker did not answer the status query of {handle.id}: "
                             f"{_first_line(err)}") from None
        raise


# ---------------------------------------------------------------------------
# The embedded server: leased while a command needs it.
# ---------------------------------------------------------------------------


async def _runtime(settings: Settings, stack: AsyncExitStack, *, pin: str | None = None) -> str:
    """Ensure a Temporal server and this home's worker for the command.

    With ``TEMPORAL_ADDRESS`` set, nothing is started (workers run there).
    Otherwise the embedded server and worker are leased (started when
    missing) and released when the command ends; ``pin`` keeps them running
    after it (a detached task, a chat thread) until ``stopline down``.

    Returns:
        The Temporal address.
    """
    from stopline.worker import runtime

    configured = runtime.configured_address(settings)
    if configured:
        return configured
    try:
        emb = await runtime.acquire_embedded(settings)
    except runtime.EmbeddedServerError as err:
        raise UsageError(str(err)) from None
    stack.push_async_callback(_release, settings, emb.lease)
    if pin:
        runtime.pin_embedded(settings, pin)
    return emb.address


async def _release(settings: Settings, lease: Any) -> None:
    from stopline.worker import runtime

    async def running(address: str) -> int:
        return await _count_running(await _client(settings, address, embedded=True))

    said = await runtime.release_embedded(settings, lease, still_running=running)
    if said == "pinned":
        err_console.print(
            "[yellow]tasks still run on the embedded server: it and the worker keep running "
            "(`stopline list` shows them; `stopline down` stops them)[/yellow]"
        )


async def _running_threads(client: Any) -> list[str]:
    """Ids of tasks and chat threads whose workflow is running (checked one
    by one: visibility may lag behind a workflow that just closed)."""
    from temporalio.client import WorkflowExecutionStatus

    query = (f"WorkflowType IN ('{AGENT_TASK_WORKFLOW}', '{CHAT_THREAD_WORKFLOW}') "
             f"AND ExecutionStatus = 'Running'")
    ids = []
    async for wf in client.list_workflows(query):
        desc = await client.get_workflow_handle(wf.id).describe()
        if desc.status == WorkflowExecutionStatus.RUNNING:
            ids.append(wf.id)
    return ids


async def _count_running(client: Any) -> int:
    return len(await _running_threads(client))


def _check_model(model: str, settings: Settings) -> str:
    """Reject a malformed model ref before a task starts; warn on a missing key.

    A ``scripted:FILE`` ref is returned with FILE made absolute: the host
    serves the scenario (``stopline.activities.scripted_models``). The key
    is read by the worker from its own environment, so a missing key here
    is only a warning (the worker may have it).

    Returns:
        The model ref the task is started with.
    """
    if model.startswith("scripted:"):
        from stopline.testing.scripted import load_scenario

        path = Path(model.split(":", 1)[1]).expanduser().resolve()
        if path.is_file():
            try:
                load_scenario(path)
            except ValueError as err:
                raise UsageError(str(err)) from None
        elif not _configured(settings):
            raise UsageError(f"scenario file {path} does not exist")
        else:
            err_console.print(f"[yellow]warning: {path} is not here; the host that runs the task "
                              f"must have it[/yellow]")
        return f"scripted:{path}"
    from stopline.activities.providers.registry import parse_model_ref

    try:
        provider, _ = parse_model_ref(model)
    except ValueError as e:
        raise UsageError(f"{e}; or scripted:FILE for a scripted scenario") from None
    key = settings.anthropic_api_key if provider == "anthropic" else settings.openai_api_key
    if key is None and provider != "openai-compat" and not _configured(settings):
        name = "ANTHROPIC_API_KEY" if provider == "anthropic" else "OPENAI_API_KEY"
        err_console.print(
            f"[yellow]warning: {name} is not set; the worker will get 401s or network "
            f"errors (retried by Temporal, then the task fails)[/yellow]"
        )
    return model


def _base_url(flag: str | None, model: str, settings: Settings) -> str | None:
    """The base URL a task is started with: ``--base-url``, else the
    provider's ``*_BASE_URL`` set in this command's environment, else
    ``None`` (the worker's own setting).

    The model call runs on a worker, which may have been started long
    before this command (``stopline up``, another host): a base URL set
    on the command line must travel with the task to reach it. Not a
    secret, so it may enter history (keys never do).
    """
    if flag:
        return flag
    provider = model.partition(":")[0]
    field = {"anthropic": "anthropic_base_url"}.get(provider, "openai_base_url")
    if provider == "scripted" or field not in settings.model_fields_set:
        return None
    return getattr(settings, field)


# ---------------------------------------------------------------------------
# Following a task: its workflow stream, rendered.
# ---------------------------------------------------------------------------


_SHELL_FAILED = re.compile(r"^(exit code (?!0\b)\d+|killed by signal|timed out)")


def tool_mark(tool_name: str | None, ok: bool | None, first_line: str) -> str:
    """``✓`` / ``✗`` / ``⊘`` for a finished tool call, as a person reads it.

    ``ok`` stays the handler's verdict (the ledger keeps it: a command that
    ran and exited 2 is ``ok=True``, DESIGN §2), but a person watching wants
    a failing command shown as failed: a ``shell`` call that exited
    non-zero, was killed or timed out is ``✗``.
    """
    if first_line.startswith("aborted"):
        return "⊘"
    if not ok:
        return "✗"
    if tool_name == "shell" and _SHELL_FAILED.match(first_line):
        return "✗"
    return "✓"


class EventRenderer:
    """Prints a task's events; streams assistant text while it is generated.

    On a terminal, the text and tool arguments a model is producing
    (``assistant_delta`` / ``tool_args_delta``) are drawn in a ``rich``
    live region that the whole message replaces when it arrives. Elsewhere
    (a pipe, a file) the text is written as it comes, and finished with a
    newline. Deltas of a round whose message already arrived, or of an
    earlier sampling attempt, are dropped.

    Args:
        out: The console to print to.
        as_json: Print each event as one JSON line instead.
    """

    def __init__(self, out: Console, *, as_json: bool = False) -> None:
        self.out = out
        self.as_json = as_json
        self.live_mode = out.is_terminal and not as_json
        self.renders = 0
        self.last_assistant_text: str | None = None
        self._live: Live | None = None
        self._key: tuple[int, int] | None = None  # (round, attempt) of the partial text
        self._partial = ""
        self._args: dict[str, tuple[str, str]] = {}  # call id -> (tool, arguments so far)
        self._done_rounds: set[int] = set()
        self._raw_open = False

    def __call__(self, ev: TaskEvent) -> None:
        if self.as_json:
            print(ev.model_dump_json(exclude_none=True), flush=True)
            return
        if ev.kind in ("assistant_delta", "tool_args_delta"):
            self._delta(ev)
            return
        shown = self._end_partial(ev.text if ev.kind == "assistant_text" else None)
        self._print(ev, shown)

    # -- deltas
    def _delta(self, ev: TaskEvent) -> None:
        if ev.round in self._done_rounds:
            return  # its message already arrived whole
        key = (ev.round, ev.attempt)
        if key != self._key:
            if self._key is not None and self._key[0] == ev.round and ev.attempt < self._key[1]:
                return  # a late delta of an earlier attempt
            self._end_partial(None)  # a retried call streams again from its start
            self._key = key
        if ev.kind == "assistant_delta":
            self._partial += ev.text
            if not self.live_mode:
                if not self._raw_open:
                    self.out.file.write("assistant: ")
                    self._raw_open = True
                self.out.file.write(ev.text)
                self.out.file.flush()
        else:
            name, so_far = self._args.get(ev.call_id or "", (ev.tool_name or "tool", ""))
            self._args[ev.call_id or ""] = (ev.tool_name or name, so_far + ev.text)
        self.renders += 1
        if self.live_mode:
            if self._live is None:
                self._live = Live(console=self.out, refresh_per_second=12, transient=True)
                self._live.start()
            self._live.update(self._live_view())

    def _live_view(self) -> Text:
        view = Text()
        if self._partial:
            view.append("assistant: ", style="bold")
            view.append(self._partial)
        for name, args in self._args.values():
            view.append(f"\n  ▶ {name} ", style="cyan")
            view.append(args[-300:], style="dim")
        view.append(" ▌", style="dim")
        return view

    def _end_partial(self, final_text: str | None) -> bool:
        """Close the live region or the streamed line.

        Returns:
            ``True`` when ``final_text`` is now on screen whole (the streamed
            line was its beginning, and the rest was written).
        """
        shown = False
        if self._live is not None:
            self._live.stop()
            self._live = None
        if self._raw_open:
            if final_text is not None and final_text.startswith(self._partial):
                self.out.file.write(final_text[len(self._partial):])
                shown = True
            self.out.file.write("\n")
            self.out.file.flush()
            self._raw_open = False
        self._key, self._partial, self._args = None, "", {}
        return shown

    # -- whole events
    def _print(self, ev: TaskEvent, shown: bool) -> None:
        c = self.out
        if ev.kind == "turn_started":
            c.print(f"[dim]── round {ev.round}[/dim]")
        elif ev.kind == "assistant_text":
            self._done_rounds.add(ev.round)
            self.last_assistant_text = ev.text
            if not shown:
                c.print("[bold]assistant:[/bold] " + escape(ev.text))
        elif ev.kind == "tool_call_started":
            self._done_rounds.add(ev.round)
            c.print(f"  [cyan]▶ {escape(ev.tool_name or '?')}[/cyan] [dim]{escape(ev.call_id or '')}[/dim]")
        elif ev.kind == "tool_call_finished":
            first = ev.text.splitlines()[0] if ev.text else ""
            mark = tool_mark(ev.tool_name, ev.ok, first)
            color = {"✓": "green", "✗": "red", "⊘": "yellow"}[mark]
            c.print(f"  [{color}]{mark}[/{color}] {escape(ev.tool_name or '?')}: [dim]{escape(first[:120])}[/dim]")
        elif ev.kind == "turn_aborted":
            self._done_rounds.add(ev.round)
            c.print("[yellow]turn aborted by user[/yellow]")
        elif ev.kind == "task_finished":
            c.print(f"[bold]finished:[/bold] {escape(ev.text)}")
        elif ev.kind == "turn_finished":
            c.print(f"[dim]turn finished: {escape(ev.text)}[/dim]")
        elif ev.kind in ("host_claimed", "host_lost", "refusal", "notification", "fallback",
                         "task_result", "task_wait_done"):
            label = ev.kind.replace("_", " ")
            style = "yellow" if ev.kind in ("host_lost", "refusal", "notification") else "dim"
            c.print(f"[{style}]{label}: {escape(ev.text)}[/{style}]")

    def close(self) -> None:
        """Stop a live region left open (the watcher is going away)."""
        self._end_partial(None)


async def _follow(
    client: Any,
    task_id: str,
    on_event: Callable[[TaskEvent], None],
    *,
    from_offset: int = 0,
    until: Callable[[TaskEvent], bool] = lambda ev: ev.kind == "task_finished",
) -> None:
    """Feed a task's events to ``on_event`` from ``from_offset`` until ``until``.

    A poll that fails for a reason that passes — the workflow task it rode
    on failed and was retried, a server blip — is resumed from the last
    event seen (so every event is shown once); one that cannot be decoded
    is a UsageError. A finished task's stream is read through a Query and
    ends with its last event.
    """
    from temporalio.client import WorkflowUpdateFailedError, WorkflowUpdateRPCTimeoutOrCancelledError
    from temporalio.contrib.workflow_streams import WorkflowStreamClient
    from temporalio.service import RPCError

    stream = WorkflowStreamClient.create(client, task_id)
    offset = from_offset
    failures = 0
    while True:
        try:
            async for item in stream.subscribe(
                [EVENTS_TOPIC], from_offset=offset, result_type=TaskEvent,
                poll_cooldown=timedelta(milliseconds=50),
            ):
                offset, failures = item.offset + 1, 0
                on_event(item.data)
                if until(item.data):
                    return
            return  # a closed run's stream, drained
        except (RPCError, WorkflowUpdateFailedError, WorkflowUpdateRPCTimeoutOrCancelledError) as err:
            _raise_if_undecodable(err)
            failures += 1
            if failures > 20:
                raise
            await asyncio.sleep(min(0.1 * failures, 1.0))
        except Exception as err:
            _raise_if_undecodable(err)
            raise


async def _follow_with_interrupts(
    client: Any, handle: Any, on_event: Callable[[TaskEvent], None], *, from_offset: int = 0
) -> str:
    """Follow events; the first Ctrl-C interrupts the turn, the second detaches.

    Returns:
        ``"finished"`` or ``"detached"``.
    """
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
    host_wait = asyncio.create_task(_say_when_waiting_for_host(handle))
    try:
        follow = asyncio.create_task(_follow(client, handle.id, on_event, from_offset=from_offset))
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
        host_wait.cancel()
        loop.remove_signal_handler(signal.SIGINT)


#: Seconds between looks at a followed task's state, for a wait for a host.
HOST_WAIT_CHECK_S = 2.0


async def _say_when_waiting_for_host(handle: Any) -> None:
    """Say on stderr, once per wait, that a followed task waits for a host.

    A task waits (state ``waiting_for_host``, DESIGN §7) while no host has a
    free slot or none takes its queue, and publishes no event meanwhile:
    without this, ``run`` would sit silent. Read from the ``StoplineStatus``
    search attribute every :data:`HOST_WAIT_CHECK_S` seconds (a Describe,
    not a Query: no worker needs to answer). Runs until cancelled.
    """
    from stopline.core import search_attributes as sa

    said = False
    while True:
        await asyncio.sleep(HOST_WAIT_CHECK_S)
        try:
            desc = await handle.describe()
        except Exception:  # a blip: look again next time
            continue
        waiting = desc.typed_search_attributes.get(sa.STATUS) == "waiting_for_host"
        if waiting and not said:
            err_console.print(
                f"[yellow]{handle.id} waits for a host: none has a free slot or takes its queue; it "
                f"goes on when one does (`stopline hosts` shows each host's tasks)[/yellow]"
            )
        said = waiting


def _not_interrupted(res: InterruptResult) -> str:
    """Why an interrupt changed nothing, in words."""
    if res.joined:
        return f"an interrupt already in progress aborted the turn: {_calls_phrase(res)}"
    if res.ended:
        return "the task is stopping (or has ended); its stop aborts the turn — nothing to interrupt"
    return "no turn was running; nothing was interrupted"


async def _send_interrupt(handle: Any) -> None:
    try:
        res: InterruptResult = await bounded_update(handle, "interrupt", result_type=InterruptResult)
    except Exception as err:  # the task ended meanwhile, or no worker: say so, keep following
        err_console.print(f"[yellow]interrupt not delivered: {escape(_first_line(err))}[/yellow]")
        return
    if not res.interrupted:
        err_console.print(f"[yellow]{_not_interrupted(res)}[/yellow]")
        return
    err_console.print(f"[yellow]{escape(_interrupted(res, handle.id))}[/yellow]")


def _interrupted(res: InterruptResult, task_id: str) -> str:
    """What an interrupt that aborted the turn did, and what to do next."""
    return f"interrupted: {_calls_phrase(res)}; continue it with `stopline message {task_id} TEXT`"


def _calls_phrase(res: InterruptResult) -> str:
    def ids(xs: list[str]) -> str:
        return f" ({', '.join(xs)})" if xs else ""
    return (f"aborted {len(res.aborted_calls)} call(s){ids(res.aborted_calls)}, "
            f"kept {len(res.kept_calls)}{ids(res.kept_calls)}")


async def _result(handle: Any) -> AgentTaskResult:
    """The task's result; a cancelled/terminated workflow or an undecodable
    one is said plainly."""
    from temporalio.client import WorkflowFailureError

    from stopline.worker.runtime import task_result

    try:
        return await task_result(handle)  # a failed task's workflow fails, carrying its result
    except WorkflowFailureError as err:
        raise UsageError(f"{handle.id} ended without a result: {_first_line(err.cause or err)}") from None
    except Exception as err:
        _raise_if_undecodable(err)
        raise


def _print_result(result: AgentTaskResult, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result.model_dump(include={
            "task_id", "status", "refused", "reason", "rounds", "provider_calls", "undelivered_messages",
        })))
        return
    color = {"completed": "green", "failed": "red", "stopped": "yellow"}[result.status]
    tag = " (refused)" if result.refused else ""
    console.print(
        f"[{color}]{result.status}{tag}[/{color}] {result.task_id}: {escape(result.reason)} "
        f"(rounds {result.rounds}, provider calls {result.provider_calls})"
    )
    if result.undelivered_messages:
        console.print(f"[yellow]{len(result.undelivered_messages)} message(s) never delivered: "
                      f"{escape('; '.join(result.undelivered_messages))}[/yellow]")


async def _warn_if_no_host(client: Any, settings: Settings, task_id: str) -> None:
    """With TEMPORAL_ADDRESS, a task nobody takes waits ``waiting_for_host``:
    say so, and what to start, instead of watching in silence."""
    pool = pool_task_queue(settings.task_queue)
    try:
        if await _recent_pollers(client, pool, activity=True):
            return
    except Exception:  # cannot tell: say nothing rather than something untrue
        return
    err_console.print(
        f"[yellow]no host takes tasks on queue {pool}: start `stopline-worker` with "
        f"TEMPORAL_ADDRESS={_configured(settings)} on a machine that holds the workspace; "
        f"{task_id} waits (state waiting_for_host) until one does[/yellow]"
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
    task_id: str | None = None,
    reuse: str = "fail",
    host: str | None = None,
    base_url: str | None = None,
) -> int:
    from temporalio.common import WorkflowIDConflictPolicy, WorkflowIDReusePolicy
    from temporalio.exceptions import WorkflowAlreadyStartedError

    task_id = task_id or f"task-{uuid.uuid4().hex[:12]}"
    # The workspace lives on the host that runs the tools; that host checks
    # it when it claims the task. Only with the embedded server (this
    # machine is the host) is a missing directory known here, early.
    if not _configured(settings) and not workspace.is_dir():
        raise UsageError(f"workspace {workspace} is not a directory")
    model = _check_model(model, settings)
    async with AsyncExitStack() as stack:
        address = await _runtime(settings, stack, pin="a detached task" if detach else None)
        client = await _client(settings, address)
        attached = False
        try:
            handle = await client.start_workflow(
                AGENT_TASK_WORKFLOW,
                AgentTaskInput(
                    prompt=prompt, model=model, workspace=str(workspace.resolve()),
                    limits=limits, host=host, base_url=_base_url(base_url, model, settings),
                ),
                id=task_id,
                task_queue=settings.task_queue,
                result_type=AgentTaskResult,
                # a task id names one task: its ledger, its sub-tasks' ids
                id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
                id_conflict_policy=WorkflowIDConflictPolicy.FAIL,
            )
        except WorkflowAlreadyStartedError:
            if reuse != "attach":
                state = await _state_word(client, task_id)
                raise UsageError(
                    f"task id {task_id} is already in use (a {state} task); choose another --id, "
                    f"or `--reuse attach` to follow that task instead"
                ) from None
            handle = client.get_workflow_handle(task_id, result_type=AgentTaskResult)
            attached = True
        if _configured(settings) and not attached:
            await _warn_if_no_host(client, settings, task_id)
        if detach:
            if as_json:
                print(json.dumps({"task_id": task_id, "status": "running"}))
            else:
                console.print(f"started {task_id} (detached); `stopline follow {task_id}` shows it")
            return 0
        if not as_json:
            verb = "following existing task" if attached else "task"
            console.print(f"{verb} [bold]{task_id}[/bold] on {address}")
        renderer = EventRenderer(console)
        outcome = await _follow_with_interrupts(
            client, handle, (lambda e: None) if as_json else renderer,
        )
        renderer.close()
        if outcome == "detached":
            if not _configured(settings):
                from stopline.worker.runtime import pin_embedded

                pin_embedded(settings, f"detached from {task_id}")
            console.print(f"detached; {task_id} keeps waiting. `stopline message {task_id} TEXT` "
                          f"continues it, `stopline follow {task_id}` shows it.")
            return 130
        result = await _result(handle)
        _print_result(result, as_json)
        return EXIT_CODES[result.status]


async def _state_word(client: Any, task_id: str) -> str:
    try:
        desc = await client.get_workflow_handle(task_id).describe()
        return desc.status.name.lower().replace("_", "-") if desc.status else "known"
    except Exception:
        return "known"


# ---------------------------------------------------------------------------
# Commands.
# ---------------------------------------------------------------------------


def cmd_up(args: argparse.Namespace, settings: Settings) -> int:
    """`stopline up`: start the embedded dev server and this home's worker, pinned."""
    from stopline.worker import runtime

    configured = _configured(settings)
    if configured:
        raise UsageError(
            f"a Temporal address is configured ({configured}): run `stopline-worker` "
            f"against it instead; `stopline up` runs the embedded server"
        )

    async def go() -> int:
        try:
            emb = await runtime.acquire_embedded(settings)
        except runtime.EmbeddedServerError as err:
            raise UsageError(str(err)) from None
        runtime.pin_embedded(settings, "stopline up")
        await runtime.release_embedded(settings, emb.lease)  # pinned: keeps running
        console.print(f"Temporal dev server on {emb.address} (UI http://127.0.0.1:{settings.dev_server_ui_port})")
        console.print(f"worker pid {emb.worker_pid}; logs in {settings.home / 'run'}")
        return 0

    return asyncio.run(go())


def cmd_down(args: argparse.Namespace, settings: Settings) -> int:
    """`stopline down`: stop the embedded server and worker, by PID.

    Tasks and chat threads still running there are stopped first, each with
    a recorded reason (a workflow cancel naming `stopline down`), so none is
    left waiting for a worker that is gone. One that does not stop in time is
    named; it goes on at the next `stopline up` (the server's SQLite file
    keeps it). Tool calls a dead worker of this home left running are
    killed once no worker holds the home (:func:`runtime.reap_left_calls`).
    """
    from stopline.worker import runtime

    async def go() -> int:
        stopped: list[str] = []
        late: list[str] = []
        if runtime.dev_server(settings).pid() is not None:
            client = await _client(settings, f"127.0.0.1:{settings.dev_server_port}", embedded=True)
            running = await _running_threads(client)
            if running and await _no_worker(client, settings, settings.task_queue):
                late, running = running, []  # nothing would record their stop now
            for task_id in running:
                try:
                    await client.get_workflow_handle(task_id).cancel(reason=DOWN_REASON)
                except Exception:  # closed meanwhile
                    pass
            for task_id in running:
                try:
                    await asyncio.wait_for(client.get_workflow_handle(task_id).result(), args.timeout)
                    stopped.append(task_id)
                except asyncio.TimeoutError:
                    late.append(task_id)
                except Exception:  # ended another way (failed, terminated): it is not running
                    stopped.append(task_id)
        async with runtime.embedded_lock(settings):
            stopped_worker, stopped_server = runtime.stop_embedded(settings)
            reaped = runtime.reap_left_calls(settings)
        if reaped:
            console.print(f"killed {len(reaped)} tool process group(s) a dead worker had left running "
                          f"(pgid {', '.join(map(str, reaped))})")
        if stopped:
            console.print(f"stopped {len(stopped)} running task(s) with reason \"{DOWN_REASON}\": "
                          f"{', '.join(stopped)}")
        if late:
            console.print(f"[yellow]{len(late)} task(s) did not record a stop (no worker, or not "
                          f"within {args.timeout:g}s) and go on at the next `stopline up`: "
                          f"{', '.join(late)}[/yellow]")
        console.print(
            f"worker {'stopped' if stopped_worker else 'not running'}; "
            f"dev server {'stopped' if stopped_server else 'not running'}"
        )
        return 0

    return asyncio.run(go())


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
    """``--base-url``, ``--max-tokens``, ``--temperature``, ``--top-p`` (defaults: the settings)."""
    parser.add_argument("--base-url", metavar="URL",
                        help="the provider's base URL for this task (default: $ANTHROPIC_BASE_URL or "
                             "$OPENAI_BASE_URL here, else the worker's)")
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
        task_id=args.id, reuse=args.reuse, base_url=args.base_url,
    ))


def cmd_follow(args: argparse.Namespace, settings: Settings) -> int:
    """`stopline follow ID`: re-attach to a task (running or finished) from any machine.

    Shows its events from the start (``--from-now``: only new ones), text
    as the model writes it; Ctrl-C interrupts the task's turn as in
    ``run``, a second Ctrl-C detaches. Exit code: the task's outcome.
    """
    from temporalio.client import WorkflowExecutionStatus
    from temporalio.contrib.workflow_streams import WorkflowStreamClient

    async def go() -> int:
        client = await _client(settings)
        handle = client.get_workflow_handle(args.id, result_type=AgentTaskResult)
        desc = await _describe(handle)
        running = desc.status == WorkflowExecutionStatus.RUNNING
        problem = await _no_worker(client, settings, desc.task_queue)
        if problem is not None:
            if not running:  # a closed task's events are read through a worker (a Query)
                raise UsageError(f"{problem}; a finished task's events are read through a worker")
            err_console.print(f"[yellow]{problem}; events show once one does[/yellow]")
        offset = 0
        if args.from_now and running:
            offset = await WorkflowStreamClient.create(client, args.id).get_offset()
        if running or not args.from_now:
            renderer = EventRenderer(console, as_json=args.json)
            if running:  # the Ctrl-C handler is installed before the next await
                err_console.print(f"[dim]following {escape(args.id)}{' from now' if args.from_now else ''}: "
                                  "Ctrl-C interrupts its turn, a second Ctrl-C detaches[/dim]")
            outcome = await _follow_with_interrupts(client, handle, renderer, from_offset=offset)
            renderer.close()
            if outcome == "detached":
                console.print(f"detached from {args.id}; it goes on")
                return 130
        result = await _result(handle)
        _print_result(result, args.json)
        return EXIT_CODES[result.status]

    return asyncio.run(go())


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
        console.print(f"transcript: {settings.ledger_dir / task_id / 'ledger.jsonl'} "
                      f"(or `stopline transcript {task_id}` while a server runs)")
    return code


async def _handle(settings: Settings, task_id: str) -> tuple[Any, Any]:
    client = await _client(settings)
    return client, client.get_workflow_handle(task_id, result_type=AgentTaskResult)


def cmd_status(args: argparse.Namespace, settings: Settings) -> int:
    """`stopline status`: the task's state, host, refusal and result (the ``status`` Query)."""
    from stopline.core.refusal import NOT_CONTINUABLE_CLI

    async def go() -> int:
        client, handle = await _handle(settings, args.id)
        desc = await _describe(handle)
        st = await _query_status(client, settings, handle, desc)
        note = NOT_CONTINUABLE_CLI if st.note else None
        out = {
            "task_id": args.id,
            "workflow_status": desc.status.name if desc.status else None,
            "state": _shown_status(st.state, desc.status),
            "round": st.round,
            "rows": st.rows,
            "result": st.result.model_dump(mode="json", exclude={"unflushed_rows"}) if st.result else None,
            "refusal": st.refusal.model_dump() if st.refusal else None,
            "stop_reason": st.stop_reason,
            "note": note,
            "host": {"host_id": st.host.host_id, "hostname": st.host.hostname} if st.host else None,
        }
        if args.json:
            print(json.dumps(out))
            return 0
        lines = [("task", args.id), ("state", f"{out['state']} (workflow {out['workflow_status']})")]
        if st.host:
            lines.append(("host", f"{st.host.host_id} ({st.host.hostname})"))
        lines.append(("progress", f"round {st.round}, {st.rows} ledger rows"))
        if st.result:
            tag = " (refused)" if st.result.refused else ""
            lines.append(("result", f"{st.result.status}{tag}: {st.result.reason}"))
            if st.result.undelivered_messages:
                lines.append(("undelivered", "; ".join(st.result.undelivered_messages)))
        if st.refusal:
            cat = f" {st.refusal.category}" if st.refusal.category else ""
            lines.append(("refusal", f"{st.refusal.provider}{cat}, round {st.refusal.round}"))
        if note:
            lines.append(("note", note))
        for k, v in lines:
            console.print(f"{k:12} {v}", markup=False)
        return 0

    return asyncio.run(go())


def _print_rows(rows: list[LedgerRow], as_json: bool) -> None:
    for row in rows:
        if as_json:
            print(row.model_dump_json())
            continue
        vis = "" if row.model_visible else " [dim](hidden from model)[/dim]"
        if row.meta.get("in_flight"):
            vis += " [dim](its tool calls are running; not yet a row)[/dim]"
        head = f"[bold]#{row.seq} r{row.round} {row.kind}[/bold]{vis}"
        if row.kind == "tool_result":
            head += f" {escape(row.tool_name or '')} {escape(row.call_id or '')} ok={row.ok}"
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

    in_flight: list[Any] = []  # a round's response whose tool calls are running

    async def held_rows(client: Any) -> list[LedgerRow]:
        """A running task's own rows (its ``ledger`` Query): the ones no
        activity has carried into history yet. Nothing when it is not
        running or no worker answers — the history's rows stand alone.
        A response whose calls its sampling activity is running (DESIGN §1)
        is no row yet: it is read from that activity's heartbeat."""
        from temporalio.client import WorkflowExecutionStatus

        handle = client.get_workflow_handle(args.id)
        try:
            desc = await handle.describe()
            if desc.status != WorkflowExecutionStatus.RUNNING:
                return []
        except RPCError:
            return []  # no such task: the history read says so
        in_flight.extend(await _round_in_flight(client, desc))
        try:
            return await handle.query("ledger", result_type=list[LedgerRow], rpc_timeout=QUERY_TIMEOUT)
        except Exception as err:  # still a transcript: what history holds
            err_console.print(f"[yellow]the running task did not answer ({escape(_first_line(err))}): "
                              f"rows it holds but has not yet written are not shown[/yellow]")
            return []

    async def rows_of(client: Any, run_id: str | None, pending: list[LedgerRow] | None = None) -> list[LedgerRow]:
        try:
            return await rows_from_history(client, args.id, run_id, pending or ())
        except RPCError as err:
            raise UsageError(f"no task {args.id}: {err.message}") from None
        except Exception as err:
            _raise_if_undecodable(err)
            raise

    async def go() -> int:
        client = await _client(settings)
        if not args.all_runs:
            rows = await rows_of(client, None, await held_rows(client))
            for response, round_ in in_flight:
                rows.append(LedgerRow(
                    seq=(rows[-1].seq if rows else 0) + 1, kind="assistant", round=round_, text=response.text,
                    tool_calls=list(response.tool_calls), meta={"in_flight": True},
                ))
            _print_rows(rows, args.json)
            return 0
        runs = [wf async for wf in client.list_workflows(f"WorkflowId = {literal(args.id)}")]
        if not runs:
            raise UsageError(f"no task {args.id}")
        latest = runs[0].run_id
        for wf in sorted(runs, key=lambda w: w.start_time):
            rows = await rows_of(client, wf.run_id)
            label = "current" if wf.run_id == latest else (wf.status.name.lower() if wf.status else "?")
            if args.json:
                print(json.dumps({"run_id": wf.run_id, "run": label, "rows": len(rows)}))
            else:
                console.print(f"[bold]── run {wf.run_id} ({label}, started {wf.start_time:%Y-%m-%d %H:%M:%S})[/bold]")
            _print_rows(rows, args.json)
        return 0

    return asyncio.run(go())


async def _round_in_flight(client: Any, desc: Any) -> list[Any]:
    """The response (and its round) of a running sampling activity that is
    running its round's tool calls (recorded in its heartbeat before they
    started, ``stopline.activities.round_tools``); empty when there is none."""
    from stopline.core.contracts import SAMPLE_ACTIVITY, SamplingResult
    from stopline.core.policies import recorded_response

    found: list[SamplingResult] = []
    for pending in desc.raw_description.pending_activities:
        if pending.activity_type.name != SAMPLE_ACTIVITY or not pending.heartbeat_details.payloads:
            continue
        try:
            details = await client.data_converter.decode(pending.heartbeat_details.payloads)
            recorded = recorded_response(details)
            if recorded is not None:
                found.append((
                    SamplingResult.model_validate(recorded["round_tools"]),
                    recorded.get("round") if isinstance(recorded.get("round"), int) else 0,
                ))
        except Exception as err:  # undecodable (another codec key): say so, show the rest
            _raise_if_undecodable(err)
            raise
    return found


def cmd_move(args: argparse.Namespace, settings: Settings) -> int:
    """`stopline move ID [--to HOST]`: move a task to another host (the ``move`` Update).

    For an operator with a stuck task: one waiting for a host that will not
    come (re-target it), or one on a host that must be drained. The target
    must hold the same workspace; a task that cannot move stays put.
    """
    from temporalio.client import WorkflowUpdateFailedError

    async def go() -> int:
        _, handle = await _handle(settings, args.id)
        await _describe(handle)
        try:
            said = await bounded_update(handle, "move", args.to, result_type=str, finish_s=None)
        except WorkflowUpdateFailedError as err:
            raise UsageError(str(getattr(err.cause, "message", None) or err.cause or err)) from None
        console.print(said, markup=False)
        return 0

    return asyncio.run(go())


def cmd_hosts(args: argparse.Namespace, settings: Settings) -> int:
    """`stopline hosts`: the live hosts of the pool and the tasks each holds.

    Hosts are read from Temporal's own view of who polls the workflow task
    queue (each worker's identity names its host id); their tasks from the
    ``StoplineHost`` search attribute of running workflows.
    """
    from stopline.activities.host import describe_hosts
    from stopline.core.search_attributes import literal

    async def go() -> int:
        client = await _client(settings)
        hosts = await describe_hosts(client, settings.task_queue, max_age_s=args.max_age)
        rows = []
        for h in hosts:
            ids = sorted([wf.id async for wf in client.list_workflows(
                f"StoplineHost = {literal(h.host_id)} AND ExecutionStatus = 'Running'"
            )])
            rows.append({
                "host_id": h.host_id, "hostname": h.hostname, "capacity": h.capacity,
                "tasks": len(ids), "task_ids": ids, "task_queue": h.task_queue,
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
        for h, r in zip(hosts, rows):
            cap = r["capacity"] if r["capacity"] is not None else "?"
            seen = f"{h.last_seen:%Y-%m-%d %H:%M:%S}" if h.last_seen else "-"
            console.print(f"{r['host_id']:16} {r['hostname']:24} {str(r['tasks']) + '/' + str(cap):>9}  {seen}",
                          markup=False)
            for task_id in r["task_ids"]:
                console.print(f"  {task_id}", markup=False)
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
    return execution.name.lower() if execution is not None else "unknown"


def cmd_list(args: argparse.Namespace, settings: Settings) -> int:
    """Tasks and chat threads with their outcome (from search attributes), in the
    server's visibility order: running ones first, then by close time, newest first."""
    from stopline.core import search_attributes as sa

    async def go() -> int:
        client = await _client(settings)
        query = f"WorkflowType IN ('{AGENT_TASK_WORKFLOW}', '{CHAT_THREAD_WORKFLOW}')"
        header = False
        async for wf in client.list_workflows(query):
            attrs = wf.typed_search_attributes
            row = {
                "id": wf.id,
                "kind": attrs.get(sa.KIND) or ("chat" if wf.workflow_type == CHAT_THREAD_WORKFLOW else "task"),
                "status": _shown_status(attrs.get(sa.STATUS), wf.status),
                "refused": bool(attrs.get(sa.REFUSED)),
                "model": attrs.get(sa.MODEL),
                "host": attrs.get(sa.HOST) or None,
                "started": wf.start_time.isoformat(),
            }
            if args.json:
                print(json.dumps(row))
                continue
            if not header:
                console.print(f"{'ID':32} {'KIND':5} {'STATUS':16} {'STARTED':19}  MODEL", markup=False)
                header = True
            tag = " refused" if row["refused"] else ""
            console.print(
                f"{row['id']:32} {row['kind']:5} {row['status'] + tag:16} "
                f"{wf.start_time:%Y-%m-%d %H:%M:%S}  {row['model'] or '-'}", markup=False,
            )
        if not header and not args.json:
            console.print("no tasks or chat threads yet")
        return 0

    return asyncio.run(go())


def cmd_interrupt(args: argparse.Namespace, settings: Settings) -> int:
    """`stopline interrupt`: send the ``interrupt`` Update (aborts the current turn only)."""
    async def go() -> int:
        from temporalio.client import WorkflowExecutionStatus

        client, handle = await _handle(settings, args.id)
        desc = await _describe(handle)
        if desc.status != WorkflowExecutionStatus.RUNNING:
            from stopline.core import search_attributes as sa

            state = _shown_status(desc.typed_search_attributes.get(sa.STATUS), desc.status)
            raise UsageError(f"task {args.id} has ended ({state}); there is no turn to interrupt")
        problem = await _no_worker(client, settings, desc.task_queue)
        if problem is not None:
            raise UsageError(problem)
        try:
            res = await bounded_update(handle, "interrupt", result_type=InterruptResult)
        except Exception:
            # a stop closed the task while the interrupt was on its way
            if (await handle.describe()).status == WorkflowExecutionStatus.RUNNING:
                raise
            res = InterruptResult(interrupted=False, ended=True)
        if args.json:
            print(res.model_dump_json())
        elif res.interrupted and (await handle.describe()).status != WorkflowExecutionStatus.RUNNING:
            # a stop came while the abort ran: the turn was interrupted, then the task ended
            console.print(f"interrupted: {_calls_phrase(res)}; the task has ended since "
                          f"(`stopline status {args.id}`)", markup=False)
        elif res.interrupted:
            console.print(_interrupted(res, args.id), markup=False)
        else:
            console.print(_not_interrupted(res))
        return 0

    return asyncio.run(go())


def cmd_message(args: argparse.Namespace, settings: Settings) -> int:
    """`stopline message`: task_message — refused for a task a refusal stopped."""
    from stopline.activities.ledger import LedgerStore
    from stopline.activities.tasks import TaskNotContinuable, send_task_message
    from stopline.core.refusal import NOT_CONTINUABLE, NOT_CONTINUABLE_CLI

    async def go() -> int:
        client, handle = await _handle(settings, args.id)
        await _describe(handle)
        try:
            ack = await send_task_message(client, LedgerStore(settings.ledger_dir), args.id, args.text)
        except TaskNotContinuable as err:
            said = str(err)
            raise UsageError(NOT_CONTINUABLE_CLI if said == NOT_CONTINUABLE else said) from None
        console.print(f"message accepted (task {ack.state})")
        return 0

    return asyncio.run(go())


def cmd_wait(args: argparse.Namespace, settings: Settings) -> int:
    """``task_wait`` from the CLI: wait until every task settles (or timeout)."""

    async def go() -> int:
        client = await _client(settings)
        worst = 0
        results: dict[str, dict[str, Any]] = {}
        for task_id in args.ids:
            handle = client.get_workflow_handle(task_id, result_type=AgentTaskResult)
            await _describe(handle)
            try:
                result = await asyncio.wait_for(_result(handle), args.timeout)
            except asyncio.TimeoutError:
                results[task_id] = {"status": "running"}
                worst = max(worst, 4)
                continue
            results[task_id] = result.model_dump(mode="json", exclude={"final_text", "unflushed_rows"})
            worst = max(worst, EXIT_CODES[result.status])
        if args.json:
            print(json.dumps(results))
        else:
            for task_id, r in results.items():
                tag = " (refused)" if r.get("refused") else ""
                reason = f": {r['reason']}" if r.get("reason") else f" after {args.timeout:g}s"
                console.print(f"{task_id}: {r['status']}{tag}{reason}", markup=False)
        return worst

    return asyncio.run(go())


def cmd_stop(args: argparse.Namespace, settings: Settings) -> int:
    """``task_stop`` from the CLI: cancel a task (reason `stopline stop`), print where it stopped."""
    from temporalio.service import RPCError

    from stopline.core.refusal import NOT_CONTINUABLE_CLI

    async def go() -> int:
        client, handle = await _handle(settings, args.id)
        desc = await _describe(handle)
        from temporalio.client import WorkflowExecutionStatus

        if desc.status == WorkflowExecutionStatus.RUNNING:
            problem = await _no_worker(client, settings, desc.task_queue)
            if problem is not None:
                raise UsageError(f"{problem}; a stop is recorded by a worker")
            try:
                await handle.cancel(reason=STOP_REASON)
            except RPCError:
                pass  # closed meanwhile: its result says where it stopped
        try:
            result = await asyncio.wait_for(_result(handle), 60)
        except asyncio.TimeoutError:
            raise UsageError(f"{args.id} did not stop within 60s") from None
        body: dict[str, Any] = {
            "task_id": args.id, "status": result.status, "refused": result.refused,
            "reason": result.reason, "evidence": result.evidence,
            "undelivered_messages": result.undelivered_messages,
        }
        if result.refused:
            body["note"] = NOT_CONTINUABLE_CLI
        if args.json:
            print(json.dumps(body))
            return 0
        console.print(f"{args.id} {result.status}: {result.reason}", markup=False)
        ev = result.evidence or {}
        if ev.get("last_message"):
            console.print(f"  last message: {str(ev['last_message'])[:300]}", markup=False)
        tool = ev.get("last_tool")
        if isinstance(tool, dict) and tool.get("tool"):  # keys: refusal.stop_evidence
            console.print(f"  last tool:    {tool['tool']} {tool.get('args_firstline') or ''}".rstrip(),
                          markup=False)
        if ev.get("changed_paths"):
            console.print(f"  changed:      {', '.join(ev['changed_paths'])}", markup=False)
        if result.undelivered_messages:
            console.print(f"  undelivered:  {'; '.join(result.undelivered_messages)}", markup=False)
        if result.refused:
            console.print(f"  note: {NOT_CONTINUABLE_CLI}", markup=False)
        return 0

    return asyncio.run(go())


def cmd_chat(args: argparse.Namespace, settings: Settings) -> int:
    """A chat thread: start one (or use ``--thread``), send messages, show each
    turn as it streams. Without TEXT, reads one message per line from stdin."""
    from temporalio.contrib.workflow_streams import WorkflowStreamClient

    from stopline.core.contracts import ChatThreadInput
    from stopline.workflows.chat_thread import TurnOutcome

    async def go() -> int:
        async with AsyncExitStack() as stack:
            # a thread outlives this command: what it needs keeps running
            address = await _runtime(settings, stack, pin="a chat thread")
            client = await _client(settings, address)
            thread_id = args.thread or f"chat-{uuid.uuid4().hex[:8]}"
            if not args.thread:
                model = _check_model(args.model, settings)
                await client.start_workflow(
                    CHAT_THREAD_WORKFLOW,
                    ChatThreadInput(
                        model=model, workspace=str(Path(args.workspace).resolve()), limits=_limits(args),
                        base_url=_base_url(args.base_url, model, settings),
                    ),
                    id=thread_id, task_queue=settings.task_queue,
                )
                console.print(f"thread [bold]{thread_id}[/bold] (continue with --thread {thread_id})")
            handle = client.get_workflow_handle(thread_id)
            await _describe(handle)
            for source_text in args.increment or []:
                source, _, text = source_text.partition(":")
                await bounded_update(handle, "increment", source, text)
            texts = [args.text] if args.text else (line.rstrip("\n") for line in sys.stdin)
            stream = WorkflowStreamClient.create(client, thread_id)
            code = 0
            for text in texts:
                if not text.strip():
                    continue
                renderer = EventRenderer(console)
                offset = await stream.get_offset()
                watch = asyncio.create_task(_follow(
                    client, thread_id, renderer, from_offset=offset,
                    until=lambda ev: ev.kind in ("turn_finished", "task_finished"),
                ))
                try:
                    out: TurnOutcome = await bounded_update(
                        handle, "ask", text, result_type=TurnOutcome, finish_s=None  # a whole turn
                    )
                    try:
                        await asyncio.wait_for(asyncio.shield(watch), 5.0)
                    except (asyncio.TimeoutError, UsageError):
                        pass
                finally:
                    watch.cancel()
                    renderer.close()
                if out.final_text and renderer.last_assistant_text != out.final_text:
                    console.print("[bold]assistant:[/bold] " + escape(out.final_text))
                tag = " (refused)" if out.refused else ""
                console.print(f"[dim]turn {out.turn}: {out.status}{tag} — {escape(out.reason)}[/dim]")
                code = EXIT_CODES.get(out.status, 0)
            if args.close:
                await handle.signal("close")
                console.print(f"thread {escape(thread_id)} closed")
            return code

    return asyncio.run(go())


def cmd_scripted_server(args: argparse.Namespace, settings: Settings) -> int:
    """`stopline scripted-server`: serve a scenario until signalled."""
    from stopline.testing.scripted import serve

    serve(args.scenario, host=args.host, port=args.port, ready_file=args.ready_file)
    return 0


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
                f"cleared {len(report.removed_tasks)} finished task(s) of their outputs, staged rows, "
                f"shell logs and call records ({_size(report.freed_bytes)} freed); "
                f"kept {len(report.kept_running)} running, "
                f"{len(report.kept_unknown)} unknown, {len(report.kept_shells)} running shell(s)"
            )
        return 0

    return asyncio.run(go())


def _size(n: int) -> str:
    """Bytes for a person: ``0 bytes``, ``12.3 KiB``, ``4.0 MiB``."""
    size = float(n)
    for unit in ("bytes", "KiB", "MiB"):
        if size < 1024:
            return f"{n} bytes" if unit == "bytes" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


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
            raise UsageError(f"cannot fetch the history of {args.id}: {err.message}") from None
        console.print(f"wrote {len(history.events)} events of {args.id} (run {history.run_id}) to {path}")
        return 0

    return asyncio.run(go())


def cmd_replay(args: argparse.Namespace, settings: Settings) -> int:
    """``stopline replay ID|FILE``: replay a history against the current code.

    A path to an existing file (or one ending in ``.json``) is read; anything
    else is a task id whose history is fetched from the server. Exit 0 when
    it replays, 1 on nondeterminism or another replay failure; 2 when the
    history cannot be read or decoded (say, encrypted and no key set).
    """
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
                raise UsageError(f"cannot fetch the history of {args.target}: {err.message}") from None
        try:
            converter = data_converter(settings)
        except Exception as err:
            raise UsageError(f"STOPLINE_CODEC_KEY: {_first_line(err)}") from None
        problem = _history_key_problem(history, settings)
        if problem is not None:
            raise UsageError(problem)
        import logging

        # the SDK would log the failed activation too; the outcome says it once
        logging.getLogger("temporalio").setLevel(logging.CRITICAL)
        # The quiet runtime: the core would also print the failure as a WARN
        # line; the outcome below says it once, clearly.
        outcome = await replay(history, converter, runtime=_runtime_without_core_logs(),
                               debug_mode=args.debug)
        if not outcome.ok and outcome.error:
            decode = _decode_problem(RuntimeError(outcome.error))
            if decode is not None:
                raise UsageError(decode)
        if args.json:
            print(json.dumps(outcome.__dict__))
        else:
            color = "green" if outcome.ok else "red"
            console.print(f"[{color}]{escape(outcome.describe())}[/{color}]")
        return 0 if outcome.ok else 1

    return asyncio.run(go())


def _history_key_problem(history: Any, settings: Settings) -> str | None:
    """Why this command cannot decode an encrypted history, or ``None``.

    Each encrypted payload names its key by a non-secret id
    (``stopline.worker.codec``); the first one found is checked against the
    keys this command has.
    """
    from stopline.worker.codec import ENCODING, KEY_ID_METADATA, key_id, parse_key

    for event in history.events:
        attrs = event.workflow_execution_started_event_attributes
        for payload in attrs.input.payloads:
            if payload.metadata.get("encoding") != ENCODING:
                return None
            if settings.codec_key is None:
                return _decode_problem(RuntimeError(ENCODING.decode()))
            texts = [settings.codec_key.get_secret_value()]
            if settings.codec_previous_keys is not None:
                texts += settings.codec_previous_keys.get_secret_value().split(",")
            have = {key_id(parse_key(t.strip())) for t in texts if t.strip()}
            kid = payload.metadata.get(KEY_ID_METADATA, b"").decode()
            if kid and kid not in have:
                return (f"cannot decode the history: it is encrypted under key {kid}, which is neither "
                        f"STOPLINE_CODEC_KEY nor one of STOPLINE_CODEC_PREVIOUS_KEYS")
            return None
    return None


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
                    raise UsageError(f"could not register search attributes: {_first_line(err)}") from None
                err_console.print(f"waiting for Temporal: {_first_line(err)}", markup=False, style="dim")
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
        epilog="Exit codes: 0 completed, 1 failed, 3 stopped, 2 usage or set-up error, "
        "4 wait timed out with a task still running, 130 detached by a second Ctrl-C, "
        "141 output pipe closed.",
    )
    p.add_argument("--home", help="state directory (default $STOPLINE_HOME or ~/.stopline)")
    sub = p.add_subparsers(dest="command", required=True)

    sub.add_parser("up", help="start the embedded Temporal dev server and a worker").set_defaults(fn=cmd_up)
    dn = sub.add_parser("down", help="stop what `up` (or a detached run or chat) started; "
                        "tasks still running there are stopped with a reason")
    dn.add_argument("--timeout", type=float, default=30.0, metavar="S",
                    help="seconds to wait for running tasks to record their stop (default 30)")
    dn.set_defaults(fn=cmd_down)

    r = sub.add_parser("run", help="start a task and follow it")
    r.add_argument("prompt")
    r.add_argument("--model", default="anthropic:claude-sonnet-4-5",
                   help="provider:model (anthropic, openai, openai-responses, openai-compat) or scripted:FILE")
    r.add_argument("--workspace", default=".", help="directory the tools work in (default: here)")
    r.add_argument("--id", help="the task id (default: task-<random>); sub-tasks are named ID.<suffix>")
    r.add_argument("--reuse", choices=("fail", "attach"), default="fail",
                   help="when --id is already in use: fail (default) or attach (follow that task)")
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

    f = sub.add_parser("follow", help="re-attach to a task: its events from the start, text as it streams")
    f.add_argument("id")
    f.add_argument("--from-now", action="store_true", help="only events from now on")
    f.add_argument("--json", action="store_true", help="one JSON line per event, then the result")
    f.set_defaults(fn=cmd_follow)

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


def _silence_stdout() -> None:
    """Point stdout at /dev/null: its reader is gone, and the interpreter's
    last flush must not raise again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``stopline`` console script.

    Every failure a person can cause or meet is one ``error:`` line and an
    exit code; ``STOPLINE_DEBUG=1`` shows the traceback of an unexpected one.
    """
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
    except BrokenPipeError:  # `stopline list | head`: the reader has all it wanted
        _silence_stdout()
        return EXIT_PIPE
    except UsageError as e:
        err_console.print(f"[red]error:[/red] {escape(str(e))}")
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        if os.environ.get("STOPLINE_DEBUG"):
            raise
        said = _decode_problem(e)
        if said is None and isinstance(e, RPCError):
            said = e.message
        elif said is None and isinstance(e, WorkflowFailureError):
            said = f"the workflow ended without a result: {_first_line(e.cause or e)}"
        elif said is None and isinstance(e, (ValueError, OSError, StoplineError)):
            said = str(e)
        elif said is None:
            said = f"{type(e).__name__}: {_first_line(e)} (STOPLINE_DEBUG=1 shows where)"
        err_console.print(f"[red]error:[/red] {escape(said)}")
        return 1 if isinstance(e, WorkflowFailureError) else 2


def entry() -> None:
    """Console-script entry: run :func:`main`, then leave without finalization.

    The Temporal SDK's native threads can abort a finalizing interpreter
    ("Fatal Python error: PyGILState_Release"), which would turn a good exit
    code into SIGABRT. Everything is flushed first; nothing else is pending.
    """
    code = main()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (BrokenPipeError, ValueError):
            _silence_stdout()
            code = code or EXIT_PIPE
    os._exit(code)


if __name__ == "__main__":
    entry()
