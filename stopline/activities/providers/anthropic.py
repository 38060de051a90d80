"""Anthropic Messages API adapter (``POST {base_url}/v1/messages``).

Why it exists: the sampling activity speaks provider-neutral
:class:`~stopline.core.contracts.Message` lists; this module is the one place that
knows Anthropic's wire format — request shape, the JSON answer, the SSE event
sequence, its error bodies and its refusal signal.

What it must never do:

- retry (Temporal owns retries; errors are classified once, in
  :func:`classify_error`, whatever shape the error came in, and raised as
  :class:`ProviderError`);
- raise on a refusal: ``stop_reason: "refusal"`` is a *result*
  (``SamplingResult.stop_reason == "refusal"``, seed 000, DESIGN §4), with
  or without text before it, and it carries no tool calls — no tool from a
  refused turn runs;
- treat ``max_tokens`` as a refusal (it is a truncation, never a verdict).
"""

from __future__ import annotations

import json
from typing import Any

import httpx

from stopline.activities.deltas import SamplingDelta
from stopline.activities.providers.base import (
    ErrorReport,
    ProviderError,
    StreamOutcome,
    WireAdapter,
    WireRequest,
    error_report,
    is_retryable_status,
    load_json_event,
    parse_retry_after,
    sampling_fields,
    shape_error,
    tool_call_from_raw,
    truncate,
)
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

PROVIDER = "anthropic"
#: The ``anthropic-version`` header value this adapter speaks.
API_VERSION = "2023-06-01"

_STOP_REASONS: dict[str, StopReason] = {
    "end_turn": "end_turn",
    "stop_sequence": "end_turn",
    "tool_use": "tool_use",
    "max_tokens": "max_tokens",
    "refusal": "refusal",
}


def normalize_stop_reason(raw: str | None) -> StopReason:
    """Map Anthropic's ``stop_reason`` onto stopline's.

    Anthropic Messages API: ``stop_reason`` — ``end_turn`` / ``stop_sequence``
    → ``end_turn``; ``tool_use`` → ``tool_use``; ``max_tokens`` →
    ``max_tokens`` (never a refusal); ``refusal`` → ``refusal``; anything else
    (``pause_turn``, ``model_context_window_exceeded``, a new value, none)
    → ``other``.

    Args:
        raw: The provider's value.

    Returns:
        The normalized stop reason.
    """
    return _STOP_REASONS.get(raw or "", "other")


def messages_url(base_url: str) -> str:
    """``{base_url}/v1/messages`` (a base URL already ending in ``/v1`` is fine)."""
    base = base_url.rstrip("/")
    if base.endswith("/v1"):
        base = base[: -len("/v1")]
    return f"{base}/v1/messages"


def request_headers(api_key: str | None) -> dict[str, str]:
    """Headers of a Messages request; ``x-api-key`` only when there is a key."""
    headers = {"anthropic-version": API_VERSION, "content-type": "application/json"}
    if api_key:
        headers["x-api-key"] = api_key
    return headers


def _content_blocks(message: Message) -> list[dict[str, Any]]:
    """One message's content blocks.

    In a user message ``tool_result`` blocks come first (Anthropic Messages
    API: tool results must lead the user turn that answers the tool uses).
    Empty text blocks are dropped (the API rejects them).
    """
    parts = list(message.parts)
    if message.role == "user":
        parts.sort(key=lambda p: 0 if isinstance(p, ToolResultPart) else 1)
    blocks: list[dict[str, Any]] = []
    for part in parts:
        if isinstance(part, TextPart):
            if part.text:
                blocks.append({"type": "text", "text": part.text})
        elif isinstance(part, ToolUsePart):
            call = part.call
            blocks.append({
                "type": "tool_use",
                "id": call.id,
                "name": call.name,
                # A call whose arguments did not parse is echoed as {}: it never ran.
                "input": call.arguments if call.arguments is not None else {},
            })
        elif isinstance(part, ToolResultPart):
            blocks.append({
                "type": "tool_result",
                "tool_use_id": part.call_id,
                "content": part.text,
                "is_error": part.is_error,
            })
    return blocks


def build_request(request: WireRequest) -> dict[str, Any]:
    """The JSON body of one Messages request.

    Anthropic Messages API: ``system`` is top-level (omitted when empty);
    ``messages[].content`` is a list of ``text`` / ``tool_use`` /
    ``tool_result`` blocks; tools are ``{name, description, input_schema}``
    (omitted when there are none); ``max_tokens`` is required;
    ``temperature`` and ``top_p`` only when set. A message left with no
    blocks is skipped.

    Args:
        request: The call.

    Returns:
        The request body.
    """
    body: dict[str, Any] = {"model": request.model, "max_tokens": request.max_tokens}
    body.update(sampling_fields(request))
    if request.system:
        body["system"] = request.system
    wire: list[dict[str, Any]] = []
    for message in request.messages:
        blocks = _content_blocks(message)
        if blocks:
            wire.append({"role": message.role, "content": blocks})
    body["messages"] = wire
    if request.tools:
        body["tools"] = [
            {"name": t.name, "description": t.description, "input_schema": t.input_schema}
            for t in request.tools
        ]
    if request.stream:
        body["stream"] = True
    return body


#: Anthropic error types whose request may succeed when sent again
#: (Anthropic Messages API, errors: 429 ``rate_limit_error``, 500
#: ``api_error``, 529 ``overloaded_error``, 504 ``timeout_error``).
RETRYABLE_TYPES = frozenset({"rate_limit_error", "api_error", "overloaded_error", "timeout_error"})
#: Error types that say the request, the key or the account is wrong:
#: sending it again cannot help (400 ``invalid_request_error``, 401
#: ``authentication_error``, 402 ``billing_error``, 403 ``permission_error``,
#: 404 ``not_found_error``, 413 ``request_too_large``).
FINAL_TYPES = frozenset({
    "invalid_request_error", "authentication_error", "billing_error", "permission_error",
    "not_found_error", "request_too_large",
})


def classify_error(report: ErrorReport, *, model: str = "") -> ProviderError:
    """Classify a failed Messages call, in any shape. The only place that does.

    Anthropic Messages API, errors: the error ``type`` decides first —
    :data:`FINAL_TYPES` are not retryable, :data:`RETRYABLE_TYPES` are;
    otherwise the HTTP status (408/409/429/5xx and 529 retryable, every other
    4xx not), and an error event in a stream without a known type is
    retryable (Anthropic sends ``overloaded_error`` that way). A retryable
    error keeps ``retry-after``. Anthropic has no "prompt filtered" error:
    its refusal is always ``stop_reason: "refusal"`` on a 200, so this never
    returns a result.

    Args:
        report: The error, from an HTTP body or a stream ``error`` event.
        model: Model name (unused: no refusal comes this way).

    Returns:
        The error to raise.
    """
    kind = report.kind or report.code or ""
    if kind in FINAL_TYPES:
        retryable = False
    elif kind in RETRYABLE_TYPES:
        retryable = True
    elif report.status is not None:
        retryable = is_retryable_status(report.status)
    else:
        retryable = True
    where = "" if report.shape == "http" else "stream error event: "
    return ProviderError(
        provider=PROVIDER,
        status=report.status,
        retryable=retryable,
        message=truncate(f"{where}{report.label()}"),
        retry_after_s=parse_retry_after(report.headers) if retryable else None,
        code=kind or None,
    )


def _refusal(stop_details: Any) -> Refusal:
    """The refusal verdict from ``stop_details`` (Anthropic: RefusalStopDetails).

    ``stop_details`` is ``{"type": "refusal", "category": "cyber" | "bio" |
    ... | null, "explanation": str | null}``; the category is taken from
    ``category`` (or a ``type`` other than ``"refusal"``), the explanation
    goes into ``detail``.
    """
    category: str | None = None
    detail: str | None = None
    if isinstance(stop_details, dict):
        cat = stop_details.get("category")
        kind = stop_details.get("type")
        if isinstance(cat, str) and cat:
            category = cat
        elif isinstance(kind, str) and kind and kind != "refusal":
            category = kind
        for key in ("explanation", "detail", "message"):
            value = stop_details.get(key)
            if isinstance(value, str) and value:
                detail = value
                break
    elif isinstance(stop_details, str) and stop_details:
        detail = stop_details
    return Refusal(provider=PROVIDER, category=category, detail=detail)


def _usage(usage: Any, previous: Usage | None = None) -> Usage:
    """Token counts; input includes cache writes and reads (all billed input)."""
    out = previous.model_copy() if previous is not None else Usage()
    if not isinstance(usage, dict):
        return out
    inputs = [usage.get(k) for k in ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")]
    if any(isinstance(v, int) for v in inputs):
        out.input_tokens = sum(v for v in inputs if isinstance(v, int))
    if isinstance(usage.get("output_tokens"), int):
        out.output_tokens = usage["output_tokens"]
    return out


def _result(
    *,
    model: str,
    text: str,
    tool_calls: list[ToolCall],
    raw_stop_reason: str,
    stop_details: Any,
    usage: Usage,
) -> SamplingResult:
    stop = normalize_stop_reason(raw_stop_reason)
    refusal = _refusal(stop_details) if stop == "refusal" else None
    return SamplingResult(
        provider=PROVIDER,
        model=model,
        text=text,
        # No tool from a refused turn runs (seed 000): drop its calls.
        tool_calls=[] if refusal is not None else tool_calls,
        stop_reason=stop,
        raw_stop_reason=raw_stop_reason,
        refusal=refusal,
        usage=usage,
    )


def parse_message(body: Any, *, model: str) -> SamplingResult:
    """Parse a complete (non-streamed) Messages response.

    Anthropic Messages API: ``content`` (list of blocks: ``text``,
    ``tool_use`` {id, name, input}; others such as ``thinking`` are skipped),
    ``stop_reason`` (required: it says whether the turn was cut short),
    ``stop_details``, ``usage``.

    Args:
        body: The decoded JSON body.
        model: Model name as sent.

    Returns:
        The result; a refusal is a result.

    Raises:
        ProviderError: Non-retryable, when the body lacks the expected shape.
    """
    if not isinstance(body, dict):
        raise shape_error(PROVIDER, "response is not a JSON object")
    content = body.get("content")
    if not isinstance(content, list):
        raise shape_error(PROVIDER, "response has no 'content' list")
    texts: list[str] = []
    calls: list[ToolCall] = []
    for i, block in enumerate(content):
        if not isinstance(block, dict):
            raise shape_error(PROVIDER, f"content[{i}] is not an object")
        kind = block.get("type")
        if kind == "text":
            text = block.get("text")
            if not isinstance(text, str):
                raise shape_error(PROVIDER, f"content[{i}] text block has no 'text' string")
            texts.append(text)
        elif kind == "tool_use":
            call_id, name = block.get("id"), block.get("name")
            if not isinstance(call_id, str) or not isinstance(name, str):
                raise shape_error(PROVIDER, f"content[{i}] tool_use block lacks 'id' or 'name'")
            calls.append(tool_call_from_raw(call_id, name, json.dumps(block.get("input", {}))))
    raw_stop = body.get("stop_reason")
    if not isinstance(raw_stop, str):
        # Without it nobody knows whether the turn was cut short (DESIGN §3).
        raise shape_error(PROVIDER, "response has no 'stop_reason'")
    return _result(
        model=model,
        text="".join(texts),
        tool_calls=calls,
        raw_stop_reason=raw_stop,
        stop_details=body.get("stop_details"),
        usage=_usage(body.get("usage")),
    )


class _Block:
    """One content block being streamed."""

    def __init__(self, start: dict[str, Any]) -> None:
        self.kind = start.get("type")
        self.text: list[str] = [start["text"]] if isinstance(start.get("text"), str) else []
        self.id = start.get("id")
        self.name = start.get("name")
        self.start_input = start.get("input", {})
        self.json: list[str] = []


class StreamAssembler(StreamOutcome):
    """Builds a result from the Messages SSE sequence.

    Anthropic Messages API, streaming: ``message_start`` →
    (``content_block_start`` → ``content_block_delta``* →
    ``content_block_stop``)* → ``message_delta`` (``stop_reason``,
    ``stop_details``, ``usage``) → ``message_stop``. ``ping`` and unknown
    events are ignored; an ``error`` event ends the stream with
    :func:`classify_error`'s verdict, a stream that ends without
    ``message_stop`` broke off (retryable), and one that reaches it without a
    ``stop_reason`` is malformed (not retryable).
    """

    def __init__(self, model: str) -> None:
        self.model = model
        self.blocks: dict[int, _Block] = {}
        self.raw_stop_reason: str | None = None
        self.stop_details: Any = None
        self.usage = Usage()
        self.stopped = False
        #: text / argument pieces of the last event(s), for watchers
        self.deltas: list[SamplingDelta] = []

    def _block(self, event: dict[str, Any], name: str) -> _Block:
        index = event.get("index")
        if not isinstance(index, int) or index not in self.blocks:
            raise shape_error(PROVIDER, f"{name} for unknown content block {index!r}", status=None)
        return self.blocks[index]

    def feed(self, event: str, data: str) -> bool:
        """Take one SSE event; ``True`` on ``message_stop``."""
        payload = load_json_event(PROVIDER, data)
        kind = payload.get("type") or event
        if kind == "message_start":
            message = payload.get("message")
            if isinstance(message, dict):
                self.usage = _usage(message.get("usage"), self.usage)
        elif kind == "content_block_start":
            index, start = payload.get("index"), payload.get("content_block")
            if not isinstance(index, int) or not isinstance(start, dict):
                raise shape_error(PROVIDER, "content_block_start without 'index' and 'content_block'", status=None)
            self.blocks[index] = _Block(start)
        elif kind == "content_block_delta":
            block = self._block(payload, "content_block_delta")
            delta = payload.get("delta")
            if isinstance(delta, dict):
                if delta.get("type") == "text_delta" and isinstance(delta.get("text"), str):
                    block.text.append(delta["text"])
                    self.deltas.append(SamplingDelta("text", delta["text"], payload["index"]))
                elif delta.get("type") == "input_json_delta" and isinstance(delta.get("partial_json"), str):
                    block.json.append(delta["partial_json"])
                    self.deltas.append(SamplingDelta(
                        "tool_args", delta["partial_json"], payload["index"], block.id, block.name))
        elif kind == "message_delta":
            delta = payload.get("delta")
            if isinstance(delta, dict):
                if isinstance(delta.get("stop_reason"), str):
                    self.raw_stop_reason = delta["stop_reason"]
                if delta.get("stop_details") is not None:
                    self.stop_details = delta["stop_details"]
            if payload.get("stop_details") is not None:
                self.stop_details = payload["stop_details"]
            self.usage = _usage(payload.get("usage"), self.usage)
        elif kind == "message_stop":
            self.stopped = True
            return True
        elif kind == "error":
            return self.fail(classify_error(error_report(payload, shape="stream", raw=data), model=self.model))
        return False

    def finish(self) -> SamplingResult:
        """The result; retryable ProviderError if ``message_stop`` never came,
        non-retryable if no ``stop_reason`` did; the classified error of an
        ``error`` event."""
        self.verdict()
        if not self.stopped:
            raise ProviderError(
                provider=PROVIDER, status=None, retryable=True,
                message="stream broke off before message_stop",
            )
        if self.raw_stop_reason is None:
            missing = "" if self.blocks else " and no content blocks"
            raise shape_error(
                PROVIDER, f"stream reached message_stop without a stop_reason{missing}", status=None,
            )
        texts: list[str] = []
        calls: list[ToolCall] = []
        for index in sorted(self.blocks):
            block = self.blocks[index]
            if block.kind == "text":
                texts.append("".join(block.text))
            elif block.kind == "tool_use":
                if not isinstance(block.id, str) or not isinstance(block.name, str):
                    raise shape_error(PROVIDER, f"streamed tool_use block {index} lacks 'id' or 'name'", status=None)
                raw = "".join(block.json) or json.dumps(block.start_input)
                calls.append(tool_call_from_raw(block.id, block.name, raw))
        return _result(
            model=self.model,
            text="".join(texts),
            tool_calls=calls,
            raw_stop_reason=self.raw_stop_reason,
            stop_details=self.stop_details,
            usage=self.usage,
        )


class AnthropicWire:
    """The Messages API's :class:`~stopline.activities.providers.base.Wire`."""

    provider = PROVIDER

    def url(self, base_url: str) -> str:
        """``{base_url}/v1/messages``."""
        return messages_url(base_url)

    def headers(self, api_key: str | None) -> dict[str, str]:
        """``anthropic-version``, and ``x-api-key`` when there is a key."""
        return request_headers(api_key)

    def build_request(self, request: WireRequest) -> dict[str, Any]:
        """See :func:`build_request`."""
        return build_request(request)

    def parse_body(self, body: Any, *, model: str) -> SamplingResult:
        """See :func:`parse_message`."""
        return parse_message(body, model=model)

    def new_stream(self, *, model: str) -> StreamAssembler:
        """A :class:`StreamAssembler`."""
        return StreamAssembler(model)

    def classify_error(self, report: ErrorReport, *, model: str) -> ProviderError:
        """See :func:`classify_error`."""
        return classify_error(report, model=model)

    async def preflight(self, client: httpx.AsyncClient, *, base_url: str, request: WireRequest) -> None:
        """Nothing to check before a Messages call."""

    async def after_cancel(self, client: httpx.AsyncClient, *, base_url: str) -> None:
        """Nothing to wait for after a cancelled call: closing the connection is enough."""


class AnthropicAdapter(WireAdapter):
    """The adapter for Anthropic: the shared ``sample()`` over :class:`AnthropicWire`."""

    def __init__(self) -> None:
        super().__init__(AnthropicWire())
