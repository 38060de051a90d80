"""The CLI as a user runs it: ``stopline demo`` on its embedded default, and
``up`` / ``run`` / ``status`` / ``list`` / ``down``. Each starts its own dev
server on free ports under a temporary ``STOPLINE_HOME`` and must leave
nothing running."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from stopline.worker.runtime import port_open
from stopline.testing.scripted import anthropic_message, entry, scenario


def _stopline(env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "stopline.cli", *args],
        env=env, capture_output=True, text=True, timeout=timeout,
    )


def test_demo_runs_on_the_embedded_server_and_stops_it(cli_env: dict[str, str]) -> None:
    proc = _stopline(cli_env, "demo", "--json")
    try:
        assert proc.returncode == 0, proc.stderr + proc.stdout
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        assert result["status"] == "completed" and result["rounds"] == 5
        ledger = Path(cli_env["STOPLINE_HOME"]) / "ledger" / result["task_id"] / "ledger.jsonl"
        rows = [json.loads(line) for line in ledger.read_text().splitlines()]
        assert any(r["kind"] == "tool_result" and "FAILED (failures=2)" in r["text"] for r in rows)
        # what demo started, it stopped
        assert not port_open("127.0.0.1", int(cli_env["STOPLINE_DEV_SERVER_PORT"]))
        run = Path(cli_env["STOPLINE_HOME"]) / "run"
        assert not list(run.glob("*.pid")), list(run.glob("*.pid"))
    finally:
        _stopline(cli_env, "down")


def test_up_run_status_list_down(cli_env: dict[str, str], tmp_path: Path) -> None:
    scen = tmp_path / "s.json"
    scen.write_text(json.dumps(scenario(
        "anthropic",
        entry(anthropic_message(tool_calls=[("c1", "shell", {"command": "exit 4"})])),
        entry(anthropic_message("reported the exit code")),
    )))
    ws = tmp_path / "ws"
    ws.mkdir()
    try:
        up = _stopline(cli_env, "up")
        assert up.returncode == 0, up.stderr + up.stdout
        assert port_open("127.0.0.1", int(cli_env["STOPLINE_DEV_SERVER_PORT"]))
        run = _stopline(cli_env, "run", "go", "--model", f"scripted:{scen}", "--workspace", str(ws), "--json")
        assert run.returncode == 0, run.stderr + run.stdout
        task_id = json.loads(run.stdout.strip().splitlines()[-1])["task_id"]
        # run did not stop what `up` started
        assert port_open("127.0.0.1", int(cli_env["STOPLINE_DEV_SERVER_PORT"]))
        status = _stopline(cli_env, "status", task_id, "--json")
        assert status.returncode == 0, status.stderr
        st = json.loads(status.stdout)
        assert st["workflow_status"] == "COMPLETED" and st["result"]["status"] == "completed"
        listing = _stopline(cli_env, "list")
        assert task_id in listing.stdout
        missing = _stopline(cli_env, "run", "x", "--workspace", str(tmp_path / "nope"))
        assert missing.returncode == 2 and "not a directory" in missing.stderr
    finally:
        down = _stopline(cli_env, "down")
    assert down.returncode == 0
    assert not port_open("127.0.0.1", int(cli_env["STOPLINE_DEV_SERVER_PORT"]))


@pytest.mark.usefixtures("unconfined")  # follows the command by the pid it prints
def test_task_verbs_and_ctrl_c_from_the_cli(cli_env: dict[str, str], tmp_path: Path) -> None:
    """refused outcome, message/status/stop/wait on it, chat, and Ctrl-C twice."""
    import signal
    import time

    from stopline.core.refusal import NOT_CONTINUABLE_CLI, NOT_FORWARDED

    ws = tmp_path / "ws"
    ws.mkdir()
    refused = tmp_path / "refused.json"
    refused.write_text(json.dumps(scenario(
        "anthropic",
        entry(anthropic_message(tool_calls=[("c1", "shell", {"command": "echo secret-arg"})])),
        entry(anthropic_message("partial", stop_reason="refusal")),
    )))
    slow = tmp_path / "slow.json"
    slow.write_text(json.dumps(scenario(
        "anthropic",
        entry(anthropic_message(tool_calls=[("c1", "shell", {"command": "echo $$ > pid; sleep 100"})])),
        entry(anthropic_message("stopped as asked")),
    )))
    chat = tmp_path / "chat.json"
    chat.write_text(json.dumps(scenario("anthropic", entry(anthropic_message("hello from the thread")))))
    try:
        assert _stopline(cli_env, "up").returncode == 0
        run = _stopline(cli_env, "run", "go", "--model", f"scripted:{refused}", "--workspace", str(ws), "--json")
        assert run.returncode == 3, run.stderr
        result = json.loads(run.stdout.strip().splitlines()[-1])
        assert result["status"] == "stopped" and result["refused"] is True
        task_id = result["task_id"]

        msg = _stopline(cli_env, "message", task_id, "please continue")
        assert msg.returncode == 2 and NOT_CONTINUABLE_CLI in " ".join(msg.stderr.split())
        status = json.loads(_stopline(cli_env, "status", task_id, "--json").stdout)
        assert status["refusal"]["provider"] == "anthropic" and status["note"] == NOT_CONTINUABLE_CLI
        stop = json.loads(_stopline(cli_env, "stop", task_id, "--json").stdout)
        assert stop["evidence"]["last_tool"]["args_firstline"] == NOT_FORWARDED
        assert "secret-arg" not in json.dumps(stop)
        wait = _stopline(cli_env, "wait", task_id, "--json")
        assert wait.returncode == 3 and json.loads(wait.stdout)[task_id]["refused"] is True

        talk = _stopline(cli_env, "chat", "hi", "--model", f"scripted:{chat}", "--workspace", str(ws), "--close")
        assert talk.returncode == 0, talk.stderr
        assert "hello from the thread" in talk.stdout
        assert talk.stdout.splitlines()[-1].startswith("thread ") and talk.stdout.rstrip().endswith(" closed")

        # Ctrl-C while a task streams: first interrupts the turn, second detaches.
        proc = subprocess.Popen(
            [sys.executable, "-m", "stopline.cli", "run", "go", "--model", f"scripted:{slow}",
             "--workspace", str(ws)],
            env=cli_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        try:
            deadline = time.monotonic() + 60
            while not (ws / "pid").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert (ws / "pid").exists()
            time.sleep(0.5)
            proc.send_signal(signal.SIGINT)
            time.sleep(2.0)
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 130, err
        assert "interrupted" in err and "detached" in out
        slow_id = next(w for w in out.split() if w.startswith("task-"))
        ledger = Path(cli_env["STOPLINE_HOME"]) / "ledger" / slow_id / "ledger.jsonl"
        kinds = [json.loads(line)["kind"] for line in ledger.read_text().splitlines()]
        assert kinds[-1] == "turn_aborted"
        assert _stopline(cli_env, "message", slow_id, "fine, stop").returncode == 0
        assert _stopline(cli_env, "wait", slow_id).returncode == 0
    finally:
        _stopline(cli_env, "down")
    assert not port_open("127.0.0.1", int(cli_env["STOPLINE_DEV_SERVER_PORT"]))


def test_down_stops_running_tasks_with_a_reason(cli_env: dict[str, str], tmp_path: Path) -> None:
    """`down` does not strand a task waiting for a worker it stopped: the task
    records a stop naming `stopline down`, read back after the next `up`."""
    import time

    ws = tmp_path / "ws"
    ws.mkdir()
    slow = tmp_path / "slow.json"
    slow.write_text(json.dumps(scenario("anthropic", entry(anthropic_message(
        tool_calls=[("c1", "shell", {"command": "echo $$ > pid; sleep 100"})])))))
    try:
        assert _stopline(cli_env, "up").returncode == 0
        run = _stopline(cli_env, "run", "go", "--model", f"scripted:{slow}", "--workspace", str(ws),
                        "--id", "left-running", "--detach")
        assert run.returncode == 0, run.stderr
        deadline = time.monotonic() + 60
        while not (ws / "pid").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        down = _stopline(cli_env, "down")
        assert down.returncode == 0, down.stderr
        assert down.stdout.splitlines()[0] == (
            'stopped 1 running task(s) with reason "`stopline down` shut the embedded Temporal '
            'server down": left-running'
        )
        assert not port_open("127.0.0.1", int(cli_env["STOPLINE_DEV_SERVER_PORT"]))
        assert _stopline(cli_env, "up").returncode == 0
        wait = _stopline(cli_env, "wait", "left-running")
        assert wait.returncode == 3
        assert wait.stdout.strip() == (
            "left-running: stopped: cancelled by a workflow cancel request: `stopline down` shut the "
            "embedded Temporal server down"
        )
    finally:
        _stopline(cli_env, "down")
    assert not port_open("127.0.0.1", int(cli_env["STOPLINE_DEV_SERVER_PORT"]))


def test_down_kills_the_tool_calls_a_dead_worker_left(cli_env: dict[str, str], tmp_path: Path) -> None:
    """A worker killed outright cannot stop its calls; `down` stops the rest
    of the runtime, so it kills the groups the dead worker left (the tool is
    run unconfined: the test follows it by the pid it prints)."""
    import os
    import signal
    import time

    from stopline.testing.processes import group_alive

    env = {**cli_env, "STOPLINE_SANDBOX": "off"}
    ws = tmp_path / "ws"
    ws.mkdir()
    slow = tmp_path / "slow.json"
    slow.write_text(json.dumps(scenario("anthropic", entry(anthropic_message(
        tool_calls=[("c1", "shell", {"command": "echo $$ > pid; exec sleep 300"})])))))
    pgid = 0
    try:
        assert _stopline(env, "up").returncode == 0
        run = _stopline(env, "run", "go", "--model", f"scripted:{slow}", "--workspace", str(ws), "--detach")
        assert run.returncode == 0, run.stderr
        deadline = time.monotonic() + 60
        while not ((ws / "pid").exists() and (ws / "pid").read_text().strip()):
            assert time.monotonic() < deadline, "the tool never started"
            time.sleep(0.05)
        pgid = int((ws / "pid").read_text())
        worker = int((Path(env["STOPLINE_HOME"]) / "run" / "worker.pid").read_text())
        os.kill(worker, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while Path(f"/proc/{worker}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert group_alive(pgid), "the dead worker's call should still be running"
        down = _stopline(env, "down", "--timeout", "1")
        assert down.returncode == 0, down.stderr
        assert (f"killed 1 tool process group(s) a dead worker had left running (pgid {pgid})"
                in down.stdout), down.stdout
        assert not group_alive(pgid)
    finally:
        _stopline(env, "down", "--timeout", "1")
        if pgid and group_alive(pgid):
            os.killpg(pgid, signal.SIGKILL)
    assert not port_open("127.0.0.1", int(cli_env["STOPLINE_DEV_SERVER_PORT"]))


def test_sampling_flags_and_settings_make_the_task_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    from stopline.cli import UsageError, _limits, build_parser

    monkeypatch.setenv("STOPLINE_TEMPERATURE", "0.2")
    monkeypatch.setenv("STOPLINE_MAX_TOKENS", "512")
    monkeypatch.delenv("STOPLINE_TOP_P", raising=False)
    args = build_parser().parse_args(["run", "x"])
    limits = _limits(args)
    assert (limits.max_tokens, limits.temperature, limits.top_p) == (512, 0.2, None)
    args = build_parser().parse_args(["run", "x", "--max-tokens", "64", "--temperature", "0", "--top-p", "0.5"])
    limits = _limits(args)
    assert (limits.max_tokens, limits.temperature, limits.top_p) == (64, 0.0, 0.5)
    monkeypatch.delenv("STOPLINE_TEMPERATURE")
    assert _limits(build_parser().parse_args(["chat", "hi"])).temperature is None  # the provider's default
    with pytest.raises(UsageError, match="temperature"):
        _limits(build_parser().parse_args(["run", "x", "--temperature", "3"]))
    with pytest.raises(UsageError, match="max_tokens"):
        _limits(build_parser().parse_args(["run", "x", "--max-tokens", "0"]))
