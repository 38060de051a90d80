"""Tools against real processes in real temporary workspaces (activities/tools).

Every test that starts a process registers what it started with the
``reaper`` fixture, which kills it at teardown whether the test passed or not.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from temporalio.testing import ActivityEnvironment

import stopline.activities.tools as tools
from stopline.activities.running import HostConfig, configured
from stopline.activities.tools import (
    TOOL_SPECS,
    OutsideWorkspace,
    close_unattended_shells,
    kill_call_groups,
    resolve_in_workspace,
    run_tool,
    tool_activity,
)
from stopline.activities.tools.procs import group_members
from stopline.activities.tools.registry import TOOLS
from stopline.core.contracts import RespondToModel, ToolCall, ToolCallInput

TASK = "task/one"  # a '/' on purpose: ids are mapped to safe file names


# ---------------------------------------------------------------------------
# Fixtures and helpers.
# ---------------------------------------------------------------------------


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "home"
    monkeypatch.setenv("STOPLINE_HOME", str(path))
    return path


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    path = tmp_path / "ws"
    path.mkdir()
    return path


@dataclasses.dataclass
class Reaper:
    pids: list[int] = dataclasses.field(default_factory=list)
    pgids: list[int] = dataclasses.field(default_factory=list)
    pidfiles: list[Path] = dataclasses.field(default_factory=list)


@pytest.fixture
def reaper(home: Path) -> Iterator[Reaper]:
    r = Reaper()
    yield r
    close_unattended_shells(TASK, grace_s=0.0)
    for pidfile in r.pidfiles:
        try:
            r.pids.append(int(pidfile.read_text().strip()))
        except (OSError, ValueError):
            pass
    for pgid in r.pgids:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for pid in r.pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def call(ws: Path, name: str, args: dict[str, Any] | None, *, call_id: str = "call-1", **kw: Any) -> ToolCallInput:
    return ToolCallInput(
        task_id=TASK,
        call=ToolCall(id=call_id, name=name, arguments=args),
        workspace=str(ws),
        **kw,
    )


async def run_ok(inp: ToolCallInput) -> RespondToModel:
    out = await run_tool(inp)
    assert isinstance(out, RespondToModel), out
    return out


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


async def wait_for(predicate: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def read_pid(path: Path, timeout: float = 5.0) -> int:
    await wait_for(lambda: path.exists() and path.read_text().strip().isdigit(), timeout)
    return int(path.read_text().strip())


def first_int(text: str) -> int:
    m = re.search(r"--- stdout ---\n(\d+)", text)
    assert m, text
    return int(m.group(1))


# ---------------------------------------------------------------------------
# API surface.
# ---------------------------------------------------------------------------


def test_exports_and_specs() -> None:
    assert sorted(tools.__all__) == sorted(
        [
            "TOOL_SPECS",
            "OutsideWorkspace",
            "close_unattended_shells",
            "kill_call_groups",
            "resolve_in_workspace",
            "run_tool",
            "tool_activity",
        ]
    )
    for name in tools.__all__:
        assert getattr(tools, name) is not None
    names = [s.name for s in TOOL_SPECS]
    assert names == ["shell", "shell_status", "shell_kill", "read_file", "write_file", "list_dir", "apply_patch"]
    for spec in TOOL_SPECS:
        schema = spec.input_schema
        assert schema["type"] == "object" and spec.description
        assert set(schema["properties"]) == set(TOOLS[spec.name].args.model_fields), spec.name
        for req in schema["required"]:
            assert TOOLS[spec.name].args.model_fields[req].is_required(), (spec.name, req)


def test_activity_name() -> None:
    from temporalio import activity

    defn = activity._Definition.from_callable(tool_activity)
    assert defn is not None and defn.name == "stopline.tool"


# ---------------------------------------------------------------------------
# Workspace confinement.
# ---------------------------------------------------------------------------


def test_resolve_in_workspace(tmp_path: Path, ws: Path) -> None:
    (ws / "sub").mkdir()
    (ws / "inner_link").symlink_to(ws / "sub")
    evil = tmp_path / "ws-evil"
    evil.mkdir()
    real_ws = Path(os.path.realpath(ws))
    assert resolve_in_workspace(ws, "sub/file.txt") == real_ws / "sub" / "file.txt"
    assert resolve_in_workspace(ws, "") == real_ws
    assert resolve_in_workspace(ws, str(ws / "sub")) == real_ws / "sub"
    assert resolve_in_workspace(ws, "inner_link/x") == real_ws / "sub" / "x"
    assert resolve_in_workspace(str(ws), "sub/../sub/./y") == real_ws / "sub" / "y"
    for bad in ["..", "../ws-evil/x", str(evil), "/etc/passwd", "sub/../../x"]:
        with pytest.raises(OutsideWorkspace) as info:
            resolve_in_workspace(ws, bad)
        assert repr(bad) in str(info.value) and "outside the workspace" in str(info.value)
    assert issubclass(OutsideWorkspace, ValueError)


@pytest.mark.parametrize(
    ("name", "args"),
    [
        ("read_file", {"path": "../outside/secret.txt"}),
        ("read_file", {"path": "link/secret.txt"}),
        ("read_file", {"path": "{outside}/secret.txt"}),
        ("write_file", {"path": "link/secret.txt", "content": "pwned"}),
        ("write_file", {"path": "../outside/new.txt", "content": "pwned"}),
        ("list_dir", {"path": ".."}),
        ("list_dir", {"path": "link"}),
        ("shell", {"command": "pwd", "cwd": ".."}),
        ("shell", {"command": "pwd", "cwd": "link"}),
        ("apply_patch", {"patch": "--- a/link/secret.txt\n+++ b/link/secret.txt\n@@ -1 +1 @@\n-secret\n+pwned\n"}),
        ("apply_patch", {"patch": "--- /dev/null\n+++ b/../outside/new.txt\n@@ -0,0 +1 @@\n+pwned\n"}),
    ],
)
async def test_paths_outside_workspace_are_refused(
    tmp_path: Path, ws: Path, home: Path, name: str, args: dict[str, Any]
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("secret\n")
    (ws / "link").symlink_to(outside)
    args = {k: v.replace("{outside}", str(outside)) if isinstance(v, str) else v for k, v in args.items()}
    out = await run_ok(call(ws, name, args))
    assert out.ok is False
    assert "outside the workspace" in out.text
    assert (outside / "secret.txt").read_text() == "secret\n"
    assert not (outside / "new.txt").exists()


# ---------------------------------------------------------------------------
# Triage at the boundary (DESIGN §2).
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "args", "needle"),
    [
        ("no_such_tool", {}, "unknown tool 'no_such_tool'"),
        ("shell", {}, "command: Field required"),
        ("shell", {"command": "ls", "timeout_s": -1}, "timeout_s: Input should be greater than 0"),
        ("shell", {"command": []}, "command"),
        ("shell", {"command": "ls", "bogus": 1}, "bogus: Extra inputs are not permitted"),
        ("read_file", {"path": "x", "offset_line": 0}, "offset_line"),
        ("write_file", {"path": "x"}, "content: Field required"),
        ("shell_status", {}, "shell_id: Field required"),
    ],
)
async def test_bad_calls_are_not_ok(ws: Path, home: Path, name: str, args: dict[str, Any], needle: str) -> None:
    out = await run_ok(call(ws, name, args))
    assert out.ok is False and out.terminal is True and not out.aborted
    assert needle in out.text, out.text


async def test_unparsed_arguments(ws: Path, home: Path) -> None:
    inp = ToolCallInput(
        task_id=TASK,
        call=ToolCall(id="c", name="shell", arguments=None, raw_arguments='{"command": "ls"', parse_error="Expecting '}'"),
        workspace=str(ws),
    )
    out = await run_ok(inp)
    assert out.ok is False
    assert out.text == "arguments were not valid JSON: Expecting '}'"


async def test_missing_workspace(tmp_path: Path, home: Path) -> None:
    out = await run_ok(call(tmp_path / "nope", "list_dir", {}))
    assert out.ok is False and "does not exist" in out.text


async def test_handler_exception_becomes_result(ws: Path, home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def boom(ctx: Any, args: Any) -> RespondToModel:
        raise RuntimeError("kaboom")

    monkeypatch.setitem(TOOLS, "list_dir", dataclasses.replace(TOOLS["list_dir"], handler=boom))
    out = await run_ok(call(ws, "list_dir", {}))
    assert out.ok is False
    assert out.text == "tool list_dir raised RuntimeError: kaboom"


# ---------------------------------------------------------------------------
# shell: foreground.
# ---------------------------------------------------------------------------


async def test_nonzero_exit_is_ok(ws: Path, home: Path) -> None:
    out = await run_ok(call(ws, "shell", {"command": "echo out; echo err >&2; exit 3"}))
    assert out.ok is True and out.terminal is True and out.aborted is False
    assert re.match(r"exit code 3 after \d+\.\ds\n--- stdout ---\nout\n\n--- stderr ---\nerr\n$", out.text), out.text
    assert out.output_ref is None
    assert out.elapsed_s > 0
    assert not (home / "ledger").exists()  # small output: no blob
    assert not list((home / "procs").rglob("*.json"))  # record removed


async def test_argv_form_and_cwd(ws: Path, home: Path) -> None:
    (ws / "sub").mkdir()
    out = await run_ok(call(ws, "shell", {"command": ["pwd"], "cwd": "sub"}))
    assert out.ok and out.text.startswith("exit code 0")
    assert os.path.realpath(ws / "sub") in out.text


@pytest.mark.usefixtures("unconfined")
async def test_killed_by_signal(ws: Path, home: Path) -> None:
    out = await run_ok(call(ws, "shell", {"command": "kill -SEGV $$"}))
    assert out.ok is True and out.text.startswith("killed by signal SIGSEGV")


async def test_missing_program_is_not_ok(ws: Path, home: Path) -> None:
    out = await run_ok(call(ws, "shell", {"command": ["definitely-not-a-program-7f3a"]}))
    assert out.ok is False
    assert "definitely-not-a-program-7f3a" in out.text and "not found" in out.text


@pytest.mark.parametrize("sandbox", ["auto", "off"])
async def test_tools_get_an_environment_by_allowlist(
    ws: Path, home: Path, monkeypatch: pytest.MonkeyPatch, sandbox: str
) -> None:
    monkeypatch.setenv("STOPLINE_SANDBOX", sandbox)
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-very-secret-0000")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAEXAMPLE0000")
    monkeypatch.setenv("DATABASE_URL", "postgres://u:pw@db/x")
    monkeypatch.setenv("STOPLINE_WORKER_ONLY", "yes")
    monkeypatch.setenv("LC_ALL", "C.UTF-8")
    out = await run_ok(call(ws, "shell", {"command": "env"}, env={"TASK_VAR": "given"}, allow_unconfined=True))
    names = {line.split("=", 1)[0] for line in out.text.splitlines() if "=" in line}
    for hidden in ("ANTHROPIC_API_KEY", "AWS_ACCESS_KEY_ID", "DATABASE_URL", "STOPLINE_WORKER_ONLY", "STOPLINE_HOME"):
        assert hidden not in names, out.text
    assert "sk-very-secret-0000" not in out.text and "AKIAEXAMPLE0000" not in out.text
    assert {"PATH", "HOME", "TERM", "LC_ALL", "TASK_VAR"} <= names, out.text
    assert "TASK_VAR=given" in out.text
    home_line = next(line for line in out.text.splitlines() if line.startswith("HOME="))
    assert home_line == ("HOME=/tmp/home" if sandbox == "auto" else f"HOME={os.path.realpath(ws)}")


@pytest.mark.usefixtures("unconfined")
async def test_timeout_stops_whole_group(ws: Path, home: Path, reaper: Reaper) -> None:
    started = time.monotonic()
    out = await run_ok(
        call(ws, "shell", {"command": "echo $$; sleep 30 & echo child $!; sleep 30", "timeout_s": 0.3})
    )
    elapsed = time.monotonic() - started
    pgid = first_int(out.text)
    reaper.pgids.append(pgid)
    child = int(re.search(r"child (\d+)", out.text).group(1))  # type: ignore[union-attr]
    assert out.ok is True and out.terminal is True and not out.aborted
    assert out.text.startswith("timed out after 0.3s"), out.text
    assert elapsed < 2.0
    assert group_members(pgid) == []
    assert not alive(pgid) and not alive(child)


async def test_timeout_is_capped_by_the_call_limit(ws: Path, home: Path) -> None:
    out = await run_ok(call(ws, "shell", {"command": "sleep 30", "timeout_s": 100}, timeout_s=0.2))
    assert out.text.startswith("timed out after 0.2s")


@pytest.mark.usefixtures("unconfined")
async def test_leader_exit_stops_children_left_in_group(ws: Path, home: Path, reaper: Reaper) -> None:
    out = await run_ok(call(ws, "shell", {"command": "sleep 30 & echo $!"}))
    child = first_int(out.text)
    reaper.pids.append(child)
    assert out.ok and out.text.startswith("exit code 0")
    assert "1 process(es) the command started were still running after it exited" in out.text
    assert not alive(child)


@pytest.mark.usefixtures("unconfined")
async def test_grandchild_holding_pipe_cannot_hang(ws: Path, home: Path, reaper: Reaper) -> None:
    gc = ws / "gc.pid"
    reaper.pidfiles.append(gc)
    started = time.monotonic()
    out = await run_ok(
        call(
            ws,
            "shell",
            {"command": "setsid bash -c 'echo $$ > gc.pid; exec sleep 30' & sleep 0.3; echo hi"},
        )
    )
    elapsed = time.monotonic() - started
    assert elapsed < 2.0
    assert out.ok and out.text.startswith("exit code 0") and "hi" in out.text
    gc_pid = int(gc.read_text())
    assert f"process(es) {gc_pid} left the command's process group" in out.text
    # it held the call's output pipe, so it was the call's: gone too
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline and _alive_not_zombie(gc_pid):
        await asyncio.sleep(0.02)
    assert not _alive_not_zombie(gc_pid)


def _alive_not_zombie(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


async def test_huge_output_is_capped_and_stored(ws: Path, home: Path) -> None:
    out = await run_ok(
        call(ws, "shell", {"command": "head -c 50000000 /dev/zero | tr '\\0' a; echo tail-marker"})
    )
    assert out.ok and out.text.startswith("exit code 0")
    assert len(out.text.encode()) <= 16_384
    assert re.search(r"\[\.\.\. \d+ bytes omitted \.\.\.\]", out.text)
    assert "tail-marker" in out.text
    assert out.output_ref == "task_one/blobs/call-1.out"
    blob = home / "ledger" / out.output_ref
    assert blob.stat().st_size == 50_000_000 + len("tail-marker\n")


async def test_output_cap_is_shared_by_streams(ws: Path, home: Path) -> None:
    out = await run_ok(
        call(
            ws,
            "shell",
            {"command": "head -c 5000 /dev/zero | tr '\\0' o; echo; echo small-err >&2"},
            output_cap_bytes=2048,
        )
    )
    assert len(out.text.encode()) <= 2048
    assert "small-err" in out.text and "bytes omitted" in out.text
    assert out.output_ref is not None
    blob = home / "ledger" / out.output_ref
    assert blob.stat().st_size == 5000 + 1 + len("small-err\n")


# ---------------------------------------------------------------------------
# Cancellation (user interrupt) through the activity.
# ---------------------------------------------------------------------------


async def _cancel_after_start(
    ws: Path, args: dict[str, Any], pidfile: Path, *, grace: float = 0.1, beats: list[Any] | None = None
) -> tuple[RespondToModel, int, float]:
    env = ActivityEnvironment()
    if beats is not None:
        env.on_heartbeat = lambda *d: beats.append(d[0] if d else None)
    with configured(HostConfig(heartbeat_interval_s=0.02)):  # beats as a probe, not the default 5 s
        task = asyncio.create_task(env.run(tool_activity, call(ws, "shell", args, kill_grace_s=grace)))
    try:
        pgid = await read_pid(pidfile)
        await asyncio.sleep(0.05)
        cancelled_at = time.monotonic()
        env.cancel()
        out = await asyncio.wait_for(task, 10)
    finally:
        if not task.done():
            task.cancel()
    assert isinstance(out, RespondToModel)
    return out, pgid, time.monotonic() - cancelled_at


@pytest.mark.usefixtures("unconfined")
async def test_cancel_process_honouring_term(ws: Path, home: Path, reaper: Reaper) -> None:
    pidfile = ws / "pid"
    reaper.pidfiles.append(pidfile)
    beats: list[Any] = []
    out, pgid, took = await _cancel_after_start(
        ws, {"command": "echo $$ > pid; echo started; sleep 100"}, pidfile, beats=beats
    )
    assert out.aborted is True and out.terminal is False and out.ok is True
    assert re.match(r"aborted by user after \d+\.\ds; the command may have partly run\. Output so far:", out.text)
    assert "started" in out.text
    assert took < 0.1 + 1.0
    assert group_members(pgid) == []
    assert {"terminal": False} in beats
    assert not list((home / "procs").rglob("*.json"))


@pytest.mark.usefixtures("unconfined")
async def test_cancel_process_ignoring_term(ws: Path, home: Path, reaper: Reaper) -> None:
    pidfile = ws / "pid"
    reaper.pidfiles.append(pidfile)
    out, pgid, took = await _cancel_after_start(
        ws,
        {"command": "trap '' TERM; echo $$ > pid; while true; do sleep 0.05; done"},
        pidfile,
        grace=0.2,
    )
    assert out.aborted is True and out.terminal is False
    assert 0.2 <= took < 0.2 + 1.0
    assert "did not exit on SIGTERM" in out.text
    assert group_members(pgid) == []


@pytest.mark.usefixtures("unconfined")
async def test_cancel_python_ignoring_term(ws: Path, home: Path, reaper: Reaper) -> None:
    pidfile = ws / "pid"
    reaper.pidfiles.append(pidfile)
    script = (
        "import os, signal, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "open('pid', 'w').write(str(os.getpid()))\n"
        "time.sleep(100)\n"
    )
    out, pgid, took = await _cancel_after_start(ws, {"command": [sys.executable, "-c", script]}, pidfile)
    assert out.aborted is True and out.terminal is False
    assert took < 0.1 + 1.0
    assert group_members(pgid) == [] and not alive(pgid)


@pytest.mark.usefixtures("unconfined")
async def test_cancel_runs_trap_behind_foreground_child(ws: Path, home: Path, reaper: Reaper) -> None:
    pidfile = ws / "pid"
    reaper.pidfiles.append(pidfile)
    out, pgid, took = await _cancel_after_start(
        ws,
        {"command": "trap 'echo cleaned > marker' TERM; echo $$ > pid; sleep 100"},
        pidfile,
        grace=0.5,
    )
    assert out.aborted is True and out.terminal is False
    assert took < 0.5 + 1.0
    assert (ws / "marker").read_text() == "cleaned\n"
    assert "did not exit on SIGTERM" not in out.text
    assert group_members(pgid) == []


@pytest.mark.usefixtures("unconfined")
async def test_cancel_after_terminal_keeps_real_result(ws: Path, home: Path, reaper: Reaper) -> None:
    # The leader exits at once; a process that left the group keeps the pipe
    # open, so the call sits in its drain phase — terminal — when the cancel
    # arrives. The real result must come back.
    gc = ws / "gc.pid"
    reaper.pidfiles.append(gc)
    beats: list[Any] = []
    env = ActivityEnvironment()
    env.on_heartbeat = lambda *d: beats.append(d[0] if d else None)
    inp = call(ws, "shell", {"command": "setsid bash -c 'echo $$ > gc.pid; exec sleep 30' & sleep 0.2; echo done; exit 4"})
    with configured(HostConfig(heartbeat_interval_s=0.02)):  # beats as a probe, not the default 5 s
        task = asyncio.create_task(env.run(tool_activity, inp))
    try:
        await wait_for(lambda: {"terminal": True} in beats)
        env.cancel()
        out = await asyncio.wait_for(task, 10)
    finally:
        if not task.done():
            task.cancel()
    assert isinstance(out, RespondToModel)
    assert out.aborted is False and out.terminal is True and out.ok is True
    assert out.text.startswith("exit code 4") and "done" in out.text


async def test_completed_call_is_not_changed_by_late_cancel(ws: Path, home: Path) -> None:
    env = ActivityEnvironment()
    out = await env.run(tool_activity, call(ws, "shell", {"command": "echo fine"}))
    env.cancel()
    assert isinstance(out, RespondToModel) and out.terminal and not out.aborted
    assert "fine" in out.text


# ---------------------------------------------------------------------------
# Process-group records and the hard abort.
# ---------------------------------------------------------------------------


@pytest.mark.usefixtures("unconfined")
async def test_kill_call_groups_kills_recorded_group(ws: Path, home: Path, reaper: Reaper) -> None:
    pidfile = ws / "pid"
    reaper.pidfiles.append(pidfile)
    task = asyncio.create_task(run_tool(call(ws, "shell", {"command": "echo $$ > pid; sleep 30"}, call_id="c-hard")))
    try:
        pgid = await read_pid(pidfile)
        record = home / "procs" / "task_one" / "c-hard.json"
        await wait_for(record.exists)
        data = json.loads(record.read_text())
        assert data["pgid"] == pgid and data["pid"] == pgid and data["started_at"] > 0
        assert kill_call_groups(TASK, ["c-hard", "never-ran"]) == [pgid]
        assert not record.exists()
        out = await asyncio.wait_for(task, 5)
    finally:
        if not task.done():
            task.cancel()
    assert isinstance(out, RespondToModel)
    assert out.text.startswith("killed by signal SIGKILL")
    assert group_members(pgid) == []
    assert kill_call_groups(TASK, ["c-hard"]) == []


# ---------------------------------------------------------------------------
# shell: background.
# ---------------------------------------------------------------------------


async def _start_background(ws: Path, command: str, call_id: str) -> tuple[str, int, RespondToModel]:
    out = await run_ok(call(ws, "shell", {"command": command, "background": True}, call_id=call_id))
    assert out.ok, out.text
    m = re.search(r"background shell (sh-[0-9a-f]{8}) \(pid (\d+)\)", out.text)
    assert m, out.text
    return m.group(1), int(m.group(2)), out


@pytest.mark.parametrize("sandbox", ["auto", "off"])
async def test_background_shell_lifecycle(
    ws: Path, home: Path, reaper: Reaper, monkeypatch: pytest.MonkeyPatch, sandbox: str
) -> None:
    monkeypatch.setenv("STOPLINE_SANDBOX", sandbox)
    shell_id, pid, started = await _start_background(ws, "echo bg-up; sleep 30", "bg-1")
    reaper.pgids.append(pid)
    log = home / "shells" / "task_one" / f"{shell_id}.log"
    assert "shell_status" in started.text and str(home) not in started.text
    record = json.loads((home / "shells" / "task_one" / f"{shell_id}.json").read_text())
    assert record["shell_id"] == shell_id and record["pid"] == pid and record["pgid"] == pid
    assert record["command"] == "echo bg-up; sleep 30" and record["log"] == str(log)
    assert record["started_at"] > 0 and record["sandbox"] is (sandbox == "auto")

    # A foreground call of the same task is interrupted: the background shell survives.
    pidfile = ws / "pid"
    if sandbox == "off":  # in a sandbox $$ is a pid of its own namespace, not the host's
        reaper.pidfiles.append(pidfile)
    fg, pgid, _ = await _cancel_after_start(ws, {"command": "echo $$ > pid; sleep 100"}, pidfile)
    assert fg.aborted
    if sandbox == "off":
        assert group_members(pgid) == []
    assert alive(pid)

    await wait_for(lambda: log.exists() and "bg-up" in log.read_text())
    status = await run_ok(call(ws, "shell_status", {"shell_id": shell_id}))
    assert status.ok and status.text.startswith(f"shell {shell_id}: running (pid {pid}")
    assert "--- log tail ---\nbg-up" in status.text

    killed = await run_ok(call(ws, "shell_kill", {"shell_id": shell_id}, kill_grace_s=0.2))
    assert killed.ok and killed.text == f"shell {shell_id} (pid {pid}) stopped (SIGTERM)"
    assert not alive(pid) and group_members(pid) == []
    status = await run_ok(call(ws, "shell_status", {"shell_id": shell_id}))
    assert f"shell {shell_id}: exited with killed by signal SIGTERM" in status.text

    again = await run_ok(call(ws, "shell_kill", {"shell_id": shell_id}))
    assert again.ok and "had already exited" in again.text


async def test_background_start_is_idempotent_per_call(ws: Path, home: Path, reaper: Reaper) -> None:
    shell_id, pid, _ = await _start_background(ws, "sleep 30", "bg-same")
    reaper.pgids.append(pid)
    again = await run_ok(call(ws, "shell", {"command": "sleep 30", "background": True}, call_id="bg-same"))
    assert again.ok and f"{shell_id} was already started by this call (pid {pid})" in again.text


async def test_unknown_shell_id_is_not_ok(ws: Path, home: Path) -> None:
    for name in ("shell_status", "shell_kill"):
        out = await run_ok(call(ws, name, {"shell_id": "sh-00000000"}))
        assert out.ok is False and "unknown shell_id 'sh-00000000'" in out.text
    out = await run_ok(call(ws, "shell_status", {"shell_id": "../../etc/passwd"}))
    assert out.ok is False


async def test_background_missing_program(ws: Path, home: Path) -> None:
    out = await run_ok(call(ws, "shell", {"command": ["no-such-prog-91x"], "background": True}))
    assert out.ok is False and "not found" in out.text


async def test_close_unattended_shells(ws: Path, home: Path, reaper: Reaper) -> None:
    running_a, pid_a, _ = await _start_background(ws, "sleep 30", "bg-a")
    running_b, pid_b, _ = await _start_background(ws, "trap '' TERM; while true; do sleep 0.05; done", "bg-b")
    done_id, done_pid, _ = await _start_background(ws, "true", "bg-c")
    reaper.pgids.extend([pid_a, pid_b])
    await wait_for(lambda: not alive(done_pid))
    # finished as its shell sees it (its sandbox may outlive the command by a
    # moment under load; a shell still ending would be closed, rightly)
    deadline = time.monotonic() + 10
    while "exited" not in (await run_ok(call(ws, "shell_status", {"shell_id": done_id}))).text:
        assert time.monotonic() < deadline, "the finished shell never reported its exit"
        await asyncio.sleep(0.05)
    closed = close_unattended_shells(TASK, grace_s=0.1)
    assert closed == sorted([running_a, running_b])
    assert not alive(pid_a) and not alive(pid_b)
    assert group_members(pid_a) == [] and group_members(pid_b) == []
    assert close_unattended_shells(TASK) == []
    # This process started them: its waiter threads reap them (no zombies).
    me = psutil.Process()
    await wait_for(
        lambda: not [c for c in me.children() if c.pid in (pid_a, pid_b, done_pid)]
    )
    status = await run_ok(call(ws, "shell_status", {"shell_id": done_id}))
    assert "exited with exit code 0" in status.text


# ---------------------------------------------------------------------------
# File tools.
# ---------------------------------------------------------------------------


async def test_write_read_list(ws: Path, home: Path) -> None:
    out = await run_ok(call(ws, "write_file", {"path": "a/b/c.txt", "content": "héllo\nworld\n"}))
    assert out.ok and out.text == "wrote 13 bytes to a/b/c.txt (created)"
    out = await run_ok(call(ws, "write_file", {"path": "a/b/c.txt", "content": "one\ntwo\nthree\n"}))
    assert out.text == "wrote 14 bytes to a/b/c.txt (overwrote)"
    out = await run_ok(call(ws, "read_file", {"path": "a/b/c.txt"}))
    assert out.ok and out.text == "one\ntwo\nthree\n"
    out = await run_ok(call(ws, "read_file", {"path": "a/b/c.txt", "offset_line": 2, "max_lines": 1}))
    assert out.text == "two\n[lines 2-2 of a/b/c.txt; more follow: use offset_line=3]"
    out = await run_ok(call(ws, "read_file", {"path": "a/b/c.txt", "offset_line": 9}))
    assert out.ok and "the file has 3 line(s)" in out.text
    (ws / "z.txt").write_text("")
    (ws / ".stopline-workspace").write_text("w-0123")  # stopline's marker (DESIGN §7): not listed
    (ws / "a" / "b" / ".stopline-workspace").write_text("")  # a project's own file of that name is
    out = await run_ok(call(ws, "list_dir", {}))
    assert out.ok and out.text == "a/\nz.txt"
    out = await run_ok(call(ws, "list_dir", {"path": "a/b"}))
    assert out.text == ".stopline-workspace\nc.txt"


async def test_read_file_is_capped(ws: Path, home: Path) -> None:
    (ws / "big.txt").write_text("".join(f"line {i:06d}\n" for i in range(100_000)))
    out = await run_ok(call(ws, "read_file", {"path": "big.txt"}, output_cap_bytes=4096))
    assert out.ok and len(out.text.encode()) <= 4096
    assert out.text.startswith("line 000000\n")
    assert re.search(r"more follow: use offset_line=\d+\]$", out.text)


@pytest.mark.parametrize(
    ("name", "args", "needle"),
    [
        ("read_file", {"path": "missing.txt"}, "not found"),
        ("read_file", {"path": "d"}, "is a directory"),
        ("write_file", {"path": "d", "content": "x"}, "is a directory"),
        ("list_dir", {"path": "missing"}, "not found"),
        ("list_dir", {"path": "f.txt"}, "not a directory"),
    ],
)
async def test_file_tool_errors(ws: Path, home: Path, name: str, args: dict[str, Any], needle: str) -> None:
    (ws / "d").mkdir()
    (ws / "f.txt").write_text("x")
    out = await run_ok(call(ws, name, args))
    assert out.ok is False and needle in out.text


PATCH = """\
--- a/src/app.py
+++ b/src/app.py
@@ -1,3 +1,3 @@
 def main():
-    print("hello")
+    print("hello, world")
     return 0
--- /dev/null
+++ b/NEWS.md
@@ -0,0 +1 @@
+- greet the world
"""


async def test_apply_patch_then_again_is_already_applied(ws: Path, home: Path) -> None:
    (ws / "src").mkdir()
    app = ws / "src" / "app.py"
    app.write_text('def main():\n    print("hello")\n    return 0\n')
    out = await run_ok(call(ws, "apply_patch", {"patch": PATCH}))
    assert out.ok and out.text.startswith("applied patch:"), out.text
    assert "src/app.py: modified, 1 hunk(s)" in out.text and "NEWS.md: created" in out.text
    after = app.read_text()
    assert 'print("hello, world")' in after
    assert (ws / "NEWS.md").read_text() == "- greet the world\n"
    again = await run_ok(call(ws, "apply_patch", {"patch": PATCH}))
    assert again.ok is True
    assert again.text == "patch already applied to src/app.py, NEWS.md; nothing changed"
    assert app.read_text() == after


async def test_apply_patch_mismatch_writes_nothing(ws: Path, home: Path) -> None:
    (ws / "src").mkdir()
    app = ws / "src" / "app.py"
    original = 'def main():\n    print("bonjour")\n    return 0\n'
    app.write_text(original)
    (ws / "other.txt").write_text("one\n")
    patch = "--- a/other.txt\n+++ b/other.txt\n@@ -1 +1 @@\n-one\n+two\n" + PATCH
    out = await run_ok(call(ws, "apply_patch", {"patch": patch}))
    assert out.ok is False
    assert "nothing was written" in out.text
    assert "src/app.py: hunk 1" in out.text
    assert "expected line 2 to be '    print(\"hello\")'" in out.text
    assert "found '    print(\"bonjour\")'" in out.text
    assert app.read_text() == original
    assert (ws / "other.txt").read_text() == "one\n"
    assert not (ws / "NEWS.md").exists()


async def test_apply_patch_deletes_and_reports_parse_errors(ws: Path, home: Path) -> None:
    (ws / "old.txt").write_text("bye\n")
    out = await run_ok(call(ws, "apply_patch", {"patch": "--- a/old.txt\n+++ /dev/null\n@@ -1 +0,0 @@\n-bye\n"}))
    assert out.ok and not (ws / "old.txt").exists()
    out = await run_ok(call(ws, "apply_patch", {"patch": "not a diff"}))
    assert out.ok is False and "could not parse the patch" in out.text


async def test_read_file_refuses_a_fifo_instead_of_blocking_the_worker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A FIFO would block the event loop (every activity, every heartbeat)."""
    import os as _os

    from stopline.activities.tools import run_tool
    from stopline.core.contracts import ToolCall, ToolCallInput

    monkeypatch.setenv("STOPLINE_HOME", str(tmp_path / "home"))
    ws = tmp_path / "ws"
    ws.mkdir()
    _os.mkfifo(ws / "f")
    for name, args in (("read_file", {"path": "f"}),
                       ("apply_patch", {"patch": "--- a/f\n+++ b/f\n@@ -1 +1 @@\n-a\n+b\n"})):
        out = await asyncio.wait_for(run_tool(ToolCallInput(
            task_id="t", call=ToolCall(id=f"c-{name}", name=name, arguments=args), workspace=str(ws),
        )), 5)
        assert out.ok is False and "not a regular file" in out.text, out


def test_group_watch_walks_proc_only_when_known_members_are_gone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Waiting on a group whose member lives costs a stat read per check, not
    a walk of /proc (which blocked the event loop through a TERM-ignoring
    call's grace); a member forked after the walk and a group left with only
    a zombie are still told apart from an empty one."""
    import contextlib
    import subprocess

    from stopline.activities.tools import procs

    walks = []
    real = procs.group_members
    monkeypatch.setattr(procs, "group_members", lambda pgid: walks.append(pgid) or real(pgid))

    # a leader that lives on, then exits leaving a child it forked late
    proc = subprocess.Popen(["sh", "-c", "sleep 0.4; sleep 30 & exit 0"],
                            start_new_session=True)
    try:
        watch = procs._GroupWatch(proc.pid)
        checks = 0
        while proc.poll() is None:
            assert not watch.emptied()
            checks += 1
            time.sleep(procs.POLL_S)
        # one walk (two if a check fell between its exit and its reaping);
        # a walk on a timer alone made ~11 in these 0.4 s
        assert checks > 20 and len(walks) <= 2, (checks, walks)
        # the leader is reaped; its late child is a member the walk never saw
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            assert not watch.emptied()
            time.sleep(procs.POLL_S)
        assert len(walks) > 1  # it walked again to find it
        os.killpg(proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while not watch.emptied() and time.monotonic() < deadline:
            time.sleep(procs.POLL_S)
        assert watch.emptied()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    # only a zombie left (our child, not reaped yet): emptied, by a walk
    zombie = subprocess.Popen(["sh", "-c", "exit 0"], start_new_session=True)
    try:
        time.sleep(0.2)
        assert procs._proc_stat(zombie.pid)[0] == "Z"
        watch = procs._GroupWatch(zombie.pid)
        assert watch.emptied()
    finally:
        zombie.wait()
