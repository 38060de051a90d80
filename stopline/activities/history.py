"""Temporal history as the ledger's truth (DESIGN §5, §7).

Every ledger row enters workflow history exactly once: as part of an
activity's input (the pending rows a sampling call or a flush carries), or —
for a row whose bulky content an activity staged on its host — as that
activity's result (the tool's outcome, the model's message), or, when a task
ended with no host to write to, in the workflow's result. So any machine that
can read the history can rebuild the transcript: a host that never held the
task, a host whose home was deleted, ``stopline transcript`` on a laptop.
The JSONL file on a host is a cache of this, rebuilt on demand.

Also here: the refusal guard that no disk can lose. A task whose chain of
runs (continue-as-new, and runs a reset made — they share
``first_execution_run_id``) holds a refusal stop is answered with that
refusal, whatever the host's ledger file holds (DESIGN §4).

What it must never do: invent a row, or reorder rows; it only reads what the
workflow recorded.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from stopline.core.contracts import (
    LEDGER_FLUSH_ACTIVITY,
    SAMPLE_ACTIVITY,
    TOOL_ACTIVITY,
    AgentTaskResult,
    LedgerFlushInput,
    LedgerRow,
    RefusalStop,
    RespondToModel,
    SampleInput,
    SamplingResult,
    ToolCall,
    ToolCallInput,
    ToolOutcome,
)
from stopline.core.search_attributes import literal

#: A task's run chain: (workflow id, run id) -> refusal in another run, or None.
_guard_cache: dict[tuple[str, str], RefusalStop | None] = {}


async def _decode(client: Any, payloads: Any, type_hint: Any) -> Any:
    values = await client.data_converter.decode(list(payloads.payloads), [type_hint])
    return values[0]


async def run_chain(client: Any, workflow_id: str, run_id: str | None) -> list[Any]:
    """The histories of a run and the runs it continued from, oldest first.

    A run a reset made starts with a copy of its base run's events up to the
    reset point, so the chain of a reset run is its own branch only.

    Args:
        client: A connected client (with the deployment's data converter).
        workflow_id: The task id.
        run_id: A run id; ``None`` for the latest run.

    Returns:
        ``temporalio.client.WorkflowHistory`` objects, oldest run first.
    """
    histories = []
    rid = run_id
    seen: set[str] = set()
    while True:
        history = await client.get_workflow_handle(workflow_id, run_id=rid).fetch_history()
        histories.append(history)
        start = history.events[0].workflow_execution_started_event_attributes
        rid = start.continued_execution_run_id
        if not rid or rid in seen:
            break
        seen.add(rid)
    return list(reversed(histories))


async def rows_from_history(
    client: Any, workflow_id: str, run_id: str | None = None, pending: Sequence[LedgerRow] = ()
) -> list[LedgerRow]:
    """Rebuild a task's ledger rows, in seq order, from its history.

    Args:
        client: A connected client (its data converter decodes — and, with
            ``STOPLINE_CODEC_KEY``, decrypts — the payloads).
        workflow_id: The task id.
        run_id: The run whose branch to rebuild; ``None`` for the latest.
        pending: A running task's own rows (its ``ledger`` Query): those it
            decided but no activity has carried yet — e.g. the model's
            message while its tool calls run — are added, their staged
            content filled from history like the others.

    Returns:
        The rows as the ledger file holds them: staged rows filled in from
        the activity results that carried their content.

    Raises:
        LedgerCorrupt: A staged row whose content no result in the history
            carries.
    """
    from stopline.activities.ledger import LedgerCorrupt

    rows: dict[int, LedgerRow] = {}
    content: dict[str, dict[str, Any]] = {}
    for history in await run_chain(client, workflow_id, run_id):
        scheduled: dict[int, str] = {}
        for event in history.events:
            if event.HasField("activity_task_scheduled_event_attributes"):
                attrs = event.activity_task_scheduled_event_attributes
                name = attrs.activity_type.name
                if name == SAMPLE_ACTIVITY:
                    inp = await _decode(client, attrs.input, SampleInput)
                    scheduled[event.event_id] = f"round-{inp.round}"
                    batch = inp.pending_rows
                elif name == LEDGER_FLUSH_ACTIVITY:
                    batch = (await _decode(client, attrs.input, LedgerFlushInput)).rows
                elif name == TOOL_ACTIVITY:
                    call = (await _decode(client, attrs.input, ToolCallInput)).call
                    scheduled[event.event_id] = f"call-{call.id}"
                    batch = []
                else:
                    batch = []
                for row in batch:
                    rows.setdefault(row.seq, row)
            elif event.HasField("activity_task_completed_event_attributes"):
                attrs = event.activity_task_completed_event_attributes
                key = scheduled.get(attrs.scheduled_event_id)
                if key is None or not attrs.result.payloads:
                    continue
                if key.startswith("round-"):
                    res: SamplingResult = await _decode(client, attrs.result, SamplingResult)
                    content[key] = {
                        "text": res.text,
                        "tool_calls": [c.model_dump() for c in res.tool_calls],
                    }
                    for call_id, ran in (res.tool_outcomes or {}).items():  # round tools (DESIGN §1)
                        if isinstance(ran, RespondToModel):
                            content[f"call-{call_id}"] = {"text": ran.text}
                else:
                    outcome = await _decode(client, attrs.result, ToolOutcome)
                    if isinstance(outcome, RespondToModel):
                        content[key] = {"text": outcome.text}
            elif event.HasField("workflow_execution_completed_event_attributes"):
                attrs = event.workflow_execution_completed_event_attributes
                if attrs.result.payloads:
                    try:
                        result = await _decode(client, attrs.result, AgentTaskResult)
                    except Exception:  # not a stopline result (another workflow type)
                        continue
                    for row in result.unflushed_rows:
                        rows.setdefault(row.seq, row)
    for row in pending:
        rows.setdefault(row.seq, row)
    out = []
    for seq in sorted(rows):
        row = rows[seq]
        key = row.meta.get("staged")
        if key:
            found = content.get(str(key))
            if found is None:
                raise LedgerCorrupt(
                    f"row {seq} of {workflow_id}: no activity result in its history carries "
                    f"its content ({key})"
                )
            meta = {k: v for k, v in row.meta.items() if k != "staged"}
            update: dict[str, Any] = {"text": found.get("text"), "meta": meta}
            if "tool_calls" in found:
                update["tool_calls"] = [ToolCall.model_validate(c) for c in found["tool_calls"]]
            row = row.model_copy(update=update)
        out.append(row)
    return out


async def chain_refusal(client: Any, workflow_id: str, run_id: str, chain_id: str) -> RefusalStop | None:
    """A refusal stop recorded in another run of this task's chain, if any.

    The runs of one chain share ``first_execution_run_id`` (continue-as-new
    and resets keep it; a new task reusing the id gets its own). A run that
    stopped refused upserted ``StoplineRefused = true`` (DESIGN §4), so one
    visibility query finds the candidates; each is confirmed from its own
    history (its first event names its chain; its result, the refusal).
    Other runs are closed and cannot change, so the answer is cached for the
    life of this process, per run.

    Args:
        client: A connected client.
        workflow_id: The task id.
        run_id: The asking run (its own refusals are its workflow state).
        chain_id: Its ``first_execution_run_id``.

    Returns:
        Where the earlier run stopped (provider, category, round, tool), or
        ``None``.
    """
    key = (workflow_id, run_id)
    if key in _guard_cache:
        return _guard_cache[key]
    found: RefusalStop | None = None
    query = f"WorkflowId = {literal(workflow_id)} AND StoplineRefused = true"
    async for wf in client.list_workflows(query):
        if wf.run_id == run_id:
            continue
        handle = client.get_workflow_handle(workflow_id, run_id=wf.run_id)
        history = await handle.fetch_history()
        start = history.events[0].workflow_execution_started_event_attributes
        if chain_id and start.first_execution_run_id != chain_id:
            continue  # another task that reused the id
        last = history.events[-1]
        if last.HasField("workflow_execution_completed_event_attributes"):
            payloads = last.workflow_execution_completed_event_attributes.result
            if payloads.payloads:
                result = await _decode(client, payloads, AgentTaskResult)
                if result.refused:
                    found = result.refusal or RefusalStop(provider="unknown")
                    break
        # a run terminated by the reset while refused-but-not-finished:
        # StoplineRefused is only set at the stop itself, so it is one
        found = RefusalStop(provider="unknown")
        break
    _guard_cache[key] = found
    return found
