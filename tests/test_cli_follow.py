"""Watching a task: token streaming and ``stopline follow``.

The sampling activity publishes text deltas to the task's workflow stream
while the model generates (``stopline.activities.deltas``); ``follow``
re-attaches to a running or finished task from its first event (or from
now), and Ctrl-C there interrupts the turn as in ``run``. The real CLI in
subprocesses, against the session's dev server and in-process workers.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from temporalio import workflow
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client
from temporalio.worker import (
    HandleUpdateInput,
    Interceptor,
    WorkflowInboundInterceptor,
    WorkflowInterceptorClassInput,
)

from stopline.activities.deltas import SamplingDelta, coalesce
from stopline.activities.ledger import LedgerStore
from stopline.activities.providers.registry import WIRE_TO_PROVIDER, get_adapter
from stopline.core.contracts import Message, TaskStatus, TextPart, ToolSpec
from stopline.testing.scripted import (
    anthropic_message,
    entry,
    openai_chat_completion,
    openai_response,
    scenario,
)
from stopline.testing.workers import running_workers, wait_until


def _address(client: Client) -> str:
    return client.service_client.config.target_host


@pytest.fixture
def env(client: Client, task_queue: str, stopline_home: Path) -> dict[str, str]:
    out = dict(os.environ)
    out.update(TEMPORAL_ADDRESS=_address(client), STOPLINE_HOME=str(stopline_home),
               STOPLINE_TASK_QUEUE=task_queue, PYTHONUNBUFFERED="1")
    return out


def _cli(env: dict[str, str], *args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "stopline.cli", *args], env=env,
                          capture_output=True, text=True, timeout=timeout)


class _Lines:
    """A subprocess's stdout (or stderr) read line by line, each with its arrival time."""

    def __init__(self, proc: subprocess.Popen[str], stream: str = "stdout") -> None:
        self.proc = proc
        self.lines: list[tuple[float, str]] = []
        self._stream = getattr(proc, stream)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self._stream is not None
        for line in self._stream:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    async def wait_for(self, needle: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not any(needle in line for _, line in self.lines):
            assert time.monotonic() < deadline, f"no {needle!r} in {self.lines}"
            assert self.proc.poll() is None or self._thread.is_alive() or any(
                needle in line for _, line in self.lines), f"exited before {needle!r}: {self.lines}"
            await asyncio.sleep(0.05)

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)


def _stream_of_chunks(n: int, *, spread_s: float, hold_s: float) -> dict[str, Any]:
    """An Anthropic SSE answer of ``n`` text chunks spread over ``spread_s``."""
    def ev(kind: str, **data: Any) -> dict[str, Any]:
        return {"event": kind, "data": {"type": kind, **data}}

    events = [
        ev("message_start", message={"id": "msg_s", "type": "message", "role": "assistant", "model": "m",
                                     "content": [], "stop_reason": None,
                                     "usage": {"input_tokens": 3, "output_tokens": 0}}),
        ev("content_block_start", index=0, content_block={"type": "text", "text": ""}),
        *[ev("content_block_delta", index=0, delta={"type": "text_delta", "text": f"w{i} "}) for i in range(n)],
        ev("content_block_stop", index=0),
        ev("message_delta", delta={"stop_reason": "end_turn"}, usage={"output_tokens": n}),
        ev("message_stop"),
    ]
    return {"stream_events": events, "event_delay_s": spread_s / len(events), "delay_s": hold_s}


# --------------------------------------------------------------- the adapters


@pytest.mark.parametrize("wire", ["anthropic", "openai-chat", "openai-responses"])
async def test_every_adapter_hands_text_and_argument_deltas_to_on_delta(
    wire: str, scripted: Any
) -> None:
    """Each wire's streamed pieces reach ``on_delta``; joined, they are the
    final text and the final tool arguments."""
    call = ("call_1", "shell", {"command": "echo hi && ls -la"})
    body = {
        "anthropic": lambda: anthropic_message("Let me look around.", tool_calls=[call]),
        "openai-chat": lambda: openai_chat_completion("Let me look around.", tool_calls=[call]),
        "openai-responses": lambda: openai_response("Let me look around.", tool_calls=[call]),
    }[wire]()
    server = scripted(scenario(wire, entry(body)))
    provider = WIRE_TO_PROVIDER[wire]
    deltas: list[SamplingDelta] = []
    async with httpx.AsyncClient() as http:
        result = await get_adapter(provider).sample(
            http, base_url=server.url, api_key=None,
            model="m", system="", messages=[Message(role="user", parts=[TextPart(text="go")])],
            tools=[ToolSpec(name="shell", description="run", input_schema={"type": "object"})],
            max_tokens=64, stream=True, on_progress=lambda: None, on_delta=deltas.append,
        )
    text = "".join(d.text for d in deltas if d.kind == "text")
    args = "".join(d.text for d in deltas if d.kind == "tool_args")
    assert len([d for d in deltas if d.kind == "text"]) > 1
    assert text == result.text == "Let me look around."
    assert args == result.tool_calls[0].raw_arguments and json.loads(args) == call[2]
    named = [d for d in deltas if d.kind == "tool_args" and d.tool_name]
    assert named and named[-1].tool_name == "shell" and named[-1].call_id == "call_1"


def test_coalescing_joins_pieces_per_block() -> None:
    pieces = [SamplingDelta("text", "Hel"), SamplingDelta("text", "lo"),
              SamplingDelta("tool_args", '{"a"', 1, "c1", "shell"), SamplingDelta("tool_args", ": 1}", 1),
              SamplingDelta("tool_args", "{}", 2, "c2", "list_dir")]
    events = coalesce(pieces, round=3, attempt=2)
    assert [(e.kind, e.text, e.call_id, e.tool_name) for e in events] == [
        ("assistant_delta", "Hello", None, None),
        ("tool_args_delta", '{"a": 1}', "c1", "shell"),
        ("tool_args_delta", "{}", "c2", "list_dir"),
    ]
    assert {(e.round, e.attempt) for e in events} == {(3, 2)}


# ------------------------------------------------------------- the CLI watcher


@pytest.mark.usefixtures("worker")
async def test_text_streams_to_a_follow_watcher_before_the_message_ends(
    client: Client, env: dict[str, str], workspace: Path, tmp_path: Path, stopline_home: Path
) -> None:
    """50 text chunks over 2 s reach ``follow`` as several separate renders
    before the whole message; the ledger still holds one assistant row."""
    scen = tmp_path / "stream.json"
    scen.write_text(json.dumps({"wire": "anthropic",
                                "responses": [_stream_of_chunks(50, spread_s=2.0, hold_s=1.5)]}))
    task_id = f"task-{uuid.uuid4().hex[:8]}"
    run = await asyncio.to_thread(_cli, env, "run", "go", "--model", f"scripted:{scen}",
                                  "--workspace", str(workspace), "--id", task_id, "--detach")
    assert run.returncode == 0, run.stderr
    proc = subprocess.Popen([sys.executable, "-m", "stopline.cli", "follow", task_id, "--json"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out = _Lines(proc)
        await out.wait_for('"status": "completed"', timeout=90)
        assert proc.wait(timeout=30) == 0, proc.stderr.read() if proc.stderr else ""
    finally:
        if proc.poll() is None:
            proc.kill()
    events = [(at, json.loads(line)) for at, line in out.lines if line.startswith('{"kind"')]
    final_at, final = next((at, e) for at, e in events if e["kind"] == "assistant_text")
    deltas = [(at, e) for at, e in events if e["kind"] == "assistant_delta" and at < final_at]
    # separate renders: arrivals at least 50 ms apart (not one drained backlog)
    renders = 1 if deltas else 0
    for (prev, _), (at, _) in zip(deltas, deltas[1:]):
        renders += at - prev >= 0.05
    assert renders >= 5, [(round(at - final_at, 3), e["text"]) for at, e in deltas]
    # the deltas are the message's beginning (the tail arrives with the whole message)
    assert final["text"].startswith("".join(e["text"] for _, e in deltas))
    rows = LedgerStore(stopline_home / "ledger").read(task_id)
    assert [r.kind for r in rows].count("assistant") == 1
    assert not any(r.text and r.text != final["text"] and "w1 " in r.text for r in rows)

    # follow on the finished task shows its events from the start, and its outcome
    again = await asyncio.to_thread(_cli, env, "follow", task_id)
    assert again.returncode == 0, again.stderr
    lines = again.stdout.splitlines()
    assert "── round 1" in lines
    assert f"assistant: {final['text']}".rstrip() in [ln.rstrip() for ln in lines]
    assert lines[-1].startswith(f"completed {task_id}: the model ended its turn")
    now = await asyncio.to_thread(_cli, env, "follow", task_id, "--from-now")
    assert now.returncode == 0 and now.stdout.splitlines() == [lines[-1]]


@pytest.mark.usefixtures("worker")
async def test_follow_shows_new_events_and_ctrl_c_interrupts_then_detaches(
    client: Client, env: dict[str, str], workspace: Path, tmp_path: Path, stopline_home: Path
) -> None:
    scen = tmp_path / "slow.json"
    scen.write_text(json.dumps(scenario("anthropic", entry(anthropic_message(
        tool_calls=[("c1", "shell", {"command": "echo $$ > pid; sleep 100"})])))))
    task_id = f"task-{uuid.uuid4().hex[:8]}"
    run = await asyncio.to_thread(_cli, env, "run", "go", "--model", f"scripted:{scen}",
                                  "--workspace", str(workspace), "--id", task_id, "--detach")
    assert run.returncode == 0, run.stderr
    deadline = time.monotonic() + 30
    while not (workspace / "pid").exists() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    proc = subprocess.Popen([sys.executable, "-m", "stopline.cli", "follow", task_id, "--from-now"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, errs = _Lines(proc), _Lines(proc, "stderr")
        await errs.wait_for(f"following {task_id} from now", timeout=60)  # Ctrl-C is handled from here
        await asyncio.sleep(1.0)  # attached: it shows nothing older than now
        proc.send_signal(signal.SIGINT)
        await out.wait_for("turn aborted by user", timeout=60)
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=30)
        errs._thread.join(timeout=10)  # the rest of stderr, to its end
        err = errs.text()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 130, err
    assert "interrupted: aborted 1 call(s) (c1), kept 0" in err
    assert "── round 1" not in out.text() and "▶ shell" not in out.text()
    assert out.lines[-1][1] == f"detached from {task_id}; it goes on"
    rows = LedgerStore(stopline_home / "ledger").read(task_id)
    assert rows[-1].kind == "turn_aborted"
    await client.get_workflow_handle(task_id).cancel(reason="test cleanup")


class _FailAPollOnce(Interceptor):
    """Fail the workflow task that carries a watcher's second stream poll
    (an Update) once, as a rejected or crashed workflow task would:
    Temporal retries the task and the workflow goes on."""

    def __init__(self, workflow_id: str, counter: Path) -> None:
        self.workflow_id, self.counter = workflow_id, counter

    def workflow_interceptor_class(
        self, input: WorkflowInterceptorClassInput
    ) -> type[WorkflowInboundInterceptor]:
        target, counter = self.workflow_id, str(self.counter)

        class Inbound(WorkflowInboundInterceptor):
            async def handle_update_handler(self, input: HandleUpdateInput) -> Any:
                if (input.update == "__temporal_workflow_stream_poll"
                        and workflow.info().workflow_id == target
                        and not workflow.unsafe.is_replaying()):
                    with workflow.unsafe.sandbox_unrestricted():
                        with open(counter, "a") as f:
                            f.write("poll\n")
                        with open(counter) as f:
                            polls = len(f.read().splitlines())
                    if polls == 2:
                        raise RuntimeError("this workflow task fails once")
                return await super().handle_update_handler(input)

        return Inbound


async def test_a_watcher_outlives_a_failed_workflow_task(
    client: Client, task_queue: str, scripted: Any, workspace: Path, stopline_home: Path,
    tmp_path: Path,
) -> None:
    """The CLI never reports an error for a task that completed: across a
    failed workflow task carrying its poll, a watcher sees every event once
    and the task's end."""
    from stopline.cli import _follow
    from stopline.core.contracts import AgentTaskResult, TaskEvent
    from stopline.settings import load_settings
    from stopline.worker.runtime import build_workers
    from tests.conftest import start_task

    task_id = f"task-{uuid.uuid4().hex[:8]}"
    counter = tmp_path / "polls"
    workers = build_workers(client, load_settings(), task_queue=task_queue, workflow_options={
        "interceptors": [_FailAPollOnce(task_id, counter)],
    })
    async with running_workers(workers):
        seen: list[TaskEvent] = []
        server = scripted(scenario(
            "anthropic",
            {**entry(anthropic_message(tool_calls=[("c1", "list_dir", {})])), "delay_s": 1.0},
            {**entry(anthropic_message("done")), "delay_s": 1.0},
        ))
        handle = await start_task(client, task_queue, server, workspace, task_id=task_id)
        await asyncio.wait_for(_follow(client, task_id, seen.append), 60)
        result = await client.get_workflow_handle(task_id, result_type=AgentTaskResult).result()
    assert result.status == "completed"
    history = await handle.fetch_history()
    assert EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED in [e.event_type for e in history.events]
    kinds = [e.kind for e in seen]
    assert kinds[-1] == "task_finished" and kinds.count("task_finished") == 1
    assert kinds.count("assistant_text") == 1 and kinds.count("turn_started") == 2
    assert len(counter.read_text().splitlines()) > 2  # polls went on after the failed one


@pytest.mark.usefixtures("worker")
@pytest.mark.parametrize("how", ["environment", "flag"])
async def test_a_base_url_given_to_run_reaches_a_worker_started_before(
    env: dict[str, str], scripted: Any, workspace: Path, how: str
) -> None:
    """The worker was started without the base URL (``stopline up`` before
    the command): the one on ``run``'s command line travels with the task."""
    assert "OPENAI_BASE_URL" not in os.environ  # the worker's own environment has none
    server = scripted(scenario("openai-chat", entry(openai_chat_completion("from the scripted server"))))
    args = ["run", "hi", "--model", "openai-compat:local", "--workspace", str(workspace), "--json"]
    if how == "flag":
        args += ["--base-url", server.url]
    else:
        env = {**env, "OPENAI_BASE_URL": server.url}
    run = await asyncio.to_thread(_cli, env, *args)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout.splitlines()[-1])["status"] == "completed"
    assert [r["path"] for r in server.requests() if r["method"] == "POST"] == ["/chat/completions"]


@pytest.mark.usefixtures("worker", "unconfined")
async def test_transcript_of_a_running_task_shows_the_message_whose_calls_run(
    client: Client, env: dict[str, str], scripted: Any, workspace: Path,
) -> None:
    """The model's message whose tool calls its sampling activity is running
    is no row of the task yet (``status`` does not count it), but it is
    recorded in that activity's heartbeat before any call starts: the
    transcript shows it, marked in flight."""
    server = scripted(scenario("anthropic", entry(anthropic_message(
        "listing, then waiting", tool_calls=[("c1", "shell", {"command": "echo $$ > pid; sleep 100"})]))))
    task_id = f"task-{uuid.uuid4().hex[:8]}"
    run = await asyncio.to_thread(_cli, env, "run", "go", "--model", "anthropic:scripted",
                                  "--base-url", server.url, "--workspace", str(workspace),
                                  "--id", task_id, "--detach")
    assert run.returncode == 0, run.stderr
    try:
        await wait_until(lambda: (workspace / "pid").exists(), 30, "the tool call")
        out = await asyncio.to_thread(_cli, env, "transcript", task_id, "--json")
        assert out.returncode == 0, out.stderr
        rows = [json.loads(line) for line in out.stdout.splitlines()]
        status = await client.get_workflow_handle(task_id).query("status", result_type=TaskStatus)
        assert len(rows) == status.rows + 1, (rows, status)
        (message,) = [r for r in rows if r["kind"] == "assistant"]
        assert message["text"] == "listing, then waiting"
        assert [c["id"] for c in message["tool_calls"]] == ["c1"]
        assert message["meta"] == {"in_flight": True} and message is rows[-1] and message["round"] == 1
    finally:
        await client.get_workflow_handle(task_id).cancel(reason="test cleanup")


@pytest.mark.usefixtures("worker", "unconfined")
async def test_a_watcher_sees_a_round_while_the_sampling_activity_runs_its_calls(
    client: Client, env: dict[str, str], scripted: Any, workspace: Path,
) -> None:
    """A quick response whose calls the sampling activity runs itself reaches
    the stream whole only when they end; a watcher gets its text and calls as
    deltas before they start (what ``run`` / ``follow`` draw meanwhile)."""
    server = scripted(scenario(
        "anthropic",
        entry(anthropic_message("first, a pause", tool_calls=[("c1", "shell", {"command": "sleep 3"})])),
        entry(anthropic_message("now the long one", tool_calls=[
            ("c2", "shell", {"command": "echo $$ > pid; sleep 100"})])),
    ))
    task_id = f"task-{uuid.uuid4().hex[:8]}"
    run = await asyncio.to_thread(_cli, env, "run", "go", "--model", "anthropic:scripted",
                                  "--base-url", server.url, "--workspace", str(workspace),
                                  "--id", task_id, "--detach")
    assert run.returncode == 0, run.stderr
    proc = subprocess.Popen([sys.executable, "-m", "stopline.cli", "follow", task_id, "--json"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out = _Lines(proc)
        await out.wait_for('"call_id":"c1"', timeout=60)  # attached during round 1's call
        await wait_until(lambda: (workspace / "pid").exists(), 60, "round 2's call")
        await out.wait_for('"text":"now the long one"', timeout=15)
        events = [json.loads(line) for _, line in out.lines if line.startswith('{"kind"')]
        round2 = [e for e in events if e.get("round") == 2]
        kinds = [e["kind"] for e in round2]
        assert "assistant_delta" in kinds and "tool_args_delta" in kinds, round2
        assert "assistant_text" not in kinds and "tool_call_started" not in kinds, round2
        (args,) = [e for e in round2 if e["kind"] == "tool_args_delta"]
        assert args["call_id"] == "c2" and args["tool_name"] == "shell" and "sleep 100" in args["text"]
    finally:
        proc.kill()
        proc.wait(timeout=30)
        await client.get_workflow_handle(task_id).cancel(reason="test cleanup")


@pytest.mark.usefixtures("worker")
async def test_a_poll_for_an_event_the_run_never_publishes_does_not_hold_it_open(
    client: Client, scripted: Any, workspace: Path, task_queue: str,
) -> None:
    """A reset re-applies a watcher's stream polls from the longer branch; one
    asking for an offset the new run never reaches must not keep the ended
    run open (nothing ever hangs)."""
    from temporalio.client import WorkflowUpdateStage
    from temporalio.contrib.workflow_streams._types import PollInput

    from tests.conftest import start_task

    server = scripted(scenario("anthropic", {**entry(anthropic_message("done")), "delay_s": 1.0}))
    handle = await start_task(client, task_queue, server, workspace)
    await handle.start_update(
        "__temporal_workflow_stream_poll", PollInput(topics=[], from_offset=10_000),
        wait_for_stage=WorkflowUpdateStage.ACCEPTED,
    )
    result = await asyncio.wait_for(handle.result(), 30)
    assert result.status == "completed"
