"""OpenAI Chat Completions adapter (``POST {base_url}/chat/completions``).

Why it exists: the one place that knows the Chat Completions wire format, for
OpenAI itself (``base_url`` like ``https://api.openai.com/v1``) and for every
OpenAI-compatible server — vLLM, llama.cpp server, Ollama — whose base URL
the caller passes (e.g. ``http://localhost:11434/v1``). The request sticks to
what those servers understand (``max_tokens``, string ``content``).

What it must never do:

- retry (Temporal owns retries; errors are classified once, in
  :func:`classify_error`, whether they come as an HTTP body or a stream
  ``error`` chunk);
- raise on a refusal. ``finish_reason: "content_filter"``, a non-empty
  ``refusal`` on the message or in stream deltas (whatever ``finish_reason``
  says), and an error whose code is a policy verdict (an HTTP 400 saying
  the *prompt* was filtered, ``cyber_policy`` ...) are all a
  ``SamplingResult`` with ``stop_reason == "refusal"`` (seed 000, DESIGN §4),
  and a refused result carries no tool calls;
- treat ``length`` as a refusal (it is a truncation).
"""

from __future__ import annotations

import asyncio
import json
import time
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

PROVIDER = "openai"
#: The category of a refusal that came from a content filter without a named one.
CONTENT_FILTER = "content_filter"

_FINISH_REASONS: dict[str, StopReason] = {
    "stop": "end_turn",
    "tool_calls": "tool_use",
    "function_call": "tool_use",
    "length": "max_tokens",
    "content_filter": "refusal",
}
#: ``error.param`` values that name a request field, not a policy category.
_REQUEST_FIELDS = ("prompt", "messages", "input", "instructions", "content")


def normalize_finish_reason(raw: str, *, has_tool_calls: bool) -> StopReason:
    """Map Chat Completions' ``finish_reason`` onto stopline's stop reason.

    OpenAI Chat Completions: ``finish_reason`` — ``stop`` → ``end_turn``,
    ``tool_calls`` / ``function_call`` → ``tool_use``, ``length`` →
    ``max_tokens`` (never a refusal), ``content_filter`` → ``refusal``, else
    ``other``. A ``stop`` that comes with tool calls is ``tool_use``: some
    compatible servers (older Ollama, vLLM) report ``stop`` there.

    Args:
        raw: The provider's value.
        has_tool_calls: Whether the message carries tool calls.

    Returns:
        The normalized stop reason (a non-empty ``refusal`` field overrides
        it; see :func:`chat_result`).
    """
    stop = _FINISH_REASONS.get(raw, "other")
    if stop == "end_turn" and has_tool_calls:
        return "tool_use"
    return stop


def completions_url(base_url: str) -> str:
    """``{base_url}/chat/completions``."""
    return f"{base_url.rstrip('/')}/chat/completions"


def request_headers(api_key: str | None) -> dict[str, str]:
    """Headers of a request; ``Authorization: Bearer`` only when there is a key."""
    headers = {"content-type": "application/json"}
    if api_key:
        headers["authorization"] = f"Bearer {api_key}"
    return headers


def _wire_messages(system: str, messages: list[Message]) -> list[dict[str, Any]]:
    wire: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    for message in messages:
        texts = [p.text for p in message.parts if isinstance(p, TextPart) and p.text]
        if message.role == "assistant":
            calls = [p.call for p in message.parts if isinstance(p, ToolUsePart)]
            if not texts and not calls:
                continue
            out: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) if texts else None}
            if calls:
                out["tool_calls"] = [
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.name, "arguments": c.raw_arguments},
                    }
                    for c in calls
                ]
            wire.append(out)
        else:
            # Tool results first: each must directly follow the assistant
            # message holding its call.
            for part in message.parts:
                if isinstance(part, ToolResultPart):
                    wire.append({"role": "tool", "tool_call_id": part.call_id, "content": part.text})
            if texts:
                wire.append({"role": "user", "content": "\n".join(texts)})
    return wire


def build_request(request: WireRequest) -> dict[str, Any]:
    """The JSON body of one Chat Completions request.

    OpenAI Chat Completions: the system prompt is the first message; an
    assistant turn is ``{"role": "assistant", "content": str | None,
    "tool_calls": [{id, type: "function", function: {name, arguments}}]}``
    with ``arguments`` echoed exactly as the model sent them; each tool
    result is a ``{"role": "tool", "tool_call_id", "content"}`` message;
    tools are ``{"type": "function", "function": {name, description,
    parameters}}`` (omitted when none). ``max_tokens`` rather than
    ``max_completion_tokens``: compatible servers only know the former.
    ``temperature`` / ``top_p`` only when set. Streaming asks for usage
    (``stream_options.include_usage``).

    Args:
        request: The call.

    Returns:
        The request body.
    """
    body: dict[str, Any] = {
        "model": request.model,
        "messages": _wire_messages(request.system, request.messages),
        "max_tokens": request.max_tokens,
    }
    body.update(sampling_fields(request))
    if request.tools:
        body["tools"] = [
            {"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.input_schema}}
            for t in request.tools
        ]
    if request.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


def _filtered_categories(results: Any) -> list[str]:
    """Keys of an Azure-style ``content_filter_result(s)`` with ``filtered: true``."""
    if not isinstance(results, dict):
        return []
    return [k for k, v in results.items() if isinstance(v, dict) and v.get("filtered") is True]


#: Error codes that are the provider's verdict on the *request's content*: a
#: refusal (DESIGN §4), never retried, never re-sent. OpenAI API error codes
#: (``content_policy_violation``, ``invalid_prompt`` "flagged as potentially
#: violating our usage policy", the policy categories ``cyber_policy`` /
#: ``bio_policy``); Azure OpenAI ``content_filter``.
POLICY_CODES = frozenset({
    "content_filter", "content_policy_violation", "invalid_prompt", "cyber_policy", "bio_policy",
})
#: Policy codes that name their category themselves.
_CATEGORY_CODES = frozenset({"invalid_prompt", "cyber_policy", "bio_policy"})
#: Codes and types that say the request, the key or the account is wrong:
#: sending it again cannot help (OpenAI API error codes: 401
#: ``invalid_api_key``, 403 / ``permission_error``, 429
#: ``insufficient_quota``, 400 ``invalid_request_error`` and its codes;
#: llama.cpp ``exceed_context_size_error``, ``authentication_error``,
#: ``not_supported_error``). Any code starting with ``invalid_`` is one too.
FINAL_CODES = frozenset({
    "insufficient_quota", "billing_hard_limit_reached", "account_deactivated",
    "invalid_api_key", "authentication_error", "permission_error", "invalid_request_error",
    "context_length_exceeded", "exceed_context_size_error", "unsupported_parameter",
    "unsupported_value", "model_not_found", "not_found_error", "not_supported_error",
})
#: Codes and types of a transient failure (OpenAI ``server_error``,
#: ``rate_limit_exceeded``; compatible servers' ``overloaded`` /
#: ``unavailable_error``) and of a generation that failed where a new sample
#: may not (Groq ``tool_use_failed``: the model's tool call did not match its
#: schema — the request was fine).
RETRYABLE_CODES = frozenset({
    "server_error", "rate_limit_exceeded", "rate_limit_error", "overloaded", "overloaded_error",
    "unavailable_error", "service_unavailable", "timeout", "api_error", "tool_use_failed",
})
#: ``error.param`` values that name a request field, not a policy category.
_REQUEST_FIELDS = ("prompt", "messages", "input", "instructions", "content")


def _filtered_categories(results: Any) -> list[str]:
    """Keys of an Azure-style ``content_filter_result(s)`` with ``filtered: true``."""
    if not isinstance(results, dict):
        return []
    return [k for k, v in results.items() if isinstance(v, dict) and v.get("filtered") is True]


def policy_refusal(report: ErrorReport, *, provider: str) -> Refusal | None:
    """The refusal in an error that is a policy verdict, if it is one.

    OpenAI / Azure OpenAI: ``error.code`` in :data:`POLICY_CODES`, a code or
    type containing ``content_filter``, or Azure's ``innererror.code``
    ``ResponsibleAIPolicyViolation`` means the provider judged the request
    itself (DESIGN §4) — in an HTTP 4xx body, a stream ``error`` event or a
    ``response.failed`` alike. Category: the filtered keys of Azure's
    ``content_filter_result``, else ``error.param`` when it names a policy
    rather than a request field, else a code that names its category
    (``cyber_policy``, ``bio_policy``, ``invalid_prompt``), else
    ``content_filter``.

    Args:
        report: The error.
        provider: Provider id for the refusal.

    Returns:
        The refusal, or ``None`` when this is an ordinary error.
    """
    if report.status is not None and not 400 <= report.status < 500:
        return None
    code, kind = report.code or "", report.kind or ""
    inner: dict[str, Any] = v if isinstance(v := report.error.get("innererror"), dict) else {}
    policy = (
        code in POLICY_CODES
        or CONTENT_FILTER in code
        or CONTENT_FILTER in kind
        or inner.get("code") == "ResponsibleAIPolicyViolation"
    )
    if not policy:
        return None
    categories = _filtered_categories(inner.get("content_filter_result")) or _filtered_categories(
        inner.get("content_filter_results")
    )
    param = report.param
    if categories:
        category = categories[0]
    elif param and param not in _REQUEST_FIELDS:
        category = param
    elif code in _CATEGORY_CODES:
        category = code
    else:
        category = CONTENT_FILTER
    return Refusal(provider=provider, category=category, detail=report.message or None)


def is_final_code(code: str) -> bool:
    """Whether an OpenAI error code or type says "do not send this again"."""
    return code in FINAL_CODES or code.startswith("invalid_")


def classify_error(
    report: ErrorReport,
    *,
    provider: str = PROVIDER,
    model: str = "",
) -> ProviderError | SamplingResult:
    """Classify a failed OpenAI-family call, in any shape. The only place the
    Chat adapter does (the Responses adapter uses it too: same API, same codes).

    OpenAI API, error codes, in this order:

    1. a policy verdict (:func:`policy_refusal`) is a refusal *result*;
    2. a code in :data:`FINAL_CODES` (or ``invalid_*``) is not retryable —
       ``insufficient_quota`` even on a 429 — and one in
       :data:`RETRYABLE_CODES` is; the code decides before the type;
    3. likewise the type (``invalid_request_error``, ``server_error``);
    4. otherwise the HTTP status: 408/409/429/5xx retryable, other 4xx not;
    5. a stream ``error`` event or ``response.failed`` without a known code
       is retryable (the provider failed mid-answer).

    A retryable HTTP error keeps ``retry-after`` / ``retry-after-ms``.

    Args:
        report: The error, from an HTTP body, a stream event or a failed
            response.
        provider: Provider id (``openai``, ``openai-compat``,
            ``openai-responses``).
        model: Model name, for a refusal result.

    Returns:
        A refusal result, or the error to raise.
    """
    refusal = policy_refusal(report, provider=provider)
    if refusal is not None:
        raw = f"http_{report.status}" if report.status is not None else _RAW_STOP[report.shape]
        return SamplingResult(
            provider=provider, model=model, stop_reason="refusal", raw_stop_reason=raw, refusal=refusal,
        )
    codes = [c for c in (report.code, report.kind) if c]
    # The code is more specific than the type (Groq's ``tool_use_failed``
    # comes with type ``invalid_request_error``): the first known one decides.
    known = [c for c in codes if is_final_code(c) or c in RETRYABLE_CODES]
    if known:
        retryable = known[0] in RETRYABLE_CODES
    elif report.status is not None:
        retryable = is_retryable_status(report.status)
    else:
        retryable = True
    where = {"http": "", "stream": "stream error event: ", "failed": "response failed: "}[report.shape]
    return ProviderError(
        provider=provider,
        status=report.status,
        retryable=retryable,
        message=truncate(f"{where}{report.label()}"),
        retry_after_s=parse_retry_after(report.headers) if retryable else None,
        code=(codes[0] if codes else None),
    )


_RAW_STOP = {"http": "http_error", "stream": "error_event", "failed": "response.failed"}


def chat_result(
    *,
    provider: str,
    model: str,
    text: str,
    refusal_text: str,
    tool_calls: list[ToolCall],
    finish_reason: str,
    filter_categories: list[str],
    usage: Usage,
) -> SamplingResult:
    """Assemble a result, applying the refusal rules (DESIGN §4).

    OpenAI Chat Completions: refused when ``finish_reason`` is
    ``content_filter`` or the message's ``refusal`` is non-empty — the latter
    whatever ``finish_reason`` says. A refused result has no tool calls.
    """
    stop = normalize_finish_reason(finish_reason, has_tool_calls=bool(tool_calls))
    refusal: Refusal | None = None
    if refusal_text or stop == "refusal":
        if filter_categories:
            category: str | None = filter_categories[0]
        elif stop == "refusal":
            category = CONTENT_FILTER
        else:
            category = None
        refusal = Refusal(provider=provider, category=category, detail=refusal_text or None)
        stop = "refusal"
    return SamplingResult(
        provider=provider,
        model=model,
        text=text,
        tool_calls=[] if refusal is not None else tool_calls,
        stop_reason=stop,
        raw_stop_reason=finish_reason,
        refusal=refusal,
        usage=usage,
    )


def _usage(usage: Any) -> Usage | None:
    if not isinstance(usage, dict):
        return None
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    return Usage(
        input_tokens=prompt if isinstance(prompt, int) else 0,
        output_tokens=completion if isinstance(completion, int) else 0,
    )


def _content_text(content: Any, provider: str) -> str:
    """``message.content``: a string, null, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    raise shape_error(provider, "choices[0].message.content is neither a string nor null")


def _raw_arguments(arguments: Any) -> str:
    # Some compatible servers send an object instead of a JSON string.
    if isinstance(arguments, str):
        return arguments
    return "" if arguments is None else json.dumps(arguments)


def parse_completion(body: Any, *, provider: str, model: str) -> SamplingResult:
    """Parse a complete (non-streamed) Chat Completions response.

    OpenAI Chat Completions: ``choices[0].message`` (``content``,
    ``refusal``, ``tool_calls``), ``choices[0].finish_reason`` (required:
    it says whether the turn was cut short), Azure's
    ``choices[0].content_filter_results``, ``usage``.

    Args:
        body: The decoded JSON body.
        provider: Provider id.
        model: Model name as sent.

    Returns:
        The result; a refusal is a result.

    Raises:
        ProviderError: Non-retryable, when the body lacks the expected shape.
    """
    if not isinstance(body, dict):
        raise shape_error(provider, "response is not a JSON object")
    choices = body.get("choices")
    if not isinstance(choices, list) or not choices:
        raise shape_error(provider, "response has no 'choices' list")
    choice = choices[0]
    if not isinstance(choice, dict) or not isinstance(choice.get("message"), dict):
        raise shape_error(provider, "choices[0] has no 'message' object")
    message = choice["message"]
    raw_calls = message.get("tool_calls") or []
    if not isinstance(raw_calls, list):
        raise shape_error(provider, "choices[0].message.tool_calls is not a list")
    calls: list[ToolCall] = []
    for i, call in enumerate(raw_calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise shape_error(provider, f"tool_calls[{i}] has no 'function.name'")
        call_id = call.get("id") if isinstance(call.get("id"), str) and call.get("id") else f"call_{i}"
        calls.append(tool_call_from_raw(call_id, fn["name"], _raw_arguments(fn.get("arguments"))))
    refusal = message.get("refusal")
    finish = choice.get("finish_reason")
    if not isinstance(finish, str):
        # Without it nobody knows whether the turn was cut short (DESIGN §3).
        raise shape_error(provider, "choices[0] has no 'finish_reason'")
    return chat_result(
        provider=provider,
        model=model,
        text=_content_text(message.get("content"), provider),
        refusal_text=refusal if isinstance(refusal, str) else "",
        tool_calls=calls,
        finish_reason=finish,
        filter_categories=_filtered_categories(choice.get("content_filter_results")),
        usage=_usage(body.get("usage")) or Usage(),
    )


class _CallPieces:
    def __init__(self) -> None:
        self.id = ""
        self.name = ""
        self.arguments: list[str] = []


class StreamAssembler(StreamOutcome):
    """Builds a result from Chat Completions chunks.

    OpenAI Chat Completions, streaming: ``data:`` chunks whose
    ``choices[0].delta`` carries ``content``, ``refusal`` and ``tool_calls``
    pieces (by ``index``: ``id`` and ``function.name`` once, then
    ``function.arguments`` pieces), a chunk with ``finish_reason``, a usage
    chunk (``choices: []``), then ``data: [DONE]``. A chunk with ``error``
    ends the stream with :func:`classify_error`'s verdict; a stream that ends with neither ``[DONE]`` nor
    a ``finish_reason`` broke off (retryable); ``[DONE]`` without any
    ``finish_reason`` is malformed (not retryable).
    """

    def __init__(self, *, provider: str, model: str) -> None:
        self.provider = provider
        self.model = model
        self.text: list[str] = []
        self.refusal: list[str] = []
        self.calls: dict[int, _CallPieces] = {}
        self.finish_reason: str | None = None
        self.filter_categories: list[str] = []
        self.usage = Usage()
        self.done = False
        #: text / argument pieces of the last event(s), for watchers
        self.deltas: list[SamplingDelta] = []

    def _call(self, piece: dict[str, Any]) -> _CallPieces:
        index = piece.get("index")
        if not isinstance(index, int):
            # No index (some compatible servers): a new id starts a new call.
            known = [i for i, c in self.calls.items() if piece.get("id") and c.id == piece.get("id")]
            if known:
                index = known[0]
            elif piece.get("id") or not self.calls:
                index = len(self.calls)
            else:
                index = max(self.calls)
        return self.calls.setdefault(index, _CallPieces())

    def feed(self, event: str, data: str) -> bool:
        """Take one SSE event; ``True`` on ``[DONE]``."""
        if data.strip() == "[DONE]":
            self.done = True
            return True
        chunk = load_json_event(self.provider, data)
        if chunk.get("error"):
            report = error_report(chunk, shape="stream", raw=data)
            return self.fail(classify_error(report, provider=self.provider, model=self.model))
        usage = _usage(chunk.get("usage"))
        if usage is not None:
            self.usage = usage
        choices = chunk.get("choices")
        for choice in choices if isinstance(choices, list) else []:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta")
            if isinstance(delta, dict):
                if isinstance(delta.get("content"), str):
                    self.text.append(delta["content"])
                    self.deltas.append(SamplingDelta("text", delta["content"], -1))
                if isinstance(delta.get("refusal"), str):
                    self.refusal.append(delta["refusal"])
                for piece in delta.get("tool_calls") or []:
                    if not isinstance(piece, dict):
                        continue
                    call = self._call(piece)
                    if isinstance(piece.get("id"), str) and not call.id:
                        call.id = piece["id"]
                    fn = piece.get("function")
                    if isinstance(fn, dict):
                        if isinstance(fn.get("name"), str) and not call.name:
                            call.name = fn["name"]
                        if fn.get("arguments") is not None:
                            call.arguments.append(_raw_arguments(fn["arguments"]))
                            self.deltas.append(SamplingDelta(
                                "tool_args", call.arguments[-1], next(i for i, c in self.calls.items() if c is call),
                                call.id or None, call.name or None))
            if isinstance(choice.get("finish_reason"), str):
                self.finish_reason = choice["finish_reason"]
            self.filter_categories += _filtered_categories(choice.get("content_filter_results"))
        return False

    def finish(self) -> SamplingResult:
        """The result; retryable ProviderError if the stream broke off; the
        classified error (or refusal) of an ``error`` chunk."""
        refused = self.verdict()
        if refused is not None:
            return refused
        if not self.done and self.finish_reason is None:
            raise ProviderError(
                provider=self.provider, status=None, retryable=True,
                message="stream broke off before finish_reason and [DONE]",
            )
        if self.finish_reason is None:
            raise shape_error(self.provider, "stream ended ([DONE]) without a finish_reason", status=None)
        calls = []
        for index in sorted(self.calls):
            piece = self.calls[index]
            if not piece.name:
                raise shape_error(self.provider, f"streamed tool call {index} has no function name", status=None)
            calls.append(tool_call_from_raw(piece.id or f"call_{index}", piece.name, "".join(piece.arguments)))
        return chat_result(
            provider=self.provider,
            model=self.model,
            text="".join(self.text),
            refusal_text="".join(self.refusal),
            tool_calls=calls,
            finish_reason=self.finish_reason,
            filter_categories=self.filter_categories,
            usage=self.usage,
        )


#: Seconds a local server's ``/props`` answer is trusted before it is asked
#: again (the server may be restarted with another chat template).
PROPS_TTL_S = 60.0
_props_seen: dict[str, tuple[float, dict[str, Any] | None]] = {}


def server_root(base_url: str) -> str:
    """``base_url`` without a trailing ``/v1`` (where llama.cpp serves ``/props``)."""
    base = base_url.rstrip("/")
    return base[: -len("/v1")] if base.endswith("/v1") else base


async def server_props(client: httpx.AsyncClient, base_url: str) -> dict[str, Any] | None:
    """What a llama.cpp server says about itself at ``GET /props``, if it does.

    Other compatible servers (vLLM, Ollama) have no such endpoint: ``None``.
    The answer is cached per base URL for :data:`PROPS_TTL_S`.

    Args:
        client: The caller's client.
        base_url: The server's OpenAI base URL.

    Returns:
        The ``/props`` object, or ``None``.
    """
    now = time.monotonic()
    seen = _props_seen.get(base_url)
    if seen is not None and now - seen[0] < PROPS_TTL_S:
        return seen[1]
    props: dict[str, Any] | None = None
    try:
        response = await client.get(f"{server_root(base_url)}/props", timeout=5.0)
        data = response.json() if response.is_success else None
        props = data if isinstance(data, dict) else None
    except (httpx.HTTPError, ValueError):
        props = None
    _props_seen[base_url] = (now, props)
    return props


async def template_caps(client: httpx.AsyncClient, base_url: str) -> dict[str, Any] | None:
    """The chat template capabilities a llama.cpp server reports, if it does.

    llama.cpp server: ``GET /props`` answers ``chat_template_caps``
    (``supports_tools``, ``supports_tool_calls``, ...).

    Args:
        client: The caller's client.
        base_url: The server's OpenAI base URL.

    Returns:
        The capabilities, or ``None`` when the server does not say.
    """
    props = await server_props(client, base_url)
    caps = props.get("chat_template_caps") if props else None
    return caps if isinstance(caps, dict) else None


#: Longest a cancelled call waits for a one-slot local server to drop it.
CANCEL_SETTLE_S = 1.0


async def wait_slot_released(client: httpx.AsyncClient, base_url: str, *, bound_s: float = CANCEL_SETTLE_S) -> bool:
    """After a cancelled call: wait until a one-slot llama.cpp server has
    dropped it, so the server is free for the next call when the cancel is
    acknowledged.

    llama.cpp notices a closed connection only when it next writes a token,
    and keeps generating until then; with one slot (``/props``
    ``total_slots``), the next request would queue behind it. With more slots
    this call's slot cannot be told apart from others', so nothing is
    awaited. ``GET /slots`` answers ``is_processing`` per slot.

    Args:
        client: The caller's client.
        base_url: The server's OpenAI base URL.
        bound_s: Give up after this long.

    Returns:
        ``True`` when the server's only slot is idle, ``False`` otherwise
        (not llama.cpp, several slots, no ``/slots``, or still busy at the
        bound).
    """
    props = await server_props(client, base_url)
    if not props or props.get("total_slots") != 1:
        return False
    deadline = time.monotonic() + bound_s
    while True:
        try:
            response = await client.get(f"{server_root(base_url)}/slots", timeout=bound_s)
            slots = response.json() if response.is_success else None
        except (httpx.HTTPError, ValueError):
            return False
        if not isinstance(slots, list):
            return False
        if not any(isinstance(s, dict) and s.get("is_processing") for s in slots):
            return True
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.02)


class ChatWire:
    """The Chat Completions :class:`~stopline.activities.providers.base.Wire`.

    Args:
        provider: Provider id it reports: ``openai`` or ``openai-compat``.
    """

    def __init__(self, provider: str = PROVIDER) -> None:
        self.provider = provider

    def url(self, base_url: str) -> str:
        """``{base_url}/chat/completions``."""
        return completions_url(base_url)

    def headers(self, api_key: str | None) -> dict[str, str]:
        """``Authorization: Bearer`` when there is a key."""
        return request_headers(api_key)

    def build_request(self, request: WireRequest) -> dict[str, Any]:
        """See :func:`build_request`."""
        return build_request(request)

    def parse_body(self, body: Any, *, model: str) -> SamplingResult:
        """See :func:`parse_completion`."""
        return parse_completion(body, provider=self.provider, model=model)

    def new_stream(self, *, model: str) -> StreamAssembler:
        """A :class:`StreamAssembler`."""
        return StreamAssembler(provider=self.provider, model=model)

    def classify_error(self, report: ErrorReport, *, model: str) -> ProviderError | SamplingResult:
        """See :func:`classify_error`."""
        return classify_error(report, provider=self.provider, model=model)

    async def preflight(self, client: httpx.AsyncClient, *, base_url: str, request: WireRequest) -> None:
        """An ``openai-compat`` server whose chat template cannot do tools
        fails the call before it is made.

        Such a server (llama.cpp with a model's own template, e.g.
        SmolLM2's) silently drops ``tools`` and answers in prose, so the task
        would "complete" with an invented answer. llama.cpp says so at
        ``/props`` (``chat_template_caps.supports_tools``); a server that
        does not answer there is not checked.

        Raises:
            ProviderError: Non-retryable (code ``template_without_tools``).
        """
        if self.provider != "openai-compat" or not request.tools:
            return
        caps = await template_caps(client, base_url)
        if caps is None:
            return
        missing = [k for k in ("supports_tools", "supports_tool_calls") if caps.get(k) is False]
        if missing:
            raise ProviderError(
                provider=self.provider, status=None, retryable=False, code="template_without_tools",
                message=(
                    f"the server's chat template cannot use tools ({server_root(base_url)}/props: "
                    f"chat_template_caps {', '.join(f'{k}=false' for k in missing)}); stopline's "
                    f"tools would be dropped silently. Start llama-server with a tool-capable "
                    f"--chat-template-file (README: A local model)"
                ),
            )


    async def after_cancel(self, client: httpx.AsyncClient, *, base_url: str) -> None:
        """A cancelled call to an ``openai-compat`` server is acknowledged
        once a one-slot llama.cpp server has dropped it (see
        :func:`wait_slot_released`)."""
        if self.provider == "openai-compat":
            await wait_slot_released(client, base_url)


class OpenAIChatAdapter(WireAdapter):
    """The adapter for Chat Completions: the shared ``sample()`` over :class:`ChatWire`.

    Args:
        provider: Provider id it reports: ``openai`` or ``openai-compat``.
    """

    def __init__(self, provider: str = PROVIDER) -> None:
        super().__init__(ChatWire(provider))
