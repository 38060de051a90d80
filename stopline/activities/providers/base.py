"""One ``sample()`` for every provider, over a small wire-format interface.

An adapter turns provider-neutral :class:`~stopline.core.contracts.Message`
lists into one provider's wire format, sends it over httpx (streaming SSE
where the provider offers it), and parses the answer into a
:class:`~stopline.core.contracts.SamplingResult`. What is the same for every
provider lives here, once: the HTTP round trip, reading SSE with
``httpx-sse``, the idle bound on a stream, turning network errors into
retryable failures, and routing every provider error — whatever shape it
came in — to the provider's one classifier. What differs lives in a
:class:`Wire`, one per provider module:

==================  ===================================================
``url``/``headers``   where and how to authenticate
``preflight``         checks before a call (a local server's template)
``build_request``     the JSON body (messages, tools, sampling settings)
``parse_body``        a complete JSON answer → result
``new_stream``        an assembler fed one SSE event at a time
``classify_error``    the provider's verdict on a failed call, from an
                      :class:`ErrorReport` (HTTP body, stream error event
                      or Responses ``response.failed`` alike)
``after_cancel``      what a cancelled call waits for (a local server
                      dropping its generation)
==================  ===================================================

Rules this module enforces for all of them:

- It never retries: Temporal owns retries (STYLE rule 3); the caller builds
  the httpx client with ``retries=0``.
- Errors are classified in exactly one function per provider (STYLE rule 4):
  ``Wire.classify_error``. A refusal is never an error: the classifier may
  answer a policy verdict with a ``SamplingResult`` whose ``stop_reason`` is
  ``"refusal"`` (seed 000, DESIGN §4), which is returned, not raised.
- A stream that sends no byte for ``idle_timeout_s`` is a retryable failure
  (httpx's read timeout is per read, so it measures exactly that).
- A cancelled call (a user interrupt reaching the sampling activity) closes
  its connection at once, then gives the wire a bounded ``after_cancel``
  before the cancel propagates: a local one-slot server is then free when
  the cancel is acknowledged.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import httpx
import httpx_sse
import pydantic_core

from stopline.activities.deltas import SamplingDelta, take_deltas
from stopline.core.contracts import Message, SamplingResult, ToolCall, ToolSpec
from stopline.core.errors import StoplineError


class ProviderError(StoplineError):
    """A provider call failed.

    Attributes:
        provider: Provider id (``anthropic``, ``openai``, ``openai-compat``,
            ``openai-responses``).
        status: HTTP status, or ``None`` for a stream error event, a
            ``response.failed``, a broken or idle stream, a network error.
        retryable: Whether Temporal may send the request again (see each
            wire's ``classify_error``).
        message: What was wrong, in words (the provider's own, truncated).
        retry_after_s: Seconds the provider asked us to wait
            (``retry-after`` / ``retry-after-ms``), if any.
        code: The provider's error code or type (``insufficient_quota``,
            ``overloaded_error`` ...), when it gave one.
    """

    def __init__(
        self,
        *,
        provider: str,
        status: int | None,
        retryable: bool,
        message: str,
        retry_after_s: float | None = None,
        code: str | None = None,
    ) -> None:
        self.provider = provider
        self.status = status
        self.retryable = retryable
        self.retry_after_s = retry_after_s
        self.message = message
        self.code = code
        where = f"HTTP {status}" if status is not None else "(no HTTP status)"
        super().__init__(f"{provider} {where}: {message}")


def parse_retry_after(headers: httpx.Headers | None) -> float | None:
    """Seconds to wait from ``retry-after-ms`` or ``retry-after`` (seconds form).

    Args:
        headers: Response headers (``None``: none, e.g. a stream event).

    Returns:
        Seconds, or ``None`` when absent or unparseable (an HTTP-date form is
        treated as absent).
    """
    if headers is None:
        return None
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


# ---------------------------------------------------------------------------
# What a wire is given and what it classifies
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class WireRequest:
    """One model call, provider-neutral.

    Attributes:
        model: Model name as the provider knows it.
        system: System prompt ("" for none).
        messages: The conversation.
        tools: Tools offered (empty: none).
        max_tokens: Output token limit.
        stream: Ask for SSE.
        temperature: Sampling temperature; ``None`` sends none (the
            provider's default).
        top_p: Nucleus sampling; ``None`` sends none.
    """

    model: str
    system: str
    messages: list[Message]
    tools: list[ToolSpec]
    max_tokens: int
    stream: bool
    temperature: float | None = None
    top_p: float | None = None


#: Where a provider error was found: a non-2xx HTTP answer, an error event in
#: an SSE stream, or a Responses ``response.failed`` (streamed or in a body).
ErrorShape = Literal["http", "stream", "failed"]


@dataclass(frozen=True)
class ErrorReport:
    """A provider's error in any shape, reduced to what a classifier reads.

    Attributes:
        shape: See :data:`ErrorShape`.
        status: HTTP status (``None`` for the stream shapes).
        code: ``error.code`` (as text; some servers send a number).
        kind: ``error.type`` (``invalid_request_error``, ``overloaded_error``).
        param: ``error.param``.
        message: ``error.message`` (or the raw body), truncated.
        error: The error object itself (``{}`` when the body had none).
        headers: Response headers (``None`` for stream events).
    """

    shape: ErrorShape
    status: int | None
    code: str | None
    kind: str | None
    param: str | None
    message: str
    error: dict[str, Any] = field(default_factory=dict)
    headers: httpx.Headers | None = None

    def label(self) -> str:
        """``"<type>/<code>: <message>"`` with the parts that are present,
        at most :data:`ERROR_TEXT_LIMIT` characters."""
        labels = [x for x in (self.kind, self.code) if x]
        labels = [x for i, x in enumerate(labels) if x not in labels[:i]]
        return truncate(f"{'/'.join(labels)}: {self.message}" if labels else self.message)


def _text(value: Any) -> str | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (str, int)):
        return str(value) or None
    return None


def error_report(obj: Any, *, shape: ErrorShape, status: int | None = None,
                 headers: httpx.Headers | None = None, raw: str = "") -> ErrorReport:
    """An :class:`ErrorReport` from an error body, event or failed response.

    Accepts the shapes providers use: ``{"error": {"type", "code",
    "message", "param"}}`` (OpenAI, Anthropic bodies and events, a chat
    ``error`` chunk), ``{"type": "error", "code", "message"}`` (a flat
    Responses error event), ``{"error": "text"}``, or anything else (quoted
    raw).

    Args:
        obj: The decoded JSON (any type).
        shape: Where it was found.
        status: HTTP status, if any.
        headers: Response headers, if any.
        raw: The text it was decoded from, quoted when nothing else says
            what was wrong.

    Returns:
        The report; its ``message`` is at most :data:`ERROR_TEXT_LIMIT` long.
    """
    err: dict[str, Any] = {}
    if isinstance(obj, dict):
        inner = obj.get("error")
        if isinstance(inner, dict):
            err = inner
        elif isinstance(inner, str) and inner:
            err = {"message": inner}
        else:
            err = obj
    kind = _text(err.get("type"))
    if kind == "error" or kind in _EVENT_TYPES:
        kind = None  # the event's own type, not the error's
    message = err.get("message")
    if not isinstance(message, str) or not message:
        message = raw.strip() or (json.dumps(err) if err else "(empty body)")
    return ErrorReport(
        shape=shape, status=status, code=_text(err.get("code")), kind=kind,
        param=_text(err.get("param")), message=truncate(message), error=err, headers=headers,
    )


_EVENT_TYPES = ("response.failed", "response.error")


class StreamAssembler(Protocol):
    """Builds one SamplingResult from a provider's SSE events."""

    def feed(self, event: str, data: str) -> bool:
        """Take one SSE event; return ``True`` once the stream is over for us
        (its terminal event, or an error the wire has classified).

        Raises:
            ProviderError: A malformed event (non-retryable).
        """
        ...

    def finish(self) -> SamplingResult:
        """The result, once the stream has ended.

        Raises:
            ProviderError: The classified error the stream reported, or a
                retryable "stream broke off" when it ended before its
                terminal event.
        """
        ...


class Wire(Protocol):
    """One provider's wire format: everything :func:`sample` does not know."""

    #: Provider id reported in results and errors.
    provider: str

    def url(self, base_url: str) -> str:
        """The endpoint for ``base_url``."""
        ...

    def headers(self, api_key: str | None) -> dict[str, str]:
        """Request headers; auth only when there is a key."""
        ...

    def build_request(self, request: WireRequest) -> dict[str, Any]:
        """The JSON body of one request."""
        ...

    def parse_body(self, body: Any, *, model: str) -> SamplingResult:
        """A complete JSON answer as a result.

        Raises:
            ProviderError: A body without the expected shape, or one that
                reports a failure (classified).
        """
        ...

    def new_stream(self, *, model: str) -> StreamAssembler:
        """A fresh assembler for one streamed answer."""
        ...

    def classify_error(self, report: ErrorReport, *, model: str) -> ProviderError | SamplingResult:
        """The provider's verdict on a failed call: the error to raise, or a
        refusal result. The only place the provider's errors are classified."""
        ...

    async def preflight(self, client: httpx.AsyncClient, *, base_url: str, request: WireRequest) -> None:
        """Checks before the call (e.g. a local server's capabilities).

        Raises:
            ProviderError: Non-retryable, when the call cannot succeed.
        """
        ...

    async def after_cancel(self, client: httpx.AsyncClient, *, base_url: str) -> None:
        """After a cancelled call, once its connection is closed: wait
        (bounded) until the server has dropped it, where that can be seen
        (a one-slot local server). Never raises."""
        ...


# ---------------------------------------------------------------------------
# Helpers the wires share. None of these retries, and none decides what a
# refusal is: each wire module keeps its own classifier and refusal rules.
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
        value = provider_json(raw_arguments)
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
    if _nesting(value) > MAX_ARGUMENT_NESTING:
        return ToolCall(
            id=call_id, name=name, arguments=None, raw_arguments=raw_arguments,
            parse_error=f"arguments nest deeper than {MAX_ARGUMENT_NESTING} levels",
        )
    return ToolCall(id=call_id, name=name, arguments=value, raw_arguments=raw_arguments)


#: Deepest nesting of objects and arrays a tool call's parsed arguments may
#: have. Temporal's JSON payloads are decoded by pydantic-core, which stops
#: at a depth of about 250 counting the result's own envelope: deeper
#: arguments made a sampling result the workflow could never read, and the
#: task hung on a failing workflow task. No tool takes arguments nested
#: anywhere near this; such a call is held back like unparsable arguments.
MAX_ARGUMENT_NESTING = 64


def _nesting(value: Any) -> int:
    """Depth of nested objects and arrays in ``value`` (a scalar: 0)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
        else:
            continue
        deepest = max(deepest, depth + 1)
    return deepest


#: A JSON escape of a UTF-16 surrogate code unit (``\\ud800``–``\\udfff``).
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE_ESCAPE_BYTES = re.compile(rb"\\u[dD][89a-fA-F]")


def provider_json(data: str | bytes) -> Any:
    """``json.loads`` for what a provider sent, lone surrogates replaced.

    JSON can escape half of a UTF-16 surrogate pair on its own
    (``"\\ud83d"``: a model that cut an emoji in two). Python decodes it
    into a string no UTF-8 encoder accepts, so the response could be
    neither recorded (activity result, ledger) nor sent back, and the
    sampling call failed and was re-sent. Each lone surrogate becomes
    U+FFFD; a well-formed pair decodes to its character as usual.

    Raises:
        ValueError: When ``data`` is not JSON (``json.JSONDecodeError``).
    """
    value = json.loads(data)
    escape = _SURROGATE_ESCAPE_BYTES if isinstance(data, (bytes, bytearray)) else _SURROGATE_ESCAPE
    if escape.search(data):  # type: ignore[arg-type]
        value = _replace_lone_surrogates(value)
    return value


def _replace_lone_surrogates(value: Any) -> Any:
    if isinstance(value, str):
        return value.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    if isinstance(value, list):
        return [_replace_lone_surrogates(v) for v in value]
    if isinstance(value, dict):
        return {_replace_lone_surrogates(k): _replace_lone_surrogates(v) for k, v in value.items()}
    return value


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
        value = provider_json(data)
    except ValueError:
        raise shape_error(provider, f"stream event is not JSON: {truncate(data, 120)!r}", status=None) from None
    if not isinstance(value, dict):
        raise shape_error(provider, f"stream event is not a JSON object: {truncate(data, 120)!r}", status=None)
    return value


def sampling_fields(request: WireRequest) -> dict[str, Any]:
    """``temperature`` / ``top_p`` for a request body, only those that are set.

    All three wires spell them the same way (Anthropic Messages, OpenAI Chat
    Completions and Responses); unset means the provider's default.
    """
    out: dict[str, Any] = {}
    if request.temperature is not None:
        out["temperature"] = request.temperature
    if request.top_p is not None:
        out["top_p"] = request.top_p
    return out


class StreamOutcome:
    """Base for assemblers: holds an error the wire classified mid-stream.

    An assembler that meets an error event calls :meth:`fail` with the
    classifier's verdict and stops; :meth:`verdict` then gives it back from
    ``finish()`` — raised when it is an error, returned when it is a refusal.
    """

    outcome: ProviderError | SamplingResult | None = None

    def fail(self, verdict: ProviderError | SamplingResult) -> bool:
        """Remember ``verdict``; returns ``True`` (the stream is over for us)."""
        self.outcome = verdict
        return True

    def verdict(self) -> SamplingResult | None:
        """The remembered refusal, or ``None`` when there is no verdict.

        Raises:
            ProviderError: The remembered error.
        """
        if isinstance(self.outcome, ProviderError):
            raise self.outcome
        return self.outcome


# ---------------------------------------------------------------------------
# The one sample()
# ---------------------------------------------------------------------------

#: Longest a cancelled call spends in its wire's ``after_cancel``.
AFTER_CANCEL_BOUND_S = 2.0


class WireAdapter:
    """A provider adapter: :meth:`sample` over one :class:`Wire`.

    Args:
        wire: The provider's wire format.
    """

    def __init__(self, wire: Wire) -> None:
        self.wire = wire
        self.provider = wire.provider

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
        temperature: float | None = None,
        top_p: float | None = None,
        idle_timeout_s: float | None = None,
        on_request: Callable[[], None] | None = None,
        on_delta: Callable[[SamplingDelta], None] | None = None,
    ) -> SamplingResult:
        """Make one model call (one try) and return its result.

        A non-2xx status goes to the wire's ``classify_error`` (which may
        turn it into a refusal result), a 2xx body to ``parse_body`` or, when
        streaming, each SSE event (read with ``httpx-sse``) to the wire's
        assembler. A streaming request answered with a plain JSON body (a
        server that ignores ``stream``) is parsed as one. Network errors
        (connect, read, a connection dropped mid-stream) and an idle stream
        become retryable ProviderErrors. Nothing is retried here.

        Args:
            client: The caller's client (built with retries off).
            base_url: e.g. ``https://api.anthropic.com``,
                ``https://api.openai.com/v1``, ``http://127.0.0.1:8080/v1``.
            api_key: Sent the wire's way when given.
            model: Model name.
            system: System prompt.
            messages: The conversation.
            tools: Tools offered.
            max_tokens: Output token limit.
            stream: Use SSE.
            on_progress: Called once the status line arrives and on every
                streamed event.
            temperature: Sampling temperature; ``None``: provider default.
            top_p: Nucleus sampling; ``None``: provider default.
            idle_timeout_s: Seconds without a byte (before the status line or
                between events) after which the call fails, retryably;
                ``None``: the client's own read timeout.
            on_request: Called just before the request is sent (the caller
                counts provider requests with it).
            on_delta: Called with each text / tool-argument piece a streamed
                event carried (the assembler's ``deltas``), so the sampling
                activity can stream them to watchers; ``None``: not collected.

        Returns:
            The result; a refusal is a result (``stop_reason == "refusal"``).

        Raises:
            ProviderError: Classified by the wire, or a shape / stream /
                network / idle error.
        """
        wire = self.wire
        request = WireRequest(
            model=model, system=system, messages=messages, tools=tools, max_tokens=max_tokens,
            stream=stream, temperature=temperature, top_p=top_p,
        )
        await wire.preflight(client, base_url=base_url, request=request)
        url, headers = wire.url(base_url), {"content-type": "application/json", **wire.headers(api_key)}
        body = request_body(wire.build_request(request))
        timeout: Any = httpx.USE_CLIENT_DEFAULT
        if idle_timeout_s is not None:
            base = client.timeout
            timeout = httpx.Timeout(
                connect=base.connect, read=idle_timeout_s, write=base.write, pool=base.pool
            )
        status: int | None = None
        if on_request is not None:
            on_request()
        try:
            if not stream:
                response = await client.post(url, headers=headers, content=body, timeout=timeout)
                status = response.status_code
                on_progress()
                if not response.is_success:
                    return self._http_error(response, model)
                return wire.parse_body(_json_body(self.provider, response), model=model)
            async with httpx_sse.aconnect_sse(
                client, "POST", url, headers=dict(headers), content=body, timeout=timeout
            ) as source:
                response = source.response
                status = response.status_code
                on_progress()
                if not response.is_success:
                    await response.aread()
                    return self._http_error(response, model)
                if "text/event-stream" not in response.headers.get("content-type", ""):
                    await response.aread()
                    return wire.parse_body(_json_body(self.provider, response), model=model)
                assembler = wire.new_stream(model=model)
                async for sse in source.aiter_sse():
                    on_progress()
                    done = assembler.feed(sse.event, sse.data)
                    if on_delta is not None:
                        for delta in take_deltas(assembler):
                            on_delta(delta)
                    if done:
                        break
                return assembler.finish()
        except asyncio.CancelledError:
            # The connection is closed by now (the `async with` has exited).
            try:
                await asyncio.wait_for(wire.after_cancel(client, base_url=base_url), AFTER_CANCEL_BOUND_S)
            except (asyncio.TimeoutError, httpx.HTTPError):
                pass
            raise
        except httpx.TimeoutException as e:
            if idle_timeout_s is not None and isinstance(e, httpx.ReadTimeout):
                where = "stream went idle" if status is not None else "no answer"
                message = (
                    f"{where}: no byte for {idle_timeout_s:g} s "
                    f"(idle bound; network error {type(e).__name__})"
                )
            else:
                where = "stream broke off" if status is not None else "request failed"
                message = f"{where}: network error {type(e).__name__}: {truncate(str(e) or repr(e))}"
            raise ProviderError(provider=self.provider, status=None, retryable=True, message=message) from e
        except httpx.RequestError as e:
            where = "stream broke off" if status is not None else "request failed"
            raise ProviderError(
                provider=self.provider, status=None, retryable=True,
                message=f"{where}: network error {type(e).__name__}: {truncate(str(e) or repr(e))}",
            ) from e

    def _http_error(self, response: httpx.Response, model: str) -> SamplingResult:
        try:
            body: Any = provider_json(response.content)
        except ValueError:
            body = None
        report = error_report(
            body, shape="http", status=response.status_code, headers=response.headers, raw=response.text,
        )
        verdict = self.wire.classify_error(report, model=model)
        if isinstance(verdict, ProviderError):
            raise verdict
        return verdict


#: Kept for callers that name the adapter interface; every adapter is a
#: :class:`WireAdapter`.
ProviderAdapter = WireAdapter


def request_body(payload: Any) -> bytes:
    """A request body as JSON bytes (UTF-8, compact).

    Encoded by pydantic-core rather than httpx's ``json=`` (the standard
    library's encoder): a request carries the tool schemas and the whole
    transcript every round, and the standard encoder took about three
    times as long (bench/bench_throughput.py). A NaN or infinity, which JSON
    lacks (a model's tool arguments may hold one), is sent as ``null``.
    """
    return pydantic_core.to_json(payload, inf_nan_mode="null")


def _json_body(provider: str, response: httpx.Response) -> Any:
    try:
        return provider_json(response.content)
    except ValueError:
        raise shape_error(
            provider, f"response body is not JSON: {truncate(response.text, 120)!r}",
            status=response.status_code,
        ) from None
