"""OpenAI Responses API adapter (``POST {base_url}/responses``).

Why it exists: the one place that knows the Responses wire format — ``input``
items instead of chat messages, ``output`` items instead of choices, typed
SSE events with a terminal ``response.completed`` / ``response.incomplete``
/ ``response.failed``. Requests are sent with ``store: false``: the
transcript lives in stopline's ledger, never on the provider.

What it must never do:

- retry (Temporal owns retries; errors are classified once, in
  :func:`classify_error`, whether they come as an HTTP body, a stream
  ``error`` event or a ``response.failed``);
- raise on a refusal. A ``refusal`` content part (or
  ``response.refusal.delta``), a response ``incomplete`` for
  ``content_filter``, and an error whose code is a policy verdict
  (``cyber_policy``, ``invalid_prompt``, a filtered prompt) are a
  ``SamplingResult`` with ``stop_reason == "refusal"`` (seed 000, DESIGN §4),
  without tool calls;
- treat ``incomplete`` for ``max_output_tokens`` as a refusal (truncation).
"""

from __future__ import annotations

from typing import Any

import httpx

from stopline.activities.deltas import SamplingDelta
from stopline.activities.providers import openai_chat
from stopline.activities.providers.base import (
    ErrorReport,
    ProviderError,
    StreamOutcome,
    WireAdapter,
    WireRequest,
    error_report,
    load_json_event,
    sampling_fields,
    shape_error,
    tool_call_from_raw,
)
from stopline.activities.providers.openai_chat import CONTENT_FILTER, request_headers
from stopline.core.contracts import (
    Message,
    Refusal,
    SamplingResult,
    StopReason,
    TextPart,
    ToolCall,
    ToolResultPart,
    ToolUsePart,
    Usage,
)

PROVIDER = "openai-responses"


def responses_url(base_url: str) -> str:
    """``{base_url}/responses``."""
    return f"{base_url.rstrip('/')}/responses"


def _message(role: str, part_type: str, texts: list[str]) -> dict[str, Any]:
    return {"type": "message", "role": role, "content": [{"type": part_type, "text": t} for t in texts]}


def _input_items(messages: list[Message]) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    for message in messages:
        if message.role == "assistant":
            texts: list[str] = []
            for part in message.parts:
                if isinstance(part, TextPart):
                    if part.text:
                        texts.append(part.text)
                elif isinstance(part, ToolUsePart):
                    if texts:
                        items.append(_message("assistant", "output_text", texts))
                        texts = []
                    call = part.call
                    items.append({
                        "type": "function_call",
                        "call_id": call.id,
                        "name": call.name,
                        "arguments": call.raw_arguments,
                    })
            if texts:
                items.append(_message("assistant", "output_text", texts))
        else:
            for part in message.parts:
                if isinstance(part, ToolResultPart):
                    items.append({"type": "function_call_output", "call_id": part.call_id, "output": part.text})
            texts = [p.text for p in message.parts if isinstance(p, TextPart) and p.text]
            if texts:
                items.append(_message("user", "input_text", texts))
    return items


def build_request(request: WireRequest) -> dict[str, Any]:
    """The JSON body of one Responses request.

    OpenAI Responses API: ``instructions`` = system prompt (omitted when
    empty); ``input`` = ``message`` items (``input_text`` parts for the user,
    ``output_text`` for the assistant), ``function_call`` items {call_id,
    name, arguments as sent} and ``function_call_output`` items {call_id,
    output}; tools ``{"type": "function", name, description, parameters}``
    (omitted when none); ``max_output_tokens``; ``temperature`` / ``top_p``
    only when set; ``store: false``.

    Args:
        request: The call.

    Returns:
        The request body.
    """
    body: dict[str, Any] = {
        "model": request.model,
        "input": _input_items(request.messages),
        "max_output_tokens": request.max_tokens,
        "store": False,
    }
    body.update(sampling_fields(request))
    if request.system:
        body["instructions"] = request.system
    if request.tools:
        body["tools"] = [
            {"type": "function", "name": t.name, "description": t.description, "parameters": t.input_schema}
            for t in request.tools
        ]
    if request.stream:
        body["stream"] = True
    return body


def classify_error(
    report: ErrorReport,
    *,
    provider: str = PROVIDER,
    model: str = "",
) -> ProviderError | SamplingResult:
    """Classify a failed Responses call, in any shape. The only place the
    Responses adapter does.

    The Responses API shares the OpenAI API's error codes, so the rules are
    the Chat adapter's (:func:`stopline.activities.providers.openai_chat.classify_error`),
    applied alike to an HTTP error body, a stream ``error`` event and a
    ``response.failed`` (its ``response.error``): a policy code
    (``cyber_policy``, ``invalid_prompt``, a content filter ...) is a
    refusal *result*; quota, auth and invalid-request codes are not
    retryable; ``server_error`` and rate limits are; the HTTP status decides
    the rest; a stream error or failed response without a known code is
    retryable.

    Args:
        report: The error.
        provider: Provider id.
        model: Model name, for a refusal result.

    Returns:
        A refusal result, or the error to raise.
    """
    return openai_chat.classify_error(report, provider=provider, model=model)


def _usage(usage: Any) -> Usage:
    if not isinstance(usage, dict):
        return Usage()
    inp, out = usage.get("input_tokens"), usage.get("output_tokens")
    return Usage(input_tokens=inp if isinstance(inp, int) else 0, output_tokens=out if isinstance(out, int) else 0)


def _failed(provider: str, model: str, response: dict[str, Any]) -> ProviderError | SamplingResult:
    """A ``failed`` response's verdict, by its ``error`` (see :func:`classify_error`)."""
    err = response.get("error")
    report = error_report({"error": err if isinstance(err, dict) else {}}, shape="failed")
    return classify_error(report, provider=provider, model=model)


def response_result(
    response: dict[str, Any],
    *,
    provider: str,
    model: str,
    seen_refusal: str = "",
) -> SamplingResult:
    """Parse a Responses ``response`` object (the body, or a terminal event's).

    OpenAI Responses API: ``output`` items — ``message`` (``output_text``
    and ``refusal`` parts), ``function_call`` {call_id, name, arguments};
    others (``reasoning`` ...) are skipped — ``status``,
    ``incomplete_details.reason``, ``usage``. Stop reason: ``completed``
    with function calls → ``tool_use``, ``completed`` → ``end_turn``,
    ``incomplete`` for ``max_output_tokens`` → ``max_tokens`` (never a
    refusal), for ``content_filter`` → ``refusal``, else ``other``. A
    refusal part (or ``seen_refusal`` streamed text) means refused, whatever
    the status. ``raw_stop_reason`` is the ``incomplete_details.reason`` of
    an incomplete response, else ``status``.

    Args:
        response: The response object.
        provider: Provider id.
        model: Model name as sent.
        seen_refusal: Refusal text already seen in ``response.refusal.delta``
            events.

    Returns:
        The result; a refusal is a result.

    Raises:
        ProviderError: Non-retryable on a missing ``output`` list or
            ``status``, or a bad item; on ``status: failed``, as
            :func:`classify_error` says (a policy code there is a refusal
            result instead).
    """
    status = response.get("status")
    if status == "failed":
        verdict = _failed(provider, model, response)
        if isinstance(verdict, ProviderError):
            raise verdict
        return verdict
    output = response.get("output")
    if not isinstance(output, list):
        raise shape_error(provider, "response has no 'output' list")
    if not isinstance(status, str):
        raise shape_error(provider, "response has no 'status'")
    texts: list[str] = []
    refusals: list[str] = [seen_refusal] if seen_refusal else []
    calls: list[ToolCall] = []
    for i, item in enumerate(output):
        if not isinstance(item, dict):
            raise shape_error(provider, f"output[{i}] is not an object")
        kind = item.get("type")
        if kind == "message":
            content = item.get("content")
            if not isinstance(content, list):
                raise shape_error(provider, f"output[{i}] message has no 'content' list")
            for part in content:
                if not isinstance(part, dict):
                    continue
                if part.get("type") == "output_text" and isinstance(part.get("text"), str):
                    texts.append(part["text"])
                elif part.get("type") == "refusal" and isinstance(part.get("refusal"), str):
                    if part["refusal"] and part["refusal"] not in refusals:
                        refusals.append(part["refusal"])
        elif kind == "function_call":
            call_id = item.get("call_id") or item.get("id")
            name, arguments = item.get("name"), item.get("arguments", "")
            if not isinstance(call_id, str) or not isinstance(name, str) or not isinstance(arguments, str):
                raise shape_error(provider, f"output[{i}] function_call lacks 'call_id', 'name' or 'arguments'")
            calls.append(tool_call_from_raw(call_id, name, arguments))
    details = response.get("incomplete_details")
    reason = details.get("reason") if isinstance(details, dict) else None
    stop: StopReason
    if status == "completed":
        stop = "tool_use" if calls else "end_turn"
    elif status == "incomplete" and reason == "max_output_tokens":
        stop = "max_tokens"
    elif status == "incomplete" and reason == CONTENT_FILTER:
        stop = "refusal"
    else:
        stop = "other"
    refusal: Refusal | None = None
    if refusals or stop == "refusal":
        refusal = Refusal(
            provider=provider,
            category=CONTENT_FILTER if stop == "refusal" else None,
            detail="\n".join(refusals) or None,
        )
        stop = "refusal"
    raw: str = reason if status == "incomplete" and isinstance(reason, str) else status
    return SamplingResult(
        provider=provider,
        model=model,
        text="".join(texts),
        tool_calls=[] if refusal is not None else calls,
        stop_reason=stop,
        raw_stop_reason=raw,
        refusal=refusal,
        usage=_usage(response.get("usage")),
    )


def parse_response(body: Any, *, provider: str, model: str) -> SamplingResult:
    """Parse a complete (non-streamed) Responses body; see :func:`response_result`."""
    if not isinstance(body, dict):
        raise shape_error(provider, "response is not a JSON object")
    return response_result(body, provider=provider, model=model)


_TERMINAL = {
    "response.completed": "completed",
    "response.incomplete": "incomplete",
    "response.failed": "failed",
}


class StreamAssembler(StreamOutcome):
    """Builds a result from the Responses SSE events.

    OpenAI Responses API, streaming: ``response.output_item.added`` /
    ``.done``, ``response.output_text.delta``, ``response.refusal.delta``,
    ``response.function_call_arguments.delta`` and a terminal
    ``response.completed`` / ``response.incomplete`` / ``response.failed``
    whose ``response`` object, when it has a non-empty ``output``, is taken
    as final; otherwise the result is built from the items and deltas seen.
    An ``error`` event ends the stream with :func:`classify_error`'s
    verdict (a policy code is a refusal, a quota code a final failure); a
    ``response.failed`` is classified the same way by its ``error``; a
    stream that ends without a terminal event broke off (retryable).
    """

    def __init__(self, *, provider: str, model: str) -> None:
        self.provider = provider
        self.model = model
        self.items: dict[int, dict[str, Any]] = {}
        self.done_items: dict[int, dict[str, Any]] = {}
        self.text: dict[int, list[str]] = {}
        self.refusal: dict[int, list[str]] = {}
        self.arguments: dict[int, list[str]] = {}
        self.terminal: dict[str, Any] | None = None
        #: text / argument pieces of the last event(s), for watchers
        self.deltas: list[SamplingDelta] = []

    def feed(self, event: str, data: str) -> bool:
        """Take one SSE event; ``True`` on a terminal event."""
        payload = load_json_event(self.provider, data)
        kind = payload.get("type") or event
        index = payload.get("output_index", 0)
        index = index if isinstance(index, int) else 0
        if kind == "response.output_item.added" and isinstance(payload.get("item"), dict):
            self.items[index] = payload["item"]
        elif kind == "response.output_item.done" and isinstance(payload.get("item"), dict):
            self.done_items[index] = payload["item"]
        elif kind == "response.output_text.delta" and isinstance(payload.get("delta"), str):
            self.text.setdefault(index, []).append(payload["delta"])
            self.deltas.append(SamplingDelta("text", payload["delta"], index))
        elif kind == "response.refusal.delta" and isinstance(payload.get("delta"), str):
            self.refusal.setdefault(index, []).append(payload["delta"])
        elif kind == "response.function_call_arguments.delta" and isinstance(payload.get("delta"), str):
            self.arguments.setdefault(index, []).append(payload["delta"])
            item = self.items.get(index) or {}
            self.deltas.append(SamplingDelta(
                "tool_args", payload["delta"], index, item.get("call_id"), item.get("name")))
        elif kind in _TERMINAL:
            response = payload.get("response")
            self.terminal = dict(response) if isinstance(response, dict) else {}
            self.terminal.setdefault("status", _TERMINAL[kind])
            return True
        elif kind == "error":
            report = error_report(payload, shape="stream", raw=data)
            return self.fail(classify_error(report, provider=self.provider, model=self.model))
        return False

    def _streamed_output(self) -> list[dict[str, Any]]:
        """The output items rebuilt from ``output_item`` events and deltas."""
        output: list[dict[str, Any]] = []
        for index in sorted(set(self.items) | set(self.done_items) | set(self.text) | set(self.arguments)):
            if index in self.done_items:
                output.append(self.done_items[index])
                continue
            item = dict(self.items.get(index) or {"type": "function_call" if index in self.arguments else "message"})
            if item.get("type") == "function_call":
                item["arguments"] = "".join(self.arguments.get(index, [])) or item.get("arguments", "")
            elif item.get("type") == "message":
                item["content"] = [{"type": "output_text", "text": "".join(self.text.get(index, []))}]
            output.append(item)
        return output

    def finish(self) -> SamplingResult:
        """The result; retryable ProviderError if no terminal event came; the
        classified verdict of an ``error`` event."""
        refused = self.verdict()
        if refused is not None:
            return refused
        if self.terminal is None:
            raise ProviderError(
                provider=self.provider, status=None, retryable=True,
                message="stream broke off before response.completed/incomplete/failed",
            )
        response = self.terminal
        if not (isinstance(response.get("output"), list) and response["output"]):
            response = {**response, "output": self._streamed_output()}
        seen = "".join("".join(pieces) for _, pieces in sorted(self.refusal.items()))
        return response_result(response, provider=self.provider, model=self.model, seen_refusal=seen)


class ResponsesWire:
    """The Responses API's :class:`~stopline.activities.providers.base.Wire`.

    Args:
        provider: Provider id it reports.
    """

    def __init__(self, provider: str = PROVIDER) -> None:
        self.provider = provider

    def url(self, base_url: str) -> str:
        """``{base_url}/responses``."""
        return responses_url(base_url)

    def headers(self, api_key: str | None) -> dict[str, str]:
        """``Authorization: Bearer`` when there is a key."""
        return request_headers(api_key)

    def build_request(self, request: WireRequest) -> dict[str, Any]:
        """See :func:`build_request`."""
        return build_request(request)

    def parse_body(self, body: Any, *, model: str) -> SamplingResult:
        """See :func:`parse_response`."""
        return parse_response(body, provider=self.provider, model=model)

    def new_stream(self, *, model: str) -> StreamAssembler:
        """A :class:`StreamAssembler`."""
        return StreamAssembler(provider=self.provider, model=model)

    def classify_error(self, report: ErrorReport, *, model: str) -> ProviderError | SamplingResult:
        """See :func:`classify_error`."""
        return classify_error(report, provider=self.provider, model=model)

    async def preflight(self, client: httpx.AsyncClient, *, base_url: str, request: WireRequest) -> None:
        """Nothing to check before a Responses call."""

    async def after_cancel(self, client: httpx.AsyncClient, *, base_url: str) -> None:
        """Nothing to wait for after a cancelled call: closing the connection is enough."""


class OpenAIResponsesAdapter(WireAdapter):
    """The adapter for the Responses API: the shared ``sample()`` over :class:`ResponsesWire`.

    Args:
        provider: Provider id it reports.
    """

    def __init__(self, provider: str = PROVIDER) -> None:
        super().__init__(ResponsesWire(provider))
