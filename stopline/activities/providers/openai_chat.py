"""OpenAI Chat Completions adapter (``POST {base_url}/chat/completions``).

Why it exists: the one place that knows the Chat Completions wire format, for
OpenAI itself (``base_url`` like ``https://api.openai.com/v1``) and for every
OpenAI-compatible server — vLLM, llama.cpp server, Ollama — whose base URL
the caller passes (e.g. ``http://localhost:11434/v1``). The request sticks to
what those servers understand (``max_tokens``, string ``content``).

What it must never do:

- retry (Temporal owns retries; errors are classified once, in
  :func:`classify_http_error`);
- raise on a refusal. ``finish_reason: "content_filter"``, a non-empty
  ``refusal`` on the message or in stream deltas (whatever ``finish_reason``
  says), and an HTTP 400 saying the *prompt* was filtered are all a
  ``SamplingResult`` with ``stop_reason == "refusal"`` (seed 000, DESIGN §4),
  and a refused result carries no tool calls;
- treat ``length`` as a refusal (it is a truncation).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

import httpx

from stopline.activities.providers.base import (
    ProviderError,
    error_body_message,
    is_retryable_status,
    load_json_event,
    parse_retry_after,
    send_request,
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
    ToolSpec,
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
#: Error codes of a 400 that says the prompt itself was filtered.
_PROMPT_FILTER_CODES = ("content_filter", "content_policy_violation")
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


def build_request(
    *,
    model: str,
    system: str,
    messages: list[Message],
    tools: list[ToolSpec],
    max_tokens: int,
    stream: bool,
) -> dict[str, Any]:
    """The JSON body of one Chat Completions request.

    OpenAI Chat Completions: the system prompt is the first message; an
    assistant turn is ``{"role": "assistant", "content": str | None,
    "tool_calls": [{id, type: "function", function: {name, arguments}}]}``
    with ``arguments`` echoed exactly as the model sent them; each tool
    result is a ``{"role": "tool", "tool_call_id", "content"}`` message;
    tools are ``{"type": "function", "function": {name, description,
    parameters}}`` (omitted when none). ``max_tokens`` rather than
    ``max_completion_tokens``: compatible servers only know the former.
    Streaming asks for usage (``stream_options.include_usage``).

    Args:
        model: Model name.
        system: System prompt.
        messages: The conversation.
        tools: Tools offered.
        max_tokens: Output token limit.
        stream: Ask for SSE.

    Returns:
        The request body.
    """
    body: dict[str, Any] = {
        "model": model,
        "messages": _wire_messages(system, messages),
        "max_tokens": max_tokens,
    }
    if tools:
        body["tools"] = [
            {"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.input_schema}}
            for t in tools
        ]
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


def _filtered_categories(results: Any) -> list[str]:
    """Keys of an Azure-style ``content_filter_result(s)`` with ``filtered: true``."""
    if not isinstance(results, dict):
        return []
    return [k for k, v in results.items() if isinstance(v, dict) and v.get("filtered") is True]


def _error_object(body: str) -> dict[str, Any] | None:
    """The ``error`` object of an OpenAI error body, if it has one."""
    try:
        data = json.loads(body)
    except ValueError:
        return None
    err = data.get("error") if isinstance(data, dict) else None
    return err if isinstance(err, dict) else None


def prompt_filter_refusal(status: int, body: str, *, provider: str) -> Refusal | None:
    """The refusal in an HTTP 400 saying the *prompt* was filtered, if it is one.

    OpenAI / Azure OpenAI: a 400 with ``error.code`` ``content_filter`` or
    ``content_policy_violation`` (or a ``type`` / ``code`` containing
    ``content_filter``, or Azure's ``innererror.code``
    ``ResponsibleAIPolicyViolation``) means the provider judged the request
    itself (DESIGN §4). Category: the filtered keys of Azure's
    ``content_filter_result``, else ``error.param`` when it names a policy
    rather than a request field (e.g. ``cyber_policy``), else
    ``content_filter``. Shared by the Chat and Responses adapters.

    Args:
        status: HTTP status.
        body: Response body text.
        provider: Provider id for the refusal.

    Returns:
        The refusal, or ``None`` when this is an ordinary error.
    """
    err = _error_object(body)
    if status != 400 or err is None:
        return None
    code, kind = str(err.get("code") or ""), str(err.get("type") or "")
    inner: dict[str, Any] = v if isinstance(v := err.get("innererror"), dict) else {}
    filtered = (
        code in _PROMPT_FILTER_CODES
        or CONTENT_FILTER in code
        or CONTENT_FILTER in kind
        or inner.get("code") == "ResponsibleAIPolicyViolation"
    )
    if not filtered:
        return None
    param = err.get("param")
    categories = _filtered_categories(inner.get("content_filter_result")) or _filtered_categories(
        inner.get("content_filter_results")
    )
    if categories:
        category = categories[0]
    elif isinstance(param, str) and param and param not in _REQUEST_FIELDS:
        category = param
    else:
        category = CONTENT_FILTER
    message = err.get("message")
    return Refusal(
        provider=provider,
        category=category,
        detail=truncate(message) if isinstance(message, str) and message else None,
    )


def classify_http_error(
    status: int,
    headers: httpx.Headers,
    body: str,
    *,
    provider: str = PROVIDER,
    model: str = "",
) -> ProviderError | SamplingResult:
    """Classify a non-2xx answer. The only place the Chat adapter does.

    OpenAI API, error codes: a 400 saying the prompt was filtered is a
    refusal *result* (see :func:`prompt_filter_refusal`); 408/409/429/5xx are
    retryable, honouring ``retry-after`` / ``retry-after-ms``, except a 429
    whose ``error.code`` is ``insufficient_quota`` (the account is out of
    credit: waiting does not help); every other 4xx is not retryable.

    Args:
        status: HTTP status.
        headers: Response headers.
        body: Response body text.
        provider: Provider id (``openai`` or ``openai-compat``).
        model: Model name, for a refusal result.

    Returns:
        A refusal result, or the error to raise.
    """
    refusal = prompt_filter_refusal(status, body, provider=provider)
    if refusal is not None:
        return SamplingResult(
            provider=provider, model=model, stop_reason="refusal",
            raw_stop_reason=f"http_{status}", refusal=refusal,
        )
    err = _error_object(body) or {}
    retryable = is_retryable_status(status) and err.get("code") != "insufficient_quota"
    return ProviderError(
        provider=provider,
        status=status,
        retryable=retryable,
        message=error_body_message(body),
        retry_after_s=parse_retry_after(headers) if retryable else None,
    )


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


class StreamAssembler:
    """Builds a result from Chat Completions chunks.

    OpenAI Chat Completions, streaming: ``data:`` chunks whose
    ``choices[0].delta`` carries ``content``, ``refusal`` and ``tool_calls``
    pieces (by ``index``: ``id`` and ``function.name`` once, then
    ``function.arguments`` pieces), a chunk with ``finish_reason``, a usage
    chunk (``choices: []``), then ``data: [DONE]``. A chunk with ``error`` is
    a retryable ProviderError; a stream that ends with neither ``[DONE]`` nor
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
            raise ProviderError(
                provider=self.provider, status=None, retryable=True,
                message=f"stream error chunk: {error_body_message(data)}",
            )
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
            if isinstance(choice.get("finish_reason"), str):
                self.finish_reason = choice["finish_reason"]
            self.filter_categories += _filtered_categories(choice.get("content_filter_results"))
        return False

    def finish(self) -> SamplingResult:
        """The result; retryable ProviderError if the stream broke off."""
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


class OpenAIChatAdapter:
    """The :class:`~activities.providers.base.ProviderAdapter` for Chat Completions.

    Args:
        provider: Provider id it reports: ``openai`` or ``openai-compat``.
    """

    def __init__(self, provider: str = PROVIDER) -> None:
        self.provider = provider

    async def sample(
        self,
        client: httpx.AsyncClient,
        *,
        base_url: str,
        api_key: str | None,
        model: str,
        system: str,
        messages: list[Message],
        tools: list[ToolSpec],
        max_tokens: int,
        stream: bool,
        on_progress: Callable[[], None],
    ) -> SamplingResult:
        """Make one Chat Completions call (one try) and return its result.

        Args:
            client: httpx client built by the caller, with retries off.
            base_url: e.g. ``https://api.openai.com/v1`` or
                ``http://localhost:11434/v1``.
            api_key: Sent as ``Authorization: Bearer`` when given.
            model: Model name.
            system: System prompt.
            messages: The conversation.
            tools: Tools offered.
            max_tokens: Output token limit.
            stream: Use SSE.
            on_progress: Called on every streamed chunk.

        Returns:
            The result; a refusal is a result (``stop_reason == "refusal"``).

        Raises:
            ProviderError: Classified by :func:`classify_http_error`, or a
                shape / stream / network error.
        """
        provider = self.provider
        return await send_request(
            client,
            provider=provider,
            url=completions_url(base_url),
            headers=request_headers(api_key),
            payload=build_request(
                model=model, system=system, messages=messages, tools=tools,
                max_tokens=max_tokens, stream=stream,
            ),
            stream=stream,
            on_progress=on_progress,
            classify=functools.partial(classify_http_error, provider=provider, model=model),
            parse_body=lambda body: parse_completion(body, provider=provider, model=model),
            new_assembler=lambda: StreamAssembler(provider=provider, model=model),
        )
