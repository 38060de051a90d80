"""The tool sandbox tried as an attacker would (DESIGN §2, §3; README "The sandbox").

Real bubblewrap, real processes, real workspaces. A sandboxed command's pids
belong to its own PID namespace, so what a test checks is what processes
*do*: a file they would write later, a listener they would reach, a file
they would read. Every escape attempt must be denied or gone by the end of
the call, and the model must read why (seed 002: a sandbox denial is a tool
result like a failed command).

The sandbox is required here: CI installs bubblewrap through ``./dev.sh``.
Set ``STOPLINE_TEST_NO_SANDBOX=1`` to skip this module on a machine without
it (the suite then says so instead of passing vacuously).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client
from temporalio.testing import ActivityEnvironment

from stopline.activities.ledger import LedgerStore
from stopline.activities.tools import kill_call_groups, run_tool, tool_activity
from stopline.activities.tools.sandbox import sandbox_status
from stopline.core.contracts import RespondToModel, ToolCall, ToolCallInput
from stopline.settings import load_settings
from stopline.testing.scripted import anthropic_message, entry, scenario
from tests.conftest import start_task

TASK = "sandbox-task"

if os.environ.get("STOPLINE_TEST_NO_SANDBOX"):
    pytest.skip("STOPLINE_TEST_NO_SANDBOX is set", allow_module_level=True)


@pytest.fixture(autouse=True)
def _sandbox_required() -> None:
    status = sandbox_status(load_settings())
    assert status.available, (
        f"bubblewrap is needed for these tests ({status.detail}); ./dev.sh installs it "
        "(or set STOPLINE_TEST_NO_SANDBOX=1)"
    )


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "home"
    path.mkdir()
    monkeypatch.setenv("STOPLINE_HOME", str(path))
    monkeypatch.delenv("STOPLINE_SANDBOX", raising=False)
    return path


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    path = tmp_path / "ws"
    path.mkdir()
    return path


@pytest.fixture
def listener() -> Iterator[tuple[int, list[socket.socket]]]:
    """A TCP listener on the host's 127.0.0.1; the list collects what it accepted."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    srv.settimeout(0.05)
    accepted: list[socket.socket] = []
    stop = False

    def loop() -> None:
        while not stop:
            try:
                conn, _ = srv.accept()
                accepted.append(conn)
            except OSError:
                continue

    import threading

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield srv.getsockname()[1], accepted
    finally:
        stop = True
        thread.join(2)
        for conn in accepted:
            conn.close()
        srv.close()


def call(ws: Path, name: str, args: dict[str, Any], *, call_id: str | None = None, **kw: Any) -> ToolCallInput:
    return ToolCallInput(
        task_id=TASK,
        call=ToolCall(id=call_id or f"c-{uuid.uuid4().hex[:8]}", name=name, arguments=args),
        workspace=str(ws),
        **kw,
    )


async def shell(ws: Path, command: str | list[str], **kw: Any) -> RespondToModel:
    timeout_s = kw.pop("timeout_s", None)
    args: dict[str, Any] = {"command": command}
    if timeout_s is not None:
        args["timeout_s"] = timeout_s
    out = await run_tool(call(ws, "shell", args, **kw))
    assert isinstance(out, RespondToModel), out
    assert out.unconfined_reason is None, out.unconfined_reason
    return out


async def still_absent(path: Path, seconds: float) -> bool:
    """``path`` does not appear within ``seconds`` (a process that outlived its call would write it)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if path.exists():
            return False
        await asyncio.sleep(0.05)
    return not path.exists()


# ---------------------------------------------------------------------------
# What a command cannot do.
# ---------------------------------------------------------------------------


async def test_writes_outside_the_workspace_are_denied_or_gone(ws: Path, home: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    host_tmp = Path(f"/tmp/stopline-escape-{uuid.uuid4().hex[:8]}")
    out = await shell(
        ws,
        f"echo x > {host_tmp} && echo tmp-ok; echo x > /etc/stopline-escape; "
        f"echo x > /usr/stopline-escape; echo x > {outside}/f; echo x > inside.txt; "
        f"echo x > /stopline-escape; echo x > /dev/stopline-escape; "
        f"head -c 100000000 /dev/zero > /dev/shm/big; ls -l /dev/shm/big; echo x > /dev/null && echo null-ok",
    )
    try:
        assert out.ok and "tmp-ok" in out.text  # its own private /tmp
        assert "/etc/stopline-escape: Read-only file system" in out.text
        assert "/usr/stopline-escape: Read-only file system" in out.text
        # the sandbox's own root (an unsized tmpfs) takes no writes either
        assert re.search(r"(^|\s)/stopline-escape: Read-only file system", out.text, re.M), out.text
        assert "/dev/stopline-escape: Read-only file system" in out.text
        # shared memory has its own capped tmpfs (64 MiB), not the unsized /dev
        assert "No space left on device" in out.text and f" {64 * 1024 * 1024} " in out.text, out.text
        assert "null-ok" in out.text
        assert f"{outside}/f: No such file or directory" in out.text
        assert not host_tmp.exists() and not Path("/etc/stopline-escape").exists()
        assert list(outside.iterdir()) == []
        assert (ws / "inside.txt").read_text() == "x\n"
    finally:
        host_tmp.unlink(missing_ok=True)


async def test_stopline_home_and_other_workspaces_are_not_visible(ws: Path, home: Path, tmp_path: Path) -> None:
    (home / "ledger").mkdir()
    (home / "ledger" / "other.jsonl").write_text("SECRET-LEDGER\n")
    other_ws = tmp_path / "other-ws"
    other_ws.mkdir()
    (other_ws / "code.py").write_text("SECRET-OTHER\n")
    out = await shell(ws, f"ls {home}; cat {home}/ledger/other.jsonl; cat {other_ws}/code.py; ls {tmp_path}")
    assert "SECRET-LEDGER" not in out.text and "SECRET-OTHER" not in out.text
    assert f"ls: cannot access '{home}': No such file or directory" in out.text
    # of the test's directory, only the path down to the workspace exists
    stdout = out.text.split("--- stdout ---\n", 1)[1].split("--- stderr ---", 1)[0].split()
    assert stdout == ["ws"], out.text


async def test_stopline_home_inside_the_workspace_is_hidden(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ws = tmp_path / "ws"
    home = ws / ".stopline"
    (home / "ledger").mkdir(parents=True)
    (home / "ledger" / "x.jsonl").write_text("SECRET-LEDGER\n")
    monkeypatch.setenv("STOPLINE_HOME", str(home))
    (ws / "visible.txt").write_text("hello\n")
    out = await shell(ws, "cat visible.txt; ls -A .stopline; cat .stopline/ledger/x.jsonl")
    assert "hello" in out.text and "SECRET-LEDGER" not in out.text
    assert ".stopline/ledger/x.jsonl: No such file or directory" in out.text


async def test_other_processes_and_their_environments_are_not_visible(
    ws: Path, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-ant-sandbox-test-0123456789")
    out = await shell(
        ws, f"cat /proc/{os.getpid()}/environ; tr '\\0' '\\n' < /proc/1/environ; ls /proc | grep -c '^[0-9]'"
    )
    assert "sk-ant-sandbox-test-0123456789" not in out.text
    assert f"/proc/{os.getpid()}/environ: No such file or directory" in out.text
    # the sandbox's own processes only: its PID 1, the supervisor, the shell, ls, grep
    count = int(out.text.split("--- stdout ---\n", 1)[1].split("--- stderr ---", 1)[0].split()[-1])
    assert count <= 6, out.text


async def test_no_capabilities_even_for_a_root_worker(ws: Path, home: Path) -> None:
    out = await shell(ws, "grep CapEff /proc/self/status; mount -o remount,rw /usr 2>&1 || echo denied")
    assert "CapEff:\t0000000000000000" in out.text and "denied" in out.text


async def test_no_network_unless_the_task_allows_it(
    ws: Path, home: Path, listener: tuple[int, list[socket.socket]]
) -> None:
    port, accepted = listener
    out = await shell(ws, f"echo hi > /dev/tcp/127.0.0.1/{port} && echo connected")
    assert "Connection refused" in out.text and "connected" not in out.text
    await asyncio.sleep(0.2)
    assert accepted == []
    allowed = await shell(ws, f"echo hi > /dev/tcp/127.0.0.1/{port} && echo connected", network=True)
    assert "connected" in allowed.text
    deadline = time.monotonic() + 2
    while not accepted and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert len(accepted) == 1


# ---------------------------------------------------------------------------
# Nothing outlives a foreground call; the model reads what was stopped.
# ---------------------------------------------------------------------------


async def test_setsid_and_double_fork_escapers_are_gone_at_the_call_end(ws: Path, home: Path) -> None:
    started = time.monotonic()
    out = await shell(
        ws,
        "setsid bash -c 'sleep 3; echo escaped > late1' </dev/null >/dev/null 2>&1 & "
        "( ( sleep 3; echo escaped > late2 ) & ) ; "
        "nohup bash -c 'trap \"\" TERM; sleep 3; echo escaped > late3' >/dev/null 2>&1 & "
        "echo leader-done",
        kill_grace_s=0.2,
    )
    took = time.monotonic() - started
    assert took < 2.5, f"the call took {took:.1f}s: too long to tell whether they were stopped"
    assert out.ok and out.text.startswith("exit code 0") and "leader-done" in out.text
    assert "process(es) the command started were still running after it exited" in out.text
    assert "use background=true" in out.text
    assert await still_absent(ws / "late1", 3.5 - took)  # they would have written by now
    assert not (ws / "late2").exists() and not (ws / "late3").exists()


async def test_timeout_terms_then_kills_everything(ws: Path, home: Path) -> None:
    started = time.monotonic()
    out = await shell(
        ws,
        "trap 'echo cleaned > trap_ran; exit 0' TERM; "
        "setsid bash -c 'trap \"\" TERM; sleep 1.5; echo late > late' </dev/null >/dev/null 2>&1 & "
        "sleep 30 & wait",
        timeout_s=0.5,
        kill_grace_s=0.3,
    )
    assert time.monotonic() - started < 3.0
    assert out.text.startswith("timed out after 0.5s; its sandbox was stopped")
    assert (ws / "trap_ran").read_text() == "cleaned\n"  # TERM first: the trap ran
    assert await still_absent(ws / "late", 2.0)  # the TERM-ignoring escaper is gone too


async def _cancelled(ws: Path, command: str, *, grace: float) -> tuple[RespondToModel, float]:
    env = ActivityEnvironment()
    task = asyncio.create_task(env.run(tool_activity, call(ws, "shell", {"command": command}, kill_grace_s=grace)))
    try:
        deadline = time.monotonic() + 10
        while not (ws / "started").exists():
            assert time.monotonic() < deadline, "the command never started"
            await asyncio.sleep(0.02)
        cancelled_at = time.monotonic()
        env.cancel()
        out = await asyncio.wait_for(task, 10)
    finally:
        if not task.done():
            task.cancel()
    assert isinstance(out, RespondToModel)
    return out, time.monotonic() - cancelled_at


async def test_interrupt_runs_the_trap_then_nothing_is_left(ws: Path, home: Path) -> None:
    out, took = await _cancelled(
        ws,
        "trap 'echo cleaned > trap_ran; exit 0' TERM; "
        "setsid bash -c 'sleep 1; echo late > late' </dev/null >/dev/null 2>&1 & "
        "touch started; sleep 100",
        # room for the trap and for the supervisor to stop the escaper, on a
        # loaded machine too: what is tested is that SIGTERM was enough
        grace=2.0,
    )
    assert out.aborted and not out.terminal and out.text.startswith("aborted by user after")
    assert took < 2.0 + 1.0
    assert (ws / "trap_ran").read_text() == "cleaned\n"
    assert "did not exit on SIGTERM" not in out.text
    assert await still_absent(ws / "late", 1.5)
    assert not list((home / "procs").rglob("*.json"))


async def test_interrupt_kills_a_command_that_ignores_term_after_the_grace(ws: Path, home: Path) -> None:
    out, took = await _cancelled(
        ws, "trap '' TERM; touch started; while true; do date +%s%N > tick; sleep 0.02; done", grace=0.3
    )
    assert out.aborted and "did not exit on SIGTERM" in out.text
    assert 0.3 <= took < 0.3 + 1.0
    last = (ws / "tick").read_text()
    await asyncio.sleep(0.3)
    assert (ws / "tick").read_text() == last  # nothing goes on writing


async def test_hard_abort_kills_a_recorded_sandbox(ws: Path, home: Path) -> None:
    task = asyncio.create_task(run_tool(call(
        ws, "shell", {"command": "touch started; while true; do date +%s%N > tick; sleep 0.02; done"},
        call_id="c-hard",
    )))
    try:
        record = home / "procs" / TASK / "c-hard.json"
        deadline = time.monotonic() + 10
        while not (record.exists() and (ws / "tick").exists()):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        data = json.loads(record.read_text())
        assert data["sandbox"] is True and data["pgid"] == data["pid"] > 1
        assert kill_call_groups(TASK, ["c-hard"]) == [data["pgid"]]
        out = await asyncio.wait_for(task, 5)
    finally:
        if not task.done():
            task.cancel()
    assert isinstance(out, RespondToModel) and out.text.startswith("killed by signal SIGKILL")
    last = (ws / "tick").read_text()
    await asyncio.sleep(0.3)
    assert (ws / "tick").read_text() == last


async def test_exit_codes_and_spawn_errors_in_the_sandbox(ws: Path, home: Path) -> None:
    out = await shell(ws, "echo out; echo err >&2; exit 3")
    assert out.text.startswith("exit code 3 after") and "out" in out.text and "err" in out.text
    out = await shell(ws, "kill -SEGV $$")
    assert out.text.startswith("exit code 139 (128+11: killed by signal SIGSEGV)")
    out = await shell(ws, ["definitely-not-a-program-7f3a"])
    assert out.ok is False and "definitely-not-a-program-7f3a" in out.text and "not found" in out.text
    (ws / "sub").mkdir()
    out = await run_tool(call(ws, "shell", {"command": ["pwd"], "cwd": "sub"}))
    assert isinstance(out, RespondToModel) and os.path.realpath(ws / "sub") in out.text


# ---------------------------------------------------------------------------
# Background shells: their own sandbox, survive the call and an interrupt.
# ---------------------------------------------------------------------------


async def test_background_shell_survives_an_interrupt_and_shell_kill_stops_all_of_it(
    ws: Path, home: Path
) -> None:
    started = await run_tool(call(
        ws, "shell",
        {"command": "setsid bash -c 'while :; do date +%s%N > tick; sleep 0.05; done' & "
                    "echo bg-up; exec sleep 300", "background": True},
        call_id="bg",
    ))
    assert isinstance(started, RespondToModel) and started.ok, started.text
    shell_id = started.text.split("background shell ", 1)[1].split()[0]
    try:
        deadline = time.monotonic() + 10
        while not (ws / "tick").exists():
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        # a foreground call of the same task is interrupted meanwhile
        fg, _ = await _cancelled(ws, "touch started; sleep 100", grace=0.1)
        assert fg.aborted
        before = (ws / "tick").read_text()
        await asyncio.sleep(0.3)
        assert (ws / "tick").read_text() != before  # still running
        status = await run_tool(call(ws, "shell_status", {"shell_id": shell_id}))
        assert isinstance(status, RespondToModel)
        assert f"shell {shell_id}: running" in status.text and "bg-up" in status.text
    finally:
        killed = await run_tool(call(ws, "shell_kill", {"shell_id": shell_id}, kill_grace_s=0.2))
    assert isinstance(killed, RespondToModel) and killed.ok and "stopped" in killed.text
    last = (ws / "tick").read_text()
    await asyncio.sleep(0.3)
    assert (ws / "tick").read_text() == last  # the setsid child went with the sandbox


# ---------------------------------------------------------------------------
# Where the sandbox cannot run: the task's policy decides.
# ---------------------------------------------------------------------------


async def test_without_bubblewrap_the_task_policy_decides(
    ws: Path, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STOPLINE_BWRAP", "/nonexistent/bwrap")
    refused = await run_tool(call(ws, "shell", {"command": "echo ran > ran"}))
    assert isinstance(refused, RespondToModel) and refused.ok is False
    assert refused.text.startswith("shell refused: commands run only in a sandbox")
    assert "bubblewrap is not installed" in refused.text and "allow_unconfined" in refused.text
    assert not (ws / "ran").exists()
    bg = await run_tool(call(ws, "shell", {"command": "echo ran > ran", "background": True}))
    assert isinstance(bg, RespondToModel) and bg.ok is False and not (ws / "ran").exists()
    wrote = await run_tool(call(ws, "write_file", {"path": "f.txt", "content": "x"}))
    assert isinstance(wrote, RespondToModel) and wrote.ok  # file tools are confined by themselves
    ran = await run_tool(call(ws, "shell", {"command": "echo ran > ran"}, allow_unconfined=True))
    assert isinstance(ran, RespondToModel) and ran.ok and (ws / "ran").exists()
    assert ran.unconfined_reason is not None and "bubblewrap is not installed" in ran.unconfined_reason


@pytest.mark.usefixtures("worker")
async def test_the_task_goes_on_and_the_model_reads_every_denial(
    client: Client, task_queue: str, scripted: Any, workspace: Path, stopline_home: Path,
    tmp_path: Path, listener: tuple[int, list[socket.socket]],
) -> None:
    port, accepted = listener
    outside = tmp_path / "outside"
    outside.mkdir()
    (stopline_home / "secret.txt").write_text("SECRET-HOME\n")
    server = scripted(scenario(
        "anthropic",
        entry(anthropic_message(tool_calls=[
            ("w", "shell", {"command": f"echo pwned > {outside}/f; echo pwned > /etc/pwned"}),
            ("h", "shell", {"command": f"cat {stopline_home}/secret.txt"}),
            ("e", "shell", {"command": f"cat /proc/{os.getpid()}/environ"}),
            ("n", "shell", {"command": f"echo hi > /dev/tcp/127.0.0.1/{port}"}),
            ("s", "shell", {"command": "setsid bash -c 'sleep 3; echo late > late' "
                                       "</dev/null >/dev/null 2>&1 & echo started-it"}),
        ])),
        entry(anthropic_message("I see what was denied.")),
    ))
    t0 = time.monotonic()
    handle = await start_task(client, task_queue, server, workspace)
    result = await asyncio.wait_for(handle.result(), 60)
    took = time.monotonic() - t0
    assert result.status == "completed" and result.final_text == "I see what was denied."
    rows = LedgerStore(stopline_home / "ledger").read(handle.id)
    results = {r.call_id: r.text or "" for r in rows if r.kind == "tool_result"}
    assert "No such file or directory" in results["w"] and "Read-only file system" in results["w"]
    assert "SECRET-HOME" not in results["h"] and "No such file or directory" in results["h"]
    assert "No such file or directory" in results["e"]
    assert "Connection refused" in results["n"]
    assert "still running after it exited" in results["s"]
    # what the model was sent in the next request says the same
    sent = json.dumps(server.requests()[1]["body"])
    for needle in ("Read-only file system", "Connection refused", "still running after it exited"):
        assert needle in sent
    assert not any(r.meta.get("unconfined") for r in rows)
    assert list(outside.iterdir()) == [] and not Path("/etc/pwned").exists() and accepted == []
    assert took < 3.0, f"the task took {took:.1f}s: too long to tell whether the sleeper was stopped"
    assert await still_absent(workspace / "late", 3.5 - took)


@pytest.mark.usefixtures("worker")
async def test_an_unconfined_run_leaves_a_ledger_row(
    client: Client, task_queue: str, scripted: Any, workspace: Path, stopline_home: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("STOPLINE_BWRAP", "/nonexistent/bwrap")
    server = scripted(scenario(
        "anthropic",
        entry(anthropic_message(tool_calls=[("c1", "shell", {"command": "echo ran"})])),
        entry(anthropic_message("done")),
        entry(anthropic_message(tool_calls=[("c2", "shell", {"command": "echo ran"})])),
        entry(anthropic_message("done")),
    ))
    allowed = await start_task(client, task_queue, server, workspace, allow_unconfined=True)
    assert (await asyncio.wait_for(allowed.result(), 60)).status == "completed"
    rows = LedgerStore(stopline_home / "ledger").read(allowed.id)
    (row,) = [r for r in rows if r.meta.get("unconfined")]
    assert row.kind == "system" and row.model_visible is False and row.call_id == "c1"
    assert "ran unconfined" in (row.text or "") and "bubblewrap is not installed" in (row.text or "")
    refused = await start_task(client, task_queue, server, workspace)
    assert (await asyncio.wait_for(refused.result(), 60)).status == "completed"
    rows = LedgerStore(stopline_home / "ledger").read(refused.id)
    (result,) = [r for r in rows if r.kind == "tool_result"]
    assert result.ok is False and "refused" in (result.text or "")
    assert not any(r.meta.get("unconfined") for r in rows)


def test_the_worker_says_at_start_whether_it_can_sandbox(tmp_path: Path) -> None:
    """The worker logs sandbox_unavailable (with why) before it connects anywhere."""
    env = {k: v for k, v in os.environ.items() if not k.endswith("_API_KEY")}
    env.update(
        STOPLINE_HOME=str(tmp_path / "home"), STOPLINE_BWRAP="/nonexistent/bwrap",
        TEMPORAL_ADDRESS="127.0.0.1:1", STOPLINE_LOG_FORMAT="json",
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "stopline.worker.main"], env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=60)  # it cannot connect: it exits
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    lines = [json.loads(x) for x in out.decode().splitlines() if x.startswith("{")]
    (line,) = [x for x in lines if x["event"] == "sandbox_unavailable"]
    assert "bubblewrap is not installed" in line["reason"] and line["level"] == "warning"
