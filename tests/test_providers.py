"""Provider adapters against the scripted server: real HTTP, real SSE.

Every case runs twice (``stream`` fixture: a JSON answer and an SSE one).
The scripted server derives the SSE sequence from the same body, so a case
proves the two paths agree. What is checked: text and tool calls, stop
reason normalization, every refusal shape (DESIGN §4: a refusal is a result,
never an exception, and carries no tool calls), error classification
(retryable or not, retry-after), and the request bodies the adapters send.
"""

from __future__ import annotations

import asyncio
import http.server
import json
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from stopline.activities.providers.anthropic import AnthropicAdapter
from stopline.activities.providers.base import ProviderAdapter, ProviderError, tool_call_from_raw
from stopline.activities.providers.openai_chat import OpenAIChatAdapter
from stopline.activities.providers.openai_responses import OpenAIResponsesAdapter
from stopline.activities.providers.registry import WIRE_TO_PROVIDER, get_adapter, parse_model_ref
from stopline.core.contracts import (
    Message,
    SamplingResult,
    TextPart,
    ToolCall,
    ToolResultPart,
    ToolSpec,
    ToolUsePart,
)
from stopline.testing.scripted import (
    ScriptedServer,
    anthropic_message,
    entry,
    openai_chat_completion,
    openai_response,
    scenario,
)

ANTHROPIC, CHAT, RESPONSES = "anthropic", "openai-chat", "openai-responses"
ALL_WIRES = (ANTHROPIC, CHAT, RESPONSES)
OPENAI_WIRES = (CHAT, RESPONSES)

PROMPT = [Message(role="user", parts=[TextPart(text="hello")])]
TOOLS = [
    ToolSpec(
        name="shell",
        description="Run a command.",
        input_schema={"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]},
    )
]

Serve = Callable[..., ScriptedServer]


@pytest.fixture(params=[False, True], ids=["json", "sse"])
def stream(request: pytest.FixtureRequest) -> bool:
    """Each case runs with a JSON answer and with an SSE one."""
    return bool(request.param)


@pytest.fixture
def serve(scripted: Callable[[dict[str, Any]], ScriptedServer]) -> Serve:
    """``serve(wire, *entries)``: a started scripted server (stopped at teardown)."""

    def make(wire: str, *entries: dict[str, Any]) -> ScriptedServer:
        return scripted(scenario(wire, *entries))

    return make


def adapter_for(wire: str) -> ProviderAdapter:
    return get_adapter(WIRE_TO_PROVIDER[wire])


def base_url(server: ScriptedServer) -> str:
    # OpenAI base URLs carry the /v1 (https://api.openai.com/v1); Anthropic's do not.
    return server.url if server.wire == ANTHROPIC else f"{server.url}/v1"


async def call(
    server: ScriptedServer,
    *,
    stream: bool,
    messages: list[Message] | None = None,
    tools: list[ToolSpec] | None = None,
    system: str = "be brief",
    api_key: str | None = None,
    timeout: float = 5.0,
    progress: list[int] | None = None,
    **extra: Any,
) -> SamplingResult:
    """One adapter call against ``server`` with a retry-free client
    (``extra``: sampling settings, ``idle_timeout_s``, ``on_request``)."""
    ticks = progress if progress is not None else []
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(timeout), transport=httpx.AsyncHTTPTransport(retries=0)
    ) as client:
        return await adapter_for(server.wire).sample(
            client,
            base_url=base_url(server),
            api_key=api_key,
            model="scripted-model",
            system=system,
            messages=messages if messages is not None else PROMPT,
            tools=tools if tools is not None else TOOLS,
            max_tokens=256,
            stream=stream,
            on_progress=lambda: ticks.append(1),
            **extra,
        )


async def call_error(server: ScriptedServer, *, stream: bool, **kw: Any) -> ProviderError:
    with pytest.raises(ProviderError) as info:
        await call(server, stream=stream, **kw)
    return info.value


def reply(wire: str, text: str = "", tool_calls: list[tuple[str, str, dict[str, Any]]] | None = None, **kw: Any) -> dict[str, Any]:
    """The wire's builder for one successful answer."""
    calls = tool_calls or []
    if wire == ANTHROPIC:
        return anthropic_message(text, calls, **kw)
    if wire == CHAT:
        return openai_chat_completion(text, calls, **kw)
    return openai_response(text, calls, **kw)


def set_raw_arguments(wire: str, body: dict[str, Any], raw: str) -> dict[str, Any]:
    """Replace the first tool call's arguments string (OpenAI wires)."""
    if wire == CHAT:
        body["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] = raw
    else:
        next(i for i in body["output"] if i["type"] == "function_call")["arguments"] = raw
    return body


# ---------------------------------------------------------------------------
# Text, tool calls, stop reasons
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("wire", ALL_WIRES)
async def test_text_reply(serve: Serve, wire: str, stream: bool) -> None:
    server = serve(wire, entry(reply(wire, "Hello there, how can I help?")))
    progress: list[int] = []
    result = await call(server, stream=stream, progress=progress)
    assert result.text == "Hello there, how can I help?"
    assert result.stop_reason == "end_turn"
    assert result.refusal is None and result.tool_calls == []
    assert result.model == "scripted-model"
    assert result.provider == WIRE_TO_PROVIDER[wire]
    assert result.usage.input_tokens == 10 and result.usage.output_tokens > 0
    # Streamed: one tick per event at least; JSON: once.
    assert len(progress) > 3 if stream else len(progress) == 1


@pytest.mark.parametrize("wire", ALL_WIRES)
async def test_tool_calls_parsed_in_order(serve: Serve, wire: str, stream: bool) -> None:
    calls = [("call_1", "shell", {"cmd": "ls -la"}), ("call_2", "shell", {"cmd": "echo \"hi\""})]
    server = serve(wire, entry(reply(wire, "Let me look.", calls)))
    result = await call(server, stream=stream)
    assert result.stop_reason == "tool_use"
    assert result.text == "Let me look."
    assert [(c.id, c.name, c.arguments) for c in result.tool_calls] == [
        ("call_1", "shell", {"cmd": "ls -la"}),
        ("call_2", "shell", {"cmd": 'echo "hi"'}),
    ]
    for c in result.tool_calls:
        assert c.parse_error is None
        assert json.loads(c.raw_arguments) == c.arguments


@pytest.mark.parametrize("wire", OPENAI_WIRES)
@pytest.mark.parametrize("raw", ['{"cmd": "ls', "[1, 2]", "not json"])
async def test_unparsable_arguments_are_a_parse_error(serve: Serve, wire: str, raw: str, stream: bool) -> None:
    body = set_raw_arguments(wire, reply(wire, "", [("call_1", "shell", {"cmd": "x"})]), raw)
    server = serve(wire, entry(body))
    result = await call(server, stream=stream)
    assert result.stop_reason == "tool_use"
    (c,) = result.tool_calls
    assert c.arguments is None and c.parse_error
    assert c.raw_arguments == raw


async def test_anthropic_unparsable_arguments(serve: Serve, stream: bool) -> None:
    # JSON answer: an input that is not an object. SSE: partial_json that
    # never closes (what a truncated tool call looks like on the wire).
    body = anthropic_message("", [("toolu_1", "shell", {"cmd": "x"})])
    body["content"][0]["input"] = ["not", "an", "object"]
    events = [
        {"event": "message_start", "data": {"type": "message_start", "message": {"usage": {"input_tokens": 3}}}},
        {"event": "content_block_start", "data": {"type": "content_block_start", "index": 0,
         "content_block": {"type": "tool_use", "id": "toolu_1", "name": "shell", "input": {}}}},
        {"event": "content_block_delta", "data": {"type": "content_block_delta", "index": 0,
         "delta": {"type": "input_json_delta", "partial_json": '{"cmd": "ec'}}},
        {"event": "content_block_stop", "data": {"type": "content_block_stop", "index": 0}},
        {"event": "message_delta", "data": {"type": "message_delta", "delta": {"stop_reason": "max_tokens"},
         "usage": {"output_tokens": 5}}},
        {"event": "message_stop", "data": {"type": "message_stop"}},
    ]
    server = serve(ANTHROPIC, entry(body, stream_events=events))
    result = await call(server, stream=stream)
    (c,) = result.tool_calls
    assert c.arguments is None and c.parse_error
    if stream:
        assert c.raw_arguments == '{"cmd": "ec'
        assert result.stop_reason == "max_tokens" and result.refusal is None
    else:
        assert c.raw_arguments == '["not", "an", "object"]'


@pytest.mark.parametrize(
    ("wire", "kw", "stop", "raw"),
    [
        (ANTHROPIC, {"stop_reason": "end_turn"}, "end_turn", "end_turn"),
        (ANTHROPIC, {"stop_reason": "stop_sequence"}, "end_turn", "stop_sequence"),
        (ANTHROPIC, {"stop_reason": "max_tokens"}, "max_tokens", "max_tokens"),
        (ANTHROPIC, {"stop_reason": "pause_turn"}, "other", "pause_turn"),
        (CHAT, {"finish_reason": "stop"}, "end_turn", "stop"),
        (CHAT, {"finish_reason": "length"}, "max_tokens", "length"),
        (RESPONSES, {}, "end_turn", "completed"),
        (RESPONSES, {"status": "incomplete", "incomplete_reason": "max_output_tokens"}, "max_tokens", "max_output_tokens"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
async def test_stop_reason_mapping(serve: Serve, wire: str, kw: dict[str, Any], stop: str, raw: str, stream: bool) -> None:
    server = serve(wire, entry(reply(wire, "partial answer", **kw)))
    result = await call(server, stream=stream)
    assert (result.stop_reason, result.raw_stop_reason) == (stop, raw)
    # Running out of tokens is never a refusal (DESIGN §4).
    assert result.refusal is None
    assert result.text == "partial answer"


@pytest.mark.parametrize("wire", ALL_WIRES)
async def test_truncated_tool_call_is_max_tokens_not_refusal(serve: Serve, wire: str, stream: bool) -> None:
    kw = {
        ANTHROPIC: {"stop_reason": "max_tokens"},
        CHAT: {"finish_reason": "length"},
        RESPONSES: {"status": "incomplete", "incomplete_reason": "max_output_tokens"},
    }[wire]
    body = reply(wire, "", [("call_1", "shell", {"cmd": "ls"})], **kw)
    server = serve(wire, entry(body))
    result = await call(server, stream=stream)
    assert result.stop_reason == "max_tokens" and result.refusal is None
    assert [c.id for c in result.tool_calls] == ["call_1"]


async def test_chat_stop_with_tool_calls_is_tool_use(serve: Serve, stream: bool) -> None:
    # Older Ollama / vLLM send finish_reason "stop" with tool calls.
    server = serve(CHAT, entry(openai_chat_completion("", [("c1", "shell", {"cmd": "ls"})], finish_reason="stop")))
    result = await call(server, stream=stream)
    assert (result.stop_reason, result.raw_stop_reason) == ("tool_use", "stop")
    assert [c.id for c in result.tool_calls] == ["c1"]


# ---------------------------------------------------------------------------
# Refusals: results, never exceptions; no tool calls survive them
# ---------------------------------------------------------------------------


def assert_refused(result: SamplingResult, *, provider: str, category: str | None, detail: str | None = None) -> None:
    assert result.stop_reason == "refusal"
    assert result.refusal is not None
    assert result.refusal.provider == provider
    assert result.refusal.category == category
    if detail is not None:
        assert result.refusal.detail == detail
    assert result.tool_calls == []


async def test_anthropic_refusal_without_content(serve: Serve, stream: bool) -> None:
    server = serve(ANTHROPIC, entry(anthropic_message("", stop_reason="refusal")))
    result = await call(server, stream=stream)
    assert_refused(result, provider="anthropic", category=None)
    assert result.text == "" and result.raw_stop_reason == "refusal"
    assert result.refusal is not None and result.refusal.detail is None


async def test_anthropic_refusal_after_text_and_tool_call(serve: Serve, stream: bool) -> None:
    # Text streamed first, then the classifier stops the turn: the text is
    # kept (the assistant wrote it), the tool call is dropped.
    body = anthropic_message("Sure, first I will", [("toolu_1", "shell", {"cmd": "nmap"})], stop_reason="refusal")
    server = serve(ANTHROPIC, entry(body))
    result = await call(server, stream=stream)
    assert_refused(result, provider="anthropic", category=None)
    assert result.text == "Sure, first I will"


async def test_anthropic_refusal_with_stop_details(serve: Serve, stream: bool) -> None:
    details = {"type": "refusal", "category": "cyber", "explanation": "This looks like an attack on a live system."}
    server = serve(ANTHROPIC, entry(anthropic_message("", stop_reason="refusal", stop_details=details)))
    result = await call(server, stream=stream)
    assert_refused(result, provider="anthropic", category="cyber", detail="This looks like an attack on a live system.")


async def test_anthropic_refusal_stop_details_without_category(serve: Serve, stream: bool) -> None:
    details = {"type": "refusal", "category": None, "explanation": None}
    server = serve(ANTHROPIC, entry(anthropic_message("I won't", stop_reason="refusal", stop_details=details)))
    result = await call(server, stream=stream)
    assert_refused(result, provider="anthropic", category=None)
    assert result.refusal is not None and result.refusal.detail is None
    assert result.text == "I won't"


async def test_chat_content_filter(serve: Serve, stream: bool) -> None:
    body = openai_chat_completion("Here is how to", [("c1", "shell", {"cmd": "x"})], finish_reason="content_filter")
    server = serve(CHAT, entry(body))
    result = await call(server, stream=stream)
    assert_refused(result, provider="openai", category="content_filter")
    assert result.raw_stop_reason == "content_filter"
    assert result.text == "Here is how to"


async def test_chat_content_filter_category_from_filter_results(serve: Serve, stream: bool) -> None:
    # Azure OpenAI: choices[].content_filter_results names what was filtered.
    body = openai_chat_completion("", finish_reason="content_filter")
    body["choices"][0]["content_filter_results"] = {
        "hate": {"filtered": False, "severity": "safe"},
        "violence": {"filtered": True, "severity": "high"},
    }
    events = [
        {"event": None, "data": {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}},
        {"event": None, "data": {"choices": [{"index": 0, "delta": {}, "finish_reason": "content_filter",
                                              "content_filter_results": body["choices"][0]["content_filter_results"]}]}},
        {"event": None, "data": "[DONE]"},
    ]
    server = serve(CHAT, entry(body, stream_events=events))
    result = await call(server, stream=stream)
    assert_refused(result, provider="openai", category="violence")


async def test_chat_refusal_field_with_finish_stop(serve: Serve, stream: bool) -> None:
    # A non-empty refusal means refused whatever finish_reason says.
    body = openai_chat_completion("", [("c1", "shell", {"cmd": "x"})], finish_reason="stop", refusal="I can't help with that.")
    server = serve(CHAT, entry(body))
    result = await call(server, stream=stream)
    assert_refused(result, provider="openai", category=None, detail="I can't help with that.")
    assert result.raw_stop_reason == "stop"


async def test_chat_refusal_only_in_stream_deltas(serve: Serve, stream: bool) -> None:
    body = openai_chat_completion("Well,", finish_reason="stop", refusal="Sorry, no.")
    events = [
        {"event": None, "data": {"choices": [{"index": 0, "delta": {"role": "assistant", "content": "Well,"}}]}},
        {"event": None, "data": {"choices": [{"index": 0, "delta": {"refusal": "Sorry, "}}]}},
        {"event": None, "data": {"choices": [{"index": 0, "delta": {"refusal": "no."}}]}},
        {"event": None, "data": {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}},
        {"event": None, "data": {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 3}}},
        {"event": None, "data": "[DONE]"},
    ]
    server = serve(CHAT, entry(body, stream_events=events))
    result = await call(server, stream=stream)
    assert_refused(result, provider="openai", category=None, detail="Sorry, no.")
    assert result.text == "Well,"


async def test_chat_empty_refusal_is_not_a_refusal(serve: Serve, stream: bool) -> None:
    server = serve(CHAT, entry(openai_chat_completion("fine", refusal="")))
    result = await call(server, stream=stream)
    assert result.stop_reason == "end_turn" and result.refusal is None


async def test_responses_refusal_part(serve: Serve, stream: bool) -> None:
    body = openai_response("", [("call_1", "shell", {"cmd": "x"})], refusal="I can't assist with that.")
    server = serve(RESPONSES, entry(body))
    result = await call(server, stream=stream)
    assert_refused(result, provider="openai-responses", category=None, detail="I can't assist with that.")
    assert result.raw_stop_reason == "completed"


async def test_responses_incomplete_content_filter(serve: Serve, stream: bool) -> None:
    body = openai_response("Partial", [("call_1", "shell", {"cmd": "x"})], status="incomplete", incomplete_reason="content_filter")
    server = serve(RESPONSES, entry(body))
    result = await call(server, stream=stream)
    assert_refused(result, provider="openai-responses", category="content_filter")
    assert result.raw_stop_reason == "content_filter"
    assert result.text == "Partial"


def responses_event(kind: str, **fields: Any) -> dict[str, Any]:
    return {"event": kind, "data": {"type": kind, **fields}}


async def test_responses_stream_built_from_deltas_when_terminal_has_no_output(serve: Serve, stream: bool) -> None:
    # A compatible server whose terminal event carries no output: the result
    # is rebuilt from the deltas, and a refusal seen only there still counts.
    body = openai_response("I cannot", [("call_1", "shell", {"cmd": "x"})], refusal="Not allowed.")
    events = [
        responses_event("response.output_item.added", output_index=0, item={"type": "message", "role": "assistant", "content": []}),
        responses_event("response.output_text.delta", output_index=0, content_index=0, delta="I can"),
        responses_event("response.output_text.delta", output_index=0, content_index=0, delta="not"),
        responses_event("response.refusal.delta", output_index=0, content_index=1, delta="Not allowed."),
        responses_event("response.output_item.added", output_index=1,
                        item={"type": "function_call", "call_id": "call_1", "name": "shell", "arguments": ""}),
        responses_event("response.function_call_arguments.delta", output_index=1, delta='{"cmd": "x"}'),
        responses_event("response.completed", response={"status": "completed", "output": [], "usage": None}),
    ]
    server = serve(RESPONSES, entry(body, stream_events=events))
    result = await call(server, stream=stream)
    assert_refused(result, provider="openai-responses", category=None)
    assert result.text == "I cannot"


async def test_responses_stream_function_call_from_deltas(serve: Serve, stream: bool) -> None:
    body = openai_response("", [("call_1", "shell", {"cmd": "x"})])
    events = [
        responses_event("response.output_item.added", output_index=0,
                        item={"type": "function_call", "call_id": "call_1", "name": "shell", "arguments": ""}),
        responses_event("response.function_call_arguments.delta", output_index=0, delta='{"cmd": '),
        responses_event("response.function_call_arguments.delta", output_index=0, delta='"x"}'),
        responses_event("response.completed", response={"status": "completed"}),
    ]
    server = serve(RESPONSES, entry(body, stream_events=events))
    result = await call(server, stream=stream)
    assert result.stop_reason == "tool_use"
    assert [(c.id, c.arguments) for c in result.tool_calls] == [("call_1", {"cmd": "x"})]


@pytest.mark.parametrize("wire", OPENAI_WIRES)
@pytest.mark.parametrize(
    ("error", "category"),
    [
        ({"message": "The response was filtered due to the prompt triggering content management policy.",
          "type": None, "param": "prompt", "code": "content_filter", "status": 400,
          "innererror": {"code": "ResponsibleAIPolicyViolation",
                         "content_filter_result": {"hate": {"filtered": False, "severity": "safe"},
                                                   "self_harm": {"filtered": True, "severity": "medium"}}}},
         "self_harm"),
        ({"message": "Your request was rejected by our safety system.", "type": "invalid_request_error",
          "param": "cyber_policy", "code": "content_policy_violation"}, "cyber_policy"),
        ({"message": "Prompt blocked.", "type": "content_filter_error", "param": None, "code": None}, "content_filter"),
    ],
    ids=["azure", "policy-param", "type"],
)
async def test_prompt_filtered_400_is_a_refusal(
    serve: Serve, wire: str, error: dict[str, Any], category: str, stream: bool
) -> None:
    server = serve(wire, entry({"error": error}, status=400))
    result = await call(server, stream=stream)
    assert_refused(result, provider=WIRE_TO_PROVIDER[wire], category=category)
    assert result.refusal is not None and result.refusal.detail == error["message"]
    assert result.model == "scripted-model"
    assert server.request_count() == 1


async def test_anthropic_400_is_never_a_refusal(serve: Serve, stream: bool) -> None:
    body = {"type": "error", "error": {"type": "invalid_request_error", "message": "content_filter: prompt too long"}}
    server = serve(ANTHROPIC, entry(body, status=400))
    err = await call_error(server, stream=stream)
    assert err.retryable is False and err.status == 400


# ---------------------------------------------------------------------------
# Errors: one classification per provider
# ---------------------------------------------------------------------------


def error_body(wire: str, message: str, kind: str = "rate_limit_error") -> dict[str, Any]:
    if wire == ANTHROPIC:
        return {"type": "error", "error": {"type": kind, "message": message}}
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


@pytest.mark.parametrize("wire", ALL_WIRES)
async def test_429_with_retry_after_is_retryable(serve: Serve, wire: str, stream: bool) -> None:
    server = serve(wire, entry(error_body(wire, "Slow down please"), status=429, headers={"retry-after": "7"}))
    err = await call_error(server, stream=stream)
    assert (err.retryable, err.status, err.retry_after_s) == (True, 429, 7.0)
    assert err.provider == WIRE_TO_PROVIDER[wire]
    assert "Slow down please" in str(err) and "429" in str(err)


@pytest.mark.parametrize("wire", ALL_WIRES)
async def test_retry_after_ms(serve: Serve, wire: str, stream: bool) -> None:
    server = serve(wire, entry(error_body(wire, "busy"), status=503, headers={"retry-after-ms": "1500"}))
    err = await call_error(server, stream=stream)
    assert (err.retryable, err.retry_after_s) == (True, 1.5)


@pytest.mark.parametrize(
    ("wire", "status"),
    [(ANTHROPIC, 529), (ANTHROPIC, 503), (ANTHROPIC, 500), (ANTHROPIC, 408), (ANTHROPIC, 409),
     (CHAT, 503), (CHAT, 502), (RESPONSES, 503), (RESPONSES, 500)],
)
async def test_transient_statuses_are_retryable(serve: Serve, wire: str, status: int, stream: bool) -> None:
    server = serve(wire, entry(error_body(wire, "Overloaded", "overloaded_error"), status=status))
    err = await call_error(server, stream=stream)
    assert (err.retryable, err.status, err.retry_after_s) == (True, status, None)
    assert "Overloaded" in err.message


@pytest.mark.parametrize("wire", ALL_WIRES)
@pytest.mark.parametrize("status", [400, 401, 403, 404, 422])
async def test_client_errors_are_not_retryable(serve: Serve, wire: str, status: int, stream: bool) -> None:
    server = serve(wire, entry(error_body(wire, f"nope {status}", "invalid_request_error"), status=status, headers={"retry-after": "3"}))
    err = await call_error(server, stream=stream)
    assert (err.retryable, err.status, err.retry_after_s) == (False, status, None)
    assert f"nope {status}" in err.message
    assert server.request_count() == 1  # nothing retried underneath


@pytest.mark.parametrize("wire", OPENAI_WIRES)
async def test_insufficient_quota_429_is_not_retryable(serve: Serve, wire: str, stream: bool) -> None:
    body = {"error": {"message": "You exceeded your current quota", "type": "insufficient_quota", "code": "insufficient_quota"}}
    server = serve(wire, entry(body, status=429))
    err = await call_error(server, stream=stream)
    assert (err.retryable, err.status) == (False, 429)


@pytest.mark.parametrize("wire", ALL_WIRES)
async def test_long_error_message_is_truncated(serve: Serve, wire: str, stream: bool) -> None:
    server = serve(wire, entry(error_body(wire, "x" * 5000, "invalid_request_error"), status=400))
    err = await call_error(server, stream=stream)
    assert 50 < len(err.message) <= 300


@pytest.mark.parametrize(
    ("wire", "body", "missing"),
    [
        (ANTHROPIC, {"id": "msg_1", "type": "message", "stop_reason": "end_turn"}, "'content'"),
        (ANTHROPIC, {"content": "just a string"}, "'content'"),
        (CHAT, {"id": "x", "choices": []}, "'choices'"),
        (CHAT, {"choices": [{"index": 0, "finish_reason": "stop"}]}, "'message'"),
        (RESPONSES, {"id": "resp_1", "status": "completed"}, "'output'"),
        (RESPONSES, {"id": "resp_1", "output": []}, "'status'"),
        (ANTHROPIC, "<html>bad gateway</html>", "not JSON"),
        (CHAT, "<html>bad gateway</html>", "not JSON"),
    ],
)
async def test_bad_shape_is_not_retryable(serve: Serve, wire: str, body: Any, missing: str, stream: bool) -> None:
    # JSON: a 200 body without the expected fields. SSE: a frame whose data
    # is not JSON (the scripted server streams any body it is given).
    server = serve(wire, entry(body, stream_events=[{"event": None, "data": "{not json"}]))
    err = await call_error(server, stream=stream)
    assert err.retryable is False
    if stream:
        assert "not JSON" in err.message
    else:
        assert err.status == 200 and missing in err.message
        assert str(err).startswith(f"{WIRE_TO_PROVIDER[wire]} HTTP 200: ")


def without_stop_signal(wire: str) -> dict[str, Any]:
    body = reply(wire, "an answer")
    if wire == ANTHROPIC:
        body["stop_reason"] = None
    else:
        body["choices"][0]["finish_reason"] = None
    return body


@pytest.mark.parametrize(
    ("wire", "body", "json_says", "sse_says"),
    [
        (ANTHROPIC, {"id": "x", "type": "message"}, "no 'content' list", "without a stop_reason and no content blocks"),
        (ANTHROPIC, without_stop_signal(ANTHROPIC), "no 'stop_reason'", "without a stop_reason"),
        (CHAT, without_stop_signal(CHAT), "no 'finish_reason'", "without a finish_reason"),
    ],
    ids=["anthropic-empty", "anthropic-no-stop", "chat-no-finish"],
)
async def test_missing_stop_signal_is_not_retryable(
    serve: Serve, wire: str, body: dict[str, Any], json_says: str, sse_says: str, stream: bool
) -> None:
    # Without a stop signal nobody knows whether the turn was cut short: an
    # engine error in both modes (the scripted server streams the same body).
    server = serve(wire, entry(body))
    err = await call_error(server, stream=stream)
    assert err.retryable is False
    assert (sse_says if stream else json_says) in err.message


@pytest.mark.parametrize("wire", ALL_WIRES)
async def test_stream_error_event_is_retryable(serve: Serve, wire: str, stream: bool) -> None:
    # SSE: an error event mid-stream. JSON: the same error as an HTTP 500.
    events: list[dict[str, Any]]
    if wire == ANTHROPIC:
        events = [
            {"event": "message_start", "data": {"type": "message_start", "message": {"usage": {"input_tokens": 1}}}},
            {"event": "error", "data": {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}},
        ]
    elif wire == CHAT:
        events = [{"event": None, "data": {"error": {"message": "Overloaded", "type": "server_error"}}}]
    else:
        events = [{"event": "error", "data": {"type": "error", "code": "server_error", "message": "Overloaded", "param": None}}]
    status = 200 if stream else 500
    server = serve(wire, entry(error_body(wire, "Overloaded", "server_error"), status=status, stream_events=events))
    err = await call_error(server, stream=stream)
    assert err.retryable is True
    assert "Overloaded" in err.message


@pytest.mark.parametrize(("wire", "after"), [(ANTHROPIC, 4), (CHAT, 2), (RESPONSES, 5), (ANTHROPIC, 0)])
async def test_broken_stream_is_retryable(serve: Serve, wire: str, after: int, stream: bool) -> None:
    # SSE: the server cuts the stream after N frames, before its terminal
    # event. JSON: the server never answers and the client times out.
    body = reply(wire, "a long answer that will not arrive in full", [("call_1", "shell", {"cmd": "ls"})])
    server = serve(wire, entry(body, break_after_events=after, delay_s=0 if stream else 5))
    err = await call_error(server, stream=stream, timeout=0.5)
    assert err.retryable is True and err.status is None
    assert "broke off" in err.message if stream else "Timeout" in err.message


async def test_connection_refused_is_retryable(stream: bool) -> None:
    server = ScriptedServer(scenario(ANTHROPIC, entry(anthropic_message("hi"))))
    server.start()
    server.stop()  # the port is closed now
    err = await call_error(server, stream=stream)
    assert err.retryable is True and "ConnectError" in err.message


@pytest.mark.parametrize("wire", [RESPONSES])
async def test_responses_failed_status(serve: Serve, wire: str, stream: bool) -> None:
    server = serve(wire, entry(openai_response("", status="failed")))
    err = await call_error(server, stream=stream)
    assert err.retryable is True and "server_error" in err.message


# ---------------------------------------------------------------------------
# Verdicts by code, in every shape (an HTTP body, a stream error event, a
# Responses response.failed): one classifier per provider decides.
# ---------------------------------------------------------------------------


def error_in_shape(wire: str, shape: str, error: dict[str, Any]) -> dict[str, Any]:
    """A scripted entry that reports ``error`` as an HTTP 400 body, a stream
    error event (after some progress) or a Responses ``response.failed``."""
    if shape == "http":
        return entry({"error": error}, status=400)
    if shape == "failed":
        failed = openai_response("", status="failed", error=error)
        return entry(failed, stream_events=[
            {"event": "response.created", "data": {"type": "response.created",
                                                   "response": {**failed, "status": "in_progress", "error": None}}},
            {"event": "response.failed", "data": {"type": "response.failed", "response": failed}},
        ])
    if wire == CHAT:
        events = [
            {"event": None, "data": {"choices": [{"index": 0, "delta": {"content": "Sure"}}]}},
            {"event": None, "data": {"error": error}},
        ]
    else:
        events = [
            {"event": "response.created", "data": {"type": "response.created", "response": {"status": "in_progress", "output": []}}},
            {"event": "error", "data": {"type": "error", "sequence_number": 2, "error": error}},
        ]
    return entry(reply(wire, "unused"), stream_events=events)


SHAPES = [(CHAT, "http"), (CHAT, "stream"), (RESPONSES, "http"), (RESPONSES, "stream"), (RESPONSES, "failed")]


@pytest.mark.parametrize(("wire", "shape"), SHAPES)
@pytest.mark.parametrize(
    ("code", "kind"),
    [("insufficient_quota", "insufficient_quota"), ("invalid_api_key", "invalid_request_error"),
     ("context_length_exceeded", "invalid_request_error"), (None, "invalid_request_error")],
)
async def test_quota_auth_and_invalid_request_codes_are_final(
    serve: Serve, wire: str, shape: str, code: str | None, kind: str
) -> None:
    server = serve(wire, error_in_shape(wire, shape, {"type": kind, "code": code, "message": "no way", "param": None}))
    err = await call_error(server, stream=shape != "http")
    assert err.retryable is False, err
    assert err.code == (code or kind) and "no way" in err.message
    assert server.request_count() == 1


@pytest.mark.parametrize(("wire", "shape"), SHAPES)
@pytest.mark.parametrize(
    ("error", "category"),
    [({"type": "invalid_request", "code": "cyber_policy", "message": "flagged for cyber risk"}, "cyber_policy"),
     ({"type": "invalid_request_error", "code": "bio_policy", "message": "flagged"}, "bio_policy"),
     ({"type": "invalid_request_error", "code": "invalid_prompt", "message": "flagged as violating policy"}, "invalid_prompt"),
     ({"type": "invalid_request_error", "code": "content_filter", "message": "filtered"}, "content_filter")],
    ids=["cyber", "bio", "invalid_prompt", "content_filter"],
)
async def test_policy_codes_are_refusals_in_every_shape(
    serve: Serve, wire: str, shape: str, error: dict[str, Any], category: str
) -> None:
    # DESIGN §4: the provider's verdict on the request is a refusal result,
    # never an error Temporal would retry (and so re-send).
    server = serve(wire, error_in_shape(wire, shape, {**error, "param": None}))
    result = await call(server, stream=shape != "http")
    assert_refused(result, provider=WIRE_TO_PROVIDER[wire], category=category)
    assert result.refusal is not None and result.refusal.detail == error["message"]
    assert result.text == "" and result.tool_calls == []
    assert server.request_count() == 1


@pytest.mark.parametrize(("wire", "shape"), [(CHAT, "stream"), (RESPONSES, "stream"), (RESPONSES, "failed")])
@pytest.mark.parametrize("code", ["server_error", "rate_limit_exceeded", None])
async def test_transient_codes_in_a_stream_are_retryable(serve: Serve, wire: str, shape: str, code: str | None) -> None:
    server = serve(wire, error_in_shape(wire, shape, {"type": None, "code": code, "message": "try later"}))
    err = await call_error(server, stream=True)
    assert err.retryable is True and err.status is None and "try later" in err.message


async def test_the_code_decides_before_the_type(serve: Serve) -> None:
    # A generation that failed validation (the request was fine) comes with
    # an invalid-request type; its code says a new sample may succeed.
    error = {"type": "invalid_request_error", "code": "tool_use_failed", "message": "bad tool call"}
    server = serve(CHAT, error_in_shape(CHAT, "stream", error))
    assert (await call_error(server, stream=True)).retryable is True
    error = {"type": "server_error", "code": "invalid_api_key", "message": "key revoked"}
    server = serve(CHAT, error_in_shape(CHAT, "stream", error))
    assert (await call_error(server, stream=True)).retryable is False


@pytest.mark.parametrize(
    ("kind", "status", "retryable"),
    [("overloaded_error", None, True), ("api_error", None, True), ("invalid_request_error", None, False),
     ("authentication_error", 401, False), ("permission_error", 403, False), ("billing_error", 402, False),
     ("rate_limit_error", 429, True), ("overloaded_error", 529, True), ("mystery_error", None, True)],
)
async def test_anthropic_error_types_decide(serve: Serve, kind: str, status: int | None, retryable: bool) -> None:
    body = {"type": "error", "error": {"type": kind, "message": f"{kind} happened"}}
    if status is None:  # as a stream error event
        events = [
            {"event": "message_start", "data": {"type": "message_start", "message": {"usage": {"input_tokens": 1}}}},
            {"event": "error", "data": body},
        ]
        server = serve(ANTHROPIC, entry(anthropic_message("x"), stream_events=events))
    else:
        server = serve(ANTHROPIC, entry(body, status=status))
    err = await call_error(server, stream=True)
    assert (err.retryable, err.status, err.code) == (retryable, status, kind)
    assert f"{kind} happened" in err.message


@pytest.mark.parametrize("wire", ALL_WIRES)
async def test_a_silent_stream_fails_within_the_idle_bound(serve: Serve, wire: str) -> None:
    # One event, then nothing for 30 s: the call gives up after the idle
    # bound, retryably, however long the client's overall timeout is.
    body = reply(wire, "a long answer that stalls")
    server = serve(wire, entry(body, event_delay_s=30))
    started = asyncio.get_running_loop().time()
    err = await call_error(server, stream=True, timeout=60, idle_timeout_s=0.4)
    elapsed = asyncio.get_running_loop().time() - started
    assert err.retryable is True and err.status is None
    assert "no byte for 0.4 s" in err.message and "went idle" in err.message
    assert elapsed < 5, elapsed


async def test_no_status_line_within_the_idle_bound(serve: Serve, stream: bool) -> None:
    server = serve(ANTHROPIC, entry(anthropic_message("late"), delay_s=30))
    err = await call_error(server, stream=stream, timeout=60, idle_timeout_s=0.3)
    assert err.retryable is True and "no answer: no byte for 0.3 s" in err.message


@pytest.mark.parametrize("wire", ALL_WIRES)
async def test_sampling_settings_reach_the_request_only_when_set(serve: Serve, wire: str, stream: bool) -> None:
    server = serve(wire, entry(reply(wire, "a")), entry(reply(wire, "b")), entry(reply(wire, "c")))
    await call(server, stream=stream)
    await call(server, stream=stream, temperature=0.0, top_p=0.5)
    await call(server, stream=stream, temperature=1.3)
    bodies = [r["body"] for r in server.requests()]
    assert "temperature" not in bodies[0] and "top_p" not in bodies[0]
    assert (bodies[1]["temperature"], bodies[1]["top_p"]) == (0.0, 0.5)
    assert bodies[2]["temperature"] == 1.3 and "top_p" not in bodies[2]


async def test_on_request_is_called_once_per_request(serve: Serve, stream: bool) -> None:
    sent: list[int] = []
    server = serve(CHAT, entry(error_body(CHAT, "nope", "invalid_request_error"), status=400))
    await call_error(server, stream=stream, on_request=lambda: sent.append(1))
    assert sent == [1] and server.request_count() == 1


class _LocalServer:
    """A stdlib stand-in for a llama.cpp server: ``GET /props`` answers
    ``props`` (``None``: 404), ``POST`` answers one chat completion."""

    def __init__(self, props: dict[str, Any] | None) -> None:
        answer = json.dumps(openai_chat_completion("ok")).encode()
        self.posts = 0
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                data = json.dumps(props).encode() if props is not None and self.path == "/props" else b"{}"
                self.send_response(200 if props is not None and self.path == "/props" else 404)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self) -> None:
                outer.posts += 1
                self.rfile.read(int(self.headers.get("content-length") or 0))
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def __enter__(self) -> _LocalServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()


async def compat_call(url: str, tools: list[ToolSpec]) -> SamplingResult:
    async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(retries=0)) as client:
        return await get_adapter("openai-compat").sample(
            client, base_url=url, api_key=None, model="local", system="", messages=PROMPT,
            tools=tools, max_tokens=16, stream=False, on_progress=lambda: None,
        )


async def test_compat_server_whose_template_cannot_do_tools_fails_before_the_call() -> None:
    caps = {"chat_template_caps": {"supports_tools": False, "supports_tool_calls": False}}
    with _LocalServer(caps) as server:
        with pytest.raises(ProviderError) as info:
            await compat_call(server.url, TOOLS)
        assert server.posts == 0
        assert (await compat_call(server.url, [])).text == "ok"  # no tools offered: nothing to check
    err = info.value
    assert err.retryable is False and err.code == "template_without_tools"
    assert "chat template cannot use tools" in err.message and "supports_tools=false" in err.message


@pytest.mark.parametrize(
    "props", [{"chat_template_caps": {"supports_tools": True, "supports_tool_calls": True}}, None],
    ids=["capable", "no-props-endpoint"],
)
async def test_compat_server_that_can_do_tools_or_does_not_say_is_called(props: dict[str, Any] | None) -> None:
    with _LocalServer(props) as server:
        assert (await compat_call(server.url, TOOLS)).text == "ok"
        assert server.posts == 1


async def test_chat_stream_without_done_but_finished_is_accepted(serve: Serve, stream: bool) -> None:
    # Some compatible servers end with finish_reason and close, no [DONE].
    events = [
        {"event": None, "data": {"choices": [{"index": 0, "delta": {"content": "ok"}}]}},
        {"event": None, "data": {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}},
    ]
    server = serve(CHAT, entry(openai_chat_completion("ok"), stream_events=events))
    result = await call(server, stream=stream)
    assert (result.text, result.stop_reason) == ("ok", "end_turn")


@pytest.mark.parametrize("wire", ALL_WIRES)
async def test_stream_answered_with_plain_json(wire: str, stream: bool) -> None:
    # A server that ignores "stream": true and answers with one JSON body
    # (the scripted server always streams then, so a bare stdlib server).
    payload = json.dumps(reply(wire, "plain")).encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("content-length") or 0))
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(retries=0)) as client:
            result = await adapter_for(wire).sample(
                client, base_url=f"http://127.0.0.1:{httpd.server_address[1]}", api_key=None, model="m",
                system="", messages=PROMPT, tools=[], max_tokens=16, stream=stream, on_progress=lambda: None,
            )
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join()
    assert (result.text, result.stop_reason) == ("plain", "end_turn")


# ---------------------------------------------------------------------------
# Request shape (what the scripted server recorded)
# ---------------------------------------------------------------------------

CONVERSATION = [
    Message(role="user", parts=[TextPart(text="list the files")]),
    Message(
        role="assistant",
        parts=[
            TextPart(text="Looking."),
            ToolUsePart(call=ToolCall(id="call_a", name="shell", arguments={"cmd": "ls"}, raw_arguments='{"cmd":"ls"}')),
            ToolUsePart(call=ToolCall(id="call_b", name="shell", arguments=None, raw_arguments='{"cmd": "l', parse_error="bad")),
        ],
    ),
    Message(
        role="user",
        parts=[
            TextPart(text="also, hurry"),
            ToolResultPart(call_id="call_a", text="a.txt\nb.txt"),
            ToolResultPart(call_id="call_b", text="arguments were truncated", is_error=True),
        ],
    ),
]


def recorded(server: ScriptedServer) -> dict[str, Any]:
    (req,) = server.requests()
    return req


async def test_anthropic_request_shape(serve: Serve, stream: bool) -> None:
    server = serve(ANTHROPIC, entry(anthropic_message("done")))
    await call(server, stream=stream, messages=CONVERSATION, api_key="sk-ant-secret")
    req = recorded(server)
    body = req["body"]
    assert req["path"] == "/v1/messages"
    assert req["headers"]["x-api-key"] == "***"  # sent, masked in the record
    assert req["headers"]["anthropic-version"] == "2023-06-01"
    assert "authorization" not in req["headers"]
    assert body["system"] == "be brief"
    assert body["model"] == "scripted-model" and body["max_tokens"] == 256
    assert body.get("stream") is (True if stream else None)
    assert body["tools"] == [{"name": "shell", "description": "Run a command.", "input_schema": TOOLS[0].input_schema}]
    assert [m["role"] for m in body["messages"]] == ["user", "assistant", "user"]
    assert body["messages"][1]["content"] == [
        {"type": "text", "text": "Looking."},
        {"type": "tool_use", "id": "call_a", "name": "shell", "input": {"cmd": "ls"}},
        {"type": "tool_use", "id": "call_b", "name": "shell", "input": {}},
    ]
    # Tool results lead the user turn, each paired with its call.
    assert body["messages"][2]["content"] == [
        {"type": "tool_result", "tool_use_id": "call_a", "content": "a.txt\nb.txt", "is_error": False},
        {"type": "tool_result", "tool_use_id": "call_b", "content": "arguments were truncated", "is_error": True},
        {"type": "text", "text": "also, hurry"},
    ]


@pytest.mark.parametrize("wire", ALL_WIRES)
async def test_request_body_is_json_whatever_the_arguments_hold(serve: Serve, wire: str, stream: bool) -> None:
    """The body is sent as UTF-8 JSON (content-type set by us): text outside
    ASCII arrives as written, and a NaN a model put in its arguments, which
    JSON cannot carry, arrives as null instead of failing the call."""
    server = serve(wire, entry(reply(wire, "done")))
    call_nan = ToolCall(id="call_n", name="shell", arguments={"cmd": "größe ✓", "x": float("nan")},
                        raw_arguments='{"cmd": "größe ✓", "x": NaN}')
    messages = [
        Message(role="user", parts=[TextPart(text="schreib «hallo» ✓")]),
        Message(role="assistant", parts=[ToolUsePart(call=call_nan)]),
        Message(role="user", parts=[ToolResultPart(call_id="call_n", text="ok ✓")]),
    ]
    await call(server, stream=stream, messages=messages)
    req = recorded(server)
    assert req["headers"]["content-type"] == "application/json"
    body = req["body"]
    assert isinstance(body, dict), f"the body did not parse as JSON: {body!r}"
    text = json.dumps(body, ensure_ascii=False)
    assert "schreib «hallo» ✓" in text and "ok ✓" in text
    if wire == ANTHROPIC:
        assert body["messages"][1]["content"][0]["input"] == {"cmd": "größe ✓", "x": None}


@pytest.mark.parametrize("wire", ALL_WIRES)
async def test_lone_surrogates_from_the_provider_become_replacement_characters(
    serve: Serve, wire: str, stream: bool
) -> None:
    """Half an emoji escaped on its own (``\\ud83d``) in text or tool
    arguments would make the response impossible to record or send back:
    it arrives as U+FFFD, and a well-formed pair as its character."""
    server = serve(wire, entry(reply(wire, "cut \ud83d here, whole \U0001f600", [
        ("call_1", "shell", {"cmd": "echo \udc00"}),
    ])))
    result = await call(server, stream=stream)
    assert result.text == "cut \ufffd here, whole \U0001f600"
    assert result.tool_calls[0].arguments == {"cmd": "echo \ufffd"}
    result.model_dump_json()  # recordable: no lone surrogate left anywhere


@pytest.mark.parametrize("wire", ALL_WIRES)
async def test_arguments_nested_too_deep_are_held_back(serve: Serve, wire: str, stream: bool) -> None:
    """Arguments nested ~250 levels deep would make a sampling result the
    workflow cannot decode (the task hung): the call comes back with a
    parse error instead, and the result stays recordable."""
    deep: Any = 1
    for _ in range(248):
        deep = {"k": deep}
    server = serve(wire, entry(reply(wire, "", [("call_1", "shell", {"cmd": "echo hi", "x": deep}),
                                                ("call_2", "shell", {"cmd": "echo ok", "x": [[{"y": 1}]]})])))
    result = await call(server, stream=stream)
    first, second = result.tool_calls
    assert first.arguments is None and first.parse_error == "arguments nest deeper than 64 levels"
    assert second.arguments == {"cmd": "echo ok", "x": [[{"y": 1}]]} and second.parse_error is None
    SamplingResult.model_validate_json(result.model_dump_json())


async def test_chat_request_shape(serve: Serve, stream: bool) -> None:
    server = serve(CHAT, entry(openai_chat_completion("done")))
    await call(server, stream=stream, messages=CONVERSATION, api_key="sk-secret")
    req = recorded(server)
    body = req["body"]
    assert req["path"] == "/v1/chat/completions"
    assert req["headers"]["authorization"] == "***"
    assert body["max_tokens"] == 256 and "max_completion_tokens" not in body
    if stream:
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    else:
        assert "stream" not in body and "stream_options" not in body
    assert body["tools"] == [
        {"type": "function", "function": {"name": "shell", "description": "Run a command.", "parameters": TOOLS[0].input_schema}}
    ]
    assert body["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "list the files"},
        {
            "role": "assistant",
            "content": "Looking.",
            "tool_calls": [
                {"id": "call_a", "type": "function", "function": {"name": "shell", "arguments": '{"cmd":"ls"}'}},
                {"id": "call_b", "type": "function", "function": {"name": "shell", "arguments": '{"cmd": "l'}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_a", "content": "a.txt\nb.txt"},
        {"role": "tool", "tool_call_id": "call_b", "content": "arguments were truncated"},
        {"role": "user", "content": "also, hurry"},
    ]


async def test_responses_request_shape(serve: Serve, stream: bool) -> None:
    server = serve(RESPONSES, entry(openai_response("done")))
    await call(server, stream=stream, messages=CONVERSATION, api_key="sk-secret")
    req = recorded(server)
    body = req["body"]
    assert req["path"] == "/v1/responses"
    assert req["headers"]["authorization"] == "***"
    assert body["instructions"] == "be brief"
    assert body["max_output_tokens"] == 256 and body["store"] is False
    assert body.get("stream") is (True if stream else None)
    assert body["tools"] == [
        {"type": "function", "name": "shell", "description": "Run a command.", "parameters": TOOLS[0].input_schema}
    ]
    assert body["input"] == [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "list the files"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Looking."}]},
        {"type": "function_call", "call_id": "call_a", "name": "shell", "arguments": '{"cmd":"ls"}'},
        {"type": "function_call", "call_id": "call_b", "name": "shell", "arguments": '{"cmd": "l'},
        {"type": "function_call_output", "call_id": "call_a", "output": "a.txt\nb.txt"},
        {"type": "function_call_output", "call_id": "call_b", "output": "arguments were truncated"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "also, hurry"}]},
    ]


@pytest.mark.parametrize("wire", ALL_WIRES)
async def test_no_key_no_system_no_tools(serve: Serve, wire: str, stream: bool) -> None:
    # Local OpenAI-compatible servers take no key; empty system / tools are omitted.
    server = serve(wire, entry(reply(wire, "hi")))
    await call(server, stream=stream, system="", tools=[], api_key=None)
    req = recorded(server)
    assert "authorization" not in req["headers"] and "x-api-key" not in req["headers"]
    body = req["body"]
    assert "tools" not in body and "system" not in body and "instructions" not in body
    if wire == CHAT:
        assert body["messages"] == [{"role": "user", "content": "hello"}]


async def test_tool_call_round_trip(serve: Serve, stream: bool) -> None:
    # What a tool call parsed from one answer looks like in the next request.
    for wire in ALL_WIRES:
        server = serve(
            wire,
            entry(reply(wire, "", [("call_9", "shell", {"cmd": "pwd"})])),
            entry(reply(wire, "/work")),
        )
        first = await call(server, stream=stream)
        history = [
            *PROMPT,
            Message(role="assistant", parts=[ToolUsePart(call=c) for c in first.tool_calls]),
            Message(role="user", parts=[ToolResultPart(call_id="call_9", text="/work")]),
        ]
        second = await call(server, stream=stream, messages=history)
        assert second.text == "/work"
        body = server.requests()[1]["body"]
        if wire == ANTHROPIC:
            assert body["messages"][1]["content"][0]["input"] == {"cmd": "pwd"}
            assert body["messages"][2]["content"][0]["tool_use_id"] == "call_9"
        elif wire == CHAT:
            assert json.loads(body["messages"][2]["tool_calls"][0]["function"]["arguments"]) == {"cmd": "pwd"}
            assert body["messages"][3] == {"role": "tool", "tool_call_id": "call_9", "content": "/work"}
        else:
            assert body["input"][1]["call_id"] == "call_9"
            assert body["input"][2] == {"type": "function_call_output", "call_id": "call_9", "output": "/work"}


# ---------------------------------------------------------------------------
# Registry and pure helpers
# ---------------------------------------------------------------------------


def test_parse_model_ref() -> None:
    assert parse_model_ref("anthropic:claude-sonnet-4-5") == ("anthropic", "claude-sonnet-4-5")
    assert parse_model_ref("openai-compat:llama3.1:8b") == ("openai-compat", "llama3.1:8b")
    with pytest.raises(ValueError, match="provider:model.*anthropic, openai, openai-compat, openai-responses"):
        parse_model_ref("claude-sonnet-4-5")
    with pytest.raises(ValueError, match="unknown provider 'gemini'"):
        parse_model_ref("gemini:pro")
    with pytest.raises(ValueError, match="no model"):
        parse_model_ref("openai:")


def test_get_adapter() -> None:
    assert isinstance(get_adapter("anthropic"), AnthropicAdapter)
    chat = get_adapter("openai")
    compat = get_adapter("openai-compat")
    assert isinstance(chat, OpenAIChatAdapter) and isinstance(compat, OpenAIChatAdapter)
    assert (chat.provider, compat.provider) == ("openai", "openai-compat")
    assert isinstance(get_adapter("openai-responses"), OpenAIResponsesAdapter)
    with pytest.raises(ValueError, match="unknown provider"):
        get_adapter("scripted")
    assert set(WIRE_TO_PROVIDER) == {"anthropic", "openai-chat", "openai-responses"}


async def test_compat_provider_id_in_results(serve: Serve, stream: bool) -> None:
    server = serve(CHAT, entry(openai_chat_completion("", finish_reason="content_filter")))
    async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(retries=0)) as client:
        result = await get_adapter("openai-compat").sample(
            client, base_url=server.url, api_key=None, model="llama3.1:8b", system="", messages=PROMPT,
            tools=[], max_tokens=16, stream=stream, on_progress=lambda: None,
        )
    assert_refused(result, provider="openai-compat", category="content_filter")
    assert result.model == "llama3.1:8b"


@pytest.mark.parametrize(
    ("raw", "arguments", "error"),
    [
        ('{"a": 1}', {"a": 1}, None),
        ("", {}, None),
        ('{"a": ', None, "not valid JSON"),
        ('"str"', None, "not an object"),
        ("null", None, "not an object"),
    ],
)
def test_tool_call_from_raw(raw: str, arguments: dict[str, Any] | None, error: str | None) -> None:
    call = tool_call_from_raw("c", "t", raw)
    assert call.arguments == arguments and call.raw_arguments == raw
    assert (call.parse_error is None) if error is None else (error in (call.parse_error or ""))


class _OneSlotServer:
    """A stdlib stand-in for a one-slot llama.cpp server that streams slowly
    and, like llama.cpp, frees its slot a while after the client hangs up."""

    def __init__(self, release_after_s: float) -> None:
        self.busy = False
        self.freed_at: float | None = None
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _json(self, value: Any) -> None:
                data = json.dumps(value).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path == "/props":
                    self._json({"total_slots": 1, "chat_template_caps": {"supports_tools": True}})
                else:
                    self._json([{"id": 0, "is_processing": outer.busy}])

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length") or 0))
                outer.busy = True
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.end_headers()
                chunk = {"choices": [{"index": 0, "delta": {"content": "word "}}]}
                try:
                    for _ in range(400):
                        self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                        self.wfile.flush()
                        time.sleep(0.05)
                except OSError:
                    time.sleep(release_after_s)  # noticed the hang-up; the slot frees later
                outer.busy = False
                outer.freed_at = time.monotonic()

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def __enter__(self) -> _OneSlotServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()


@pytest.mark.parametrize("provider", ["openai-compat", "openai"])
async def test_a_cancelled_call_waits_for_a_one_slot_server_to_free_its_slot(provider: str) -> None:
    # An interrupt cancels the sampling call: against a one-slot local server
    # the cancel is acknowledged only once the server has dropped the
    # generation, so the next request does not queue behind it. A hosted
    # provider ("openai") is not asked anything after a cancel.
    with _OneSlotServer(release_after_s=0.3) as server:
        ticks: list[int] = []
        async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(retries=0)) as client:
            call_task = asyncio.create_task(get_adapter(provider).sample(
                client, base_url=server.url, api_key=None, model="local", system="", messages=PROMPT,
                tools=[], max_tokens=500, stream=True, on_progress=lambda: ticks.append(1),
            ))
            while len(ticks) < 3:
                await asyncio.sleep(0.01)
            call_task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call_task
            acknowledged = time.monotonic()
        if provider == "openai-compat":
            assert server.freed_at is not None and server.freed_at <= acknowledged
            assert not server.busy
        else:  # acknowledged at once, while the server was still generating
            assert server.freed_at is None or server.freed_at > acknowledged
