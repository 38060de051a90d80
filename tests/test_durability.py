"""Surviving host restarts (DESIGN §5): real worker processes killed with
SIGKILL or stopped with SIGTERM mid-task, a new worker taking over, and the
ledger file checked byte for byte across the crash. Real dev server, real
HTTP (scripted provider), real tool processes.

Every test but the symlink one runs its workers as subprocesses
(``tests/_worker_proc.py``); everything a test starts is stopped by its own
PID in ``finally``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import pytest_asyncio
from temporalio.client import Client

from stopline.activities.ledger import LedgerStore
from stopline.core.contracts import AgentTaskResult, InterruptResult, LedgerRow
from stopline.testing.scripted import anthropic_message, entry, scenario
from tests._worker_proc import Workers
from tests.conftest import start_task

#: Heartbeat timeout of the tasks here: a dead worker is noticed this fast.
HEARTBEAT_S = 1.0
#: Upper bound on one task's run in these tests (kills included).
RESULT_TIMEOUT_S = 45.0


@pytest_asyncio.fixture
async def procs(
    client: Client, stopline_home: Path, task_queue: str, tmp_path: Path
) -> AsyncIterator[Workers]:
    """Worker subprocesses for this test; all SIGKILLed by PID at teardown."""
    workers = Workers(client, stopline_home, task_queue, tmp_path / "logs")
    try:
        yield workers
    finally:
        workers.stop_all()


# ---------------------------------------------------------------- helpers


def _ledger_path(home: Path, task_id: str) -> Path:
    return LedgerStore(home / "ledger").path(task_id)


def _ledger_bytes(home: Path, task_id: str) -> bytes:
    path = _ledger_path(home, task_id)
    return path.read_bytes() if path.exists() else b""


def _rows(home: Path, task_id: str) -> list[LedgerRow]:
    return LedgerStore.read_path(_ledger_path(home, task_id))


async def _until(cond: Any, what: str, timeout: float = 20.0, every: float = 0.02) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        await asyncio.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")


async def _wait_file(path: Path, timeout: float = 20.0, every: float = 0.02) -> str:
    await _until(lambda: path.exists() and path.read_text().strip(), f"{path}", timeout, every)
    return path.read_text().strip()


async def _result(handle: Any, procs: Workers) -> AgentTaskResult:
    try:
        return await asyncio.wait_for(handle.result(), RESULT_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise AssertionError(f"task did not finish; worker logs:\n{procs.logs()}") from None


def assert_fsynced_rows_survived(before: bytes, after: bytes) -> None:
    """DESIGN §5: a ledger write fsynced before the crash is there after it,
    exactly once, unchanged — the file before the kill is a prefix of the
    file after (no row lost, none rewritten), every line complete."""
    assert before, "the ledger had no fsynced row before the kill: the test proves nothing"
    assert before.endswith(b"\n"), "the ledger ended in a torn line before the kill"
    assert after.startswith(before), (
        "the ledger after the crash does not continue the one before it:\n"
        f"before:\n{before.decode()}\nafter:\n{after.decode()}"
    )


def assert_seqs_contiguous(rows: list[LedgerRow]) -> None:
    """No row twice, no row lost: seqs are exactly 1..n, in file order."""
    assert [r.seq for r in rows] == list(range(1, len(rows) + 1)), [r.seq for r in rows]


def _tool_results(rows: list[LedgerRow], call_id: str) -> list[LedgerRow]:
    return [r for r in rows if r.kind == "tool_result" and r.call_id == call_id]


def _tool_result_block(body: dict[str, Any], call_id: str) -> dict[str, Any]:
    """The ``tool_result`` block for ``call_id`` in an Anthropic request body."""
    for msg in body["messages"]:
        if msg["role"] != "user" or not isinstance(msg["content"], list):
            continue
        for block in msg["content"]:
            if block.get("type") == "tool_result" and block.get("tool_use_id") == call_id:
                return block
    raise AssertionError(f"no tool_result for {call_id} in the request: {body['messages']}")


def _block_text(block: dict[str, Any]) -> str:
    content = block.get("content")
    if isinstance(content, list):
        return "".join(c.get("text", "") for c in content if isinstance(c, dict))
    return str(content)


def _live(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


# ------------------------------------------------------------------ tests


async def test_kill_9_mid_sampling_retries_the_call_and_loses_no_row(
    client: Client, task_queue: str, scripted: Any, workspace: Path, stopline_home: Path,
    procs: Workers,
) -> None:
    server = scripted(scenario(
        "anthropic",
        entry(anthropic_message("first", tool_calls=[("c1", "shell", {"command": "echo one"})])),
        # round 2, first attempt: held until the worker dies (it never answers)
        entry(anthropic_message("this answer must never be stored"), delay_s=30),
        # round 2, the retry on the new worker
        entry(anthropic_message("second", tool_calls=[("c2", "shell", {"command": "echo two"})])),
        entry(anthropic_message("all done")),
    ))
    first = await procs.start()
    handle = await start_task(
        client, task_queue, server, workspace, heartbeat_timeout_s=HEARTBEAT_S
    )
    await _until(lambda: server.request_count() >= 2, "the held sampling request")
    first.kill()
    before = _ledger_bytes(stopline_home, handle.id)  # what the crash left on disk
    await _until(lambda: server.requests()[1]["disconnected"], "the dead worker's hang-up", 5)
    await procs.start()
    result = await _result(handle, procs)

    assert result.status == "completed" and result.final_text == "all done", result
    # the sampling call was retried: one more request than rounds
    assert server.request_count() == 4
    reqs = server.requests()
    assert reqs[2]["body"]["messages"] == reqs[1]["body"]["messages"]  # the same transcript again
    assert result.provider_calls == 4  # the lost attempt is counted
    after = _ledger_bytes(stopline_home, handle.id)
    assert_fsynced_rows_survived(before, after)
    rows = _rows(stopline_home, handle.id)
    assert_seqs_contiguous(rows)
    # before the kill: prompt, round-1 assistant, c1's result (flushed by round 2's sampling)
    rows_before = [LedgerRow.model_validate_json(ln) for ln in before.splitlines()]
    assert [r.kind for r in rows_before] == ["prompt", "assistant", "tool_result"]
    assert [r.kind for r in rows] == [
        "prompt", "assistant", "tool_result", "assistant", "tool_result", "assistant", "system",
    ]
    assert len(_tool_results(rows, "c1")) == 1 and len(_tool_results(rows, "c2")) == 1
    assert not any("must never be stored" in (r.text or "") for r in rows)


@pytest.mark.usefixtures("unconfined")  # follows the command by the pid it prints
@pytest.mark.parametrize("round_tools", [True, False], ids=["round-tools", "tool-activity"])
async def test_kill_9_mid_tool_gives_a_lost_receipt_and_never_reruns_it(
    client: Client, task_queue: str, scripted: Any, workspace: Path, stopline_home: Path,
    procs: Workers, round_tools: bool,
) -> None:
    """``round-tools``: the call runs in its round's sampling activity (DESIGN
    §1); its response was recorded in a heartbeat before it started, so the
    retry does not sample again — the model gets the response's receipt and
    the provider sees no extra request. ``tool-activity``: the call is its
    own activity, which times out."""
    server = scripted(scenario(
        "anthropic",
        entry(anthropic_message(tool_calls=[("c0", "shell", {"command": "echo zero"})])),
        entry(anthropic_message(tool_calls=[(
            "c1", "shell", {"command": "echo started >> starts; echo $$ > pid; sleep 30"},
        )])),
        entry(anthropic_message("I will check what the lost call did")),
    ))
    tool_pgid: int | None = None
    try:
        first = await procs.start()
        handle = await start_task(
            client, task_queue, server, workspace, heartbeat_timeout_s=HEARTBEAT_S,
            round_tools=round_tools,
        )
        tool_pgid = int(await _wait_file(workspace / "pid"))
        await asyncio.sleep(0.1)
        first.kill()
        before = _ledger_bytes(stopline_home, handle.id)
        # The tool runs in its own session: the worker's SIGKILL does not reach it.
        survived_kill = _live(tool_pgid)
        await procs.start()
        result = await _result(handle, procs)

        assert result.status == "completed", result
        assert result.final_text == "I will check what the lost call did"
        assert server.request_count() == 3
        # what the model got for the lost call
        block = _tool_result_block(server.requests()[2]["body"], "c1")
        text = _block_text(block)
        assert text.startswith("lost: the worker running shell stopped"), text
        assert "may have partly run" in text and "not run again" in text, text
        assert block.get("is_error") is True
        # the ledger row says the same, once
        rows = _rows(stopline_home, handle.id)
        lost = _tool_results(rows, "c1")
        assert len(lost) == 1 and lost[0].ok is False and lost[0].text == text
        # the tool was not run again
        assert (workspace / "starts").read_text().splitlines() == ["started"]
        assert_fsynced_rows_survived(before, _ledger_bytes(stopline_home, handle.id))
        assert_seqs_contiguous(rows)
        # The lost call's process outlived its worker (own session), but the
        # workflow killed its group before the model saw the receipt.
        record = stopline_home / "procs" / handle.id / "c1.json"
        assert survived_kill
        assert not _live(tool_pgid) and not record.exists()
    finally:
        if tool_pgid is not None:
            _kill_group(tool_pgid)


@pytest.mark.usefixtures("unconfined")  # follows the command by the pid it prints
async def test_an_interrupt_while_the_rounds_worker_is_dead_gives_its_call_a_lost_receipt(
    client: Client, task_queue: str, scripted: Any, workspace: Path, stopline_home: Path,
    procs: Workers,
) -> None:
    """The call runs in its round's sampling activity (DESIGN §1), whose
    worker is SIGKILLed; the interrupt comes while no worker runs, so no
    push can reach the call. Once a worker is back the abort learns from
    Temporal what the round recorded — the response, in its heartbeat — and
    the call gets a "lost" receipt before the marker: recorded once, never
    run again, and the model is not asked that round again."""
    server = scripted(scenario(
        "anthropic",
        entry(anthropic_message("running it", tool_calls=[(
            "c1", "shell", {"command": "echo started >> starts; echo $$ > pid; sleep 30"},
        )])),
        entry(anthropic_message("after the interrupt")),
    ))
    tool_pgid: int | None = None
    try:
        first = await procs.start()
        handle = await start_task(client, task_queue, server, workspace, heartbeat_timeout_s=HEARTBEAT_S)
        tool_pgid = int(await _wait_file(workspace / "pid"))
        first.kill()
        interrupt = asyncio.ensure_future(handle.execute_update("interrupt", result_type=InterruptResult))
        await asyncio.sleep(0.5)
        assert not interrupt.done()  # no worker: nothing can answer yet
        await procs.start()
        res = await asyncio.wait_for(interrupt, RESULT_TIMEOUT_S)
        assert res.interrupted and res.kept_calls == ["c1"] and res.aborted_calls == [], res
        rows = _rows(stopline_home, handle.id)
        assert rows[-1].kind == "turn_aborted"
        (message,) = [r for r in rows if r.kind == "assistant"]
        assert message.text == "running it" and [c.id for c in message.tool_calls] == ["c1"]
        (lost,) = _tool_results(rows, "c1")
        assert lost.text.startswith("lost:") and lost.ok is False, lost.text
        assert lost.seq == message.seq + 1 and rows[-1].seq == lost.seq + 1

        await handle.execute_update("message", "go on")
        result = await _result(handle, procs)
        assert result.status == "completed" and result.final_text == "after the interrupt", result
        assert server.request_count() == 2  # round 1 was never sampled again
        assert (workspace / "starts").read_text().splitlines() == ["started"]
        assert_seqs_contiguous(_rows(stopline_home, handle.id))
        await _until(lambda: not _live(tool_pgid), "the lost call's group to be killed")
    finally:
        if tool_pgid is not None:
            _kill_group(tool_pgid)


@pytest.mark.parametrize("when", ["at_side_effect", "during_next_sampling"])
async def test_kill_between_tool_finish_and_next_step_keeps_one_result(
    client: Client, task_queue: str, scripted: Any, workspace: Path, stopline_home: Path,
    procs: Workers, when: str,
) -> None:
    """``at_side_effect``: SIGKILL the moment the tool's side effect appears
    (the activity's completion may or may not have reached the server: a
    real race, both endings are honest). ``during_next_sampling``: SIGKILL
    once the next sampling call is in flight (held by the server), i.e. the
    tool's result is in history and was flushed to the ledger by that call."""
    server = scripted(scenario(
        "anthropic",
        entry(anthropic_message(tool_calls=[
            ("c1", "shell", {"command": "echo ran >> side; echo tool-output-xyz"}),
        ])),
        # the next sampling: held, so a kill lands while it is in flight
        entry(anthropic_message("after the crash"), delay_s=3),
        entry(anthropic_message("after the crash")),
    ))
    first = await procs.start()
    handle = await start_task(
        client, task_queue, server, workspace, heartbeat_timeout_s=HEARTBEAT_S
    )
    await _until(lambda: (workspace / "side").exists(), "the tool's side effect", every=0.002)
    if when == "during_next_sampling":
        await _until(lambda: server.request_count() >= 2, "the held next sampling request")
    first.kill()
    before = _ledger_bytes(stopline_home, handle.id)
    requests_at_kill = server.request_count()
    await procs.start()
    result = await _result(handle, procs)

    assert result.status == "completed" and result.final_text == "after the crash", result
    rows = _rows(stopline_home, handle.id)
    results = _tool_results(rows, "c1")
    assert len(results) == 1, results
    assert (workspace / "side").read_text().splitlines() == ["ran"]  # never re-run
    assert_seqs_contiguous(rows)
    assert_fsynced_rows_survived(before, _ledger_bytes(stopline_home, handle.id))
    real = "tool-output-xyz" in results[0].text
    if when == "during_next_sampling":
        # the result was on disk before the crash, and is there once after it
        assert before.count(b'"call_id":"c1"') == 1 and real, before.decode()
        assert server.request_count() == 3 and server.requests()[1]["disconnected"]
    elif not real:  # the kill beat the activity's completion: an honest receipt
        assert results[0].text.startswith("lost:") and results[0].ok is False
    block = _tool_result_block(server.requests()[-1]["body"], "c1")
    assert _block_text(block) == results[0].text
    print(
        f"\n[durability] kill {when}: requests at kill={requests_at_kill}, "
        f"model saw {'the real result' if real else 'a lost receipt'}"
    )


async def test_sigterm_drains_the_tool_and_records_no_interrupt(
    client: Client, task_queue: str, scripted: Any, workspace: Path, stopline_home: Path,
    procs: Workers,
) -> None:
    server = scripted(scenario(
        "anthropic",
        entry(anthropic_message(tool_calls=[
            ("c1", "shell", {"command": "echo started >> starts; sleep 3; echo done"}),
        ])),
        entry(anthropic_message("finished after the restart")),
    ))
    first = await procs.start()
    handle = await start_task(
        client, task_queue, server, workspace, heartbeat_timeout_s=HEARTBEAT_S
    )
    await _wait_file(workspace / "starts")
    await asyncio.sleep(0.2)
    first.terminate()
    # one worker per home (DESIGN §7): the next one starts once the first has
    # drained and exited, as a pod with the same volume does
    rc = await first.wait_exit(20)
    await procs.start()
    result = await _result(handle, procs)

    assert result.status == "completed", result
    rows = _rows(stopline_home, handle.id)
    assert not any(r.kind == "turn_aborted" for r in rows), [r.kind for r in rows]
    assert not any("aborted by user" in (r.text or "") for r in rows)
    assert_seqs_contiguous(rows)
    (c1,) = _tool_results(rows, "c1")
    block = _tool_result_block(server.requests()[1]["body"], "c1")
    print(f"\n[durability] SIGTERM: old worker exit code {rc}; the model saw: {_block_text(block)!r}")
    assert _block_text(block) == c1.text
    # the shutdown grace (10 s) outlasts the 3 s tool: its real result is kept
    assert "done" in c1.text and "exit code 0" in c1.text and c1.ok, c1.text
    assert (workspace / "starts").read_text().splitlines() == ["started"]
    assert rc == 0, first.log()


async def test_symlink_out_of_the_workspace_is_refused(
    client: Client, task_queue: str, scripted: Any, workspace: Path, stopline_home: Path,
    worker: Any, tmp_path: Path,
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    secret = outside / "secret.txt"
    secret.write_text("top secret\n")
    (workspace / "filelink").symlink_to(secret)
    (workspace / "dirlink").symlink_to(outside, target_is_directory=True)
    calls = [
        ("r1", "read_file", {"path": "filelink"}),
        ("w1", "write_file", {"path": "filelink", "content": "pwned\n"}),
        ("r2", "read_file", {"path": "dirlink/secret.txt"}),
        ("w2", "write_file", {"path": "dirlink/secret.txt", "content": "pwned\n"}),
        ("w3", "write_file", {"path": "dirlink/new.txt", "content": "pwned\n"}),
    ]
    server = scripted(scenario(
        "anthropic",
        entry(anthropic_message(tool_calls=calls)),
        entry(anthropic_message("refused, as expected")),
    ))
    handle = await start_task(client, task_queue, server, workspace)
    result = await asyncio.wait_for(handle.result(), RESULT_TIMEOUT_S)

    assert result.status == "completed", result
    rows = _rows(stopline_home, handle.id)
    for call_id, _, _ in calls:
        (row,) = _tool_results(rows, call_id)
        assert row.ok is False, (call_id, row.text)
        assert "outside the workspace" in row.text, (call_id, row.text)
        assert "top secret" not in row.text
    assert secret.read_text() == "top secret\n"
    assert sorted(p.name for p in outside.iterdir()) == ["secret.txt"]
    assert (workspace / "filelink").is_symlink() and (workspace / "dirlink").is_symlink()


async def test_a_3mb_tool_output_ends_neither_task_nor_worker(
    client: Client, task_queue: str, scripted: Any, workspace: Path, stopline_home: Path,
    procs: Workers,
) -> None:
    server = scripted(scenario(
        "anthropic",
        entry(anthropic_message(tool_calls=[
            ("big", "shell", {"command": "head -c 3000000 /dev/urandom | base64"}),
        ])),
        entry(anthropic_message("that was a lot of output")),
    ))
    proc = await procs.start()
    handle = await start_task(
        client, task_queue, server, workspace, heartbeat_timeout_s=HEARTBEAT_S
    )
    result = await _result(handle, procs)

    assert result.status == "completed", result
    assert result.final_text == "that was a lot of output"
    assert proc.alive(), proc.log()
    rows = _rows(stopline_home, handle.id)
    (row,) = _tool_results(rows, "big")
    assert len(row.text.encode()) < 20_000, len(row.text.encode())
    assert "bytes omitted" in row.text
    ref = row.meta.get("output_ref")
    assert ref, row.meta
    blob = (stopline_home / "ledger" / ref).resolve()
    assert (stopline_home / "ledger").resolve() in blob.parents, blob
    assert blob.stat().st_size >= 3_000_000, blob.stat().st_size
    # the ledger line itself stays small: the output lives beside it
    line = next(
        ln for ln in _ledger_bytes(stopline_home, handle.id).splitlines() if b'"big"' in ln
        and b'"tool_result"' in ln
    )
    assert len(line) < 25_000
    assert len(_block_text(_tool_result_block(server.requests()[1]["body"], "big"))) < 20_000
