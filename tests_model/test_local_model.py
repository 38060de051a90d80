"""stopline end to end against a real model: llama.cpp's server, SmolLM2.

Each test drives a real task through the ``stopline`` CLI and a worker
subprocess and asserts an outcome stopline is responsible for — not what the
model chose to say. Every task is bounded (``--max-rounds``, ``--max-tokens``,
timeouts).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stopline.core.contracts import AgentTaskResult, InterruptResult
from stopline.testing.llama_server import LlamaServer, tool_chat_template
from stopline.worker.runtime import task_result
from tests_model.conftest import MakeStopline, Stopline, wait_generating

#: Makes SmolLM2 (temperature 0) copy one exact call, written the way the
#: chat template tells it to call: it does not choose tools by itself.
LIST_DIR_PROMPT = (
    "Reply with exactly this text and nothing else:\n"
    '<tool_call>\n{"name": "list_dir", "arguments": {"path": "."}}\n</tool_call>'
)
#: Keeps the model writing prose for a while, with no tool call.
STORY_PROMPT = "Write a very long story about a lighthouse keeper and the sea. Do not call any function."


async def test_one_round_task_completes_with_the_models_text_in_the_ledger(
    stopline: Stopline, workspace: Path
) -> None:
    result = stopline.run(
        "Say hello to me in one short sentence. Do not call any function.", workspace,
        "--max-rounds", "1", "--max-tokens", "64", "--temperature", "0",
    )
    assert result["status"] == "completed", result
    assert result["rounds"] == 1 and result["provider_calls"] == 1
    texts = [r.text for r in stopline.ledger(result["task_id"]) if r.kind == "assistant"]
    assert len(texts) == 1 and texts[0].strip(), texts


async def test_a_quoted_list_dir_call_runs_and_its_result_reaches_the_next_request(
    stopline: Stopline, workspace: Path
) -> None:
    result = stopline.run(LIST_DIR_PROMPT, workspace, "--max-rounds", "2", "--max-tokens", "96")
    assert result["status"] != "failed", result
    rows = stopline.ledger(result["task_id"])
    listing = [r for r in rows if r.kind == "tool_result" and r.tool_name == "list_dir"]
    assert listing, [(r.kind, r.text[:80]) for r in rows]
    assert listing[0].ok and "zebra-notes.txt" in listing[0].text
    # Round 2 was sampled, and the prompt the server processed for it (a
    # slot keeps the last prompt it rendered) carries the tool's result.
    assert result["rounds"] == 2 and result["provider_calls"] == 2, result
    (slot,) = stopline.server.slots()
    assert "zebra-notes.txt" in slot["prompt"], slot["prompt"][-2000:]


async def test_an_interrupt_frees_the_servers_slot_before_the_update_returns(
    stopline: Stopline, workspace: Path
) -> None:
    # The grace (DESIGN §3: how long the interrupt waits for calls to finish
    # cooperatively) covers llama.cpp's reaction: it notices the closed
    # connection only at its next token, and the sampling call acknowledges
    # the cancel once the server's one slot is idle.
    task_id = stopline.start(
        STORY_PROMPT, workspace, "--max-rounds", "1", "--max-tokens", "2000", "--grace", "2",
    )
    handle = stopline.client.get_workflow_handle(task_id, result_type=AgentTaskResult)
    try:
        await wait_generating(stopline.server)
        answer = await handle.execute_update("interrupt", result_type=InterruptResult)
        slots = stopline.server.slots()
        assert answer.interrupted, answer
        assert not any(s.get("is_processing") for s in slots), slots
        kinds = [r.kind for r in stopline.ledger(task_id)]
        assert "turn_aborted" in kinds, kinds
        assert "assistant" not in kinds  # the in-flight model call was dropped
    finally:
        await _terminate_if_running(handle)


async def test_a_worker_killed_mid_generation_is_replaced_and_the_task_ends(
    stopline: Stopline, workspace: Path
) -> None:
    # Three rounds: the round the crash cut short counts as one (the task
    # moves to the new worker's host and samples again).
    task_id = stopline.start(STORY_PROMPT, workspace, "--max-rounds", "3", "--max-tokens", "160")
    handle = stopline.client.get_workflow_handle(task_id, result_type=AgentTaskResult)
    try:
        await wait_generating(stopline.server)
        (first,) = stopline.workers.started
        first.kill()  # SIGKILL: a crash, mid-generation
        await stopline.workers.start()
        result = await asyncio.wait_for(task_result(handle), timeout=240)
    finally:
        await _terminate_if_running(handle)
    assert result.status != "failed", result
    assert result.status == "completed" or "max_tokens" in result.reason, result
    assert result.provider_calls >= 1 and result.host_id, result


@pytest.fixture
def toolless_llama(tmp_path: Path) -> Iterator[LlamaServer]:
    """A server with SmolLM2's own chat template, which cannot do tools."""
    with LlamaServer(tmp_path / "toolless.log", ctx=4096, chat_template=None) as server:
        yield server


async def test_a_chat_template_without_tools_fails_the_first_round_and_says_so(
    make_stopline: MakeStopline, workspace: Path, toolless_llama: LlamaServer
) -> None:
    caps = toolless_llama.props()["chat_template_caps"]
    assert caps["supports_tools"] is False, caps  # the premise: llama.cpp reports it
    stopline = await make_stopline(toolless_llama)
    result = stopline.run(LIST_DIR_PROMPT, workspace, "--max-rounds", "2", "--max-tokens", "64")
    assert result["status"] == "failed" and result["rounds"] == 1, result
    assert "chat template cannot use tools" in result["reason"], result
    assert "openai-compat:smollm2" in result["reason"], result
    assert all(s.get("id_task") is None for s in toolless_llama.slots())  # nothing was sent


@pytest.fixture
def small_context_llama(tmp_path: Path) -> Iterator[LlamaServer]:
    """A server whose context (1,024 tokens) cannot hold stopline's first request."""
    with LlamaServer(tmp_path / "small.log", ctx=1024, chat_template=tool_chat_template()) as server:
        yield server


async def test_a_context_too_small_fails_with_the_servers_reason_after_one_request(
    make_stopline: MakeStopline, workspace: Path, small_context_llama: LlamaServer
) -> None:
    stopline = await make_stopline(small_context_llama)
    result = stopline.run(LIST_DIR_PROMPT, workspace, "--max-rounds", "2", "--max-tokens", "64")
    assert result["status"] == "failed" and result["provider_calls"] == 1, result
    assert result["rounds"] == 1 and "1 attempt" in result["reason"], result
    assert "HTTP 400" in result["reason"] and "context" in result["reason"], result


async def _terminate_if_running(handle: Any) -> None:
    desc = await handle.describe()
    if desc.status is not None and desc.status.name == "RUNNING":
        await handle.terminate("test over")
