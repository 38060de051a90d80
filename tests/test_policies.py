"""Pure policies, tested without Temporal: transcript building and validation,
tool-call triage of a sampling result, receipt texts (seed 002; DESIGN §3)."""

from __future__ import annotations

import pytest

from stopline.core import policies
from stopline.core.contracts import LedgerRow, SamplingResult, ToolCall, ToolResultPart


def _call(cid: str, name: str = "shell", args: dict | None = None, parse_error: str | None = None) -> ToolCall:
    return ToolCall(id=cid, name=name, arguments=args if parse_error is None else None,
                    raw_arguments="{}", parse_error=parse_error)


def _rows(*specs: tuple) -> list[LedgerRow]:
    rows = []
    for i, (kind, kw) in enumerate(specs, start=1):
        rows.append(LedgerRow(seq=i, kind=kind, **kw))
    return rows


def test_rows_to_messages_pairs_results_and_merges_user_side() -> None:
    rows = _rows(
        ("prompt", {"text": "fix it"}),
        ("assistant", {"text": "running", "tool_calls": [_call("a", args={}), _call("b", args={})]}),
        ("tool_result", {"call_id": "a", "text": "ok", "ok": True}),
        ("tool_result", {"call_id": "b", "text": "aborted by user after 0.1s", "ok": True}),
        ("turn_aborted", {"text": policies.turn_aborted_marker()}),
        ("provider-refusal-stop", {"model_visible": False, "text": "hidden"}),
        ("user_message", {"text": "go on"}),
    )
    msgs = policies.rows_to_messages(rows)
    assert [m.role for m in msgs] == ["user", "assistant", "user"]
    last = msgs[-1].parts
    assert [type(p).__name__ for p in last] == ["ToolResultPart", "ToolResultPart", "TextPart", "TextPart"]
    assert "hidden" not in str(msgs)
    policies.validate_conversation(msgs)


def test_validator_rejects_missing_and_duplicate_results() -> None:
    rows = _rows(
        ("prompt", {"text": "x"}),
        ("assistant", {"tool_calls": [_call("a", args={}), _call("b", args={})]}),
        ("tool_result", {"call_id": "a", "text": "ok", "ok": True}),
    )
    with pytest.raises(policies.ConversationInvalid, match="b .* 0 results"):
        policies.validate_conversation(policies.rows_to_messages(rows))
    rows.append(LedgerRow(seq=4, kind="tool_result", call_id="a", text="again", ok=True))
    rows.append(LedgerRow(seq=5, kind="tool_result", call_id="b", text="ok", ok=True))
    with pytest.raises(policies.ConversationInvalid, match="a .* 2 results"):
        policies.validate_conversation(policies.rows_to_messages(rows))


def test_validator_rejects_orphan_result_and_empty_assistant() -> None:
    from stopline.core.contracts import Message, TextPart

    orphan = [Message(role="user", parts=[ToolResultPart(call_id="zz", text="x")])]
    with pytest.raises(policies.ConversationInvalid):
        policies.validate_conversation(orphan)
    empty = [Message(role="user", parts=[TextPart(text="hi")]),
             Message(role="assistant", parts=[TextPart(text="  ")]),
             Message(role="user", parts=[TextPart(text="?")])]
    with pytest.raises(policies.ConversationInvalid, match="empty"):
        policies.validate_conversation(empty)


def test_rows_to_messages_never_stores_an_empty_assistant_message() -> None:
    rows = _rows(("prompt", {"text": "x"}), ("assistant", {"text": ""}), ("user_message", {"text": "y"}))
    msgs = policies.rows_to_messages(rows)
    assert all(m.role == "user" for m in msgs) and len(msgs) == 1


def test_validator_requires_ending_with_user() -> None:
    rows = _rows(("prompt", {"text": "x"}), ("assistant", {"text": "done"}))
    with pytest.raises(policies.ConversationInvalid, match="end with a user"):
        policies.validate_conversation(policies.rows_to_messages(rows))


def test_max_tokens_turn_runs_none_of_its_tools() -> None:
    result = SamplingResult(provider="p", model="m", stop_reason="max_tokens", raw_stop_reason="length",
                            tool_calls=[_call("a", args={"command": "ls"}), _call("b", args={})])
    blocked = policies.untriaged_calls(result)
    assert set(blocked) == {"a", "b"}
    assert all("token limit" in t and "truncated" in t for t in blocked.values())


def test_unparsable_arguments_block_the_whole_turn() -> None:
    result = SamplingResult(provider="p", model="m", stop_reason="tool_use",
                            tool_calls=[_call("a", args={}), _call("b", parse_error="Expecting ','")])
    blocked = policies.untriaged_calls(result)
    assert "Expecting ','" in blocked["b"] and "not a JSON object" in blocked["b"]
    assert "another call" in blocked["a"]


def test_a_call_whose_arguments_held_a_secret_does_not_run() -> None:
    """DESIGN §5: the workflow sees the key replaced; running the call would
    run it with the mask in its place."""
    masked = ToolCall(id="a", name="shell", arguments={"command": f"echo {policies.REDACTED} > k"},
                      raw_arguments=f'{{"command": "echo {policies.REDACTED} > k"}}')
    result = SamplingResult(provider="p", model="m", stop_reason="tool_use", tool_calls=[masked, _call("b", args={})])
    blocked = policies.untriaged_calls(result)
    assert list(blocked) == ["a"] and "held a secret value" in blocked["a"]
    assert not any(c in policies.REDACTED for c in "*?[]{}$`'\"<>|&;() ")  # inert in a shell


def test_clean_turn_runs_everything() -> None:
    result = SamplingResult(provider="p", model="m", stop_reason="tool_use", tool_calls=[_call("a", args={})])
    assert policies.untriaged_calls(result) == {}


def test_receipts_are_honest() -> None:
    call = _call("a", name="shell", args={})
    text = policies.aborted_receipt(call, 1.234, "partial line")
    assert text.startswith("aborted by user after 1.2s") and "partly run" in text and "partial line" in text
    assert "may have partly run" in policies.lost_receipt(call, "heartbeat timeout")
    marker = policies.turn_aborted_marker()
    assert "interrupted" in marker and "Background shells" in marker and "partly run" in marker


def test_cap_text_keeps_head_and_tail() -> None:
    text = "A" * 1000 + "B" * 1000
    capped = policies.cap_text(text, 200)
    assert capped.startswith("A" * 100) and capped.endswith("B" * 100) and "omitted" in capped
    assert policies.cap_text("short", 200) == "short"


def test_response_with_repeated_call_ids_is_an_engine_error() -> None:
    ok = SamplingResult(provider="p", model="m", tool_calls=[_call("a", args={}), _call("b", args={})])
    assert policies.response_shape_problem(ok) is None
    dup = SamplingResult(provider="p", model="m", tool_calls=[_call("a", args={}), _call("a", args={})])
    assert "repeat" in (policies.response_shape_problem(dup) or "")


def _calls(*names: str) -> list[ToolCall]:
    return [ToolCall(id=f"c{i}", name=n, arguments={}, raw_arguments="{}") for i, n in enumerate(names)]


def test_round_tool_calls_runs_all_host_calls_or_none() -> None:
    """The sampling activity runs a response's calls only when the workflow
    would run every one on the host, unchanged (DESIGN §1)."""
    host = SamplingResult(provider="p", model="m", tool_calls=_calls("shell", "read_file"), stop_reason="tool_use")
    assert [c.id for c in policies.round_tool_calls(host, set())] == ["c0", "c1"]
    # a sub-task tool runs in the workflow, a team's tool on its queue: none here
    assert policies.round_tool_calls(host.model_copy(update={"tool_calls": _calls("shell", "task_start")}), set()) == []
    assert policies.round_tool_calls(host, {"read_file"}) == []
    # a cut-off response runs nothing; nor does a malformed one, or a refusal
    cut = host.model_copy(update={"stop_reason": "max_tokens"})
    assert policies.untriaged_calls(cut) and policies.round_tool_calls(cut, set()) == []
    twice = host.model_copy(update={"tool_calls": _calls("shell") + _calls("shell")})
    assert policies.response_shape_problem(twice) and policies.round_tool_calls(twice, set()) == []
    assert policies.round_tool_calls(SamplingResult(provider="p", model="m"), set()) == []


def test_recorded_response_reads_only_a_recorded_round() -> None:
    details = {"attempt": 1, "requests": 1, policies.ROUND_TOOLS_DETAILS_KEY: {"provider": "p", "model": "m"}}
    assert policies.recorded_response([details]) == details
    assert policies.recorded_response([{"attempt": 1, "requests": 1}]) is None
    assert policies.recorded_response([]) is None and policies.recorded_response(None) is None
    assert policies.recorded_response(["not a dict"]) is None


def test_only_a_round_that_may_change_something_is_recorded_first() -> None:
    """A lost worker must never hide a call that may have changed something
    (DESIGN §5); a round of reads hides nothing and is spared the RPC."""
    assert policies.round_needs_record(_calls("list_dir", "read_file", "shell_status")) is False
    for writer in ("shell", "write_file", "apply_patch", "shell_kill"):
        assert policies.round_needs_record(_calls("list_dir", writer)) is True
