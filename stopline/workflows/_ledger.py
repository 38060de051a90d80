"""The thread's ledger as workflow state: appending rows, and getting them to
the host's JSONL file (DESIGN §3, §5).

Rows live here as workflow state; activities mirror them to the file. A row
whose bulky content an activity already staged on the host travels by
reference (``meta["staged"]``), so its content enters history once. Ledger
writes ride on the next sampling call; :meth:`LedgerMixin._flush` is for the
moments with none to ride on (an abort's marker, a task's end).

Deterministic code only.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.exceptions import ActivityError

from stopline.workflows._placement import HostLost
from stopline.workflows._state import FLUSH_RETRY, written_paths

with workflow.unsafe.imports_passed_through():
    from stopline.core.contracts import (
        LEDGER_FLUSH_ACTIVITY,
        LedgerFlushInput,
        LedgerRow,
        RespondToModel,
        RowKind,
        TaskEvent,
        ToolCall,
    )
    from stopline.core.policies import background_shell_id
    from stopline.core.turn_state import Counters


class LedgerMixin:
    """Ledger rows, pending-row shipping, flushes and event publishing."""

    _inp: Any
    _rows: list[LedgerRow]
    _next_seq: int
    _flushed_seq: int
    _staged: dict[int, str]
    _n: Counters
    _events: Any
    _inbox: list[str]
    _increments_inbox: list[tuple[str, str]]
    _unaccepted: list[int]
    _shells: dict[str, str]
    _host: Any
    # _host_queue, _host_bound, _host_gone, _why_host_gone, _mark_host_lost and
    # _lost_host_of come from PlacementMixin (stubs here would shadow them).

    async def _flush(
        self,
        *,
        kill_calls: list[str] | None = None,
        close_shells: bool = False,
        release: bool = False,
    ) -> None:
        """Append pending rows to the host's ledger file and fsync (one activity).

        Args:
            kill_calls: Calls whose process groups must be gone (SIGKILL).
            close_shells: Close the thread's background shells (a task that
                completed normally).
            release: End the thread's host session on the host (it is done
                with the host; frees its capacity slot at once).

        Raises:
            HostLost: The host is gone (the flush was never picked up, or the
                host's session ended while waiting); the rows stay pending and
                ride on the next activity, on the next host.
            ActivityError: The flush itself failed (a ledger the host cannot
                repair); the caller ends the thread with the reason.
        """
        pending = self._pending_rows()
        if not pending and not kill_calls and not close_shells and not release:
            return
        handle = workflow.start_activity(
            LEDGER_FLUSH_ACTIVITY,
            LedgerFlushInput(
                task_id=workflow.info().workflow_id,
                rows=pending,
                kill_calls=kill_calls or [],
                close_shells=close_shells,
                release_session=release,
            ),
            result_type=int,
            task_queue=self._host_queue(),
            **self._host_bound(),
            start_to_close_timeout=timedelta(seconds=30),
            retry_policy=FLUSH_RETRY,
            summary="ledger flush",
        )
        await workflow.wait_condition(lambda: handle.done() or self._host_gone_now())
        if not handle.done():
            raise HostLost(self._why_host_gone())
        try:
            last = handle.result()
        except ActivityError as err:
            if self._lost_host_of(err):
                self._mark_host_lost("a ledger write on it was never picked up")
                raise HostLost(self._why_host_gone()) from None
            raise
        self._flushed_seq = max(self._flushed_seq, last)

    def _append(self, kind: RowKind, *, model_visible: bool = True, **fields: Any) -> LedgerRow:
        row = LedgerRow(
            seq=self._next_seq,
            kind=kind,
            round=self._n.rounds,
            model_visible=model_visible,
            at=workflow.now(),
            **fields,
        )
        self._next_seq += 1
        self._rows.append(row)
        return row

    def _append_tool_result(self, call: ToolCall, outcome: RespondToModel, *, staged: bool = False) -> None:
        """Append a tool result row.

        ``staged``: the text is exactly what the tool activity returned (and
        staged on the host), so the row travels to the ledger file by
        reference, not again as content (DESIGN §5). Sub-task tools run in
        the workflow, and the team's own tools on their own task queue: they
        stage nothing.
        """
        meta: dict[str, Any] = {"elapsed_s": round(outcome.elapsed_s, 3)}
        if outcome.aborted:
            meta["aborted"] = True
        if outcome.output_ref:
            meta["output_ref"] = outcome.output_ref
        row = self._append(
            "tool_result",
            text=outcome.text,
            call_id=call.id,
            tool_name=call.name,
            ok=outcome.ok,
            meta=meta,
        )
        if staged and self._runs_on_host(call):  # only the host's tools stage their text
            self._staged[row.seq] = f"call-{call.id}"
        if (call.name == "shell" and outcome.ok and not outcome.aborted and self._host is not None
                and (call.arguments or {}).get("background") is True):
            # remember where it runs: a lost host takes its shells with it
            self._shells[background_shell_id(workflow.info().workflow_id, call.id)] = self._host.host_id
        if outcome.unconfined_reason:
            # the audit trail of a command run outside the sandbox (DESIGN §2)
            self._append(
                "system", model_visible=False, call_id=call.id, tool_name=call.name,
                text=f"{call.name} {call.id} ran unconfined (no sandbox): {outcome.unconfined_reason}",
                meta={"unconfined": True},
            )
        self._n.last_tool_outcome = outcome.text
        if outcome.ok and call.name in ("write_file", "apply_patch") and call.arguments:
            self._n.changed_paths.extend(written_paths(call))
        self._publish(
            "tool_call_finished", call_id=call.id, tool_name=call.name, ok=outcome.ok,
            text=outcome.text[:200],
        )

    def _pending_rows(self) -> list[LedgerRow]:
        """Rows not yet in the ledger file, as the flushing activity gets them:
        a staged row without its content (the host has it), the rest whole."""
        self._staged = {k: v for k, v in self._staged.items() if k > self._flushed_seq}
        out = []
        for r in self._rows:
            if r.seq <= self._flushed_seq:
                continue
            key = self._staged.get(r.seq)
            if key is None:
                out.append(r)
            else:
                out.append(r.model_copy(update={
                    "text": None, "tool_calls": [], "meta": {**r.meta, "staged": key},
                }))
        return out

    def _drain_inbox(self) -> None:
        for kind, text in self._increments_inbox:
            row = self._append("increment", text=text, meta={"increment": True, "source": kind})
            self._unaccepted.append(row.seq)
        self._increments_inbox.clear()
        for text in self._inbox:
            self._append("user_message", text=text)
        self._inbox.clear()

    def _publish(self, kind: str, **fields: Any) -> None:
        self._events.publish(
            TaskEvent(kind=kind, round=self._n.rounds, last_seq=self._flushed_seq, **fields)  # type: ignore[arg-type]
        )
