"""A scripted LLM provider over real HTTP: replays a scenario, decides nothing.

Tests, the demo and the benchmarks need a "model" that answers without
network access, yet they must exercise the real provider adapters: real
sockets, real status codes and headers, real SSE framing, real broken streams
and real client timeouts. :class:`ScriptedServer` is that model. It serves a
scenario's recorded responses *in order*, in the wire format the scenario
names, and records every request it receives so a test can assert what the
client sent. It never inspects a request to choose an answer: entry ``k`` is
the answer to the ``k``-th POST, whatever was asked.

Scenario (a dict, or a JSON file holding one)::

    {"wire": "anthropic" | "openai-chat" | "openai-responses",
     "responses": [
       {"body": {...non-streaming provider JSON...},   # required unless stream_events
        "status": 200, "headers": {}, "delay_s": 0, "repeat": 1,
        "stream_events": [{"event": "name" | None, "data": <json or str>}],
        "break_after_events": None,     # streaming: cut the stream after N frames
        "event_delay_s": 0}             # streaming: pause between frames
     ]}

A streamed 200 answer is derived from ``body`` exactly as the real provider
streams it (see ``_anthropic_events`` / ``_chat_events`` /
``_responses_events``), unless ``stream_events`` gives the frames verbatim.
"""

from __future__ import annotations

import copy
import json
import math
import os
import pathlib
import select
import signal
import socket
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

WIRES = ("anthropic", "openai-chat", "openai-responses")
_DEFAULTS: dict[str, Any] = {"status": 200, "headers": {}, "delay_s": 0, "repeat": 1}
_DEFAULTS.update(break_after_events=None, event_delay_s=0)
_ENTRY_KEYS = {*_DEFAULTS, "body", "stream_events"}
_MASKED_HEADERS = {"authorization", "x-api-key"}
_PIECES = 3  # how many chunks a streamed text / JSON string is split into

SSEFrame = tuple[str | None, str]  # (event name or None, data line(s))


# ---------------------------------------------------------------------------
# Scenario loading and builders
# ---------------------------------------------------------------------------


def load_scenario(path_or_dict: dict[str, Any] | str | pathlib.Path) -> dict[str, Any]:
    """Load and validate a scenario.

    Args:
        path_or_dict: A scenario dict, or the path of a JSON file holding one.

    Returns:
        A validated deep copy with every entry's defaults filled in
        (``status`` 200, ``headers`` {}, ``delay_s`` 0, ``repeat`` 1,
        ``break_after_events`` None, ``event_delay_s`` 0).

    Raises:
        ValueError: The file is unreadable or not JSON, ``wire`` is not one of
            :data:`WIRES`, ``responses`` is not a list, or an entry is malformed.
    """
    if isinstance(path_or_dict, dict):
        raw: Any = copy.deepcopy(path_or_dict)
        where = "scenario"
    else:
        where = f"scenario file {str(path_or_dict)!r}"
        try:
            raw = json.loads(pathlib.Path(path_or_dict).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"{where}: cannot load: {exc}") from exc
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: must be a JSON object, got {type(raw).__name__}")
    if raw.get("wire") not in WIRES:
        raise ValueError(f"{where}: 'wire' must be one of {', '.join(WIRES)}; got {raw.get('wire')!r}")
    responses = raw.get("responses")
    if not isinstance(responses, list):
        raise ValueError(f"{where}: 'responses' must be a list; got {type(responses).__name__}")
    raw["responses"] = [_check_entry(e, f"{where}: responses[{i}]") for i, e in enumerate(responses)]
    return raw


def _check_entry(e: Any, where: str) -> dict[str, Any]:
    if not isinstance(e, dict):
        raise ValueError(f"{where}: must be an object, got {type(e).__name__}")
    unknown = set(e) - _ENTRY_KEYS
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)} (allowed: {sorted(_ENTRY_KEYS)})")
    out = {**copy.deepcopy(_DEFAULTS), **e}
    if "body" not in out and "stream_events" not in out:
        raise ValueError(f"{where}: needs 'body' (or 'stream_events')")
    if not isinstance(out["status"], int) or not 100 <= out["status"] <= 599:
        raise ValueError(f"{where}: 'status' must be an HTTP status code; got {out['status']!r}")
    if not isinstance(out["headers"], dict):
        raise ValueError(f"{where}: 'headers' must be an object")
    for key in ("delay_s", "event_delay_s"):
        if not isinstance(out[key], (int, float)) or out[key] < 0:
            raise ValueError(f"{where}: {key!r} must be a number >= 0; got {out[key]!r}")
    if not isinstance(out["repeat"], int) or out["repeat"] < 1:
        raise ValueError(f"{where}: 'repeat' must be an integer >= 1; got {out['repeat']!r}")
    brk = out["break_after_events"]
    if brk is not None and (not isinstance(brk, int) or brk < 0):
        raise ValueError(f"{where}: 'break_after_events' must be null or an int >= 0; got {brk!r}")
    events = out.get("stream_events")
    if events is not None and not (
        isinstance(events, list) and all(isinstance(ev, dict) and "data" in ev for ev in events)
    ):
        raise ValueError(f"{where}: 'stream_events' must be a list of {{'event', 'data'}} objects")
    return out


def _id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def _out_tokens(*parts: Any) -> int:
    return max(1, sum(len(json.dumps(p)) for p in parts if p) // 4)


def anthropic_message(
    text: str = "",
    tool_calls: Iterable[tuple[str, str, dict[str, Any]]] = (),
    stop_reason: str | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """Build a full Anthropic Messages API response body.

    Args:
        text: Assistant text; a ``text`` block is added only when non-empty.
        tool_calls: ``(call_id, name, arguments_dict)`` per ``tool_use`` block.
        stop_reason: Default ``"tool_use"`` when there are tool calls, else
            ``"end_turn"``.
        **extra: Merged at top level last (e.g. ``stop_details={...}``,
            ``usage={...}``).

    Returns:
        ``{"id", "type": "message", "role", "model": "scripted", "content",
        "stop_reason", "stop_sequence": None, "usage"}``.
    """
    calls = list(tool_calls)
    content: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
    content += [{"type": "tool_use", "id": c, "name": name, "input": args} for c, name, args in calls]
    return {
        "id": _id("msg_scripted_"),
        "type": "message",
        "role": "assistant",
        "model": "scripted",
        "content": content,
        "stop_reason": stop_reason or ("tool_use" if calls else "end_turn"),
        "stop_sequence": None,
        "usage": {"input_tokens": 10, "output_tokens": _out_tokens(text, *calls)},
        **extra,
    }


def openai_chat_completion(
    text: str | None = "",
    tool_calls: Iterable[tuple[str, str, dict[str, Any]]] = (),
    finish_reason: str | None = None,
    refusal: str | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """Build a full OpenAI Chat Completions response body (one choice).

    Args:
        text: ``message.content``. ``""`` becomes ``None`` when there are tool
            calls or a refusal (what the real API sends).
        tool_calls: ``(call_id, name, arguments_dict)``; sent as
            ``{"id", "type": "function", "function": {"name", "arguments":
            <JSON string>}}``.
        finish_reason: Default ``"tool_calls"`` when there are tool calls,
            else ``"stop"``.
        refusal: ``message.refusal``.
        **extra: Merged at top level last.
    """
    calls = list(tool_calls)
    message: dict[str, Any] = {
        "role": "assistant",
        "content": None if text == "" and (calls or refusal) else text,
        "refusal": refusal,
    }
    if calls:
        message["tool_calls"] = [
            {"id": c, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
            for c, name, args in calls
        ]
    out_tokens = _out_tokens(text, refusal, *calls)
    return {
        "id": _id("chatcmpl-scripted"),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": "scripted",
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": finish_reason or ("tool_calls" if calls else "stop"),
            }
        ],
        "usage": {"prompt_tokens": 10, "completion_tokens": out_tokens, "total_tokens": out_tokens + 10},
        **extra,
    }


def openai_response(
    text: str = "",
    tool_calls: Iterable[tuple[str, str, dict[str, Any]]] = (),
    status: str = "completed",
    refusal: str | None = None,
    incomplete_reason: str | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """Build a full OpenAI Responses API response body.

    Args:
        text: An ``output_text`` part of a ``message`` item (when non-empty).
        tool_calls: ``(call_id, name, arguments_dict)``; each a
            ``{"type": "function_call", "id", "call_id", "name", "arguments":
            <JSON string>, "status"}`` item after the message.
        status: ``completed`` | ``incomplete`` | ``failed`` | ...
        refusal: A ``refusal`` part of the message item.
        incomplete_reason: ``incomplete_details.reason`` when ``status`` is
            ``incomplete`` (default ``"max_output_tokens"``).
        **extra: Merged at top level last.
    """
    calls = list(tool_calls)
    item_status = "incomplete" if status == "incomplete" else "completed"
    output: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    parts += [{"type": "output_text", "text": text, "annotations": []}] if text else []
    parts += [{"type": "refusal", "refusal": refusal}] if refusal else []
    if parts:
        msg = {"type": "message", "id": _id("msg_"), "status": item_status, "role": "assistant"}
        output.append({**msg, "content": parts})
    for cid, name, args in calls:
        fc = {"type": "function_call", "id": _id("fc_"), "call_id": cid, "name": name}
        output.append({**fc, "arguments": json.dumps(args), "status": item_status})
    out_tokens = _out_tokens(text, refusal, *calls)
    return {
        "id": _id("resp_"),
        "object": "response",
        "created_at": int(time.time()),
        "status": status,
        "model": "scripted",
        "output": output,
        "incomplete_details": (
            {"reason": incomplete_reason or "max_output_tokens"} if status == "incomplete" else None
        ),
        "error": {"code": "server_error", "message": "scripted failure"} if status == "failed" else None,
        "usage": {"input_tokens": 10, "output_tokens": out_tokens, "total_tokens": 10 + out_tokens},
        **extra,
    }


def entry(
    body: Any,
    *,
    status: int = 200,
    headers: dict[str, str] | None = None,
    delay_s: float = 0,
    repeat: int = 1,
    **kw: Any,
) -> dict[str, Any]:
    """Build one scenario entry; ``kw`` may hold ``stream_events``,
    ``break_after_events`` and ``event_delay_s`` (seconds between frames)."""
    out = {"status": status, "headers": dict(headers or {}), "delay_s": delay_s, "body": body}
    return {**out, "repeat": repeat, **kw}


def scenario(wire: str, *entries: dict[str, Any]) -> dict[str, Any]:
    """Build a validated scenario dict: ``{"wire": wire, "responses": [...]}``."""
    return load_scenario({"wire": wire, "responses": list(entries)})


# ---------------------------------------------------------------------------
# Streaming: non-streaming body -> the wire's real SSE frames
# ---------------------------------------------------------------------------


def _pieces(s: str, n: int = _PIECES) -> list[str]:
    """Split ``s`` into at most ``n`` non-empty consecutive chunks."""
    if not s:
        return []
    size = math.ceil(len(s) / n)
    return [s[i : i + size] for i in range(0, len(s), size)]


def _anthropic_events(body: dict[str, Any]) -> Iterator[SSEFrame]:
    def ev(type_: str, **fields: Any) -> SSEFrame:
        return type_, json.dumps({"type": type_, **fields})

    def delta(i: int, kind: str, key: str, value: str) -> SSEFrame:
        return ev("content_block_delta", index=i, delta={"type": kind, key: value})

    usage = dict(body.get("usage") or {})
    start_usage = {**usage, "output_tokens": min(1, usage.get("output_tokens", 0))}
    message = {**body, "content": [], "stop_reason": None, "stop_sequence": None, "usage": start_usage}
    message.pop("stop_details", None)
    yield ev("message_start", message=message)
    yield ev("ping")
    for i, block in enumerate(body.get("content") or []):
        kind = block.get("type")
        if kind == "text":
            yield ev("content_block_start", index=i, content_block={**block, "text": ""})
            for p in _pieces(block.get("text", "")):
                yield delta(i, "text_delta", "text", p)
        elif kind == "tool_use":
            yield ev("content_block_start", index=i, content_block={**block, "input": {}})
            for p in _pieces(json.dumps(block.get("input", {}))):
                yield delta(i, "input_json_delta", "partial_json", p)
        elif kind == "thinking":
            start = {**block, "thinking": "", "signature": ""}
            yield ev("content_block_start", index=i, content_block=start)
            for p in _pieces(block.get("thinking", "")):
                yield delta(i, "thinking_delta", "thinking", p)
            if sig := block.get("signature"):
                yield delta(i, "signature_delta", "signature", sig)
        else:  # redacted_thinking, server tool blocks...: whole block at start
            yield ev("content_block_start", index=i, content_block=block)
        yield ev("content_block_stop", index=i)
    end = {"stop_reason": body.get("stop_reason"), "stop_sequence": body.get("stop_sequence")}
    if "stop_details" in body:
        end["stop_details"] = body["stop_details"]
    yield ev("message_delta", delta=end, usage=usage)
    yield ev("message_stop")


def _chat_events(body: dict[str, Any], include_usage: bool) -> Iterator[SSEFrame]:
    base = {k: body.get(k) for k in ("id", "created", "model", "system_fingerprint")}
    base["object"] = "chat.completion.chunk"
    choice = (body.get("choices") or [{}])[0]
    msg = choice.get("message") or {}

    def chunk(delta: dict[str, Any], finish: str | None = None) -> SSEFrame:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        data: dict[str, Any] = {**base, "choices": [choice]}
        if include_usage:
            data["usage"] = None
        return None, json.dumps(data)

    content = msg.get("content")
    yield chunk({"role": "assistant", "content": "" if content is not None else None, "refusal": None})
    for p in _pieces(content or ""):
        yield chunk({"content": p})
    for p in _pieces(msg.get("refusal") or ""):
        yield chunk({"refusal": p})
    for i, call in enumerate(msg.get("tool_calls") or []):
        fn = call.get("function") or {}
        head = {"index": i, "id": call.get("id"), "type": "function"}
        yield chunk({"tool_calls": [{**head, "function": {"name": fn.get("name"), "arguments": ""}}]})
        for p in _pieces(fn.get("arguments") or ""):
            yield chunk({"tool_calls": [{"index": i, "function": {"arguments": p}}]})
    yield chunk({}, choice.get("finish_reason"))
    if include_usage:
        yield None, json.dumps({**base, "choices": [], "usage": body.get("usage")})
    yield None, "[DONE]"


def _responses_events(body: dict[str, Any]) -> Iterator[SSEFrame]:
    seq = iter(range(1 << 30))

    def ev(type_: str, **fields: Any) -> SSEFrame:
        return type_, json.dumps({"type": type_, "sequence_number": next(seq), **fields})

    shell = {**body, "status": "in_progress", "output": [], "usage": None}
    shell.update(incomplete_details=None, error=None)
    yield ev("response.created", response=shell)
    yield ev("response.in_progress", response=shell)
    for oi, item in enumerate(body.get("output") or []):
        kind, iid = item.get("type"), item.get("id")
        if kind == "message":
            added = {**item, "status": "in_progress", "content": []}
            yield ev("response.output_item.added", output_index=oi, item=added)
            for ci, part in enumerate(item.get("content") or []):
                at = {"item_id": iid, "output_index": oi, "content_index": ci}
                ptype = part.get("type")
                key = {"output_text": "text", "refusal": "refusal"}.get(ptype)
                yield ev("response.content_part.added", **at, part={**part, key: ""} if key else part)
                if ptype == "output_text":
                    for p in _pieces(part.get("text", "")):
                        yield ev("response.output_text.delta", **at, delta=p, logprobs=[])
                    yield ev("response.output_text.done", **at, text=part.get("text", ""), logprobs=[])
                elif ptype == "refusal":
                    for p in _pieces(part.get("refusal", "")):
                        yield ev("response.refusal.delta", **at, delta=p)
                    yield ev("response.refusal.done", **at, refusal=part.get("refusal", ""))
                yield ev("response.content_part.done", **at, part=part)
        elif kind == "function_call":
            args = item.get("arguments", "")
            added = {**item, "arguments": "", "status": "in_progress"}
            yield ev("response.output_item.added", output_index=oi, item=added)
            for p in _pieces(args):
                yield ev("response.function_call_arguments.delta", item_id=iid, output_index=oi, delta=p)
            at = {"item_id": iid, "output_index": oi}
            yield ev("response.function_call_arguments.done", **at, arguments=args)
        else:
            yield ev("response.output_item.added", output_index=oi, item=item)
        yield ev("response.output_item.done", output_index=oi, item=item)
    terminals = {"incomplete": "response.incomplete", "failed": "response.failed"}
    yield ev(terminals.get(body.get("status"), "response.completed"), response=body)


def _stream_frames(wire: str, e: dict[str, Any], request_body: Any) -> list[SSEFrame]:
    if e.get("stream_events") is not None:
        return [
            (ev.get("event"), ev["data"] if isinstance(ev["data"], str) else json.dumps(ev["data"]))
            for ev in e["stream_events"]
        ]
    body = e.get("body") or {}
    if wire == "anthropic":
        return list(_anthropic_events(body))
    if wire == "openai-chat":
        opts = request_body.get("stream_options") if isinstance(request_body, dict) else None
        return list(_chat_events(body, bool(isinstance(opts, dict) and opts.get("include_usage"))))
    return list(_responses_events(body))


def _encode_frame(frame: SSEFrame) -> bytes:
    name, data = frame
    head = f"event: {name}\n" if name is not None else ""
    lines = "".join(f"data: {line}\n" for line in data.split("\n"))
    return (head + lines + "\n").encode("utf-8")


# ---------------------------------------------------------------------------
# The server
# ---------------------------------------------------------------------------


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _HTTPServer

    def setup(self) -> None:
        super().setup()
        self.server.owner._track(self.connection, add=True)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.owner._track(self.connection, add=False)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass

    def do_GET(self) -> None:
        owner, path = self.server.owner, self.path.split("?", 1)[0]
        if path == "/_health":
            self._send_json(200, {"ok": True})
        elif path == "/_requests":
            self._send_json(200, owner.requests())
        else:
            owner._record(self, self._read_body(), consume=False)
            self._send_json(404, _error(f"no route for GET {path}"))

    def do_POST(self) -> None:
        owner = self.server.owner
        record, e = owner._record(self, self._read_body(), consume=True)
        if e is None:
            msg = f"scripted scenario exhausted after {owner._total} responses"
            self._send_json(400, _error(msg, "invalid_request_error"))
            return
        if e["delay_s"] and not self._hold(e["delay_s"]):
            owner._mark_disconnected(record)
            return
        if record["stream"] and e["status"] == 200:
            frames = _stream_frames(owner.wire, e, record["body"])
            if not self._send_stream(e, frames):
                owner._mark_disconnected(record)
        elif e.get("body") is None and e.get("stream_events") is not None:
            msg = "scripted entry has only stream_events but the request did not stream"
            self._send_json(500, _error(msg, "api_error"))
        else:
            self._send_json(e["status"], e["body"], e["headers"])

    def _read_body(self) -> Any:
        """The request body (Content-Length framed): parsed JSON, else raw text."""
        raw = self.rfile.read(int(self.headers.get("content-length") or 0))
        text = raw.decode("utf-8", errors="replace")
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return text

    def _hold(self, seconds: float) -> bool:
        """Wait ``seconds``; return ``False`` as soon as the client hangs up."""
        deadline = time.monotonic() + seconds
        while (remaining := deadline - time.monotonic()) > 0:
            readable, _, _ = select.select([self.connection], [], [], min(remaining, 0.5))
            if not readable:
                continue
            try:
                if not self.connection.recv(1, socket.MSG_PEEK):
                    return False
            except OSError:
                return False
            time.sleep(min(remaining, 0.02))  # extra bytes (pipelining), not a hang-up
        return True

    def _send_json(self, status: int, body: Any, headers: dict[str, str] | None = None) -> None:
        headers = dict(headers or {})
        if isinstance(body, str):  # raw text: lets a scenario serve garbage
            payload, ctype = body.encode("utf-8"), "text/plain; charset=utf-8"
        else:
            payload, ctype = json.dumps(body).encode("utf-8"), "application/json"
        self.send_response(status)
        if not any(k.lower() == "content-type" for k in headers):
            self.send_header("Content-Type", ctype)
        for k, v in headers.items():
            self.send_header(k, str(v))
        self.send_header("Content-Length", str(len(payload)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        try:
            self.wfile.write(payload)
        except OSError:
            pass

    def _send_stream(self, e: dict[str, Any], frames: list[SSEFrame]) -> bool:
        """Send SSE frames; ``False`` when the client hung up mid-stream."""
        self.close_connection = True
        brk = e.get("break_after_events")
        try:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            for k, v in e["headers"].items():
                self.send_header(k, str(v))
            self.send_header("Connection", "close")
            self.end_headers()
            for n, frame in enumerate(frames):
                if brk is not None and n >= brk:
                    break
                if n and e.get("event_delay_s"):
                    time.sleep(e["event_delay_s"])
                self.wfile.write(_encode_frame(frame))
            # Returning closes the connection: after a break that is the end
            # of the body (close-delimited), with no terminal event sent.
        except OSError:
            return False
        return True


def _error(message: str, type_: str = "not_found_error") -> dict[str, Any]:
    return {"type": "error", "error": {"type": type_, "message": message}}


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 64
    owner: ScriptedServer

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], OSError):  # client hang-ups are expected
            super().handle_error(request, client_address)


class ScriptedServer:
    """Serve a scenario's responses in order over real HTTP; record requests.

    Any POST (any path) consumes the next entry (``repeat`` serves one entry
    several times); ``GET /_requests`` lists the records; ``GET /_health``
    answers ``{"ok": true}``. Once exhausted every POST gets HTTP 400
    ``{"type": "error", "error": {"type": "invalid_request_error", "message":
    "scripted scenario exhausted after N responses"}}``.

    Each request record: ``{"index": int (0-based), "method", "path",
    "headers": {lower-cased name: value} with ``authorization`` / ``x-api-key``
    values shown as ``"***"``, "body": parsed JSON or raw str,
    "response_index": entry index (0-based) or None, "stream": bool (request
    asked for SSE), "disconnected": bool (client hung up before the answer was
    fully sent), "received_at": unix seconds (float)}``.

    Args:
        scenario: A scenario dict or a JSON file path (see module docstring).
        host: Interface to bind.
        port: TCP port; 0 picks a free one (read it from :attr:`port`).
    """

    def __init__(
        self, scenario: dict[str, Any] | str | pathlib.Path, *, host: str = "127.0.0.1", port: int = 0
    ) -> None:
        self._scenario = load_scenario(scenario)
        self._plan = [i for i, e in enumerate(self._scenario["responses"]) for _ in range(e["repeat"])]
        self._total = len(self._plan)
        self._lock = threading.Lock()
        self._records: list[dict[str, Any]] = []
        self._next = 0
        self._conns: set[socket.socket] = set()
        self._httpd = _HTTPServer((host, port), _Handler, bind_and_activate=True)
        self._httpd.owner = self
        self._thread: threading.Thread | None = None
        self._stopped = False

    @property
    def url(self) -> str:
        """Base URL, e.g. ``"http://127.0.0.1:41234"`` (no trailing slash)."""
        host = self._httpd.server_address[0]
        return f"http://{host}:{self.port}"

    @property
    def port(self) -> int:
        """The bound TCP port."""
        return int(self._httpd.server_address[1])

    @property
    def wire(self) -> str:
        """The scenario's wire format: one of :data:`WIRES`."""
        return str(self._scenario["wire"])

    def start(self) -> ScriptedServer:
        """Serve from a daemon background thread; returns ``self``."""
        if self._thread is None and not self._stopped:
            self._thread = threading.Thread(
                target=self._httpd.serve_forever,
                kwargs={"poll_interval": 0.05},
                name=f"scripted-server-{self.port}",
                daemon=True,
            )
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving, cut in-flight connections, close the socket, join. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        if self._thread is not None:
            self._httpd.shutdown()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._httpd.server_close()
        if self._thread is not None:
            self._thread.join()

    def __enter__(self) -> ScriptedServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def requests(self) -> list[dict[str, Any]]:
        """A deep copy of every request record so far, in arrival order."""
        with self._lock:
            return copy.deepcopy(self._records)

    def request_count(self) -> int:
        """How many requests were recorded (control endpoints excluded)."""
        with self._lock:
            return len(self._records)

    # -- used by the handler ------------------------------------------------

    def _track(self, conn: socket.socket, *, add: bool) -> None:
        with self._lock:
            (self._conns.add if add else self._conns.discard)(conn)

    def _record(
        self, h: _Handler, body: Any, *, consume: bool
    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """Record a request and, for a POST, take the next entry (None when exhausted)."""
        headers: dict[str, str] = {}
        for name, value in h.headers.items():
            name = name.lower()
            value = "***" if name in _MASKED_HEADERS else value
            headers[name] = f"{headers[name]}, {value}" if name in headers else value
        with self._lock:
            e_index = None
            if consume and self._next < len(self._plan):
                e_index = self._plan[self._next]
                self._next += 1
            record = {
                "index": len(self._records),
                "method": h.command,
                "path": h.path,
                "headers": headers,
                "body": body,
                "response_index": e_index,
                "stream": isinstance(body, dict) and body.get("stream") is True,
                "disconnected": False,
                "received_at": time.time(),
            }
            self._records.append(record)
        return record, (self._scenario["responses"][e_index] if e_index is not None else None)

    def _mark_disconnected(self, record: dict[str, Any]) -> None:
        with self._lock:
            record["disconnected"] = True


def serve(
    scenario_path: str,
    *,
    host: str,
    port: int,
    ready_file: str | None = None,
    exit_when: Callable[[], bool] | None = None,
    poll_s: float = 1.0,
) -> None:
    """Run a :class:`ScriptedServer` in the foreground (``stopline scripted-server``).

    Blocks until SIGTERM/SIGINT (handlers are installed only when called from
    the main thread, and restored on return) or until ``exit_when()`` returns
    True (checked every ``poll_s`` seconds). Prints one line to stderr once
    listening.

    Args:
        scenario_path: Scenario JSON file.
        host: Interface to bind.
        port: TCP port; 0 picks a free one.
        ready_file: When given, the bound port (decimal text) is written here
            atomically (temp file + rename) once the server listens.
        exit_when: Optional predicate; the server stops when it returns True.
        poll_s: Seconds between ``exit_when`` checks.
    """
    done = threading.Event()
    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, lambda *_: done.set())
    try:
        with ScriptedServer(scenario_path, host=host, port=port) as server:
            if ready_file:
                target = pathlib.Path(ready_file)
                fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
                with os.fdopen(fd, "w") as f:
                    f.write(str(server.port))
                os.replace(tmp, target)
            print(
                f"stopline scripted server ({server.wire}, {server._total} responses) on {server.url}",
                file=sys.stderr,
                flush=True,
            )
            while not done.wait(poll_s):
                if exit_when is not None and exit_when():
                    break
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
