"""Bounded disk: caps on what a call and a background shell store, and retention.

A command that prints 1 GiB, a background shell that never stops talking,
finished tasks piling up blobs: each stays within a setting, and the model or
the operator is told where the cut is.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client, WorkflowHandle

from stopline.activities.retention import collect, workflow_closed_probe
from stopline.activities.tools import close_unattended_shells, run_tool
from stopline.core.contracts import RespondToModel, ToolCall, ToolCallInput
from stopline.settings import load_settings
from stopline.testing.scripted import anthropic_message, entry, scenario
from tests.conftest import start_task

GIB = 1 << 30


def _call(ws: Path, name: str, args: dict[str, Any], call_id: str = "c1", **kw: Any) -> ToolCallInput:
    return ToolCallInput(task_id="disk", call=ToolCall(id=call_id, name=name, arguments=args), workspace=str(ws), **kw)


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    path = tmp_path / "ws"
    path.mkdir()
    return path


async def test_a_1gib_output_is_stored_up_to_its_cap_and_says_so(
    ws: Path, stopline_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cap = 4 << 20
    monkeypatch.setenv("STOPLINE_TOOL_OUTPUT_STORE_CAP_BYTES", str(cap))
    out = await run_tool(_call(ws, "shell", {"command": "yes | head -c 1G; echo END-OF-OUTPUT"}))
    assert isinstance(out, RespondToModel) and out.ok and out.text.startswith("exit code 0")
    assert len(out.text.encode()) <= 16_384 and "END-OF-OUTPUT" in out.text  # head + tail inline
    assert f"the output was {GIB + len('END-OF-OUTPUT') + 1} bytes" in out.text
    assert f"keeps its first {cap} bytes" in out.text
    blob = stopline_home / "ledger" / out.output_ref  # type: ignore[operator]
    size = blob.stat().st_size
    assert cap < size <= cap + 200, size
    with blob.open("rb") as f:
        f.seek(cap)
        tail = f.read().decode()
    assert "bytes of output not stored" in tail and f"capped at {cap} bytes" in tail


async def test_a_chatty_background_shell_keeps_its_log_within_the_cap(
    ws: Path, stopline_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cap = 64 * 1024
    monkeypatch.setenv("STOPLINE_SHELL_LOG_CAP_BYTES", str(cap))
    started = await run_tool(_call(
        ws, "shell",
        {"command": "for i in $(seq 1 40); do head -c 100000 /dev/zero | tr '\\0' x; echo; done; "
                    "echo LAST-LINE; sleep 30", "background": True},
    ))
    assert isinstance(started, RespondToModel) and started.ok, started.text
    shell_id = started.text.split("background shell ", 1)[1].split()[0]
    logs = stopline_home / "shells" / "disk"
    try:
        deadline = time.monotonic() + 30
        while "LAST-LINE" not in _read(logs / f"{shell_id}.log"):
            assert time.monotonic() < deadline, "the shell never finished talking"
            await asyncio.sleep(0.05)
        on_disk = sum(p.stat().st_size for p in logs.glob(f"{shell_id}.log*") if not p.name.endswith(".cut"))
        assert on_disk <= cap, on_disk
        status = await run_tool(_call(ws, "shell_status", {"shell_id": shell_id}, call_id="c2"))
        assert isinstance(status, RespondToModel) and status.ok
        dropped = json.loads((logs / f"{shell_id}.log.cut").read_text())["dropped"]
        assert dropped >= 40 * 100_001 - cap
        assert f"[log capped at {cap} bytes: the oldest {dropped} bytes of output were dropped]" in status.text
        assert status.text.rstrip().endswith("LAST-LINE")
    finally:
        close_unattended_shells("disk", grace_s=0.1)


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


async def _with_blob_then(client: Client, task_queue: str, scripted: Any, workspace: Path, then: dict[str, Any]) -> WorkflowHandle[Any, Any]:
    """A task whose first call leaves a blob (output over the inline cap); then ``then``."""
    server = scripted(scenario(
        "anthropic",
        entry(anthropic_message(tool_calls=[("big", "shell", {"command": "head -c 100000 /dev/zero | tr '\\0' y"})])),
        entry(anthropic_message(tool_calls=[("next", "shell", then)])),
        entry(anthropic_message("done")),
    ))
    return await start_task(client, task_queue, server, workspace, task_id=f"gc-{uuid.uuid4().hex[:8]}")


@pytest.mark.usefixtures("worker")
async def test_stopline_gc_removes_a_finished_tasks_blobs_and_keeps_a_running_ones(
    client: Client, task_queue: str, scripted: Any, tmp_path: Path, stopline_home: Path,
) -> None:
    ws_done, ws_running = tmp_path / "ws-done", tmp_path / "ws-running"
    ws_done.mkdir()
    ws_running.mkdir()
    done = await _with_blob_then(client, task_queue, scripted, ws_done, {"command": "echo quick"})
    running = await _with_blob_then(client, task_queue, scripted, ws_running,
                                    {"command": "touch started; sleep 120"})
    try:
        assert (await asyncio.wait_for(done.result(), 60)).status == "completed"
        deadline = time.monotonic() + 30
        while not (ws_running / "started").exists():
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        blobs_done = stopline_home / "ledger" / done.id / "blobs"
        blobs_running = stopline_home / "ledger" / running.id / "blobs"
        assert list(blobs_done.iterdir()) and list(blobs_running.iterdir())
        env = {k: v for k, v in os.environ.items() if k != "STOPLINE_SANDBOX"}
        env.update(STOPLINE_HOME=str(stopline_home),
                   TEMPORAL_ADDRESS=client.service_client.config.target_host)
        gc = subprocess.run([sys.executable, "-m", "stopline.cli", "gc", "--json"], env=env,
                            capture_output=True, text=True, timeout=60)
        assert gc.returncode == 0, gc.stderr
        report = json.loads(gc.stdout)
        assert done.id in report["removed_tasks"] and running.id in report["kept_running"]
        assert report["freed_bytes"] >= 100_000
        assert not blobs_done.exists() and list(blobs_running.iterdir())
        # the transcript stays
        assert (stopline_home / "ledger" / done.id / "ledger.jsonl").stat().st_size > 0
    finally:
        await running.cancel()
        await asyncio.wait_for(running.result(), 30)


@pytest.mark.usefixtures("worker")
async def test_the_age_limit_keeps_recent_finished_tasks(
    client: Client, task_queue: str, scripted: Any, workspace: Path, stopline_home: Path,
) -> None:
    task = await _with_blob_then(client, task_queue, scripted, workspace, {"command": "echo quick"})
    assert (await asyncio.wait_for(task.result(), 60)).status == "completed"
    settings = load_settings()
    closed = workflow_closed_probe(client)
    week = 7 * 86400.0
    kept = await collect(settings, closed, older_than_s=week)
    assert task.id not in kept.removed_tasks
    assert (stopline_home / "ledger" / task.id / "blobs").exists()
    # eight days later
    removed = await collect(settings, closed, older_than_s=week, now=time.time() + 8 * 86400)
    assert task.id in removed.removed_tasks
    assert not (stopline_home / "ledger" / task.id / "blobs").exists()
    assert not (stopline_home / "ledger" / task.id / "staged").exists()
