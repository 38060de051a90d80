"""The provider adapter interface and the one error type adapters raise.

An adapter turns provider-neutral :class:`~stopline.contracts.Message` lists
into one provider's wire format, sends it over httpx (streaming SSE where the
provider offers it), and parses the answer into a
:class:`~stopline.contracts.SamplingResult`. It never retries: Temporal owns
retries (STYLE: "the provider client built with retries off").

Errors are classified in exactly one function per provider
(``classify_http_error`` in each adapter module) into :class:`ProviderError`
with ``retryable`` set; the sampling activity maps that onto Temporal's retry
policy. A refusal is never an error: it is a ``SamplingResult`` with
``stop_reason == "refusal"`` (seed 000).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import httpx

from stopline.contracts import Message, SamplingResult, ToolSpec


class ProviderError(Exception):
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
