"""Operating stopline on Temporal (issue "for teams already on Temporal"):
search attributes, Prometheus metrics, OpenTelemetry tracing, payload
encryption, and the docker-compose deployment files. Real dev servers, real
worker processes, real HTTP."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from temporalio.api.common.v1 import Payload
from temporalio.api.operatorservice.v1 import ListSearchAttributesRequest
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter

from stopline.core import search_attributes
from stopline.core.contracts import AgentTaskResult
from stopline.settings import load_settings
from stopline.testing.scripted import anthropic_message, entry, scenario
from stopline.testing.workers import running_workers
from stopline.worker import runtime
from stopline.worker.codec import (
    ENCODING,
    KEY_ID_METADATA,
    CodecKeyError,
    EncryptionCodec,
    codec_from_settings,
    data_converter,
    key_id,
    parse_key,
)
from stopline.worker.runtime import (
    WORKER_SHUTDOWN_GRACE_S,
    build_workers,
    connect,
    free_port,
)
from stopline.worker.telemetry import build_runtime, tracing_interceptors
from tests.conftest import start_task

REPO = Path(__file__).resolve().parent.parent


def _address(client: Client) -> str:
    return client.service_client.config.target_host


def _key() -> str:
    return base64.b64encode(os.urandom(32)).decode()


async def _custom_attributes(client: Client) -> dict[str, int]:
    resp = await client.operator_service.list_search_attributes(
        ListSearchAttributesRequest(namespace=client.namespace)
    )
    return dict(resp.custom_attributes)


# ---------------------------------------------------------------------------
# Search attributes
# ---------------------------------------------------------------------------


def test_search_attribute_keys_and_dev_server_flags() -> None:
    names = {k.name: search_attributes.type_name(k) for k in search_attributes.ALL}
    assert names == {
        "StoplineStatus": "Keyword",
        "StoplineRefused": "Bool",
        "StoplineKind": "Keyword",
        "StoplineModel": "Keyword",
        "StoplineHost": "Keyword",
    }
    flags = runtime._search_attribute_flags()
    assert flags[::2] == ["--search-attribute"] * 5
    assert sorted(flags[1::2]) == sorted(f"{n}={t}" for n, t in names.items())
    assert all("temporal operator search-attribute create" in c for c in search_attributes.cli_commands())
    ups = search_attributes.updates(status="stopped", refused=True, kind="task", model="m")
    assert [(u.key.name, u.value) for u in ups] == [
        ("StoplineStatus", "stopped"), ("StoplineRefused", True),
        ("StoplineKind", "task"), ("StoplineModel", "m"),
    ]
    assert search_attributes.updates() == []


async def test_register_is_idempotent_on_a_real_server(client: Client) -> None:
    first = await search_attributes.register(client)
    assert set(first) == {k.name for k in search_attributes.ALL}
    second = await search_attributes.register(client)
    assert second == {k.name: "exists" for k in search_attributes.ALL}
    have = await _custom_attributes(client)
    for key in search_attributes.ALL:
        assert have[key.name] == int(key.indexed_value_type)


def test_register_cli_against_the_test_server(client: Client) -> None:
    """What the compose one-shot service runs: exit 0, one line per attribute."""
    env = {k: v for k, v in os.environ.items() if k != "STOPLINE_CODEC_KEY"}
    env["TEMPORAL_ADDRESS"] = _address(client)
    res = subprocess.run(
        [sys.executable, "-m", "stopline.cli", "search-attributes", "register", "--wait", "30"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=60,
    )
    assert res.returncode == 0, res.stderr
    for key in search_attributes.ALL:
        assert re.search(rf"^{key.name}\s+(created|exists)$", res.stdout, re.MULTILINE), res.stdout


def test_register_cli_gives_up_after_wait_when_no_server(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "STOPLINE_CODEC_KEY"}
    env["TEMPORAL_ADDRESS"] = f"127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    res = subprocess.run(
        [sys.executable, "-m", "stopline.cli", "search-attributes", "register", "--wait", "1"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=60,
    )
    assert res.returncode == 2 and "could not register search attributes" in res.stderr, res.stderr
    assert "waiting for Temporal" in res.stderr
    assert time.monotonic() - t0 < 30


async def test_register_refuses_an_attribute_of_another_type() -> None:
    """An existing attribute with the wrong type is an error, not a silent reuse."""
    from temporalio.api.enums.v1 import IndexedValueType
    from temporalio.api.operatorservice.v1 import ListSearchAttributesResponse

    class _Operator:
        added: list[Any] = []

        async def list_search_attributes(self, req: Any) -> Any:
            return ListSearchAttributesResponse(
                custom_attributes={"StoplineRefused": IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD}
            )

        async def add_search_attributes(self, req: Any) -> None:
            self.added.append(req)

    class _Client:
        namespace = "default"
        operator_service = _Operator()

    conflict = "StoplineRefused exists .* as INDEXED_VALUE_TYPE_KEYWORD"
    with pytest.raises(search_attributes.SearchAttributeTypeConflict, match=conflict):
        await search_attributes.register(_Client())  # type: ignore[arg-type]
    assert _Operator.added == []


async def test_a_refused_task_is_found_by_its_search_attributes(
    client: Client, task_queue: str, worker: Any, scripted: Any, workspace: Path
) -> None:
    """The README's query, ``StoplineRefused = true``, finds a refused task."""
    await search_attributes.register(client)  # a no-op on the session's server
    refused = scripted(scenario("anthropic", entry(anthropic_message("", stop_reason="refusal"))))
    done = scripted(scenario("anthropic", entry(anthropic_message("done"))))
    capped = scripted(scenario("anthropic", entry(anthropic_message(tool_calls=[("c", "list_dir", {})]))))
    h_refused = await start_task(client, task_queue, refused, workspace)
    h_done = await start_task(client, task_queue, done, workspace)
    h_stopped = await start_task(client, task_queue, capped, workspace, max_rounds=1)
    assert (await h_refused.result()).refused is True
    assert (await h_done.result()).status == "completed"
    assert (await h_stopped.result()).status == "stopped"
    ids = f"WorkflowId IN ('{h_refused.id}', '{h_done.id}', '{h_stopped.id}')"
    found: dict[str, list[str]] = {}
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:  # visibility is eventually consistent
        found = {
            q: [wf.id async for wf in client.list_workflows(f"{ids} AND {q}")]
            for q in ("StoplineRefused = true", "StoplineStatus = 'completed'", "StoplineKind = 'task'",
                      "StoplineStatus = 'stopped'")
        }
        if found["StoplineRefused = true"] and found["StoplineStatus = 'completed'"] and len(
            found["StoplineKind = 'task'"]
        ) == 3 and len(found["StoplineStatus = 'stopped'"]) == 2:
            break
        await asyncio.sleep(0.2)
    assert found["StoplineRefused = true"] == [h_refused.id]
    assert found["StoplineStatus = 'completed'"] == [h_done.id]
    assert sorted(found["StoplineKind = 'task'"]) == sorted([h_refused.id, h_done.id, h_stopped.id])
    # a stopped task is found whether a refusal or a limit stopped it
    assert sorted(found["StoplineStatus = 'stopped'"]) == sorted([h_refused.id, h_stopped.id])
    desc = await h_done.describe()
    assert desc.typed_search_attributes.get(search_attributes.MODEL) == "anthropic:scripted"


async def test_embedded_dev_server_registers_search_attributes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``start_dev_server`` (what ``stopline up`` runs) passes the flags."""
    monkeypatch.delenv("TEMPORAL_ADDRESS", raising=False)
    settings = load_settings(
        home=tmp_path / "home", dev_server_port=free_port(), dev_server_ui_port=free_port()
    )
    server = runtime.dev_server(settings)
    try:
        address = runtime.start_dev_server(settings)
        deadline = time.monotonic() + 20
        while True:
            try:
                # the port opens a moment before the frontend serves
                # ("Frontend is not healthy yet"): connecting is retried too
                client = await Client.connect(address)
                have = await _custom_attributes(client)
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)
        for key in search_attributes.ALL:
            assert have.get(key.name) == int(key.indexed_value_type), have
    finally:
        server.stop()
    assert server.pid() is None


# ---------------------------------------------------------------------------
# Metrics and tracing
# ---------------------------------------------------------------------------


def test_metrics_runtime_only_when_asked_and_bind_is_validated() -> None:
    assert build_runtime(load_settings()) is None
    assert build_runtime(load_settings(metrics_bind="")) is None
    with pytest.raises(ValueError, match="host:port"):
        build_runtime(load_settings(metrics_bind="9464"))


def test_metrics_bind_on_a_taken_port_fails_clearly() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"cannot serve metrics on 127.0.0.1:{port}"):
            build_runtime(load_settings(metrics_bind=f"127.0.0.1:{port}"))


def test_tracing_interceptor_when_asked_and_available(monkeypatch: pytest.MonkeyPatch) -> None:
    assert tracing_interceptors(load_settings()) == []
    monkeypatch.setenv("STOPLINE_OTEL", "")  # set but empty, as compose passes it: off
    assert load_settings().otel is False
    got = tracing_interceptors(load_settings(otel=True))
    try:
        from temporalio.contrib.opentelemetry import TracingInterceptor
    except ImportError:  # the `otel` extra is not installed: run untraced
        assert got == []
    else:
        assert len(got) == 1 and isinstance(got[0], TracingInterceptor)


async def test_worker_serves_prometheus_metrics(
    client: Client, task_queue: str, scripted: Any, workspace: Path, stopline_home: Path, tmp_path: Path
) -> None:
    """``python -m stopline.worker.main`` with STOPLINE_METRICS_BIND: after one
    task, ``/metrics`` has the SDK's ``temporal_`` metrics; SIGTERM stops it."""
    port = free_port()
    env = dict(os.environ)
    for var in ("ANTHROPIC_API_KEY", "OPENAI_API_KEY", "STOPLINE_CODEC_KEY", "STOPLINE_OTEL"):
        env.pop(var, None)
    env.update(
        TEMPORAL_ADDRESS=_address(client),
        STOPLINE_HOME=str(stopline_home),
        STOPLINE_TASK_QUEUE=task_queue,
        STOPLINE_METRICS_BIND=f"127.0.0.1:{port}",
        STOPLINE_LOG_FORMAT="json",
    )
    log_path = tmp_path / "worker.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "stopline.worker.main"], cwd=REPO, env=env,
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )
    try:
        server = scripted(scenario("anthropic", entry(anthropic_message("done"))))
        handle = await start_task(client, task_queue, server, workspace)
        result = await asyncio.wait_for(handle.result(), timeout=60)
        assert result.status == "completed", log_path.read_text()
        async with httpx.AsyncClient() as http:
            text = ""
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                text = (await http.get(f"http://127.0.0.1:{port}/metrics", timeout=5)).text
                if "temporal_workflow_completed" in text:
                    break
                await asyncio.sleep(0.2)
        assert re.search(r"^temporal_\w+", text, re.MULTILINE), text[:500]
        assert "temporal_workflow_completed" in text
        assert f'task_queue="{task_queue}"' in text
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(proc.wait, WORKER_SHUTDOWN_GRACE_S + 10)
        assert code == 0, log_path.read_text()
        assert "worker_stopped" in log_path.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# ---------------------------------------------------------------------------
# Payload encryption
# ---------------------------------------------------------------------------


async def test_codec_round_trip_and_key_handling() -> None:
    key = os.urandom(32)
    codec = EncryptionCodec(key)
    plain = [Payload(metadata={"encoding": b"json/plain"}, data=b'"the secret prompt"')]
    sealed = await codec.encode(plain)
    again = await codec.encode(plain)
    assert sealed[0].metadata["encoding"] == ENCODING
    assert sealed[0].metadata[KEY_ID_METADATA] == key_id(key).encode()
    assert b"secret" not in sealed[0].SerializeToString()
    assert sealed[0].data != again[0].data  # a fresh nonce per payload
    assert await codec.decode(sealed) == plain
    # payloads written before the codec was on decode unchanged
    assert await codec.decode(plain) == plain
    # rotation: the new codec still reads the old key's payloads
    rotated = EncryptionCodec(os.urandom(32), previous_keys=[key])
    assert await rotated.decode(sealed) == plain
    with pytest.raises(CodecKeyError, match="does not have"):
        await EncryptionCodec(os.urandom(32)).decode(sealed)
    tampered = Payload()
    tampered.CopyFrom(sealed[0])
    tampered.data = sealed[0].data[:-1] + bytes([sealed[0].data[-1] ^ 1])
    with pytest.raises(CodecKeyError, match="does not authenticate"):
        await codec.decode([tampered])


def test_codec_keys_from_settings() -> None:
    assert codec_from_settings(load_settings()) is None
    assert data_converter(load_settings()) is pydantic_data_converter
    k = _key()
    assert parse_key(k) == base64.b64decode(k)
    assert parse_key(base64.urlsafe_b64encode(base64.b64decode(k)).decode()) == base64.b64decode(k)
    with pytest.raises(CodecKeyError, match="32 bytes"):
        parse_key(base64.b64encode(b"short").decode())
    with pytest.raises(CodecKeyError, match="not base64"):
        parse_key("not base64 at all!")
    old = _key()
    codec = codec_from_settings(load_settings(codec_key=k, codec_previous_keys=f"{old}, "))
    assert codec is not None and codec.key_id == key_id(parse_key(k))
    conv = data_converter(load_settings(codec_key=k))
    assert conv.payload_codec is not None
    # failure messages and stack traces move into an (encrypted) payload
    from temporalio.api.failure.v1 import Failure
    from temporalio.exceptions import ApplicationError

    failure = Failure()
    conv.failure_converter.to_failure(ApplicationError("boom"), conv.payload_converter, failure)
    assert failure.message == "Encoded failure" and failure.encoded_attributes.data


async def test_encrypted_task_history_is_unreadable_without_the_key(
    client: Client, task_queue: str, scripted: Any, workspace: Path, stopline_home: Path
) -> None:
    """A task run with STOPLINE_CODEC_KEY: the server holds ciphertext only.

    The prompt and the model's answer are nowhere in the raw history bytes
    a client without the key reads; a client with the key (``connect()``
    with the setting) decodes the result.
    """
    prompt = f"PROMPT-CANARY-{uuid.uuid4().hex}"
    answer = f"ANSWER-CANARY-{uuid.uuid4().hex}"
    settings = load_settings(codec_key=_key())
    secure = await connect(settings, address=_address(client))
    workers = build_workers(secure, settings, task_queue=task_queue)
    async with running_workers(workers):
        server = scripted(scenario(
            "anthropic",
            entry(anthropic_message(
                "checking", tool_calls=[("c1", "shell", {"command": f"echo {answer}-tool"})]
            )),
            entry(anthropic_message(answer)),
        ))
        handle = await start_task(secure, task_queue, server, workspace, prompt)
        result = await handle.result()
        assert result.status == "completed" and result.final_text == answer
        # the model really received the prompt: encryption is only at rest
        assert prompt in json.dumps(server.requests()[0]["body"])

    plain_handle = client.get_workflow_handle(handle.id, result_type=AgentTaskResult)
    history = await plain_handle.fetch_history()
    raw = b"".join(e.SerializeToString() for e in history.events)
    assert len(history.events) > 10
    for canary in (prompt, answer, f"{answer}-tool"):
        assert canary.encode() not in raw
        assert canary not in history.to_json()
    assert ENCODING in raw  # the payloads are there, encrypted
    with pytest.raises(Exception):
        await plain_handle.result()  # without the key the result cannot be read
    decoded = await secure.get_workflow_handle(handle.id, result_type=AgentTaskResult).result()
    assert decoded.final_text == answer


async def test_replay_of_an_encrypted_history_needs_the_key(
    client: Client, task_queue: str, scripted: Any, workspace: Path, stopline_home: Path
) -> None:
    from stopline.replay import replay

    settings = load_settings(codec_key=_key())
    secure = await connect(settings, address=_address(client))
    workers = build_workers(secure, settings, task_queue=task_queue)
    async with running_workers(workers):
        server = scripted(scenario("anthropic", entry(anthropic_message("done"))))
        handle = await start_task(secure, task_queue, server, workspace)
        assert (await handle.result()).status == "completed"
    history = await handle.fetch_history()
    assert (await replay(history, data_converter(settings))).ok
    without = await replay(history, pydantic_data_converter)
    assert not without.ok and not without.nondeterminism


# ---------------------------------------------------------------------------
# Deployment files
# ---------------------------------------------------------------------------


def _compose() -> str:
    return (REPO / "docker-compose.yml").read_text()


def test_compose_file_has_the_stack_and_a_long_enough_stop_grace() -> None:
    text = _compose()
    assert "\t" not in text  # YAML forbids tabs for indentation
    for image in ("temporalio/auto-setup:", "temporalio/ui:", "postgres:"):
        assert image in text
    services = re.findall(r"^  ([a-z][a-z0-9-]*):\s*$", text.split("\nvolumes:")[0], re.MULTILINE)
    assert {"postgresql", "temporal", "temporal-ui", "search-attributes", "worker"} <= set(services)
    grace = re.search(r"stop_grace_period:\s*(\d+)s", text)
    assert grace and int(grace.group(1)) > WORKER_SHUTDOWN_GRACE_S
    assert "TEMPORAL_ADDRESS: temporal:7233" in text
    for var in ("ANTHROPIC_API_KEY", "OPENAI_API_KEY"):
        # passed through from the host, never written into the file
        assert re.search(rf"^\s+- {var}\s*$", text, re.MULTILINE), var
    assert "search-attributes register" in text
    # replicas share the home volume and each take a host slot in it (DESIGN §7)
    assert re.search(r"^\s+- STOPLINE_HOME_SLOTS=\d+\s*$", text, re.MULTILINE)
    assert "STOPLINE_HOST_TASK_QUEUE" not in text


def test_dockerfile_runs_the_worker() -> None:
    text = (REPO / "Dockerfile").read_text()
    assert text.startswith("# ") and "FROM python:3.11-slim" in text
    assert 'CMD ["stopline-worker"]' in text
    ignore = (REPO / ".dockerignore").read_text().split()
    assert ".venv" in ignore and ".git" in ignore
