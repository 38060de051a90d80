"""Replay debugging: export a task's history, replay it against current code.

Every aborted or refused turn can be replayed from its history and replays
identically (DESIGN §5). Replaying runs the workflow code again over the
recorded events with ``temporalio.worker.Replayer``: no activity runs, no
provider is called, nothing is written. It answers two questions:

- *What did this task do?* — step through a real history in a debugger
  (set a breakpoint in ``workflows/``, run ``stopline replay FILE``).
- *Is my change safe for running tasks?* — a change that makes the code
  issue different commands than the history recorded (another activity,
  another order) is a nondeterminism error: a running task would get stuck
  on it after a worker restart. ``tests/test_replay.py`` replays every
  ``tests/histories/*.json`` in CI for this reason.

Files are the JSON of ``WorkflowHistory.to_json()``, the same shape the
Temporal UI's "Download" and ``temporal workflow show --output json`` write,
so either can be replayed. The JSON does not hold the workflow id;
:func:`load_history` takes it from the file name unless told.

With ``STOPLINE_CODEC_KEY`` set, payloads in the history are encrypted; the
replayer uses :func:`stopline.worker.codec.data_converter`, so the same key must be
set to replay.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from temporalio.client import Client, WorkflowHistory
from temporalio.converter import DataConverter
from temporalio.worker import Replayer
from temporalio.workflow import NondeterminismError


@dataclass
class ReplayOutcome:
    """What one replay found.

    Attributes:
        ok: The code replayed the whole history without a failure.
        workflow_id: The history's workflow id.
        run_id: Its run id.
        events: Number of events in the history.
        nondeterminism: The failure was a nondeterminism error (the code
            issued different commands than the history recorded).
        event_id: The history event where the code diverged, when the
            SDK's error names it.
        error: The failure's message, if any.
    """

    ok: bool
    workflow_id: str
    run_id: str
    events: int
    nondeterminism: bool = False
    event_id: int | None = None
    error: str | None = None

    def describe(self) -> str:
        """One human line for the CLI."""
        head = f"{self.workflow_id} (run {self.run_id}, {self.events} events)"
        if self.ok:
            return f"replay OK: {head} replays deterministically against the current code"
        kind = "nondeterminism" if self.nondeterminism else "replay failure"
        where = f" at event {self.event_id}" if self.event_id is not None else ""
        return f"{kind}{where}: {head}: {self.error}"


#: Patterns the Rust core uses to name the event of a nondeterminism error,
#: most specific first: ``... this event: HistoryEvent(id: 5, ...)`` or
#: ``... event id 5 ...``. Deliberately strict: a message like "activity id
#: of scheduled event '5'" quotes an *activity* id, not an event id; when
#: no pattern matches, :func:`_locate_divergence` finds the event instead.
_EVENT_ID_PATTERNS = (
    re.compile(r"HistoryEvent\(\s*id:\s*(\d+)"),
    re.compile(r"\bevent[_ ]id[:= ]+(\d+)", re.IGNORECASE),
)


def diverged_event_id(message: str) -> int | None:
    """The event id a replay error message names, if it names one.

    Args:
        message: The replay failure's message.

    Returns:
        The first event id found, or ``None``.
    """
    for pattern in _EVENT_ID_PATTERNS:
        m = pattern.search(message)
        if m:
            return int(m.group(1))
    return None


_CORE_MESSAGE = re.compile(r'message:\s*"((?:[^"\\]|\\.)*)"')


def failure_summary(message: str) -> str:
    """The core's own failure message out of its debug-formatted wrapper.

    A replay failure reads ``Workflow activation completion failed: Failure {
    failure: Some(Failure { message: "[TMPRL1100] Nondeterminism error: ...",
    ... }) }``; the quoted message is the part a person needs.
    """
    m = _CORE_MESSAGE.search(message)
    return m.group(1).replace('\\"', '"') if m else message


def default_workflows() -> list[type]:
    """Every workflow class in the ``workflows`` package.

    Discovered rather than listed, so a new workflow type (e.g. a chat) is
    replayable the day it is added. The Replayer picks the class by the
    history's workflow type.
    """
    import stopline.workflows as workflows

    found: dict[str, type] = {}
    for info in pkgutil.iter_modules(workflows.__path__, prefix="stopline.workflows."):
        module = importlib.import_module(info.name)
        for value in vars(module).values():
            if isinstance(value, type) and value.__module__ == module.__name__ and hasattr(
                value, "__temporal_workflow_definition"
            ):
                found[value.__qualname__] = value
    return list(found.values())


def load_history(path: Path, workflow_id: str | None = None) -> WorkflowHistory:
    """Read a history JSON file (``to_json()``, Temporal UI or CLI export).

    Args:
        path: The file.
        workflow_id: The workflow id; default: the file name without
            ``.json`` (``stopline history export`` names files that way
            unless told otherwise).

    Returns:
        The history.
    """
    return WorkflowHistory.from_json(workflow_id or path.stem, path.read_text())


async def fetch_history(client: Client, workflow_id: str, run_id: str | None = None) -> WorkflowHistory:
    """Fetch a workflow's full history from the server.

    Args:
        client: Connected client.
        workflow_id: The task id.
        run_id: A specific run (default: the latest run, e.g. the last one
            after continue-as-new).
    """
    return await client.get_workflow_handle(workflow_id, run_id=run_id).fetch_history()


async def export_history(
    client: Client, workflow_id: str, path: Path, run_id: str | None = None
) -> WorkflowHistory:
    """Fetch a workflow's history and write it as JSON to ``path``.

    Returns:
        The history written.
    """
    history = await fetch_history(client, workflow_id, run_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(history.to_json())
    return history


async def replay(
    history: WorkflowHistory,
    data_converter: DataConverter,
    workflows: Sequence[type] | None = None,
    **replayer_options: Any,
) -> ReplayOutcome:
    """Replay one history against workflow code and report what happened.

    On a nondeterminism error the event where the code diverged is found:
    from the error message when the SDK names it, else by
    :func:`_locate_divergence` (bisecting over workflow tasks).

    Args:
        history: The history.
        data_converter: The converter the history was written with (the
            codec, if the payloads are encrypted).
        workflows: Workflow classes to replay with (default:
            :func:`default_workflows`, the current code).
        **replayer_options: Passed to :class:`temporalio.worker.Replayer`
            (e.g. ``workflow_runner``, ``debug_mode``, ``runtime``).

    Returns:
        The outcome; a failure is reported, never raised.
    """
    # Our own executor, shut down at the end: the Replayer's default one
    # is never shut down, and bisection replays several times.
    with ThreadPoolExecutor(thread_name_prefix="stopline-replay") as executor:
        replayer = Replayer(
            workflows=list(workflows) if workflows is not None else default_workflows(),
            data_converter=data_converter,
            workflow_task_executor=executor,
            **replayer_options,
        )
        failure = await _failure(replayer, history)
        outcome = ReplayOutcome(
            ok=failure is None,
            workflow_id=history.workflow_id,
            run_id=history.run_id,
            events=len(history.events),
        )
        if failure is not None:
            message = str(failure)
            outcome.error = failure_summary(message)
            outcome.nondeterminism = isinstance(failure, NondeterminismError) or (
                "nondetermin" in message.lower()
            )
            outcome.event_id = diverged_event_id(message)
            if outcome.event_id is None and outcome.nondeterminism:
                outcome.event_id = await _locate_divergence(replayer, history, message)
    return outcome


async def _failure(replayer: Replayer, history: WorkflowHistory) -> Exception | None:
    result = await replayer.replay_workflow(history, raise_on_replay_failure=False)
    return result.replay_failure


async def _locate_divergence(replayer: Replayer, history: WorkflowHistory, message: str) -> int | None:
    """Find the event where the code diverged when the error does not say.

    A history cut just after a ``WorkflowTaskStarted`` event is a valid
    in-progress history in which every *earlier* workflow task's commands
    were checked against their recorded events. So "the cut after the k-th
    workflow task start fails" is monotonic in k, and bisection finds the
    first failing cut in O(log n) replays: the divergence is in the
    commands of the workflow task before it. Within that task's command
    events, the one naming a value the error quotes (an activity type, a
    timer id...) is the answer; else the task's first command event.

    Returns:
        The event id, or ``None`` if it cannot be narrowed down.
    """
    events = list(history.events)
    starts = [i for i, ev in enumerate(events) if ev.HasField("workflow_task_started_event_attributes")]

    async def fails(k: int) -> bool:
        if k == len(starts):
            return True  # the full history: known to fail
        cut = WorkflowHistory(history.workflow_id, events[: starts[k] + 1])
        return await _failure(replayer, cut) is not None

    lo, hi = 0, len(starts)  # find the smallest k in [lo, hi] that fails
    while lo < hi:
        mid = (lo + hi) // 2
        if await fails(mid):
            hi = mid
        else:
            lo = mid + 1
    if lo == 0:
        return None
    begin = starts[lo - 1]
    end = starts[lo] if lo < len(starts) else len(events)
    completed = next(
        (i for i in range(begin, end) if events[i].HasField("workflow_task_completed_event_attributes")),
        None,
    )
    if completed is None or completed + 1 >= len(events):
        return None
    candidates = events[completed + 1 : end]
    quoted = set(re.findall(r"'([^']+)'", message))
    for ev in candidates:
        if quoted & _event_names(ev):
            return ev.event_id
    return candidates[0].event_id


def _event_names(ev: Any) -> set[str]:
    """Identifying values of a command event the SDK quotes in its errors."""
    names: set[str] = set()
    for field, attrs in (
        ("activity_task_scheduled_event_attributes", ("activity_id",)),
        ("timer_started_event_attributes", ("timer_id",)),
        ("marker_recorded_event_attributes", ("marker_name",)),
        ("start_child_workflow_execution_initiated_event_attributes", ("workflow_id",)),
    ):
        if ev.HasField(field):
            a = getattr(ev, field)
            names.update(str(getattr(a, name)) for name in attrs)
            if hasattr(a, "activity_type"):
                names.add(a.activity_type.name)
            if hasattr(a, "workflow_type"):
                names.add(a.workflow_type.name)
    return names
