"""Replay debugging (DESIGN §5): export a task's history, replay it against
the current code, and detect a divergence (nondeterminism) with the event
where it happened. Real dev server, real CLI processes.

Also replays every committed ``tests/histories/*.json`` (regenerate them
with ``tests/histories/make_histories.py``): a workflow change that would
break tasks already running fails here, in CI, instead of in production.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from temporalio import workflow
from temporalio.client import Client, WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import UnsandboxedWorkflowRunner

from stopline.replay import default_workflows, diverged_event_id, load_history, replay
from stopline.testing.scripted import anthropic_message, entry, scenario
from tests.conftest import start_task

REPO = Path(__file__).resolve().parent.parent
HISTORIES = Path(__file__).resolve().parent / "histories"


@workflow.defn(name="AgentTask")
class _Impostor:
    """Registered under AgentTask's name but schedules another activity
    first: replaying a real AgentTask history with it must diverge."""

    @workflow.run
    async def run(self, inp: Any) -> str:
        await workflow.execute_activity(
            "stopline.something_else", start_to_close_timeout=timedelta(seconds=5)
        )
        return "impostor"


def _cli(*args: str, address: str | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop("STOPLINE_CODEC_KEY", None)
    if address:
        env["TEMPORAL_ADDRESS"] = address
    return subprocess.run(
        [sys.executable, "-m", "stopline.cli", *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )


def _address(client: Client) -> str:
    return client.service_client.config.target_host


def _first_command_event(history: WorkflowHistory) -> int:
    """The first event a workflow command produced: where code that issues
    different commands diverges from this history."""
    for prev, ev in zip(history.events, history.events[1:]):
        if prev.HasField("workflow_task_completed_event_attributes"):
            return ev.event_id
    raise AssertionError("no completed workflow task")


async def _completed_task(client: Client, task_queue: str, scripted: Any, workspace: Path) -> Any:
    server = scripted(scenario(
        "anthropic",
        entry(anthropic_message("looking", tool_calls=[("c1", "shell", {"command": "echo hi"})])),
        entry(anthropic_message("done")),
    ))
    handle = await start_task(client, task_queue, server, workspace)
    assert (await handle.result()).status == "completed"
    return handle


@pytest.mark.usefixtures("worker")
async def test_export_then_replay_via_the_cli(
    client: Client, task_queue: str, scripted: Any, workspace: Path, tmp_path: Path
) -> None:
    handle = await _completed_task(client, task_queue, scripted, workspace)
    out = tmp_path / "exported" / f"{handle.id}.json"
    exported = await asyncio.to_thread(
        _cli, "history", "export", handle.id, str(out), address=_address(client)
    )
    assert exported.returncode == 0, exported.stderr
    assert f"to {out}" in exported.stdout
    history = load_history(out)
    assert history.workflow_id == handle.id
    assert history.events[-1].HasField("workflow_execution_completed_event_attributes")

    from_file = await asyncio.to_thread(_cli, "replay", str(out))
    assert from_file.returncode == 0, from_file.stdout + from_file.stderr
    assert "replay OK" in from_file.stdout and handle.id in from_file.stdout

    from_server = await asyncio.to_thread(_cli, "replay", handle.id, "--json", address=_address(client))
    assert from_server.returncode == 0, from_server.stdout + from_server.stderr
    outcome = json.loads(from_server.stdout.strip().splitlines()[-1])
    assert outcome["ok"] is True and outcome["workflow_id"] == handle.id
    assert outcome["events"] == len(history.events)


@pytest.mark.usefixtures("worker")
async def test_divergent_code_is_reported_with_the_event(
    client: Client, task_queue: str, scripted: Any, workspace: Path
) -> None:
    """Replaying against a different workflow (same type name, another
    activity) is a nondeterminism error at its first command."""
    handle = await _completed_task(client, task_queue, scripted, workspace)
    history = await handle.fetch_history()
    assert (await replay(history, pydantic_data_converter)).ok  # the real code replays

    outcome = await replay(
        history, pydantic_data_converter, workflows=[_Impostor],
        workflow_runner=UnsandboxedWorkflowRunner(),
    )
    assert not outcome.ok and outcome.nondeterminism, outcome
    event_id = _first_command_event(history)
    assert outcome.event_id == event_id, outcome.error
    assert outcome.error and outcome.error.startswith("[TMPRL1100] Nondeterminism error"), outcome.error
    assert outcome.describe().startswith(f"nondeterminism at event {event_id}:")


@pytest.mark.usefixtures("worker")
@pytest.mark.parametrize(("nth", "renamed"), [(0, "stopline.renamed"), (1, "stopline.tool")])
async def test_cli_exits_1_on_a_divergent_history_and_names_the_event(
    client: Client, task_queue: str, scripted: Any, workspace: Path, tmp_path: Path,
    nth: int, renamed: str,
) -> None:
    """A history whose n-th sampling activity the current code would not
    schedule (its type changed in the file) makes ``stopline replay FILE``
    exit 1 naming that event — also deep in the history, where the SDK's
    message names no event and the same activity type occurs earlier."""
    handle = await _completed_task(client, task_queue, scripted, workspace)
    history = await handle.fetch_history()
    scheduled = [
        ev for ev in history.events if ev.HasField("activity_task_scheduled_event_attributes")
        and ev.activity_task_scheduled_event_attributes.activity_type.name == "stopline.sample"
    ]
    target = scheduled[nth]
    original = target.activity_task_scheduled_event_attributes.activity_type.name
    assert original != renamed and original == "stopline.sample"
    doc = history.to_json_dict()
    for ev in doc["events"]:
        if int(ev["eventId"]) == target.event_id:
            ev["activityTaskScheduledEventAttributes"]["activityType"]["name"] = renamed
    path = tmp_path / f"{handle.id}.json"
    path.write_text(json.dumps(doc))
    res = await asyncio.to_thread(_cli, "replay", str(path))
    assert res.returncode == 1, res.stdout + res.stderr
    assert f"nondeterminism at event {target.event_id}:" in res.stdout, res.stdout
    assert "WARN" not in res.stdout + res.stderr  # the core's own log line is not repeated


def test_missing_history_file_is_a_usage_error(tmp_path: Path) -> None:
    res = _cli("replay", str(tmp_path / "nope.json"))
    assert res.returncode == 2 and "no such history file" in res.stderr


def test_event_id_is_parsed_from_core_messages() -> None:
    assert diverged_event_id("No command scheduled for event HistoryEvent(id: 5, ActivityTaskScheduled)") == 5
    assert diverged_event_id("nondeterminism at event id 12") == 12
    assert diverged_event_id("something else entirely") is None
    # a quoted activity id is not an event id: bisection finds the event instead
    quoted_activity_id = "Activity id of scheduled event '5' does not match activity id of activity command '1'"
    assert diverged_event_id(quoted_activity_id) is None


def test_replay_knows_every_workflow_type() -> None:
    names = {w.__temporal_workflow_definition.name for w in default_workflows()}  # type: ignore[attr-defined]
    assert "AgentTask" in names


# ---------------------------------------------------------------------------
# Committed histories: every one must replay against the current code.
# ---------------------------------------------------------------------------

#: ``[None]`` when the directory is empty, so the test fails instead of
#: being skipped as an empty parameter set.
_COMMITTED = sorted(HISTORIES.glob("*.json")) or [None]


def test_committed_histories_include_the_base_scenarios() -> None:
    names = {p.stem for p in HISTORIES.glob("*.json")}
    assert {"completed", "interrupted"} <= names, names


@pytest.mark.parametrize("path", _COMMITTED, ids=lambda p: p.stem if p else "none")
async def test_committed_history_replays(path: Path | None) -> None:
    assert path is not None, f"no histories in {HISTORIES}; run tests/histories/make_histories.py"
    outcome = await replay(load_history(path), pydantic_data_converter)
    assert outcome.ok, (
        f"{outcome.describe()}\nThe current workflow code cannot replay {path.name}: tasks running "
        "today would break on a worker restart. Guard the change with workflow.patched(...); "
        "regenerate the file only if breaking running tasks is intended."
    )
