"""Bounded, linear history and host affinity (issue 5; DESIGN §5).

- continue-as-new carries a long task's ledger by reference: every run's
  history stays small, the ledger stays contiguous and complete;
- history per round is constant (pass references, not the transcript);
- tool activities run on the host-bound task queue, not the workflow's;
- API keys are redacted from log output.
"""

from __future__ import annotations

import asyncio
import io
import json
import uuid
from pathlib import Path
from typing import Any

import pytest
import structlog
from temporalio.client import Client

from stopline.activities.ledger import LedgerStore
from stopline.core.contracts import AgentTaskInput, AgentTaskResult, TaskLimits, TaskStatus
from stopline.settings import load_settings
from stopline.secrets import REDACTED
from stopline.testing.scripted import anthropic_message, entry, scenario
from stopline.worker.runtime import build_workers
from tests.conftest import start_task


def _rounds_scenario(rounds: int) -> dict:
    return scenario(
        "anthropic",
        entry(anthropic_message(tool_calls=[("c", "list_dir", {})]), repeat=rounds - 1),
        entry(anthropic_message("finished")),
    )


async def _run_chain(client: Client, wf_id: str) -> list[Any]:
    """Histories of every run of a continue-as-new chain, first to last."""
    runs = []
    async for wf in client.list_workflows(f"WorkflowId = '{wf_id}'"):
        runs.append(wf)
    histories = []
    for wf in sorted(runs, key=lambda w: w.start_time):
        histories.append(await client.get_workflow_handle(wf_id, run_id=wf.run_id).fetch_history())
    return histories


@pytest.mark.usefixtures("worker")
async def test_long_task_continues_as_new_carrying_the_ledger(
    client: Client, task_queue: str, scripted: Any, workspace: Path, stopline_home: Path
) -> None:
    rounds = 120
    server = scripted(_rounds_scenario(rounds))
    handle = await start_task(
        client, task_queue, server, workspace, max_rounds=rounds + 5,
        continue_as_new_after_events=150,
    )
    result = await asyncio.wait_for(handle.result(), 240)
    assert result.status == "completed" and result.rounds == rounds
    assert result.provider_calls == rounds and server.request_count() == rounds
    await asyncio.sleep(1)  # visibility catches up
    histories = await _run_chain(client, handle.id)
    assert len(histories) >= 3, len(histories)
    for h in histories:
        assert len(h.events) < 250  # every run well under the server's limits
    # what a run carries does not grow with the task (the stream is trimmed)
    inputs = [h.events[0].ByteSize() for h in histories]
    assert max(inputs[1:]) < 64_000, inputs
    rows = LedgerStore(stopline_home / "ledger").read(handle.id)
    assert [r.seq for r in rows] == list(range(1, len(rows) + 1))
    assert [r.kind for r in rows].count("tool_result") == rounds - 1
    assert rows[0].kind == "prompt" and rows[-2].text == "finished"
    assert rows[-1].meta["outcome"] == "completed"
    # the last request still held the whole conversation (read from the ledger, by reference)
    last_body = server.requests()[-1]["body"]
    assert len(last_body["messages"]) == 2 * (rounds - 1) + 1


@pytest.mark.usefixtures("worker")
async def test_history_grows_linearly_with_rounds(
    client: Client, task_queue: str, scripted: Any, workspace: Path
) -> None:
    sizes = {}
    for rounds in (5, 25):
        server = scripted(_rounds_scenario(rounds))
        handle = await start_task(client, task_queue, server, workspace, max_rounds=100)
        assert (await handle.result()).rounds == rounds
        history = await handle.fetch_history()
        sizes[rounds] = (len(history.events), len(history.to_json()))
    events_per_round = (sizes[25][0] - sizes[5][0]) / 20
    bytes_per_round = (sizes[25][1] - sizes[5][1]) / 20
    # constant per round: the 25-round history is not quadratically larger
    assert events_per_round <= 14, sizes
    assert sizes[25][1] < 25 / 5 * sizes[5][1] * 1.2, sizes
    assert bytes_per_round < 12_000, sizes


async def test_a_task_waits_for_a_host_then_runs_on_the_one_that_claimed_it(
    client: Client, scripted: Any, workspace: Path, stopline_home: Path
) -> None:
    """Placement (DESIGN §7): with only a workflow worker, the task waits
    visibly for a host and nothing is sampled or run; once a host's pool and
    own-queue workers run, it claims the task and the tool runs there."""
    from stopline.activities.host import host_id_for
    from stopline.core import search_attributes as sa

    wf_queue = f"wf-{uuid.uuid4().hex[:8]}"
    server = scripted(scenario(
        "anthropic",
        entry(anthropic_message(tool_calls=[("c1", "shell", {"command": "hostname > where.txt"})])),
        entry(anthropic_message("done")),
    ))
    settings = load_settings()
    wf_only, pool, host = build_workers(client, settings, task_queue=wf_queue)
    run_wf = asyncio.create_task(wf_only.run())
    try:
        handle = await client.start_workflow(
            "AgentTask",
            AgentTaskInput(prompt="x", model="anthropic:scripted", base_url=server.url,
                           workspace=str(workspace), limits=TaskLimits()),
            id=f"aff-{uuid.uuid4().hex[:8]}", task_queue=wf_queue, result_type=AgentTaskResult,
        )
        deadline = asyncio.get_running_loop().time() + 20
        while True:
            st = await handle.query("status", result_type=TaskStatus)
            if st.state == "waiting_for_host" or asyncio.get_running_loop().time() > deadline:
                break
            await asyncio.sleep(0.2)
        assert st.state == "waiting_for_host" and st.host is None
        await asyncio.sleep(1.0)
        # no host polls the pool yet: nothing sampled, nothing run
        assert server.request_count() == 0 and not (workspace / "where.txt").exists()
        runs = [asyncio.create_task(pool.run()), asyncio.create_task(host.run())]
        try:
            result = await asyncio.wait_for(handle.result(), 60)
        finally:
            await asyncio.gather(pool.shutdown(), host.shutdown(), return_exceptions=True)
            for r in runs:
                r.cancel()
        assert result.status == "completed" and (workspace / "where.txt").exists()
        assert result.host_id == host_id_for(stopline_home)
        assert host.task_queue == f"{wf_queue}-host-{result.host_id}"
        desc = await handle.describe()
        assert desc.typed_search_attributes.get(sa.HOST) == result.host_id
    finally:
        await wf_only.shutdown()
        run_wf.cancel()


def test_api_keys_are_redacted_from_logs(monkeypatch: pytest.MonkeyPatch) -> None:
    from stopline.logging import configure_logging

    secret = "sk-live-0123456789abcdef"
    monkeypatch.setenv("OPENAI_API_KEY", secret)
    monkeypatch.setenv("STOPLINE_LOG_FORMAT", "json")
    buf = io.StringIO()
    configure_logging(load_settings())
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(file=buf))
    log = structlog.get_logger("t")
    log.info("request", url="https://x", header=f"Bearer {secret}", api_key=secret, task_id="t1")
    out = buf.getvalue()
    assert secret not in out and REDACTED in out
    line = json.loads(out.strip().splitlines()[-1])
    assert line["task_id"] == "t1" and line["api_key"] == REDACTED
    structlog.reset_defaults()


@pytest.mark.usefixtures("worker")
async def test_json_logs_bind_task_round_and_tool(
    client: Client, task_queue: str, scripted: Any, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from stopline.logging import configure_logging

    monkeypatch.setenv("STOPLINE_LOG_FORMAT", "json")
    buf = io.StringIO()
    configure_logging(load_settings())
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(file=buf), cache_logger_on_first_use=False)
    try:
        server = scripted(scenario(
            "anthropic",
            entry(anthropic_message(tool_calls=[("c1", "shell", {"command": "true"})])),
            entry(anthropic_message("ok")),
        ))
        handle = await start_task(client, task_queue, server, workspace)
        assert (await handle.result()).status == "completed"
    finally:
        structlog.reset_defaults()
    lines = [json.loads(x) for x in buf.getvalue().splitlines() if x.startswith("{")]
    tool = next(x for x in lines if x["event"] == "tool_call")
    assert tool["task_id"] == handle.id and tool["round"] == 1 and tool["tool"] == "shell"
    sampled = [x for x in lines if x["event"] == "sampled"]
    assert [x["round"] for x in sampled] == [1, 2] and all(x["task_id"] == handle.id for x in sampled)


@pytest.mark.usefixtures("worker")
async def test_each_row_enters_history_once(
    client: Client, task_queue: str, scripted: Any, workspace: Path, stopline_home: Path
) -> None:
    """A tool's output and the model's text are in history once (as the
    activity's result), not again in the next activity's input (DESIGN §5)."""
    server = scripted(scenario(
        "anthropic",
        entry(anthropic_message("SAID-ONCE-7f1c", tool_calls=[("c1", "shell", {"command": "echo OUT-ONCE-$((90+3))ab"})])),
        entry(anthropic_message(tool_calls=[("c2", "list_dir", {})])),
        entry(anthropic_message("done")),
    ))
    handle = await start_task(client, task_queue, server, workspace)
    assert (await handle.result()).status == "completed"
    history = await handle.fetch_history()
    raw = b"".join(e.SerializeToString() for e in history.events)
    assert raw.count(b"OUT-ONCE-93ab") == 1
    assert raw.count(b"SAID-ONCE-7f1c") == 1
    # and the ledger file still holds the whole rows
    rows = LedgerStore(stopline_home / "ledger").read(handle.id)
    assert any("OUT-ONCE-93ab" in (r.text or "") for r in rows if r.kind == "tool_result")
    assert any(r.text == "SAID-ONCE-7f1c" for r in rows if r.kind == "assistant")
    assert all("staged" not in r.meta for r in rows)
