"""AgentTask end to end: real dev server, real HTTP to the scripted provider,
real processes in a real temporary workspace (issue 2)."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowFailureError

from stopline.activities.ledger import LedgerStore
from stopline.core.contracts import AgentTaskResult, LedgerRow
from stopline.testing.scripted import anthropic_message, entry, openai_chat_completion, scenario
from stopline.settings import load_settings
from stopline.worker.runtime import task_result
from tests.conftest import start_task

pytestmark = pytest.mark.usefixtures("worker")


def _tool_results(server: Any) -> dict[str, dict]:
    """Every tool result the provider received, by call id (last request wins)."""
    out: dict[str, dict] = {}
    for req in server.requests():
        for msg in req["body"].get("messages", []):
            if isinstance(msg.get("content"), list):
                for block in msg["content"]:
                    if block.get("type") == "tool_result":
                        out[block["tool_use_id"]] = block
    return out


def _ledger(home: Path, task_id: str) -> list[LedgerRow]:
    return LedgerStore(home / "ledger").read(task_id)


async def test_demo_scenario_fixes_the_workspace(
    client: Client, task_queue: str, scripted: Any, tmp_path: Path, stopline_home: Path
) -> None:
    data = resources.files("stopline.data") / "demo"
    ws = tmp_path / "demo-ws"
    with resources.as_file(data / "workspace") as src:
        shutil.copytree(src, ws)
    server = scripted(json.loads((data / "scenario.json").read_text()))
    handle = await start_task(client, task_queue, server, ws, "fix the failing tests")
    result = await handle.result()
    assert result.status == "completed", result
    assert result.rounds == 5 and result.provider_calls == 5
    assert "pass" in result.final_text
    tests = subprocess.run(
        [sys.executable, "-m", "unittest", "discover", "-s", "tests", "-t", "."],
        cwd=ws, capture_output=True, text=True,
    )
    assert tests.returncode == 0, tests.stderr
    rows = _ledger(stopline_home, handle.id)
    first_run = next(r for r in rows if r.kind == "tool_result" and r.call_id == "toolu_01")
    assert "FAILED (failures=2)" in first_run.text and "exit code 1" in first_run.text
    assert first_run.ok is True  # the process ran: a failing test run is a result, not a failure
    second_run = next(r for r in rows if r.kind == "tool_result" and r.call_id == "toolu_04")
    assert "OK" in second_run.text and "exit code 0" in second_run.text
    # the model saw the failing output in its next request
    assert "FAILED (failures=2)" in _tool_results(server)["toolu_01"]["content"]


async def test_tool_failures_reach_the_model_and_the_task_completes(
    client: Client, task_queue: str, scripted: Any, workspace: Path, tmp_path: Path
) -> None:
    outside = tmp_path / "outside.txt"
    outside.write_text("secret")
    (workspace / "a.txt").write_text("hello\n")
    (workspace / "adir").mkdir()
    bad_patch = "--- a/a.txt\n+++ b/a.txt\n@@ -1 +1 @@\n-goodbye\n+hi\n"
    calls = [
        ("c_exit", "shell", {"command": "echo out; echo err >&2; exit 3"}),
        ("c_timeout", "shell", {"command": "sleep 30", "timeout_s": 0.5}),
        ("c_missing", "shell", {"command": ["definitely-not-a-program-xyz"]}),
        ("c_outside", "read_file", {"path": "../outside.txt"}),
        ("c_patch", "apply_patch", {"patch": bad_patch}),
        ("c_badargs", "write_file", {"path": "x.txt"}),
        ("c_unknown", "no_such_tool", {}),
    ]
    server = scripted(scenario(
        "anthropic",
        entry(anthropic_message("trying things", tool_calls=calls)),
        entry(anthropic_message("done")),
    ))
    handle = await start_task(client, task_queue, server, workspace)
    result = await handle.result()
    assert result.status == "completed" and result.rounds == 2
    seen = _tool_results(server)
    assert set(seen) == {c[0] for c in calls}
    expect_ok = {"c_exit": True, "c_timeout": True, "c_missing": False, "c_outside": False,
                 "c_patch": False, "c_badargs": False, "c_unknown": False}
    for cid, ok in expect_ok.items():
        assert bool(seen[cid].get("is_error")) is (not ok), (cid, seen[cid])
    assert "exit code 3" in seen["c_exit"]["content"] and "err" in seen["c_exit"]["content"]
    assert "timed out" in seen["c_timeout"]["content"]
    assert "secret" not in seen["c_outside"]["content"]
    assert (workspace / "a.txt").read_text() == "hello\n"


async def test_a_handler_that_raises_becomes_a_tool_result(
    client: Client, task_queue: str, scripted: Any, workspace: Path
) -> None:
    # A directory where a file is expected makes the handler's own I/O raise.
    (workspace / "d").mkdir()
    server = scripted(scenario(
        "anthropic",
        entry(anthropic_message(tool_calls=[("c1", "write_file", {"path": "d", "content": "x"})])),
        entry(anthropic_message("ok")),
    ))
    handle = await start_task(client, task_queue, server, workspace)
    assert (await handle.result()).status == "completed"
    res = _tool_results(server)["c1"]
    assert res.get("is_error") is True and res["content"]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_engine_errors_fail_once_without_retry_loop(
    client: Client, task_queue: str, scripted: Any, workspace: Path, stream: bool
) -> None:
    shapeless = scripted(scenario("anthropic", entry({"id": "x", "type": "message"})))
    h1 = await start_task(client, task_queue, shapeless, workspace, stream=stream)
    r1 = await task_result(h1)
    assert r1.status == "failed" and "anthropic" in r1.reason and "content" in r1.reason
    assert shapeless.request_count() == 1 and r1.provider_calls == 1
    # Temporal sees what stopline sees: the workflow FAILED, its failure
    # carries the task's result (the UI and alerting count it)
    desc = await h1.describe()
    assert desc.status == WorkflowExecutionStatus.FAILED
    with pytest.raises(WorkflowFailureError) as failure:
        await h1.result()
    assert AgentTaskResult.from_failure(failure.value) == r1

    bad = scripted(scenario("openai-chat", entry(
        {"error": {"message": "Unsupported parameter: foo", "type": "invalid_request_error"}},
        status=400,
    )))
    h2 = await start_task(client, task_queue, bad, workspace, stream=stream)
    r2 = await task_result(h2)
    assert r2.status == "failed" and "400" in r2.reason and "Unsupported parameter" in r2.reason
    assert bad.request_count() == 1


async def test_transient_errors_are_retried_honouring_retry_after(
    client: Client, task_queue: str, scripted: Any, workspace: Path
) -> None:
    server = scripted(scenario(
        "anthropic",
        entry({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}, status=529),
        entry({"type": "error", "error": {"type": "rate_limit_error", "message": "slow down"}},
              status=429, headers={"retry-after": "2"}),
        entry(anthropic_message("finally")),
    ))
    handle = await start_task(client, task_queue, server, workspace)
    result = await handle.result()
    assert result.status == "completed" and result.final_text == "finally"
    assert server.request_count() == 3 and result.provider_calls == 3
    times = [r["received_at"] for r in server.requests()]
    assert times[2] - times[1] >= 2.0, times


async def test_no_secret_enters_workflow_history(
    client: Client, task_queue: str, scripted: Any, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = "sk-ant-test-7f3c9a1e5b2d4c6f8e0a"
    monkeypatch.setenv("ANTHROPIC_API_KEY", secret)
    server = scripted(scenario(
        "anthropic",
        entry(anthropic_message(tool_calls=[("c1", "shell", {"command": "echo hi"})])),
        entry(anthropic_message("bye")),
    ))
    handle = await start_task(client, task_queue, server, workspace)
    assert (await handle.result()).status == "completed"
    assert all(r["headers"].get("x-api-key") == "***" for r in server.requests())  # it was sent
    history = await handle.fetch_history()
    assert secret not in history.to_json()


async def test_jsonl_ledger_equals_workflow_ledger_and_only_grows(
    client: Client, task_queue: str, scripted: Any, workspace: Path, stopline_home: Path
) -> None:
    server = scripted(scenario(
        "openai-chat",
        entry(openai_chat_completion("one", tool_calls=[("c1", "shell", {"command": "echo 1"})])),
        entry(openai_chat_completion("two", tool_calls=[("c2", "write_file", {"path": "f", "content": "x"})])),
        entry(openai_chat_completion("three", tool_calls=[("c3", "read_file", {"path": "f"})]), delay_s=1.5),
        entry(openai_chat_completion("done")),
    ))
    handle = await start_task(client, task_queue, server, workspace)
    path = LedgerStore(stopline_home / "ledger").path(handle.id)
    while server.request_count() < 3:
        await asyncio.sleep(0.05)
    snapshot = path.read_bytes()
    assert snapshot.count(b"\n") >= 5
    result = await handle.result()
    assert result.status == "completed"
    final = path.read_bytes()
    assert final.startswith(snapshot)
    workflow_rows = await handle.query("ledger", result_type=list[LedgerRow])
    file_rows = LedgerStore(stopline_home / "ledger").read(handle.id)
    assert [r.model_dump() for r in file_rows] == [r.model_dump() for r in workflow_rows]
    assert [r.seq for r in file_rows] == list(range(1, len(file_rows) + 1))
    kinds = [r.kind for r in file_rows]
    assert kinds[0] == "prompt" and kinds.count("tool_result") == 3


async def test_max_rounds_stops_the_task(
    client: Client, task_queue: str, scripted: Any, workspace: Path
) -> None:
    server = scripted(scenario(
        "anthropic",
        entry(anthropic_message(tool_calls=[("c", "list_dir", {})]), repeat=3),
    ))
    handle = await start_task(client, task_queue, server, workspace, max_rounds=2)
    result = await handle.result()
    assert result.status == "stopped" and "max rounds" in result.reason and result.rounds == 2


async def test_cli_run_json_against_running_worker(
    client: Client, task_queue: str, workspace: Path, stopline_home: Path, temporal_env: Any,
    tmp_path: Path,
) -> None:
    scen = tmp_path / "scenario.json"
    scen.write_text(json.dumps(scenario(
        "anthropic",
        entry(anthropic_message("listing", tool_calls=[("c1", "list_dir", {})])),
        entry(anthropic_message("all done")),
    )))
    address = client.service_client.config.target_host
    env = {
        **__import__("os").environ,
        "TEMPORAL_ADDRESS": address,
        "STOPLINE_HOME": str(stopline_home),
        "STOPLINE_TASK_QUEUE": task_queue,
    }
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "stopline.cli", "run", "list the files",
        "--model", f"scripted:{scen}", "--workspace", str(workspace), "--json",
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, err.decode()
    last = json.loads(out.decode().strip().splitlines()[-1])
    assert last["status"] == "completed" and last["refused"] is False and last["rounds"] == 2
    assert set(last) == {"task_id", "status", "refused", "reason", "rounds", "provider_calls",
                         "undelivered_messages"}
    rows = _ledger(stopline_home, last["task_id"])
    assert rows[-2].kind == "assistant" and rows[-2].text == "all done"
    # the ending itself is the last row (hidden from the model)
    assert rows[-1].kind == "system" and rows[-1].meta["outcome"] == "completed"
    assert rows[-1].model_visible is False
    # and the transcript command prints the ledger as JSON lines
    tr = subprocess.run(
        [sys.executable, "-m", "stopline.cli", "transcript", last["task_id"], "--json"],
        env=env, capture_output=True, text=True, timeout=60,
    )
    assert tr.returncode == 0, tr.stderr
    assert [json.loads(line)["seq"] for line in tr.stdout.splitlines()] == [r.seq for r in rows]


def test_settings_read_from_environment(stopline_home: Path) -> None:
    s = load_settings()
    assert s.home == stopline_home and s.ledger_dir == stopline_home / "ledger"




async def test_malformed_turns_are_honest_outcomes(
    client: Client, task_queue: str, scripted: Any, workspace: Path, stopline_home: Path
) -> None:
    """Repeated call ids fail before any call runs; whitespace text is never
    stored; an unknown stop reason is not reported as a finished answer."""
    dup = scripted(scenario("anthropic", entry(anthropic_message(tool_calls=[
        ("c1", "shell", {"command": "echo one >> dup.txt"}),
        ("c1", "shell", {"command": "echo two >> dup.txt"}),
    ]))))
    r = await task_result(await start_task(client, task_queue, dup, workspace))
    assert r.status == "failed" and "repeat" in r.reason and not (workspace / "dup.txt").exists()

    ws_text = scripted(scenario(
        "anthropic",
        entry(anthropic_message("   \n ", tool_calls=[("c1", "list_dir", {})])),
        entry(anthropic_message("done")),
    ))
    h = await start_task(client, task_queue, ws_text, workspace)
    assert (await h.result()).status == "completed"
    rows = _ledger(stopline_home, h.id)
    assert all((row.text or "").strip() or row.tool_calls for row in rows if row.kind == "assistant")
    blocks = ws_text.requests()[1]["body"]["messages"][1]["content"]
    assert all(b.get("type") != "text" for b in blocks)

    paused = scripted(scenario("anthropic", entry(anthropic_message("partial", stop_reason="pause_turn"))))
    r3 = await (await start_task(client, task_queue, paused, workspace)).result()
    assert r3.status == "stopped" and "pause_turn" in r3.reason


async def test_a_response_too_large_for_history_fails_once_clearly(
    client: Client, task_queue: str, scripted: Any, workspace: Path
) -> None:
    big = "x" * 1_600_000
    server = scripted(scenario("anthropic", entry(anthropic_message(
        tool_calls=[("c1", "write_file", {"path": "big.txt", "content": big})]
    ), repeat=3)))
    r = await task_result(await start_task(client, task_queue, server, workspace))
    assert r.status == "failed" and "exceeds" in r.reason and "limit" in r.reason
    assert server.request_count() == 1 and r.provider_calls == 1
    assert not (workspace / "big.txt").exists()


async def test_a_terminated_task_is_listed_as_terminated_not_running(
    client: Client, task_queue: str, scripted: Any, workspace: Path, worker: Any,
    stopline_home: Path,
) -> None:
    held = scripted(scenario("anthropic", entry(anthropic_message("never"), delay_s=30)))
    handle = await start_task(client, task_queue, held, workspace)
    deadline = asyncio.get_running_loop().time() + 20
    while held.request_count() == 0 and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
    await handle.terminate("test: an operator's terminate")
    env = {**__import__("os").environ, "TEMPORAL_ADDRESS": client.service_client.config.target_host,
           "STOPLINE_HOME": str(stopline_home)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "stopline.cli", "list", "--json", env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    (row,) = [r for r in map(json.loads, out.decode().splitlines()) if r["id"] == handle.id]
    assert row["status"] == "terminated", row
