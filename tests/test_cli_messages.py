"""Every message the CLI prints is true: each wording is checked here as a
person meets it — the real ``stopline`` command in a subprocess, against the
session's dev server (``TEMPORAL_ADDRESS``) and in-process workers — by its
exit code and one line."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client

from stopline.activities.ledger import LedgerStore
from stopline.cli import tool_mark
from stopline.core.contracts import AgentTaskInput, AgentTaskResult
from stopline.core.policies import cancel_stop_reason
from stopline.core.refusal import NOT_CONTINUABLE, NOT_CONTINUABLE_CLI
from stopline.settings import load_settings
from stopline.testing.scripted import anthropic_message, entry, scenario
from stopline.testing.workers import running_workers
from stopline.worker.runtime import build_workers, connect, free_port
from tests.conftest import start_task


def _address(client: Client) -> str:
    return client.service_client.config.target_host


@pytest.fixture
def env(client: Client, task_queue: str, stopline_home: Path) -> dict[str, str]:
    """The environment of a CLI pointed at the session server and this test's queue."""
    out = {k: v for k, v in os.environ.items()
           if k not in ("STOPLINE_CODEC_KEY", "STOPLINE_CODEC_PREVIOUS_KEYS")}
    out.update(TEMPORAL_ADDRESS=_address(client), STOPLINE_HOME=str(stopline_home),
               STOPLINE_TASK_QUEUE=task_queue)
    return out


def _cli(env: dict[str, str], *args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "stopline.cli", *args], env=env,
                          capture_output=True, text=True, timeout=timeout)


async def _acli(env: dict[str, str], *args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    """The CLI run off the event loop (the in-process workers need it)."""
    return await asyncio.to_thread(_cli, env, *args, timeout=timeout)


def _one_line(text: str, needle: str) -> str:
    lines = [ln for ln in text.splitlines() if needle in ln]
    assert lines, f"no line with {needle!r} in:\n{text}"
    return lines[0]


def _scen(tmp_path: Path, name: str, *entries: dict[str, Any]) -> Path:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(scenario("anthropic", *entries)))
    return path


async def _detached_in_a_long_tool(env: dict[str, str], tmp_path: Path, workspace: Path) -> str:
    """``run --detach`` a task whose tool call sleeps 100 s; its id once the call runs."""
    slow = _scen(tmp_path, "slow", entry(anthropic_message(
        tool_calls=[("c1", "shell", {"command": "echo $$ > pid; sleep 100"})])))
    task_id = f"task-{uuid.uuid4().hex[:8]}"
    run = await _acli(env, "run", "go", "--model", f"scripted:{slow}", "--workspace", str(workspace),
                      "--id", task_id, "--detach")
    assert run.returncode == 0, run.stderr
    deadline = time.monotonic() + 30
    while not (workspace / "pid").exists() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert (workspace / "pid").exists()
    return task_id


# --------------------------------------------------------------- pure wording


def test_cancel_reasons_name_a_cancel() -> None:
    assert cancel_stop_reason("") == "cancelled by a workflow cancel request (no reason given)"
    assert cancel_stop_reason("`stopline stop`") == "cancelled by a workflow cancel request: `stopline stop`"
    assert cancel_stop_reason(
        "Cancel requested by workflow with run id 01ab with reason: its parent task t ended (completed)"
    ) == "cancelled by a workflow cancel request: its parent task t ended (completed)"
    assert cancel_stop_reason("Cancel requested by workflow with run id 01ab with reason: ") == (
        "cancelled by a workflow cancel request: sent by workflow run 01ab"
    )


def test_a_failing_command_is_marked_failed_and_ok_stays_the_handlers() -> None:
    assert tool_mark("shell", True, "exit code 2 after 0.0s") == "✗"
    assert tool_mark("shell", True, "killed by signal SIGKILL after 1.0s") == "✗"
    assert tool_mark("shell", True, "timed out after 5s; its process group was stopped (SIGTERM)") == "✗"
    assert tool_mark("shell", True, "exit code 0 after 0.1s") == "✓"
    assert tool_mark("shell", True, "exit code 10 after 0.1s") == "✗"
    assert tool_mark("read_file", False, "no such file") == "✗"
    assert tool_mark("shell", True, "aborted by user after 0.5s") == "⊘"
    assert tool_mark("write_file", True, "wrote 3 bytes") == "✓"


def test_the_cli_refusal_sentence_names_the_cli_verbs() -> None:
    assert "stopline run --model" in NOT_CONTINUABLE_CLI and "task_start" not in NOT_CONTINUABLE_CLI
    assert "task_start" in NOT_CONTINUABLE  # the model-facing one keeps its tools


# ------------------------------------------------------- who answers, or not


def test_server_unreachable(env: dict[str, str]) -> None:
    port = free_port()
    out = _cli({**env, "TEMPORAL_ADDRESS": f"127.0.0.1:{port}"}, "status", "task-x")
    assert out.returncode == 2
    assert _one_line(out.stderr, "error:").startswith(f"error: cannot reach the Temporal server at 127.0.0.1:{port}")
    assert "Traceback" not in out.stderr and "WARN" not in out.stderr


async def test_no_worker_at_all(client: Client, env: dict[str, str], workspace: Path) -> None:
    task_id = f"task-{uuid.uuid4().hex[:8]}"
    queue = env["STOPLINE_TASK_QUEUE"]
    await client.start_workflow(
        "AgentTask", AgentTaskInput(prompt="x", model="anthropic:m", workspace=str(workspace)),
        id=task_id, task_queue=queue,
    )
    try:
        out = await _acli(env, "status", task_id)
        assert out.returncode == 2
        assert _one_line(out.stderr, "error:") == (
            f"error: no worker is running: nothing polls task queue {queue} (start one: `stopline-worker` "
            f"with TEMPORAL_ADDRESS={env['TEMPORAL_ADDRESS']}); the status of {task_id} is answered by a worker"
        )
        # and `run` says what to start instead of waiting in silence
        scen = _scen(workspace.parent, "s", entry(anthropic_message("hi")))
        run = await _acli(env, "run", "go", "--model", f"scripted:{scen}", "--workspace", str(workspace),
                          "--detach", "--id", f"{task_id}-b")
        assert run.returncode == 0, run.stderr
        assert _one_line(run.stderr, "no host").startswith(
            f"no host takes tasks on queue {queue}-pool: start `stopline-worker` with "
            f"TEMPORAL_ADDRESS={env['TEMPORAL_ADDRESS']}"
        )
        assert "stopline up" not in run.stderr
    finally:
        for wid in (task_id, f"{task_id}-b"):
            await client.get_workflow_handle(wid).terminate("test cleanup")


async def test_interrupt_and_message_say_so_when_the_worker_just_went_away(
    client: Client, env: dict[str, str], workspace: Path, tmp_path: Path, task_queue: str
) -> None:
    """The task's only worker stopped a moment ago, so it still counts as a
    recent poller: the Update is sent, and nothing takes it up. Both commands
    say so within their bound instead of waiting for ever."""
    from stopline.activities.tasks import UPDATE_ACCEPT_WAIT_S

    task_id = ""
    try:
        async with running_workers(build_workers(client, load_settings(), task_queue=task_queue)):
            task_id = await _detached_in_a_long_tool(env, tmp_path, workspace)
        started = time.monotonic()
        interrupt, message = await asyncio.gather(
            _acli(env, "interrupt", task_id), _acli(env, "message", task_id, "are you there?"))
        took = time.monotonic() - started
        for out, update in ((interrupt, "interrupt"), (message, "message")):
            assert out.returncode == 2, out.stdout + out.stderr
            assert _one_line(out.stderr, "error:").startswith(
                f"error: no worker took up the '{update}' Update of task {task_id} within "
                f"{UPDATE_ACCEPT_WAIT_S:g}s: its worker is gone or stuck"
            ), out.stderr
        assert UPDATE_ACCEPT_WAIT_S <= took < UPDATE_ACCEPT_WAIT_S + 20, took
    finally:
        if task_id:
            await client.get_workflow_handle(task_id).terminate("test cleanup")


@pytest.mark.usefixtures("worker")
async def test_no_worker_polls_this_tasks_queue(
    client: Client, env: dict[str, str], workspace: Path
) -> None:
    task_id = f"task-{uuid.uuid4().hex[:8]}"
    other = f"other-{uuid.uuid4().hex[:8]}"
    await client.start_workflow(
        "AgentTask", AgentTaskInput(prompt="x", model="anthropic:m", workspace=str(workspace)),
        id=task_id, task_queue=other,
    )
    try:
        out = await _acli(env, "status", task_id)
        assert out.returncode == 2
        assert _one_line(out.stderr, "error:").startswith(
            f"error: no worker polls this task's queue {other} (workers poll {env['STOPLINE_TASK_QUEUE']}); "
            f"start one with STOPLINE_TASK_QUEUE={other}"
        )
    finally:
        await client.get_workflow_handle(task_id).terminate("test cleanup")


async def test_cannot_decode_without_the_key(
    client: Client, task_queue: str, scripted: Any, workspace: Path, env: dict[str, str]
) -> None:
    settings = load_settings(codec_key=base64.b64encode(os.urandom(32)).decode())
    secure = await connect(settings, address=_address(client))
    workers = build_workers(secure, settings, task_queue=task_queue)
    async with running_workers(workers):
        server = scripted(scenario("anthropic", entry(anthropic_message("secret answer"))))
        handle = await start_task(secure, task_queue, server, workspace)
        assert (await handle.result()).status == "completed"
        want = ("error: cannot decode the task's payloads: they are encrypted and this command has "
                "no key; set STOPLINE_CODEC_KEY to the key its workers use")
        for args in (("status", handle.id), ("wait", handle.id), ("transcript", handle.id),
                     ("replay", handle.id)):
            out = await _acli(env, *args)
            assert out.returncode == 2, (args, out.stderr)
            assert _one_line(out.stderr, "error:") == want, args
            assert "Traceback" not in out.stderr, args


# ------------------------------------------------------------ what a task says


@pytest.mark.usefixtures("worker")
async def test_stop_names_the_cancel_and_reports_an_undelivered_message(
    client: Client, env: dict[str, str], workspace: Path, tmp_path: Path, stopline_home: Path
) -> None:
    task_id = await _detached_in_a_long_tool(env, tmp_path, workspace)
    msg = await _acli(env, "message", task_id, "please also check the docs")
    assert msg.returncode == 0 and msg.stdout.strip() == "message accepted (task running)", msg.stderr
    stop = await _acli(env, "stop", task_id)
    assert stop.returncode == 0, stop.stderr
    assert stop.stdout.splitlines()[0] == (
        f"{task_id} stopped: cancelled by a workflow cancel request: `stopline stop`"
    )
    assert _one_line(stop.stdout, "undelivered:").strip() == "undelivered:  please also check the docs"
    last_tool = _one_line(stop.stdout, "last tool:").strip()
    assert last_tool == "last tool:    shell command=echo $$ > pid; sleep 100", stop.stdout
    result = await client.get_workflow_handle(task_id, result_type=AgentTaskResult).result()
    assert result.undelivered_messages == ["please also check the docs"]
    rows = LedgerStore(stopline_home / "ledger").read(task_id)
    assert any(r.meta.get("undelivered_messages") == 1 for r in rows)

    # a cancel with no reason (as `temporal workflow cancel` sends) is named a cancel too
    (workspace / "pid").unlink()
    other = await _detached_in_a_long_tool(env, tmp_path, workspace)
    await client.get_workflow_handle(other).cancel()
    wait = await _acli(env, "wait", other)
    assert wait.returncode == 3
    assert wait.stdout.strip() == f"{other}: stopped: cancelled by a workflow cancel request (no reason given)"


@pytest.mark.usefixtures("worker")
async def test_run_marks_a_failing_command_failed_and_lists_read_well(
    client: Client, env: dict[str, str], workspace: Path, tmp_path: Path, stopline_home: Path
) -> None:
    scen = _scen(tmp_path, "fail",
                 entry(anthropic_message(tool_calls=[("c1", "shell", {"command": "exit 2"})])),
                 entry(anthropic_message("it exited 2")))
    task_id = f"task-{uuid.uuid4().hex[:8]}"
    run = await _acli(env, "run", "go", "--model", f"scripted:{scen}", "--workspace", str(workspace),
                      "--id", task_id)
    assert run.returncode == 0, run.stderr
    assert _one_line(run.stdout, "shell:").strip().startswith("✗ shell: exit code 2 after")
    row = next(r for r in LedgerStore(stopline_home / "ledger").read(task_id) if r.kind == "tool_result")
    assert row.ok is True  # the handler's verdict: the command ran
    # the same id again is a clear error
    again = await _acli(env, "run", "go", "--model", f"scripted:{scen}", "--workspace", str(workspace),
                        "--id", task_id)
    assert again.returncode == 2
    assert _one_line(again.stderr, "error:") == (
        f"error: task id {task_id} is already in use (a completed task); choose another --id, or "
        f"`--reuse attach` to follow that task instead"
    )
    # list: a header, then rows without Python reprs
    ls = await _acli(env, "list")
    assert ls.returncode == 0
    lines = ls.stdout.splitlines()
    assert lines[0].split() == ["ID", "KIND", "STATUS", "STARTED", "MODEL"]
    mine = _one_line(ls.stdout, task_id)
    assert "None" not in ls.stdout and "['" not in ls.stdout
    assert mine.split()[1:3] == ["task", "completed"] and mine.split()[-1] == f"scripted:{scen}"
    # status: one fact per line, no None
    st = await _acli(env, "status", task_id)
    assert st.returncode == 0 and "None" not in st.stdout
    assert _one_line(st.stdout, "result") .split(None, 1)[1] == "completed: the model ended its turn"


@pytest.mark.usefixtures("worker")
async def test_interrupt_lists_ids_joined(
    client: Client, env: dict[str, str], workspace: Path, tmp_path: Path
) -> None:
    slow = _scen(tmp_path, "slow", entry(anthropic_message(
        tool_calls=[("call_a", "shell", {"command": "echo $$ > pid; sleep 100"})])))
    task_id = f"task-{uuid.uuid4().hex[:8]}"
    assert (await _acli(env, "run", "go", "--model", f"scripted:{slow}", "--workspace", str(workspace),
                        "--id", task_id, "--detach")).returncode == 0
    deadline = time.monotonic() + 30
    while not (workspace / "pid").exists() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    out = await _acli(env, "interrupt", task_id)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == (
        f"interrupted: aborted 1 call(s) (call_a), kept 0; continue it with "
        f"`stopline message {task_id} TEXT`"
    )
    handle = client.get_workflow_handle(task_id)
    await handle.cancel(reason="stopline stop")
    await handle.result()
    again = await _acli(env, "interrupt", task_id)  # an ended task: said so, not an RPC error
    assert again.returncode == 2
    assert _one_line(again.stderr, "error:") == (
        f"error: task {task_id} has ended (stopped); there is no turn to interrupt"
    )


@pytest.mark.usefixtures("worker")
async def test_a_refused_task_points_a_person_to_stopline_run(
    client: Client, env: dict[str, str], workspace: Path, tmp_path: Path
) -> None:
    refused = _scen(tmp_path, "refused", entry(anthropic_message("no", stop_reason="refusal")))
    task_id = f"task-{uuid.uuid4().hex[:8]}"
    run = await _acli(env, "run", "go", "--model", f"scripted:{refused}", "--workspace", str(workspace),
                      "--id", task_id, "--json")
    assert run.returncode == 3
    msg = await _acli(env, "message", task_id, "go on")
    assert msg.returncode == 2
    line = " ".join(msg.stderr.split())
    assert line == f"error: {NOT_CONTINUABLE_CLI}"


@pytest.mark.usefixtures("worker")
async def test_no_traceback_when_the_reader_goes_away(
    client: Client, env: dict[str, str], workspace: Path, tmp_path: Path
) -> None:
    scen = _scen(tmp_path, "many", entry(anthropic_message(
        "x" * 2000, tool_calls=[(f"c{i}", "list_dir", {}) for i in range(30)])),
        entry(anthropic_message("done")))
    task_id = f"task-{uuid.uuid4().hex[:8]}"
    assert (await _acli(env, "run", "go", "--model", f"scripted:{scen}", "--workspace", str(workspace),
                        "--id", task_id, "--json")).returncode == 0
    for args in (("transcript", task_id, "--json"), ("list",)):
        r, w = os.pipe()
        os.close(r)  # the reader is gone before the first write
        proc = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", "stopline.cli", *args], env=env, stdout=w,
            stderr=subprocess.PIPE, text=True, timeout=60,
        )
        os.close(w)
        assert proc.returncode == 141, (args, proc.stderr)
        assert proc.stderr == "", (args, proc.stderr)
