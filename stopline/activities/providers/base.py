"""The provider adapter interface and the one error type adapters raise.

An adapter turns provider-neutral :class:`~stopline.core.contracts.Message` lists
into one provider's wire format, sends it over httpx (streaming SSE where the
provider offers it), and parses the answer into a
:class:`~stopline.core.contracts.SamplingResult`. It never retries: Temporal owns
retries (STYLE: "the provider client built with retries off").

Errors are classified in exactly one function per provider
(``classify_http_error`` in each adapter module) into :class:`ProviderError`
with ``retryable`` set; the sampling activity maps that onto Temporal's retry
policy. A refusal is never an error: it is a ``SamplingResult`` with
``stop_reason == "refusal"`` (seed 000).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Protocol

import httpx
import httpx_sse

from stopline.core.contracts import Message, SamplingResult, ToolCall, ToolSpec
from stopline.core.errors import StoplineError


class ProviderError(StoplineError):
    """A provider call failed.

    Attributes:
        provider: Provider id (``anthropic``, ``openai``, ``openai-responses``).
        status: HTTP status, or ``None`` for a broken stream / bad shape.
        retryable: ``True`` for 408/409/429/5xx/529, a stream that broke off
            or sent an error event, a network error; ``False`` for other 4xx
            and a body without the expected shape (an engine error).
        retry_after_s: Seconds the provider asked us to wait
            (``retry-after`` / ``retry-after-ms``), if any.
        message: What was wrong, in words.
    """

    def __init__(
        self,
        *,
        provider: str,
        status: int | None,
        retryable: bool,
        message: str,
        retry_after_s: float | None = None,
    ) -> None:
        self.provider = provider
        self.status = status
        self.retryable = retryable
        self.retry_after_s = retry_after_s
        self.message = message
        where = f"HTTP {status}" if status is not None else "no status"
        super().__init__(f"{provider} {where}: {message}")


def parse_retry_after(headers: httpx.Headers) -> float | None:
    """Seconds to wait from ``retry-after-ms`` or ``retry-after`` (seconds form).

    Args:
        headers: Response headers.

    Returns:
        Seconds, or ``None`` when absent or unparseable (an HTTP-date form is
        treated as absent).
    """
    ms = headers.get("retry-after-ms")
    if ms is not None:
        try:
            return max(0.0, float(ms) / 1000.0)
        except ValueError:
            pass
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None


class SamplingRequest(Protocol):
    """What an adapter needs to make one call (duck-typed)."""

    model: str
    system: str
    messages: list[Message]
    tools: list[ToolSpec]
    max_tokens: int
    stream: bool


class ProviderAdapter(Protocol):
    """One provider's wire format.

    ``sample`` calls ``on_progress()`` on every streamed chunk (the sampling
    activity also heartbeats from a background loop).
    """

    provider: str

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
        """Make one model call and return its result.

        Raises:
            ProviderError: On any failure, classified retryable or not.
        """
        ...


# ---------------------------------------------------------------------------
# Shared by the three adapter modules (added with them). None of these
# retries, and none decides what a refusal is: each adapter module keeps its
# own ``classify_http_error`` and its own refusal rules.
# ---------------------------------------------------------------------------

#: How much of a provider's error text a ProviderError message keeps.
ERROR_TEXT_LIMIT = 300


def truncate(text: str, limit: int = ERROR_TEXT_LIMIT) -> str:
    """``text`` cut to ``limit`` characters, with an ellipsis when cut."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def is_retryable_status(status: int) -> bool:
    """Whether an HTTP status is worth retrying.

    Retryable: 408 (timeout), 409 (conflict), 429 (rate limit) and every 5xx,
    which includes Anthropic's 529 ``overloaded_error`` (Anthropic Messages
    API: errors; OpenAI API: error codes). Every other status is not.

    Args:
        status: HTTP status code.

    Returns:
        ``True`` for 408, 409, 429, 500-599.
    """
    return status in (408, 409, 429) or 500 <= status <= 599


def error_body_message(body: str) -> str:
    """The provider's own words from an error body, truncated.

    Both Anthropic (``{"type": "error", "error": {"type", "message"}}``) and
    OpenAI (``{"error": {"message", "type", "code", "param"}}``) put them
    under ``error``; anything else is quoted raw.

    Args:
        body: The response body as text.

    Returns:
        ``"<type>/<code>: <message>"`` when the body has that shape, else
        the body itself (or ``"(empty body)"``), at most
        :data:`ERROR_TEXT_LIMIT` characters.
    """
    try:
        data = json.loads(body)
    except ValueError:
        data = None
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, str) and err:
            return truncate(err)
        if isinstance(err, dict):
            labels = [str(err[k]) for k in ("type", "code") if isinstance(err.get(k), (str, int)) and err.get(k)]
            message = err.get("message")
            text = str(message) if message else json.dumps(err)
            return truncate(f"{'/'.join(labels)}: {text}" if labels else text)
        if isinstance(data.get("message"), str):
            return truncate(data["message"])
    return truncate(body.strip() or "(empty body)")


def tool_call_from_raw(call_id: str, name: str, raw_arguments: str) -> ToolCall:
    """A :class:`ToolCall` from the arguments string the model produced.

    Arguments that do not parse are not an exception: the call gets
    ``arguments=None`` and ``parse_error`` says why, and the engine runs none
    of that turn's tools (DESIGN §3). An empty string counts as ``{}`` (a
    tool without parameters; some OpenAI-compatible servers send ``""``).

    Args:
        call_id: The provider's call id.
        name: Tool name.
        raw_arguments: The JSON text as the provider sent it; kept verbatim.

    Returns:
        The tool call, parsed or with ``parse_error`` set.
    """
    if not raw_arguments.strip():
        return ToolCall(id=call_id, name=name, arguments={}, raw_arguments=raw_arguments)
    try:
        value = json.loads(raw_arguments)
    except ValueError as e:
        return ToolCall(
            id=call_id, name=name, arguments=None, raw_arguments=raw_arguments,
            parse_error=f"arguments are not valid JSON: {e}",
        )
    if not isinstance(value, dict):
        return ToolCall(
            id=call_id, name=name, arguments=None, raw_arguments=raw_arguments,
            parse_error=f"arguments are a JSON {type(value).__name__}, not an object",
        )
    return ToolCall(id=call_id, name=name, arguments=value, raw_arguments=raw_arguments)


def shape_error(provider: str, what: str, *, status: int | None = 200) -> ProviderError:
    """A non-retryable error for a response without the expected shape.

    Such a response is an engine error (DESIGN §2: ``Fatal``), and resending
    the same request would not change it.
    """
    return ProviderError(provider=provider, status=status, retryable=False, message=what)


def load_json_event(provider: str, data: str) -> dict[str, Any]:
    """One SSE ``data`` field parsed as a JSON object.

    Raises:
        ProviderError: Non-retryable, when it is not a JSON object.
    """
    try:
        value = json.loads(data)
    except ValueError:
        raise shape_error(provider, f"stream event is not JSON: {truncate(data, 120)!r}", status=None) from None
    if not isinstance(value, dict):
        raise shape_error(provider, f"stream event is not a JSON object: {truncate(data, 120)!r}", status=None)
    return value


class StreamAssembler(Protocol):
    """Builds one SamplingResult from a provider's SSE events."""

    def feed(self, event: str, data: str) -> bool:
        """Take one SSE event; return ``True`` once the terminal event is seen.

        Raises:
            ProviderError: On an error event (retryable) or a malformed one.
        """
        ...

    def finish(self) -> SamplingResult:
        """The result, once the stream has ended.

        Raises:
            ProviderError: Retryable "stream broke off" when the stream ended
                before its terminal event.
        """
        ...


async def send_request(
    client: httpx.AsyncClient,
    *,
    provider: str,
    url: str,
    headers: dict[str, str],
    payload: dict[str, Any],
    stream: bool,
    on_progress: Callable[[], None],
    classify: Callable[[int, httpx.Headers, str], ProviderError | SamplingResult],
    parse_body: Callable[[Any], SamplingResult],
    new_assembler: Callable[[], StreamAssembler],
) -> SamplingResult:
    """POST one request and turn the answer into a SamplingResult. One try.

    The HTTP round trip every adapter shares: a non-2xx status goes to the
    module's ``classify`` (which may turn it into a refusal result), a 2xx
    body to ``parse_body`` or, when streaming, each SSE event (read with
    ``httpx-sse``) to the assembler. A streaming request answered with a
    plain JSON body (a server that ignores ``stream``) is parsed as one.
    Network errors (``httpx.RequestError``: connect, read, timeouts, a
    connection dropped mid-stream) become retryable ProviderErrors. Nothing
    is retried here: Temporal owns retries.

    Args:
        client: The caller's client (built with retries off).
        provider: Provider id for error messages.
        url: Endpoint URL.
        headers: Request headers (auth included when there is a key).
        payload: JSON body.
        stream: Read the answer as SSE.
        on_progress: Called once the status line arrives and on every event.
        classify: The provider module's ``classify_http_error``.
        parse_body: Parses a complete JSON body.
        new_assembler: Makes the stream assembler.

    Returns:
        The sampling result (a refusal included).

    Raises:
        ProviderError: Classified retryable or not.
    """
    status: int | None = None
    try:
        if not stream:
            response = await client.post(url, headers=headers, json=payload)
            status = response.status_code
            on_progress()
            if not response.is_success:
                return _outcome(classify(status, response.headers, response.text))
            return parse_body(_json_body(provider, response))
        async with httpx_sse.aconnect_sse(client, "POST", url, headers=dict(headers), json=payload) as source:
            response = source.response
            status = response.status_code
            on_progress()
            if not response.is_success:
                await response.aread()
                return _outcome(classify(status, response.headers, response.text))
            if "text/event-stream" not in response.headers.get("content-type", ""):
                await response.aread()
                return parse_body(_json_body(provider, response))
            assembler = new_assembler()
            async for sse in source.aiter_sse():
                on_progress()
                if assembler.feed(sse.event, sse.data):
                    break
            return assembler.finish()
    except httpx.RequestError as e:
        where = "stream broke off" if status is not None else "request failed"
        raise ProviderError(
            provider=provider, status=None, retryable=True,
            message=f"{where}: network error {type(e).__name__}: {truncate(str(e) or repr(e))}",
        ) from e


def _outcome(classified: ProviderError | SamplingResult) -> SamplingResult:
    if isinstance(classified, ProviderError):
        raise classified
    return classified


def _json_body(provider: str, response: httpx.Response) -> Any:
    try:
        return json.loads(response.content)
    except ValueError:
        raise shape_error(
            provider, f"response body is not JSON: {truncate(response.text, 120)!r}",
            status=response.status_code,
        ) from None
