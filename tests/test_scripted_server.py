"""The scripted provider server over real HTTP: order, wire formats, failures, records."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from stopline.testing.scripted import (
    ScriptedServer,
    anthropic_message,
    entry,
    load_scenario,
    openai_chat_completion,
    openai_response,
    scenario,
    serve,
)

WIRE_PATHS = {
    "anthropic": "/v1/messages",
    "openai-chat": "/v1/chat/completions",
    "openai-responses": "/v1/responses",
}


@pytest.fixture
def run() -> Iterator[Any]:
    """Start servers for a test; every one is stopped afterwards."""
    servers: list[ScriptedServer] = []

    def _run(scn: Any) -> ScriptedServer:
        servers.append(ScriptedServer(scn).start())
        return servers[-1]

    try:
        yield _run
    finally:
        for s in servers:
            s.stop()


def post(server: ScriptedServer, body: dict[str, Any] | None = None, **kw: Any) -> httpx.Response:
    return httpx.post(server.url + WIRE_PATHS[server.wire], json=body or {"model": "m"}, **kw)


def sse(resp: httpx.Response) -> list[tuple[str | None, str]]:
    """Parse an SSE body into (event, data) frames; checks the framing is exact."""
    assert resp.headers["content-type"] == "text/event-stream"
    assert "content-length" not in resp.headers
    frames = []
    for raw in resp.text.split("\n\n"):
        if not raw:
            continue
        event, data = None, []
        for line in raw.split("\n"):
            field, _, value = line.partition(": ")
            if field == "event":
                event = value
            else:
                assert field == "data", line
                data.append(value)
        frames.append((event, "\n".join(data)))
    assert resp.text.endswith("\n\n")
    return frames


def data_of(frames: list[tuple[str | None, str]]) -> list[dict[str, Any]]:
    return [json.loads(d) for _, d in frames if d != "[DONE]"]


# ---------------------------------------------------------------------------


def test_responses_in_order_with_repeat_then_exhausted(run: Any) -> None:
    a, b = anthropic_message("first"), anthropic_message("second")
    server = run(scenario("anthropic", entry(a, repeat=2), entry(b)))
    bodies = [post(server).json() for _ in range(3)]
    assert bodies == [a, a, b]
    exhausted = httpx.post(server.url + "/messages", json={})
    assert exhausted.status_code == 400
    message = "scripted scenario exhausted after 3 responses"
    assert exhausted.json() == {"type": "error", "error": {"type": "invalid_request_error", "message": message}}
    assert [r["response_index"] for r in server.requests()] == [0, 0, 1, None]
    assert server.request_count() == 4


def test_any_post_path_consumes(run: Any) -> None:
    bodies = [openai_chat_completion(str(i)) for i in range(6)]
    server = run(scenario("openai-chat", *map(entry, bodies)))
    paths = ["/v1/messages", "/messages", "/v1/chat/completions", "/chat/completions"]
    paths += ["/v1/responses", "/responses"]
    assert [httpx.post(server.url + p, json={}).json() for p in paths] == bodies
    assert [r["path"] for r in server.requests()] == paths


def test_concurrent_posts_each_get_a_distinct_entry(run: Any) -> None:
    server = run(scenario("openai-responses", *(entry(openai_response(str(i))) for i in range(20))))
    got: list[str] = []
    lock = threading.Lock()

    def worker() -> None:
        body = post(server).json()
        with lock:
            got.append(body["output"][0]["content"][0]["text"])

    threads = [threading.Thread(target=worker) for _ in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(got, key=int) == [str(i) for i in range(20)]
    assert sorted(r["response_index"] for r in server.requests()) == list(range(20))


@pytest.mark.parametrize(
    ("wire", "body"),
    [
        ("anthropic", anthropic_message("hi", [("t1", "shell", {"cmd": "ls"})])),
        ("openai-chat", openai_chat_completion("hi", [("c1", "shell", {"cmd": "ls"})])),
        ("openai-responses", openai_response("hi", [("c1", "shell", {"cmd": "ls"})])),
    ],
)
def test_non_streaming_is_plain_json(run: Any, wire: str, body: dict[str, Any]) -> None:
    server = run(scenario(wire, entry(body)))
    resp = post(server, {"model": "m", "stream": False})
    assert resp.status_code == 200
    assert resp.headers["content-type"] == "application/json"
    assert resp.json() == body
    assert server.requests()[0]["stream"] is False


def test_anthropic_sse_matches_body(run: Any) -> None:
    text = "Let me look at the files in the workspace."
    calls = [("toolu_1", "shell", {"cmd": "ls -la", "n": 3}), ("toolu_2", "read", {"path": "a/b.py"})]
    body = anthropic_message(text, calls, stop_details={"category": "x"})
    server = run(scenario("anthropic", entry(body)))
    frames = sse(post(server, {"model": "m", "stream": True}))
    events = [e for e, _ in frames]
    datas = data_of(frames)
    assert all(d["type"] == e for e, d in zip(events, datas, strict=True))
    assert events[:2] == ["message_start", "ping"] and events[-2:] == ["message_delta", "message_stop"]
    assert datas[0]["message"]["content"] == [] and datas[0]["message"]["id"] == body["id"]
    blocks: dict[int, dict[str, Any]] = {}
    for d in datas:
        if d["type"] == "content_block_start":
            blocks[d["index"]] = {"start": d["content_block"], "parts": [], "stopped": False}
        elif d["type"] == "content_block_delta":
            delta = d["delta"]
            blocks[d["index"]]["parts"].append(delta.get("text", delta.get("partial_json")))
        elif d["type"] == "content_block_stop":
            blocks[d["index"]]["stopped"] = True
    assert list(blocks) == [0, 1, 2] and all(b["stopped"] for b in blocks.values())
    assert blocks[0]["start"] == {"type": "text", "text": ""}
    assert len(blocks[0]["parts"]) > 1 and "".join(blocks[0]["parts"]) == text
    for i, (cid, name, args) in enumerate(calls, start=1):
        assert blocks[i]["start"] == {"type": "tool_use", "id": cid, "name": name, "input": {}}
        assert len(blocks[i]["parts"]) > 1 and json.loads("".join(blocks[i]["parts"])) == args
    delta = datas[-2]
    expected = {"stop_reason": "tool_use", "stop_sequence": None, "stop_details": {"category": "x"}}
    assert delta["delta"] == expected
    assert delta["usage"] == body["usage"]


def test_openai_chat_sse_matches_body(run: Any) -> None:
    calls = [("call_a", "shell", {"cmd": "pwd"}), ("call_b", "read", {"path": "x.txt"})]
    body = openai_chat_completion("Running two tools now.", calls)
    server = run(scenario("openai-chat", entry(body)))
    frames = sse(post(server, {"model": "m", "stream": True}))
    assert all(e is None for e, _ in frames) and frames[-1][1] == "[DONE]"
    chunks = data_of(frames)
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == body["id"] for c in chunks)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0]["role"] == "assistant"
    assert "".join(d.get("content") or "" for d in deltas) == body["choices"][0]["message"]["content"]
    args: dict[int, str] = {}
    heads = []
    for d in deltas:
        for tc in d.get("tool_calls", []):
            if "id" in tc:
                heads.append(tc)
                assert tc["function"]["arguments"] == ""
            args[tc["index"]] = args.get(tc["index"], "") + tc["function"]["arguments"]
    assert [(h["index"], h["id"], h["type"], h["function"]["name"]) for h in heads] == [
        (0, "call_a", "function", "shell"),
        (1, "call_b", "function", "read"),
    ]
    assert [json.loads(args[i]) for i in (0, 1)] == [c[2] for c in calls]
    finishes = [c["choices"][0]["finish_reason"] for c in chunks]
    assert finishes[-1] == "tool_calls" and set(finishes[:-1]) == {None}
    assert "usage" not in chunks[-1]


def test_openai_chat_sse_refusal_and_usage_chunk(run: Any) -> None:
    body = openai_chat_completion(refusal="I can't help with that request.")
    assert body["choices"][0]["message"]["content"] is None
    server = run(scenario("openai-chat", entry(body)))
    resp = post(server, {"model": "m", "stream": True, "stream_options": {"include_usage": True}})
    chunks = data_of(sse(resp))
    refusal = "".join(c["choices"][0]["delta"].get("refusal") or "" for c in chunks if c["choices"])
    assert refusal == "I can't help with that request."
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == body["usage"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"


def test_openai_responses_sse_matches_body(run: Any) -> None:
    body = openai_response("All done, here is the summary.", [("call_9", "shell", {"cmd": "make test"})])
    server = run(scenario("openai-responses", entry(body)))
    frames = sse(post(server, {"model": "m", "stream": True}))
    events = [e for e, _ in frames]
    datas = data_of(frames)
    assert all(d["type"] == e for e, d in zip(events, datas, strict=True))
    assert [d["sequence_number"] for d in datas] == list(range(len(datas)))
    assert events[0] == "response.created" and datas[0]["response"]["status"] == "in_progress"
    assert events[-1] == "response.completed" and datas[-1]["response"] == body
    assert events.count("response.output_item.added") == events.count("response.output_item.done") == 2
    text = "".join(d["delta"] for d in datas if d["type"] == "response.output_text.delta")
    assert text == "All done, here is the summary."
    fargs = "".join(d["delta"] for d in datas if d["type"] == "response.function_call_arguments.delta")
    assert json.loads(fargs) == {"cmd": "make test"}
    added = [d for d in datas if d["type"] == "response.output_item.added"]
    added_fc = added[1]
    assert added_fc["item"]["call_id"] == "call_9" and added_fc["item"]["arguments"] == ""
    assert [d["item"] for d in datas if d["type"] == "response.output_item.done"] == body["output"]


@pytest.mark.parametrize(
    ("status", "terminal"), [("incomplete", "response.incomplete"), ("failed", "response.failed")]
)
def test_openai_responses_sse_terminal_event(run: Any, status: str, terminal: str) -> None:
    body = openai_response("partial", status=status, refusal="no" if status == "failed" else None)
    server = run(scenario("openai-responses", entry(body)))
    frames = sse(post(server, {"model": "m", "stream": True}))
    assert frames[-1][0] == terminal and json.loads(frames[-1][1])["response"] == body
    if status == "incomplete":
        assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    else:
        refusal = "".join(d["delta"] for d in data_of(frames) if d["type"] == "response.refusal.delta")
        assert refusal == "no"


def test_status_and_headers_served_even_when_streaming(run: Any) -> None:
    err = {"type": "error", "error": {"type": "rate_limit_error", "message": "slow down"}}
    ok = anthropic_message("ok")
    server = run(scenario("anthropic", entry(err, status=429, headers={"retry-after": "2"}), entry(ok)))
    resp = post(server, {"model": "m", "stream": True})
    assert resp.status_code == 429 and resp.headers["retry-after"] == "2" and resp.json() == err
    assert post(server).json() == ok


def test_delay_is_honoured(run: Any) -> None:
    server = run(scenario("anthropic", entry(anthropic_message("late"), delay_s=0.4)))
    t0 = time.monotonic()
    assert post(server).json()["content"][0]["text"] == "late"
    assert time.monotonic() - t0 >= 0.4
    assert server.requests()[0]["disconnected"] is False


def test_disconnect_during_delay_is_recorded(run: Any) -> None:
    held, nxt = entry(anthropic_message("never"), delay_s=30), entry(anthropic_message("next"))
    server = run(scenario("anthropic", held, nxt))
    t0 = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):
        post(server, timeout=0.3)
    deadline = time.monotonic() + 5
    while not server.requests()[0]["disconnected"]:
        assert time.monotonic() < deadline, "disconnect not noticed"
        time.sleep(0.02)
    assert time.monotonic() - t0 < 5
    assert post(server).json()["content"][0]["text"] == "next"


def test_break_after_events_cuts_generated_stream(run: Any) -> None:
    server = run(scenario("anthropic", entry(anthropic_message("hello there"), break_after_events=3)))
    frames = sse(post(server, {"model": "m", "stream": True}))
    assert [e for e, _ in frames] == ["message_start", "ping", "content_block_start"]


def test_stream_events_sent_verbatim_and_break(run: Any) -> None:
    events = [
        {"event": "message_start", "data": {"type": "message_start", "message": {"id": "m1"}}},
        {"event": None, "data": "raw text"},
        {"event": "error", "data": {"type": "error", "error": {"type": "overloaded_error"}}},
    ]
    whole, cut = entry(None, stream_events=events), entry(None, stream_events=events, break_after_events=1)
    server = run(scenario("anthropic", whole, cut))
    resp = post(server, {"model": "m", "stream": True})
    assert resp.text == (
        'event: message_start\ndata: {"type": "message_start", "message": {"id": "m1"}}\n\n'
        "data: raw text\n\n"
        'event: error\ndata: {"type": "error", "error": {"type": "overloaded_error"}}\n\n'
    )
    assert [e for e, _ in sse(post(server, {"model": "m", "stream": True}))] == ["message_start"]


def test_anthropic_sse_thinking_block(run: Any) -> None:
    thinking = {"type": "thinking", "thinking": "Consider the options carefully.", "signature": "sig=="}
    body = anthropic_message("answer")
    body["content"].insert(0, thinking)
    server = run(scenario("anthropic", entry(body)))
    datas = data_of(sse(post(server, {"model": "m", "stream": True})))
    deltas = [d["delta"] for d in datas if d["type"] == "content_block_delta" and d["index"] == 0]
    assert "".join(d.get("thinking", "") for d in deltas) == thinking["thinking"]
    assert deltas[-1] == {"type": "signature_delta", "signature": "sig=="}


def test_stream_events_only_entry_refuses_a_non_streaming_request(run: Any) -> None:
    server = run(scenario("anthropic", entry(None, stream_events=[{"event": "x", "data": {}}])))
    resp = post(server, {"model": "m"})
    assert resp.status_code == 500 and "only stream_events" in resp.json()["error"]["message"]


def test_event_delay_and_disconnect_mid_stream(run: Any) -> None:
    slow = entry(openai_chat_completion("a b c d e f g h i"), event_delay_s=0.2)
    server = run(scenario("openai-chat", slow))
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={"stream": True}) as resp:
        first = next(resp.iter_lines())
        assert first.startswith("data: ")
    deadline = time.monotonic() + 5
    while not server.requests()[0]["disconnected"]:
        assert time.monotonic() < deadline, "mid-stream disconnect not noticed"
        time.sleep(0.02)


def test_requests_endpoint_masks_auth_and_keeps_bodies(run: Any) -> None:
    server = run(scenario("openai-chat", entry(openai_chat_completion("x"), repeat=2)))
    httpx.post(
        server.url + "/v1/chat/completions",
        json={"model": "m", "stream": False, "messages": []},
        headers={"Authorization": "Bearer sk-secret", "x-api-key": "sk-ant-secret", "X-Trace": "t1"},
    )
    httpx.post(server.url + "/v1/chat/completions", content=b"not json")
    assert httpx.get(server.url + "/_health").json() == {"ok": True}
    records = httpx.get(server.url + "/_requests").json()
    assert records == server.requests()
    assert "sk-" not in json.dumps(records)
    first, second = records
    assert first["headers"]["authorization"] == "***" and first["headers"]["x-api-key"] == "***"
    assert first["headers"]["x-trace"] == "t1"
    assert first["body"] == {"model": "m", "stream": False, "messages": []}
    assert [first[k] for k in ("index", "method", "response_index", "stream")] == [0, "POST", 0, False]
    assert second["body"] == "not json" and second["index"] == 1
    assert abs(first["received_at"] - time.time()) < 60


def test_load_scenario_from_file_and_errors(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"wire": "openai-responses", "responses": [{"body": {"a": 1}}]}))
    loaded = load_scenario(path)
    assert loaded["responses"][0]["status"] == 200 and loaded["responses"][0]["repeat"] == 1
    assert load_scenario(str(path)) == loaded
    bad: list[tuple[Any, str]] = [
        ({"wire": "gemini", "responses": []}, "'wire' must be one of"),
        ({"wire": "anthropic", "responses": {}}, "'responses' must be a list"),
        ({"wire": "anthropic", "responses": [1]}, r"responses\[0\]: must be an object"),
        ({"wire": "anthropic", "responses": [{"status": 200}]}, "needs 'body'"),
        ({"wire": "anthropic", "responses": [{"body": {}, "repeat": 0}]}, "'repeat'"),
        ({"wire": "anthropic", "responses": [{"body": {}, "break_after_event": 2}]}, "unknown keys"),
        (tmp_path / "missing.json", "cannot load"),
    ]
    for scn, msg in bad:
        with pytest.raises(ValueError, match=msg):
            load_scenario(scn)
    (tmp_path / "bad.json").write_text("{nope")
    with pytest.raises(ValueError, match="cannot load"):
        ScriptedServer(tmp_path / "bad.json")


def test_builders_defaults() -> None:
    msg = anthropic_message(tool_calls=[("t", "n", {})])
    assert msg["content"] == [{"type": "tool_use", "id": "t", "name": "n", "input": {}}]
    assert msg["stop_reason"] == "tool_use" and anthropic_message("x")["stop_reason"] == "end_turn"
    chat = openai_chat_completion(tool_calls=[("c", "n", {"a": 1})])
    choice = chat["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "n", "arguments": '{"a": 1}'}
    resp = openai_response(tool_calls=[("c", "n", {})], status="incomplete", incomplete_reason="length")
    assert resp["output"][0]["type"] == "function_call" and resp["output"][0]["call_id"] == "c"
    assert resp["incomplete_details"] == {"reason": "length"}


def test_stop_is_idempotent_and_closes_port() -> None:
    server = ScriptedServer(scenario("anthropic"))
    server.stop()  # never started
    with ScriptedServer(scenario("anthropic")) as s:
        url = s.url
        assert httpx.get(url + "/_health").status_code == 200
    s.stop()
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/_health")


def test_stop_cuts_a_held_request() -> None:
    server = ScriptedServer(scenario("anthropic", entry(anthropic_message("x"), delay_s=30))).start()
    try:
        errors: list[Exception] = []

        def call() -> None:
            try:
                post(server, timeout=10)
            except Exception as exc:  # noqa: BLE001 - the test asserts on it
                errors.append(exc)

        t = threading.Thread(target=call)
        t.start()
        while server.request_count() == 0:
            time.sleep(0.01)
    finally:
        t0 = time.monotonic()
        server.stop()
    t.join(5)
    assert time.monotonic() - t0 < 3 and not t.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], httpx.RemoteProtocolError)


def test_serve_writes_ready_file_and_exits(tmp_path: Path) -> None:
    scn = tmp_path / "scn.json"
    scn.write_text(json.dumps(scenario("anthropic", entry(anthropic_message("from serve")))))
    ready = tmp_path / "port"
    stop = threading.Event()
    kwargs = {"host": "127.0.0.1", "port": 0, "ready_file": str(ready), "exit_when": stop.is_set}
    kwargs["poll_s"] = 0.05
    t = threading.Thread(target=serve, args=(str(scn),), kwargs=kwargs)
    t.start()
    try:
        deadline = time.monotonic() + 5
        while not ready.exists():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        url = f"http://127.0.0.1:{int(ready.read_text())}"
        assert httpx.post(url + "/v1/messages", json={}).json()["content"][0]["text"] == "from serve"
    finally:
        stop.set()
        t.join(5)
    assert not t.is_alive()
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/_health")
