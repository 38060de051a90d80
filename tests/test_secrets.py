"""Secrets out of every reach (DESIGN §5): history, ledger, CLI output, logs, tools, spawned processes.

The end-to-end case is the one from the field: a provider answers 401 with
a body that echoes the API key. A real worker process (its own stdout and
stderr captured, console and JSON), a real dev server, the real CLI — and
the key must be in none of what they produce, while the redacted marker
shows the message did travel.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from google.protobuf.message import Message as ProtoMessage
from temporalio.api.common.v1 import Payload
from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment

from stopline.activities.ledger import LedgerStore
from stopline.core.contracts import AgentTaskInput, AgentTaskResult, TaskLimits
from stopline.logging import configure_logging
from stopline.secrets import REDACTED, Redactor, secret_values, service_env
from stopline.settings import load_settings
from stopline.testing.scripted import anthropic_message, entry, scenario
from stopline.worker.codec import RedactingCodec, codec_from_settings, data_converter
from stopline.worker.runtime import Managed, _spawn, free_port, task_result

REPO = Path(__file__).resolve().parent.parent


def _keys() -> dict[str, str]:
    return {
        "ANTHROPIC_API_KEY": f"sk-ant-api03-{uuid.uuid4().hex}{uuid.uuid4().hex}",
        "OPENAI_API_KEY": f"sk-proj-{uuid.uuid4().hex}",
    }


# ---------------------------------------------------------------------------
# The pieces.
# ---------------------------------------------------------------------------


def test_redactor_replaces_every_spelling_and_across_chunks() -> None:
    key = "sk-ant-0123456789abcdef"
    quoted = 'pa"ss\\word-0123'
    r = Redactor([key, quoted, "short"])
    assert r.text(f"bearer {key}, again {key}") == f"bearer {REDACTED}, again {REDACTED}"
    assert r.text("a short word") == "a short word"  # under MIN_SECRET_CHARS: not a secret
    assert r.bytes(json.dumps({"p": quoted}).encode()) == json.dumps({"p": REDACTED}).encode()
    stream = r.stream()
    data = f"head {key} middle {key}".encode()
    out = b"".join(stream.feed(data[i : i + 5]) for i in range(0, len(data), 5)) + stream.flush()
    assert out == f"head {REDACTED} middle {REDACTED}".encode()
    assert not Redactor([]) and Redactor([]).text("x") == "x"


def test_secret_values_are_the_configured_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    keys = _keys()
    codec = base64.b64encode(os.urandom(32)).decode()
    old = base64.b64encode(os.urandom(32)).decode()
    for k, v in {**keys, "STOPLINE_CODEC_KEY": codec, "STOPLINE_CODEC_PREVIOUS_KEYS": f"{old},",
                 "TEMPORAL_API_KEY": "temporal-cloud-key-0123"}.items():
        monkeypatch.setenv(k, v)
    assert set(secret_values(load_settings())) == {*keys.values(), codec, old, "temporal-cloud-key-0123"}


async def test_the_data_converter_redacts_payloads_and_failures(monkeypatch: pytest.MonkeyPatch) -> None:
    key = _keys()["ANTHROPIC_API_KEY"]
    monkeypatch.setenv("ANTHROPIC_API_KEY", key)
    conv = data_converter(load_settings())
    assert isinstance(conv.payload_codec, RedactingCodec)
    (payload,) = await conv.encode([{"text": f"echoed {key}"}])
    assert key.encode() not in payload.data and REDACTED.encode() in payload.data
    binary = Payload(metadata={"encoding": b"binary/protobuf"}, data=key.encode())
    assert (await conv.payload_codec.encode([binary]))[0].data == key.encode()  # never corrupted
    from temporalio.api.failure.v1 import Failure
    from temporalio.exceptions import ApplicationError

    failure = Failure()
    await conv.encode_failure(ApplicationError(f"HTTP 401: invalid key {key}"), failure)
    assert key not in str(failure) and REDACTED in failure.message


def test_stdlib_log_lines_become_redacted_json(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import logging

    key = _keys()["OPENAI_API_KEY"]
    monkeypatch.setenv("OPENAI_API_KEY", key)
    monkeypatch.setenv("STOPLINE_LOG_FORMAT", "json")
    configure_logging(load_settings())
    try:
        try:
            raise RuntimeError(f"provider said: bad key {key}")
        except RuntimeError:
            logging.getLogger("temporalio.activity").warning("Completing activity as failed", exc_info=True)
        err = capsys.readouterr().err
    finally:
        import structlog

        structlog.reset_defaults()
        root = logging.getLogger()
        for h in [h for h in root.handlers if getattr(h, "_stopline_handler", False)]:
            root.removeHandler(h)
    (line,) = [json.loads(x) for x in err.splitlines() if x.strip()]
    assert line["event"] == "Completing activity as failed" and line["logger"] == "temporalio.activity"
    assert "Traceback" in line["exception"] and REDACTED in line["exception"]
    assert key not in err


def test_service_env_drops_secrets_by_name_and_value() -> None:
    keys = _keys()
    base = {**keys, "PATH": "/usr/bin", "AWS_SECRET_ACCESS_KEY": "x" * 20, "DATABASE_URL": "postgres://u:p@h/d",
            "INNOCENT": keys["OPENAI_API_KEY"], "STOPLINE_HOME": "/h"}
    assert service_env(base) == {"PATH": "/usr/bin", "STOPLINE_HOME": "/h"}


def test_a_spawned_worker_gets_its_keys_on_a_pipe_not_in_its_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    keys = _keys()
    for k, v in keys.items():
        monkeypatch.setenv(k, v)
    probe = (
        "import hashlib, os, sys, time\n"
        "from stopline.worker.main import take_secrets\n"
        "take_secrets()\n"
        "print(hashlib.sha256(os.environ['ANTHROPIC_API_KEY'].encode()).hexdigest(), flush=True)\n"
        "time.sleep(30)\n"
    )
    managed = Managed("probe", tmp_path / "probe.pid", tmp_path / "probe.log")
    pid = _spawn(managed, [sys.executable, "-c", probe], secrets=dict(keys))
    try:
        deadline = time.monotonic() + 20
        while not managed.log_file.read_text().strip():
            assert time.monotonic() < deadline, "the probe never printed"
            time.sleep(0.05)
        import hashlib

        assert managed.log_file.read_text().split()[0] == hashlib.sha256(keys["ANTHROPIC_API_KEY"].encode()).hexdigest()
        environ = Path(f"/proc/{pid}/environ").read_bytes()
        for value in keys.values():
            assert value.encode() not in environ
        assert b"STOPLINE_SECRETS_FD" in environ  # the pipe, not the keys
    finally:
        managed.stop(2.0)


def test_up_starts_a_dev_server_and_worker_with_no_key_in_their_environment(tmp_path: Path) -> None:
    keys = _keys()
    env = {k: v for k, v in os.environ.items() if k not in ("TEMPORAL_ADDRESS",)}
    env.update(keys)
    env.update(
        STOPLINE_HOME=str(tmp_path / "home"), STOPLINE_DEV_SERVER_PORT=str(free_port()),
        STOPLINE_DEV_SERVER_UI_PORT=str(free_port()), STOPLINE_HOST_TASK_QUEUE=f"host-{tmp_path.name}",
    )

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "stopline.cli", *args], env=env,
                              capture_output=True, text=True, timeout=120)

    try:
        up = cli("up")
        assert up.returncode == 0, up.stderr + up.stdout
        run = tmp_path / "home" / "run"
        pids = {name: int((run / f"{name}.pid").read_text()) for name in ("temporal", "worker")}
        for name, pid in pids.items():
            environ = Path(f"/proc/{pid}/environ").read_bytes()
            for value in keys.values():
                assert value.encode() not in environ, name
    finally:
        down = cli("down")
    assert down.returncode == 0, down.stderr


# ---------------------------------------------------------------------------
# A 401 echoing the key, end to end.
# ---------------------------------------------------------------------------


def _payloads(msg: ProtoMessage) -> Iterator[Payload]:
    """Every Payload inside a protobuf message (history events are deep)."""
    if isinstance(msg, Payload):
        yield msg
        return
    for field, value in msg.ListFields():
        if field.message_type is None:
            continue
        if isinstance(value, ProtoMessage):
            yield from _payloads(value)
            continue
        items = value.values() if hasattr(value, "values") else value  # a map, or a repeated field
        for item in items:
            if isinstance(item, ProtoMessage):
                yield from _payloads(item)


class _Worker:
    def __init__(self, env: dict[str, str], log: Path) -> None:
        self.log = log
        with log.open("wb") as out:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "stopline.worker.main"], env=env, cwd=REPO,
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )

    async def ready(self) -> None:
        deadline = time.monotonic() + 60
        while "worker_started" not in self.log.read_text(errors="replace"):
            assert self.popen.poll() is None, self.log.read_text()
            assert time.monotonic() < deadline, self.log.read_text()
            await asyncio.sleep(0.05)

    def stop(self) -> None:
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait()


@pytest.mark.parametrize("mode", ["json-with-codec", "console"])
async def test_a_401_echoing_the_key_leaves_no_trace(
    temporal_env: WorkflowEnvironment, scripted: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    mode: str,
) -> None:
    keys = _keys()
    secrets = dict(keys)
    if mode == "json-with-codec":
        secrets["STOPLINE_CODEC_KEY"] = base64.b64encode(os.urandom(32)).decode()
    home, ws = tmp_path / "home", tmp_path / "ws"
    ws.mkdir()
    queue = f"secrets-{uuid.uuid4().hex[:8]}"
    address = temporal_env.client.service_client.config.target_host
    server = scripted(scenario(
        "anthropic",
        entry(anthropic_message(tool_calls=[("c1", "shell", {"command": "env; echo; cat /proc/[0-9]*/environ | tr '\\0' '\\n'"})])),
        entry({"type": "error", "error": {"type": "authentication_error",
                                          "message": f"invalid x-api-key: {keys['ANTHROPIC_API_KEY']}"}},
              status=401),
    ))
    env = {k: v for k, v in os.environ.items() if not k.startswith("STOPLINE_") and k != "TEMPORAL_ADDRESS"}
    env.update(secrets)
    env.update(
        TEMPORAL_ADDRESS=address, STOPLINE_HOME=str(home), STOPLINE_TASK_QUEUE=queue,
        STOPLINE_HOST_TASK_QUEUE=queue, STOPLINE_LOG_FORMAT="json" if mode.startswith("json") else "console",
        PYTHONUNBUFFERED="1",
    )
    for k, v in secrets.items():
        monkeypatch.setenv(k, v)
    worker = _Worker(env, tmp_path / "worker.log")
    try:
        await worker.ready()
        settings = load_settings()
        client = Client(temporal_env.client.service_client, namespace=temporal_env.client.namespace,
                        data_converter=data_converter(settings))
        handle = await client.start_workflow(
            "AgentTask",
            AgentTaskInput(prompt="go", model="anthropic:scripted", base_url=server.url, workspace=str(ws),
                           limits=TaskLimits()),
            id=f"secret-{uuid.uuid4().hex[:8]}", task_queue=queue, result_type=AgentTaskResult,
        )
        result = await asyncio.wait_for(task_result(handle), 60)  # a failed task: its workflow fails
        await _check_everything_but_the_log(handle, result, secrets, settings, home, env)
    finally:
        worker.stop()
    # the worker's log: the SDK's warning about the failed activity is there, redacted
    log = worker.log.read_text(errors="replace")
    for value in secrets.values():
        assert value not in log, "a secret in the worker log"
    assert "Completing activity as failed" in log and REDACTED in log
    if mode.startswith("json"):
        for line in log.splitlines():
            if line.strip():
                json.loads(line)  # every line is JSON, tracebacks included


async def _check_everything_but_the_log(
    handle: Any, result: AgentTaskResult, secrets: dict[str, str], settings: Any, home: Path,
    env: dict[str, str],
) -> None:
    values = list(secrets.values())

    def clean(text: str | bytes, where: str) -> None:
        raw = text.encode() if isinstance(text, str) else text
        for value in values:
            assert value.encode() not in raw, f"a secret in {where}"

    # the message travelled, redacted
    assert result.status == "failed" and "401" in result.reason and REDACTED in result.reason
    clean(result.reason, "the result")
    # history: raw, and every payload decoded (decrypted when the codec is on)
    history = await handle.fetch_history()
    clean(history.to_json(), "the raw history")
    codec = codec_from_settings(settings)
    payloads = [p for e in history.events for p in _payloads(e)]
    decoded = await codec.decode(payloads) if codec else payloads
    assert any(REDACTED.encode() in p.data for p in decoded)
    for p in decoded:
        clean(p.data, "a decoded history payload")
    # everything under STOPLINE_HOME (ledger, staged rows, blobs)
    files = [p for p in home.rglob("*") if p.is_file()]
    assert any(p.name == "ledger.jsonl" for p in files)
    for p in files:
        clean(p.read_bytes(), str(p))
    rows = LedgerStore(home / "ledger").read(handle.id)
    (tool,) = [r for r in rows if r.kind == "tool_result"]
    assert "PATH=" in (tool.text or "") and "ANTHROPIC_API_KEY" not in (tool.text or "")
    # the CLI
    for args in (["status", handle.id, "--json"], ["transcript", handle.id, "--json"], ["transcript", handle.id]):
        out = subprocess.run([sys.executable, "-m", "stopline.cli", *args], env=env, capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        clean(out.stdout + out.stderr, f"stopline {' '.join(args)}")
        assert REDACTED in out.stdout


async def test_a_tool_call_carrying_a_secret_is_not_run_with_the_mask(
    client: Client, scripted: Any, workspace: Path, task_queue: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The model wrote a configured key into a tool call: the workflow only
    ever sees the call with the key replaced (DESIGN §5), so the call is not
    run — neither with the key nor with the mask in its place (a mask that
    reached a shell would run as whatever it expands to) — and the model is
    told why."""
    from stopline.worker.runtime import build_workers, connect
    from stopline.testing.workers import running_workers
    from tests.conftest import start_task

    secret = f"sk-ant-test-{uuid.uuid4().hex}"
    monkeypatch.setenv("ANTHROPIC_API_KEY", secret)
    settings = load_settings()
    secure = await connect(settings, address=client.service_client.config.target_host)
    server = scripted(scenario(
        "anthropic",
        entry(anthropic_message(tool_calls=[
            ("c1", "shell", {"command": f"echo {secret} > s.txt"}),
            ("c2", "write_file", {"path": "w.txt", "content": f"key={secret}"}),
            ("c3", "list_dir", {"path": "."}),
        ])),
        entry(anthropic_message("done")),
    ))
    async with running_workers(build_workers(secure, settings, task_queue=task_queue)):
        handle = await start_task(secure, task_queue, server, workspace)
        result = await asyncio.wait_for(handle.result(), 60)
    assert result.status == "completed", result
    assert not (workspace / "s.txt").exists() and not (workspace / "w.txt").exists()
    sent = json.dumps(server.requests()[1]["body"])
    assert secret not in sent
    results = {r.call_id: r for r in LedgerStore(load_settings().ledger_dir).read(handle.id)
               if r.kind == "tool_result"}
    assert not results["c1"].ok and "held a secret value" in (results["c1"].text or "")
    assert not results["c2"].ok and "held a secret value" in (results["c2"].text or "")
    assert results["c3"].ok  # its sibling without the key ran


def test_a_key_split_across_streamed_pieces_never_leaves_in_parts() -> None:
    """The token stream is published in pieces; each is redacted holding back
    what could start a key, so neither half of a split key is published."""
    from stopline.activities.deltas import DeltaPublisher, SamplingDelta

    key = "sk-test-secret-AAAA1234"
    pub = DeltaPublisher(round=1, attempt=1, interval_s=1.0, redactor=Redactor([key]))
    for piece in ('{"command": "echo sk-test-secr', 'et-AAAA1234 > s.txt"}', " and more text after it"):
        pub.on_delta(SamplingDelta(kind="tool_args", text=piece, index=1, call_id="c1", tool_name="shell"))
    sent = "".join(d.text for d in pub._buffer)
    assert REDACTED in sent
    for part in ("sk-test", "secr", "et-AAAA", "AAAA1234", "1234"):
        assert part not in sent, sent
    assert sent.startswith('{"command": "echo ' + REDACTED + ' > s.txt"}')


def test_a_key_spelled_with_json_escapes_is_redacted_and_its_call_not_run() -> None:
    """JSON may spell a key with \\u escapes the redactor cannot see in the raw
    text: the raw arguments are rewritten from the parsed ones, so the key is
    redacted and the call recognised as one that held a secret."""
    from stopline.activities.providers.base import tool_call_from_raw
    from stopline.activities.sampling import _spell_out_secrets
    from stopline.core import policies
    from stopline.core.contracts import SamplingResult

    key = "sk-test-secret-AAAA1234"
    raw = '{"command": "echo sk-test-secret-\\u0041AAA1234 > s.txt"}'
    result = SamplingResult(provider="p", model="m", stop_reason="tool_use",
                            tool_calls=[tool_call_from_raw("c1", "shell", raw)])
    redactor = Redactor([key])
    assert redactor.text(raw) == raw  # what the redactor alone would miss
    _spell_out_secrets(result, redactor)
    seen = SamplingResult.model_validate_json(redactor.text(result.model_dump_json()))  # as the workflow sees it
    assert key not in seen.model_dump_json() and "\\u0041AAA" not in seen.model_dump_json()
    assert "held a secret value" in policies.untriaged_calls(seen)["c1"]
