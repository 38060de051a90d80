"""The sampling activity: one model call, streamed, heartbeating.

Input is a reference (task id + last seq), not the transcript: the activity
appends the workflow's pending rows to the ledger, reads the transcript from
the ledger store, validates it, and sends it (DESIGN §5: history grows
linearly with rounds).

Retries belong to Temporal: a retryable :class:`ProviderError` becomes a
retryable ``ApplicationError`` whose ``next_retry_delay`` is at least the
provider's ``retry-after``; anything else becomes a non-retryable one and the
task fails with a reason naming provider, model, attempts, status and what
was wrong. The httpx client is built with no retries of its own; a provider
that sends no byte for ``STOPLINE_SAMPLING_IDLE_TIMEOUT_S`` fails the attempt
(retryably).

Every attempt says how many provider requests the call has made so far —
in its heartbeat details and in its failure details (``{"attempt",
"requests", ...}``) — so the workflow counts ``provider_calls`` truly even
when Temporal ends the call with a timeout, which carries only the last
heartbeat's details.

API keys are read here, from the environment (``Settings``), and never
returned or logged: they never enter workflow history (DESIGN §5).
"""

from __future__ import annotations

import asyncio
import functools
import json
import ssl
import weakref
from datetime import datetime, timedelta, timezone

import httpx
import structlog
from temporalio import activity
from temporalio.exceptions import ApplicationError, ApplicationErrorCategory

from stopline.activities import round_tools, scripted_models
from stopline.activities._heartbeat import heartbeating
from stopline.activities.deltas import UNWATCHED_FIRST_PUBLISH_S, DeltaPublisher
from stopline.activities.ledger import append_rows, default_store
from stopline.activities.running import current, sampling_key
from stopline.activities.providers.base import ProviderError
from stopline.activities.providers.registry import get_adapter, parse_model_ref
from stopline.activities.scripted_models import is_scripted
from stopline.core.contracts import (
    SAMPLE_ACTIVITY,
    SAMPLING_DROPPED_ERROR,
    Refusal,
    SampleInput,
    SamplingResult,
    ToolCall,
)
from stopline.core.policies import (
    ConversationInvalid,
    round_tool_calls,
    rows_to_messages,
    validate_conversation,
)
from stopline.secrets import Redactor, current_redactor
from stopline.settings import Settings, load_settings

log = structlog.get_logger("stopline.sampling")

#: System prompt used when a task gives none.
DEFAULT_SYSTEM_PROMPT = (
    "You are a careful software agent working in a workspace directory. Use the "
    "tools to inspect and change files and to run commands. Tool calls made in "
    "one turn run concurrently; make dependent calls in separate turns. A tool "
    "result that reports a failure is information: read it and adapt. When the "
    "task is done, reply with a short summary and no tool call."
)


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """One TLS context per worker process.

    Loading the CA bundle costs ~25 ms; building it per sampling call was
    about a third of a round's wall time (bench/bench_rounds.py).
    """
    return httpx.create_ssl_context()


#: HTTP clients by event loop, then by sampling timeout (seconds).
_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[float, httpx.AsyncClient]] = (
    weakref.WeakKeyDictionary()
)


def _http_client(timeout_s: float) -> httpx.AsyncClient:
    """The worker's HTTP client (one connection pool per event loop).

    A client per call opened a new connection every round — for a real
    provider a TCP and TLS handshake per model call — and built a pool each
    time. One pool keeps connections alive between rounds. No retries in the
    transport: Temporal owns retries (STYLE rule 3). No connection limit: a
    worker's concurrent model calls are bounded by its activity slots.

    Args:
        timeout_s: Read/write/pool timeout of a call (``sampling_timeout_s``);
            connecting gets 10 s.
    """
    per_loop = _clients.setdefault(asyncio.get_running_loop(), {})
    client = per_loop.get(timeout_s)
    if client is None or client.is_closed:
        client = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, connect=10.0),
            transport=httpx.AsyncHTTPTransport(
                retries=0, verify=_tls_context(),
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=100),
            ),
        )
        per_loop[timeout_s] = client
    return client


def _tools_for(inp: SampleInput) -> list:
    if inp.tools:
        return list(inp.tools)
    if inp.toolset == "none":
        return list(inp.extra_tools)
    from stopline.activities.tools import TOOL_SPECS
    from stopline.core.task_tools import TASK_TOOL_SPECS

    if inp.toolset == "workspace+tasks":
        return [*TOOL_SPECS, *TASK_TOOL_SPECS, *inp.extra_tools]
    return [*TOOL_SPECS, *inp.extra_tools]


def _spell_out_secrets(result: SamplingResult, redactor: Redactor) -> None:
    """Rewrite a tool call's raw arguments that hide a secret in JSON escapes.

    ``raw_arguments`` is kept as the provider sent it, but JSON may spell a
    key with ``\\u`` escapes the redactor cannot see, while the parsed
    arguments hold it plainly (and are redacted). Such a call's raw text is
    replaced by its arguments re-serialized, so the key is redacted there
    too and the call is recognised as one that held a secret (DESIGN §5).
    """
    if not redactor:
        return
    for call in result.tool_calls:
        if call.arguments is None:
            continue
        plain = json.dumps(call.arguments, ensure_ascii=False)
        if redactor.text(plain) != plain and redactor.text(call.raw_arguments) == call.raw_arguments:
            call.raw_arguments = plain


#: Seconds a round's tool calls need beyond their own timeout, to end and
#: report (the ``stopline.tool`` activity's start-to-close has the same room).
ROUND_TOOLS_ROOM_S = 60.0


def _room_for_calls(info: activity.Info, call_timeout_s: float) -> bool:
    """Whether the round's calls fit in what is left of this attempt's
    start-to-close and the call's schedule-to-close (the sampling bounds,
    ``TaskLimits.sampling_timeout_s`` / ``sampling_total_timeout_s``): a
    bound that fired mid-call would end it "lost" though its worker lives."""
    now = datetime.now(timezone.utc)
    need = timedelta(seconds=call_timeout_s + ROUND_TOOLS_ROOM_S)
    if info.start_to_close_timeout and now + need > info.started_time + info.start_to_close_timeout:
        return False
    if info.schedule_to_close_timeout and now + need > info.scheduled_time + info.schedule_to_close_timeout:
        return False
    return True


def _holds_secret(call: ToolCall, redactor: Redactor) -> bool:
    """Whether a configured secret is in a tool call's arguments (raw or
    parsed): the data converter masks it on the way to the workflow."""
    if not redactor:
        return False
    if redactor.text(call.raw_arguments) != call.raw_arguments:
        return True
    plain = json.dumps(call.arguments, ensure_ascii=False) if call.arguments is not None else ""
    return redactor.text(plain) != plain


def _persisted_refusal(inp: SampleInput, rows: list) -> SamplingResult | None:
    """A task whose ledger holds a refusal stop is never sampled again.

    Every way back in — a reset, a re-driven run, a replay gone live — meets
    the persisted ``provider-refusal-stop`` row here and gets the same
    refusal, with no provider call (seed 000 §5).
    """
    if inp.thread_kind not in ("task", "fix"):
        return None
    for row in rows:
        if row.kind == "provider-refusal-stop":
            return SamplingResult(
                provider=str(row.meta.get("provider", "unknown")),
                model=inp.model,
                stop_reason="refusal",
                raw_stop_reason="persisted",
                refusal=Refusal(
                    provider=str(row.meta.get("provider", "unknown")),
                    category=row.meta.get("category"),
                ),
            )
    return None


async def _chain_refusal(inp: SampleInput) -> SamplingResult | None:
    """The refusal guard no disk can lose (DESIGN §4, §7): a task or fix task
    whose run chain stopped refused before — a run a reset abandoned, a
    ledger on a host that is gone — gets that refusal, with no provider call.
    """
    if inp.thread_kind not in ("task", "fix"):
        return None
    from stopline.activities.history import chain_refusal

    info = activity.info()
    ref = await chain_refusal(activity.client(), info.workflow_id, info.workflow_run_id, inp.chain_id)
    if ref is None:
        return None
    return SamplingResult(
        provider=ref.provider,
        model=inp.model,
        stop_reason="refusal",
        raw_stop_reason="persisted",
        refusal=Refusal(provider=ref.provider, category=ref.category),
    )


#: ApplicationError type of a provider failure (retryable or not).
PROVIDER_ERROR_TYPE = "ProviderError"
#: ApplicationError type of a response too large to record in history.
RESPONSE_TOO_LARGE_TYPE = "ResponseTooLarge"
#: Largest sampling result recorded in history (bytes of JSON); Temporal's
#: payload limit is 2 MiB.
MAX_RESULT_BYTES = 1_500_000
#: Room one tool outcome takes in a result besides its capped text (bytes).
OUTCOME_OVERHEAD_BYTES = 4096
#: ApplicationError type of a transcript that would be invalid for a provider.
CONVERSATION_INVALID_TYPE = "ConversationInvalid"


def _base_url_and_key(provider: str, inp: SampleInput, settings: Settings) -> tuple[str, str | None]:
    if provider == "anthropic":
        key = settings.anthropic_api_key
        base = inp.base_url or settings.anthropic_base_url
    else:
        key = settings.openai_api_key
        base = inp.base_url or settings.openai_base_url
    return base.rstrip("/"), key.get_secret_value() if key is not None else None


@activity.defn(name=SAMPLE_ACTIVITY)
async def sample(inp: SampleInput) -> SamplingResult:
    """Flush pending rows, read the transcript, make one model call.

    Args:
        inp: Reference to the transcript and the call's parameters.

    Returns:
        The sampling result (a refusal is a result, not an error), with
        ``attempt`` set to this activity attempt.

    Raises:
        ApplicationError: ``ProviderError`` (retryable per the provider's
            classification, ``next_retry_delay`` ≥ retry-after) or
            ``ConversationInvalid`` (non-retryable). ``details[0]`` is
            ``{"attempt": n, "requests": provider requests so far,
            "status": http status or None, "provider", "model"}``.
    """
    with structlog.contextvars.bound_contextvars(task_id=inp.task_id, round=inp.round):
        return await _sample(inp)


def _failure(info: activity.Info, requests: int, *, status: int | None = None,
             provider: str | None = None, model: str | None = None) -> dict:
    """``details[0]`` of a failed attempt (read by the workflow's failure reason)."""
    return {"attempt": info.attempt, "requests": requests, "status": status, "provider": provider, "model": model}


async def _sample(inp: SampleInput) -> SamplingResult:
    settings = load_settings()
    info = activity.info()
    if inp.round_tools is not None:
        round_tools.raise_if_lost(info)  # an earlier attempt started its calls: never again
    # Each attempt sends at most one request; earlier attempts sent theirs.
    sent = [info.attempt - 1]
    if is_scripted(inp.model):
        # a scripted scenario is served on this host, per task
        try:
            ref, url = scripted_models.resolve(inp.task_id, inp.model)
        except ValueError as e:
            raise ApplicationError(
                str(e), _failure(info, sent[0]), type=PROVIDER_ERROR_TYPE, non_retryable=True,
            ) from e
        inp = inp.model_copy(update={"model": ref, "base_url": url})
    store = default_store()
    # The rows a model call carries need no fsync (the file is a cache of
    # Temporal history, rebuilt from it after a machine crash); the write
    # itself still runs off the event loop.
    await append_rows(store, inp.task_id, inp.pending_rows, durable=False)
    all_rows = store.read(inp.task_id)
    persisted = _persisted_refusal(inp, all_rows) or await _chain_refusal(inp)
    if persisted is not None:
        persisted.attempt = 0  # no provider call was made
        return persisted
    rows = [r for r in all_rows if r.seq <= inp.upto_seq]
    messages = rows_to_messages(rows)
    try:
        validate_conversation(messages)
    except ConversationInvalid as e:
        raise ApplicationError(
            f"transcript invalid for the provider: {e}",
            _failure(info, sent[0]),
            type=CONVERSATION_INVALID_TYPE,
            non_retryable=True,
        ) from e
    try:
        provider, model = parse_model_ref(inp.model)
        adapter = get_adapter(provider)
    except ValueError as e:
        raise ApplicationError(
            str(e), _failure(info, sent[0]),
            type=PROVIDER_ERROR_TYPE, non_retryable=True,
        ) from e
    base_url, api_key = _base_url_and_key(provider, inp, settings)
    client = _http_client(settings.sampling_timeout_s)

    def count_request() -> None:
        sent[0] = info.attempt

    # Text and tool-argument deltas go to the task's workflow stream while
    # the model generates (batched: each publish is a Signal; see deltas.py);
    # unwatched, only a call that goes on for a while publishes.
    deltas = DeltaPublisher(
        round=inp.round, attempt=info.attempt,
        interval_s=settings.stream_deltas_s if inp.stream else 0.0,
        redactor=current_redactor(settings),
        first_after_s=0.0 if inp.watched else UNWATCHED_FIRST_PUBLISH_S,
    )
    try:
        # The heartbeat details carry the request count: a timeout reports
        # only the last heartbeat's details, and provider_calls must still
        # count every request (DESIGN §5).
        beats = [0]

        def beat_details() -> dict:
            beats[0] += 1
            return {"attempt": info.attempt, "requests": sent[0]}

        async with heartbeating(beat_details), deltas:
            call = adapter.sample(
                client,
                base_url=base_url,
                api_key=api_key,
                model=model,
                system=inp.system or DEFAULT_SYSTEM_PROMPT,
                messages=messages,
                tools=_tools_for(inp),
                max_tokens=inp.max_tokens,
                stream=inp.stream,
                on_progress=lambda: None,
                on_delta=deltas.on_delta,
                temperature=inp.temperature,
                top_p=inp.top_p,
                idle_timeout_s=settings.sampling_idle_timeout_s,
                on_request=count_request,
            )
            calls = current().calls
            if calls is None:
                result = await call
            else:
                # A registered unit: a pushed cancel drops the request here
                # at once (DESIGN §3); httpx closes the connection.
                result = await calls.run(
                    inp.task_id, sampling_key(inp.round), call,
                    pass_on_late_cancel=inp.round_tools is not None,  # to the round's calls
                )
    except asyncio.CancelledError:
        if activity.is_cancelled():
            raise  # Temporal's cancel (or a worker shutdown): the SDK reports it
        raise ApplicationError(
            "sampling dropped: the turn was interrupted",
            _failure(info, sent[0]),
            type=SAMPLING_DROPPED_ERROR,
            non_retryable=True,
            category=ApplicationErrorCategory.BENIGN,  # an interrupt, not a fault: no warning
        ) from None
    except ProviderError as e:
        log.warning(
            "provider_error", task_id=inp.task_id, provider=e.provider, status=e.status,
            retryable=e.retryable, attempt=info.attempt, code=e.code,
        )
        delay = timedelta(seconds=e.retry_after_s) if e.retry_after_s else None
        raise ApplicationError(
            str(e),
            _failure(info, sent[0], status=e.status, provider=e.provider, model=model),
            type=PROVIDER_ERROR_TYPE,
            non_retryable=not e.retryable,
            next_retry_delay=delay,
        ) from None
    result.attempt = info.attempt
    _spell_out_secrets(result, current_redactor(settings))
    size = len(result.model_dump_json())
    if size > MAX_RESULT_BYTES:
        # Temporal refuses payloads over 2 MiB and would retry the call
        # forever, re-billing it each time: say so once, clearly.
        raise ApplicationError(
            f"{result.provider} response of {size} bytes (text and tool arguments) exceeds "
            f"the {MAX_RESULT_BYTES}-byte limit of one model turn; ask for smaller steps",
            _failure(info, sent[0], status=200, provider=result.provider, model=model),
            type=RESPONSE_TOO_LARGE_TYPE,
            non_retryable=True,
        )
    # In memory (LedgerStore.stage): no thread hop, which cost more than the put.
    store.stage(
        inp.task_id,
        f"round-{inp.round}",
        {"text": result.text, "tool_calls": [c.model_dump() for c in result.tool_calls]},
    )
    log.info(
        "sampled", provider=result.provider, model=result.model, stop_reason=result.stop_reason,
        tool_calls=len(result.tool_calls), attempt=info.attempt,
    )
    if inp.round_tools is not None:
        calls = round_tool_calls(result, set(inp.round_tools.elsewhere))
        if size + len(calls) * (inp.round_tools.output_cap_bytes + OUTCOME_OVERHEAD_BYTES) > MAX_RESULT_BYTES:
            calls = []  # their outcomes might not fit this payload: each runs as its own activity
        if calls and not _room_for_calls(info, inp.round_tools.timeout_s):
            calls = []  # they could outlast this activity's own bounds: their own activities
        if any(_holds_secret(c, current_redactor(settings)) for c in calls):
            # The workflow sees this call with the key masked and runs none
            # of it (policies.untriaged_calls); here the key is still in it.
            calls = []
        if calls:
            # a watcher sees the round while its calls run (unwatched: from
            # the first second on, as for a model call)
            rest = asyncio.create_task(deltas.publish_rest(
                after_s=0.0 if inp.watched or deltas.published else UNWATCHED_FIRST_PUBLISH_S,
            ))
            try:
                result.tool_outcomes = await round_tools.run_round_tools(
                    inp, result, calls, {"attempt": info.attempt, "requests": sent[0]}, beaten=beats[0] > 0,
                )
            finally:
                await deltas.end_rest(rest)
    return result
