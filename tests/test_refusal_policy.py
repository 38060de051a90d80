"""Refusal policies without Temporal (seed 000 §2–§4): thread kinds, the
disposition matrix, receipts and stop evidence that carry no trigger."""

from __future__ import annotations

import json

import pytest

from stopline.core import refusal
from stopline.core.refusal import Disposition, RefusalStop, disposition, thread_kind

TRIGGER = "TRIGGER-7731-exploit-payload"


@pytest.mark.parametrize(
    ("route", "scope", "source", "kind"),
    [
        ("subagent", "thread", "cli", "task"),
        ("subagent", "worker", "cli", "task"),
        ("chat", "worker", "cli", "task"),  # worker scope on a chat route is a task
        ("chat", "thread", "chat", "chat"),
        ("chat", "thread", "fix:ci", "fix"),
        ("subagent", "worker", "fix:lint", "fix"),
    ],
)
def test_thread_kind(route: str, scope: str, source: str, kind: str) -> None:
    assert thread_kind(route, scope, source) == kind


def test_task_stops_at_once_even_with_increments() -> None:
    d = disposition("task", unaccepted_increments=3, quarantine_retries_used=0, quarantine_retries=3)
    assert d == Disposition("stop")


def test_chat_quarantines_then_retries_then_stops_with_notification() -> None:
    used, actions = 0, []
    unaccepted = 1
    while True:
        d = disposition("chat", unaccepted_increments=unaccepted, quarantine_retries_used=used,
                        quarantine_retries=3, candidates=2)
        actions.append(d.action)
        if d.action != "quarantine_retry":
            break
        unaccepted, used = 0, used + 1
    assert actions == ["quarantine_retry"] * 3 + ["stop_notify"]  # 4 provider hits in all
    # never another model, whatever the candidates
    assert all(a not in ("switch_candidate", "reprobe") for a in actions)


def test_chat_without_increments_stops_at_once() -> None:
    d = disposition("chat", unaccepted_increments=0, quarantine_retries_used=0, quarantine_retries=3)
    assert d.action == "stop_notify"


def test_fix_task_switches_then_reprobes_then_freezes() -> None:
    kw = dict(unaccepted_increments=0, quarantine_retries_used=0, quarantine_retries=3, candidates=2)
    first = disposition("fix", current=0, **kw)
    assert first == Disposition("switch_candidate", candidate=1)
    second = disposition("fix", current=1, skipped=frozenset({0}), **kw)
    assert second == Disposition("reprobe", candidate=0)
    third = disposition("fix", current=0, skipped=frozenset({0, 1}), reprobes_used=1, **kw)
    assert third.action == "freeze"


def test_fix_task_quarantines_first_when_it_can() -> None:
    d = disposition("fix", unaccepted_increments=1, quarantine_retries_used=0, quarantine_retries=2,
                    candidates=2)
    assert d == Disposition("quarantine_retry", candidate=0)


def test_receipt_says_where_not_why() -> None:
    stop = RefusalStop(provider="anthropic", category="cyber", round=3, tool="read_file")
    text = refusal.refusal_receipt(stop, "I looked at the config.")
    assert "anthropic" in text and "cyber" in text and "round 3" in text and "read_file" in text
    assert refusal.NOT_CONTINUABLE in text and "I looked at the config." in text
    assert "history" not in text.lower()  # no pointer to read the full (trigger) history


def test_stop_evidence_is_stripped_for_a_refused_task() -> None:
    kw = dict(last_message="working on it", last_tool="shell",
              last_tool_args=f'{{"command": "cat {TRIGGER}"}}\nsecond line',
              last_tool_outcome=f"{TRIGGER} output", changed_paths=[f"/ws/{TRIGGER}.txt"])
    normal = refusal.stop_evidence(refused=False, **kw)
    assert TRIGGER in json.dumps(normal) and normal["changed_paths"]
    assert normal["last_tool"]["args_firstline"] == f'{{"command": "cat {TRIGGER}"}}'  # not JSON: raw
    stripped = refusal.stop_evidence(refused=True, **kw)
    assert TRIGGER not in json.dumps(stripped)
    assert stripped["last_tool"] == {"tool": "shell", "args_firstline": refusal.NOT_FORWARDED,
                                     "outcome": refusal.NOT_FORWARDED_SHORT}
    assert stripped["changed_paths"] == [] and stripped["last_message"] == "working on it"


def test_stop_evidence_shows_the_arguments_first_line_decoded() -> None:
    """JSON escapes a newline: the raw first line would be the whole call."""
    show = refusal.arguments_first_line
    assert show(json.dumps({"command": "sleep 1 # first\necho second"})) == "command=sleep 1 # first"
    assert show(json.dumps({"path": "a.txt", "content": "one\ntwo"})) == "path=a.txt content=one"
    assert show(json.dumps({"n": 3, "flags": ["a"], "s": "é"})) == 'n=3 flags=["a"] s=é'
    assert show('{"command": "cut') == '{"command": "cut'  # unparsable: as sent
    assert show("[1, 2]") == "[1, 2]" and show("") == "" and show(None) == ""
    assert len(show(json.dumps({"command": "x" * 500}))) == refusal.ARGS_FIRSTLINE_CHARS


def test_delivery_status_of_a_stopped_task_is_cancelled() -> None:
    assert refusal.delivery_status("stopped") == "cancelled"
    assert refusal.delivery_status("completed") == "delivered"
