"""Provider calls end to end — verdicts, bounds, settings: a task against the scripted server on a real
dev server, checking what a verdict does to the task — failed, refused or
retried — how many requests reached the provider, and what the reason says.

Each verdict arrives in the shape a provider really uses for it: a Responses
``error`` event mid-stream (quota, policy), a stream that goes silent, a
provider that never answers within an attempt's start-to-close timeout.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client

from stopline.activities.ledger import LedgerStore
from stopline.testing.scripted import entry, openai_chat_completion, openai_response, scenario
from stopline.worker.runtime import task_result
from tests.conftest import start_task

pytestmark = pytest.mark.usefixtures("worker")


def _error_event_entry(error: dict[str, Any]) -> dict[str, Any]:
    """A Responses stream that starts, then reports ``error`` as an event."""
    return entry(openai_response("unused"), stream_events=[
        {"event": "response.created", "data": {"type": "response.created", "response": {"status": "in_progress", "output": []}}},
        {"event": "error", "data": {"type": "error", "sequence_number": 1, "error": error}},
    ])


async def test_quota_error_event_fails_after_one_request(
    client: Client, task_queue: str, scripted: Any, workspace: Path
) -> None:
    server = scripted(scenario(
        "openai-responses",
        _error_event_entry({"type": "insufficient_quota", "code": "insufficient_quota",
                            "message": "You are out of credit.", "param": None}),
        entry(openai_response("must never be served")),
    ))
    result = await task_result(await start_task(client, task_queue, server, workspace))
    assert result.status == "failed" and not result.refused, result
    assert server.request_count() == 1 and result.provider_calls == 1
    for part in ("openai-responses:scripted", "1 attempt", "1 provider request", "insufficient_quota",
                 "out of credit"):
        assert part in result.reason, result.reason


async def test_policy_error_event_stops_the_task_refused_after_one_request(
    client: Client, task_queue: str, scripted: Any, workspace: Path, stopline_home: Path
) -> None:
    server = scripted(scenario(
        "openai-responses",
        _error_event_entry({"type": "invalid_request", "code": "cyber_policy",
                            "message": "Flagged for possible cybersecurity risk."}),
        entry(openai_response("must never be served")),
    ))
    handle = await start_task(client, task_queue, server, workspace)
    result = await handle.result()
    assert result.status == "stopped" and result.refused, result
    assert server.request_count() == 1 and result.provider_calls == 1
    rows = LedgerStore(stopline_home / "ledger").read(handle.id)
    stop = [r for r in rows if r.kind == "provider-refusal-stop"]
    assert len(stop) == 1 and stop[0].meta.get("category") == "cyber_policy"


async def test_a_silent_stream_is_retried_after_the_idle_bound(
    client: Client, task_queue: str, scripted: Any, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The worker's activities read settings per call: a 0.5 s idle bound.
    monkeypatch.setenv("STOPLINE_SAMPLING_IDLE_TIMEOUT_S", "0.5")
    server = scripted(scenario(
        "openai-chat",
        entry(openai_chat_completion("this answer stalls after its first chunk"), event_delay_s=60),
        entry(openai_chat_completion("done")),
    ))
    handle = await start_task(client, task_queue, server, workspace)
    result = await handle.result()
    assert result.status == "completed" and result.final_text == "done", result
    assert server.request_count() == 2 and result.provider_calls == 2
    desc = await handle.describe()
    # The stall cost the idle bound and one retry wait (1 s), not the 60 s
    # the server would have held the stream for.
    assert desc.close_time is not None and desc.start_time is not None
    assert (desc.close_time - desc.start_time).total_seconds() < 30


async def test_start_to_close_timeouts_count_every_request_and_say_who(
    client: Client, task_queue: str, scripted: Any, workspace: Path
) -> None:
    # Each attempt gets 1 s; the provider holds every answer for 20 s. The
    # call's total bound (3.5 s) leaves room for two attempts: the second
    # ends in a timeout Temporal reports, carrying only the last heartbeat's
    # details — from which provider_calls must still come out true.
    server = scripted(scenario("openai-chat", entry(openai_chat_completion("late"), delay_s=20, repeat=5)))
    handle = await start_task(
        client, task_queue, server, workspace, sampling_timeout_s=1.0, sampling_total_timeout_s=3.5,
    )
    result = await task_result(handle)
    assert result.status == "failed", result
    made = server.request_count()
    assert made >= 2 and result.provider_calls == made, (made, result)
    for part in ("openai:scripted", f"{made} attempts", f"{made} provider requests", "timed out"):
        assert part in result.reason, result.reason


async def test_task_sampling_settings_reach_every_request(
    client: Client, task_queue: str, scripted: Any, workspace: Path
) -> None:
    server = scripted(scenario(
        "openai-chat",
        entry(openai_chat_completion("", [("c1", "list_dir", {"path": "."})])),
        entry(openai_chat_completion("done")),
    ))
    handle = await start_task(client, task_queue, server, workspace, max_tokens=77, temperature=0.0, top_p=0.9)
    assert (await handle.result()).status == "completed"
    bodies = [r["body"] for r in server.requests()]
    assert len(bodies) == 2
    for body in bodies:
        assert (body["max_tokens"], body["temperature"], body["top_p"]) == (77, 0.0, 0.9)
