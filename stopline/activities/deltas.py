"""Token streaming: the sampling activity publishes what the model is
generating to the task's workflow stream, in small batches.

Why it exists: a model call can take a minute; a person watching a task
(``stopline run`` / ``follow`` / ``chat``) should see the text — and the
tool calls' arguments as they form — while it is produced, not when the
whole message arrives. The provider adapters hand each text or
tool-argument piece to their ``on_delta`` callback as a
:class:`SamplingDelta`; :class:`DeltaPublisher` buffers them and, every
``interval_s`` (default 0.25 s), coalesces what arrived into one
``assistant_delta`` event per text block and one ``tool_args_delta`` per
forming tool call, published on the task's ``events`` topic through
``temporalio.contrib.workflow_streams`` (a Signal to the workflow).

The cost is the reason for batching: every publish is a Signal — a server
round trip, a workflow task, and on Temporal Cloud one billed Action — and
it completes each watcher's pending poll (an Update: one more Action and
history events per watcher; ``bench/bench_cli.py`` measured about 9 history
events per publish with one watcher). At 0.25 s, a 60 s model call costs at
most 240 publishes, whatever the token rate, and a call shorter than one
interval costs none — nor does one shorter than
:data:`UNWATCHED_FIRST_PUBLISH_S` when nobody watched the task as it started
(``SampleInput.watched``; a watcher attaching later still sees a long call
stream);
``STOPLINE_STREAM_DELTAS_S=0`` turns streaming off (watchers then see each
message whole).

What it must never do: write the ledger (only whole messages are recorded;
the workflow appends the assistant row from the sampling result), or let a
failed publish fail or slow the model call (a publish error is logged and
streaming stops for the rest of that call).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import structlog

from stopline.core.contracts import EVENTS_TOPIC, TaskEvent

if TYPE_CHECKING:
    from stopline.secrets import Redactor, StreamRedactor

log = structlog.get_logger("stopline.deltas")

#: Longest the end of a model call waits for a publish in flight, seconds.
FINAL_FLUSH_S = 5.0
#: Seconds before the first publish of a call nobody watched when it started.
UNWATCHED_FIRST_PUBLISH_S = 1.0


@dataclass(frozen=True)
class SamplingDelta:
    """One piece of a response as the provider streamed it.

    Attributes:
        kind: ``text`` (assistant text) or ``tool_args`` (a tool call's
            argument JSON, as it forms).
        text: The piece.
        index: The provider's content index (a text block, a tool call).
        call_id: The tool call's id, when known (``tool_args``).
        tool_name: The tool's name, when known (``tool_args``).
    """

    kind: Literal["text", "tool_args"]
    text: str
    index: int = 0
    call_id: str | None = None
    tool_name: str | None = None


def take_deltas(assembler: Any) -> list[SamplingDelta]:
    """Pop the deltas a stream assembler collected from its last event(s).

    Args:
        assembler: A provider's stream assembler; one without a ``deltas``
            list yields none.

    Returns:
        The deltas, oldest first (the assembler's list is emptied).
    """
    pending = getattr(assembler, "deltas", None)
    if not pending:
        return []
    out = list(pending)
    pending.clear()
    return out


class DeltaPublisher:
    """Collects a sampling call's deltas and publishes them every ``interval_s``.

    Use as ``async with DeltaPublisher(...) as deltas:`` inside the sampling
    activity and pass ``deltas.on_delta`` to the adapter. Only calls
    longer than one interval publish anything: the whole message follows
    at once as ``assistant_text``, so what is still buffered when the call
    ends is dropped rather than sent (a Signal saved per round). A publish
    in flight when the call ends is waited for (at most
    :data:`FINAL_FLUSH_S`), so no delta reaches the stream after the call's
    result.

    Each piece is redacted before it is buffered, per text block or tool
    call, holding back what could be the start of a secret until the next
    piece shows it is not: a key split across two pieces (or two
    publishes) never leaves in parts (DESIGN §5).

    Args:
        round: The sampling round (stamped on each event).
        attempt: The activity attempt (a retry streams again from the start).
        interval_s: Seconds between publishes; ``<= 0`` disables publishing.
        redactor: The configured secrets (``None``: none).
        first_after_s: No publish before this many seconds of the call
            (:data:`UNWATCHED_FIRST_PUBLISH_S` when nobody watched as it
            started: a shorter call publishes nothing for nobody, a longer
            one still streams to a watcher who attaches meanwhile).
    """

    def __init__(
        self, *, round: int, attempt: int, interval_s: float, redactor: Redactor | None = None,
        first_after_s: float = 0.0,
    ) -> None:
        self.round = round
        self.attempt = attempt
        self.interval_s = interval_s
        self.first_after_s = first_after_s
        self.published = 0
        self._redactor = redactor if redactor else None
        self._streams: dict[tuple[str, int], StreamRedactor[str]] = {}
        self._buffer: list[SamplingDelta] = []
        self._client: Any = None
        self._topic: Any = None
        self._loop: asyncio.Task[None] | None = None
        self._publishing = asyncio.Lock()
        self._broken = False
        self._rest_started = False

    @property
    def enabled(self) -> bool:
        """Whether deltas are being published."""
        return self.interval_s > 0 and not self._broken

    async def __aenter__(self) -> DeltaPublisher:
        if self.interval_s > 0:
            self._loop = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *_: Any) -> None:
        if self._loop is None:
            return
        try:
            # wait out a publish in flight, then stop the loop where it sleeps
            await asyncio.wait_for(self._publishing.acquire(), FINAL_FLUSH_S)
            self._publishing.release()
        except asyncio.TimeoutError:
            pass
        finally:
            self._loop.cancel()
            try:
                await self._loop
            except asyncio.CancelledError:
                pass
        # What is left is not published (see the class docstring), unless
        # publish_rest is asked for it.

    async def publish_rest(self, after_s: float = 0.0) -> None:
        """Publish what the call left buffered, after the context has exited.

        For a round whose tool calls the sampling activity runs itself
        (DESIGN §1): its message reaches the stream only when they end, so a
        watcher would otherwise see nothing of the round while they run.
        On a terminal, ``run`` / ``follow`` then show the text and the calls
        (``▶ tool args``) until the whole message replaces them. Run it as a
        task beside the calls and end it with :meth:`end_rest`.

        Args:
            after_s: Seconds to wait first (:data:`UNWATCHED_FIRST_PUBLISH_S`
                when nobody watched as the round started: calls that end
                sooner publish nothing).

        The publish is bounded by :data:`FINAL_FLUSH_S`; a failure is logged,
        never raised: the round goes on either way.
        """
        if not self.enabled or not self._buffer:
            return
        if after_s > 0:
            await asyncio.sleep(after_s)
        self._rest_started = True

        async def publish() -> None:
            async with self._publishing:
                await self._publish()

        try:
            await asyncio.wait_for(publish(), FINAL_FLUSH_S)
        except Exception as err:  # the workflow closed, the server blinked, too slow
            log.warning("delta_publish_failed", error=str(err) or type(err).__name__)
            self._broken = True

    async def end_rest(self, rest: asyncio.Task[None]) -> None:
        """End a :meth:`publish_rest` task when the round's calls have ended:
        cancelled while it still waits, waited for once it publishes (so no
        delta reaches the stream after the round's result)."""
        if not rest.done() and not self._rest_started:
            rest.cancel()
        await asyncio.wait([rest])

    def on_delta(self, delta: SamplingDelta) -> None:
        """The adapters' ``on_delta`` callback: one text or tool-argument piece."""
        if not self.enabled:
            return
        if self._redactor is not None:
            key = (delta.kind, delta.index)
            if key not in self._streams:
                self._streams[key] = self._redactor.text_stream()
            text = self._streams[key].feed(delta.text)
            if not text and not delta.call_id:
                return
            delta = replace(delta, text=text)
        self._buffer.append(delta)

    async def _run(self) -> None:
        first = True
        while self.enabled:
            await asyncio.sleep(max(self.interval_s, self.first_after_s) if first else self.interval_s)
            first = False
            if not self._buffer:
                continue
            async with self._publishing:
                try:
                    await self._publish()
                except Exception as err:  # the workflow closed, the server blinked
                    log.warning("delta_publish_failed", error=str(err))
                    self._broken = True

    async def _publish(self) -> None:
        if self._client is None:  # made at the first publish: most calls make none
            from temporalio.contrib.workflow_streams import WorkflowStreamClient

            # Flushed by our own loop, not the client's flusher: the
            # coalescing below needs the whole interval's pieces at once.
            self._client = WorkflowStreamClient.from_within_activity(
                batch_interval=timedelta(hours=1), max_retry_duration=timedelta(seconds=30),
            )
            self._topic = self._client.topic(EVENTS_TOPIC, type=TaskEvent)
        events = coalesce(self._buffer, round=self.round, attempt=self.attempt)
        self._buffer = []
        for ev in events:
            self._topic.publish(ev)
        await self._client.flush()
        self.published += 1


def coalesce(deltas: list[SamplingDelta], *, round: int, attempt: int) -> list[TaskEvent]:
    """Join consecutive pieces of the same block into one event each.

    Args:
        deltas: Pieces in arrival order.
        round: Sampling round.
        attempt: Activity attempt.

    Returns:
        ``assistant_delta`` / ``tool_args_delta`` events, in order; a piece
        of a different block starts a new event.
    """
    out: list[TaskEvent] = []
    last: tuple[str, int] | None = None
    for d in deltas:
        key = (d.kind, d.index)
        if out and key == last:
            prev = out[-1]
            out[-1] = prev.model_copy(update={
                "text": prev.text + d.text,
                "call_id": prev.call_id or d.call_id,
                "tool_name": prev.tool_name or d.tool_name,
            })
            continue
        out.append(TaskEvent(
            kind="assistant_delta" if d.kind == "text" else "tool_args_delta",
            round=round, attempt=attempt, text=d.text, call_id=d.call_id, tool_name=d.tool_name,
        ))
        last = key
    return out


__all__ = ["DeltaPublisher", "SamplingDelta", "coalesce", "take_deltas"]
