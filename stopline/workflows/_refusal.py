"""The refusal path of a thread (seed 000; DESIGN §4).

A refusal is the provider's verdict, never an error: it goes to the
disposition matrix (:func:`stopline.core.refusal.disposition`) and either
samples again (a chat thread's quarantine, a fix task's candidate switch)
or stops where it landed, keeping the scene, with a persisted
``provider-refusal-stop`` row that every way back in checks.

Deterministic code only.
"""

from __future__ import annotations

from typing import Any

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from stopline.core import refusal
    from stopline.core.contracts import ModelCandidate, RefusalStop, SamplingResult
    from stopline.core.turn_state import Counters, End


class RefusalMixin:
    """Disposition, quarantine, candidate switch and the refusal stop."""

    _inp: Any
    _kind: str
    _n: Counters
    _candidates: list[ModelCandidate]
    _candidate: int
    _skipped: set[int]
    _reprobes: int
    _quarantine_used: int
    _unaccepted: list[int]
    _accepted_upto: int
    _sampled_upto: int
    _notified: bool
    _refusal_stop: RefusalStop | None
    _turn_text: str

    def _on_refusal(self, result: SamplingResult) -> End | None:
        """The refusal path, in the order seed 000 gives; ``None`` means sample again.

        1. Record: the verdict becomes a hidden ``refusal`` row (the trigger
           stays in the thread's own ledger, unquarantined, for audit) and a
           ``refusal`` event.
        2. Disposition: by thread kind (:func:`stopline.core.refusal.disposition`):
           a chat thread quarantines its unaccepted increments and retries
           the same provider, bounded; a fix task switches candidate or
           re-probes; a task stops. A refusal already persisted in this
           task's chain stops it whatever its kind (DESIGN §4, §7).
        3. Persist the stop: :meth:`_stop_refused` appends the
           ``provider-refusal-stop`` row — one :class:`RefusalStop` — that
           every way back in checks (the message validator, the sampling
           guard, a reset, a replay).
        4. End: ``stopped`` with ``refused``, the scene kept (no shell is
           closed); a chat thread adds one critical notification.
        """
        ref = result.refusal
        assert ref is not None
        # 1. record
        self._append(
            "refusal",
            model_visible=False,
            meta={"provider": ref.provider, "category": ref.category, "round": self._n.rounds,
                  "candidate": self._candidate, "persisted": result.raw_stop_reason == "persisted"},
        )
        self._publish("refusal", text=f"{ref.provider} {ref.category or ''}".strip())
        # 2. disposition
        if result.raw_stop_reason == "persisted":
            action = "stop"
        else:
            d = refusal.disposition(
                self._kind,
                unaccepted_increments=len(self._unaccepted),
                quarantine_retries_used=self._quarantine_used,
                quarantine_retries=self._inp.quarantine_retries,
                candidates=len(self._candidates),
                skipped=frozenset(self._skipped),
                current=self._candidate,
                reprobes_used=self._reprobes,
                reprobe_limit=self._inp.reprobe_limit,
            )
            action = d.action
        match action:
            case "quarantine_retry":
                if self._unaccepted:
                    self._append("quarantine", model_visible=False, meta={"seqs": list(self._unaccepted)})
                    self._unaccepted = []
                self._quarantine_used += 1
                return None
            case "switch_candidate" | "reprobe":
                self._skipped.add(self._candidate)
                if action == "reprobe":
                    self._reprobes += 1
                self._candidate = d.candidate or 0
                self._publish("fallback", text=self._candidates[self._candidate].model)
                return None
        # 3. persist the stop, 4. end
        end = self._stop_refused(result)
        if action == "stop_notify" and not self._notified:
            self._notified = True  # one critical notification per episode, not per message
            self._append(
                "notification",
                model_visible=False,
                text=(
                    f"critical: {ref.provider} refused this thread's request after "
                    f"{self._quarantine_used} quarantined retr"
                    f"{'y' if self._quarantine_used == 1 else 'ies'}. The thread is "
                    f"stopped; it will not switch model by itself. To recover, a "
                    f"person switches the model, or starts fresh in a new thread "
                    f"without the old history."
                ),
                meta={"severity": "critical"},
            )
            self._publish("notification", text="refusal: quarantine exhausted; needs a person")
        return end

    def _stop_refused(self, result: SamplingResult) -> End:
        """Persist the refusal stop and end where it landed (seed 000 §3, §5).

        The assistant's own text of the refused turn (already accepted by
        the provider) is kept; the stop is one :class:`RefusalStop`, both the
        workflow's state and the ``provider-refusal-stop`` row's meta.
        """
        ref = result.refusal
        assert ref is not None
        if result.text:
            self._append("assistant", text=result.text)
            self._n.final_text = result.text
            self._turn_text = result.text
        self._refusal_stop = RefusalStop(
            provider=ref.provider, category=ref.category, round=self._n.rounds, tool=self._n.last_tool,
        )
        self._append("provider-refusal-stop", model_visible=False, meta=self._refusal_stop.model_dump())
        category = f" ({ref.category})" if ref.category else ""
        return End("stopped", f"refused by {ref.provider}{category}", refused=True)

    def _accept_increments(self) -> None:
        """The provider accepted the request: its increments are accepted."""
        self._notified = False
        self._accepted_upto = self._sampled_upto
        self._unaccepted = [s for s in self._unaccepted if s > self._sampled_upto]

    def _refusal_info(self) -> RefusalStop | None:
        return self._refusal_stop
