"""Running on a fleet (DESIGN §7): tasks placed on a pool of hosts, host loss
as a clean outcome, a transcript and a refusal guard that outlive any host.

Each host is a real worker process with its own ``STOPLINE_HOME`` (so its
own host id) in its own UTS namespace (its own hostname) and mount namespace
(where a test can hide a directory from it: a host without the workspace).
The test process itself runs no worker for the task queue: every task here
is started by "a client on a machine without a worker". Real dev server,
real HTTP to the scripted provider, real tool processes. Everything a test
starts is stopped by its own PID in ``finally``.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from temporalio.api.common.v1 import WorkflowExecution
from temporalio.api.workflowservice.v1 import ResetWorkflowExecutionRequest
from temporalio.client import Client, WorkflowExecutionStatus

from stopline.activities.host import host_id_for
from stopline.activities.ledger import LedgerStore
from stopline.core import search_attributes as sa
from stopline.core.contracts import (
    AgentTaskInput,
    AgentTaskResult,
    LedgerRow,
    ModelCandidate,
    TaskLimits,
    TaskStatus,
)
from stopline.testing.scripted import anthropic_message, entry, scenario
from tests._worker_proc import WorkerProc, kill_leftover_tool_groups, server_address

#: Host-loss bounds of the tasks here (defaults are 30 s / 10 s).
LOST_S = 3.0
CLAIM_S = 3.0
RESULT_TIMEOUT_S = 60.0


def _uts_allowed() -> bool:
    try:
        return subprocess.run(
            ["unshare", "--uts", "--mount", "--propagation", "private", "true"],
            capture_output=True, timeout=10,
        ).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


pytestmark = pytest.mark.skipif(
    not _uts_allowed(), reason="needs unshare --uts --mount (root, namespaces allowed)"
)


class Fleet:
    """Host processes of one test; ``stop_all()`` kills them by PID."""

    def __init__(self, client: Client, task_queue: str, root: Path) -> None:
        self.address = server_address(client)
        self.task_queue = task_queue
        self.root = root
        self.hosts: list[WorkerProc] = []

    async def start(
        self, name: str, *, home: Path | None = None, hide: tuple[Path, ...] = (),
        wait: bool = True, **env: str,
    ) -> WorkerProc:
        """Start a host named ``name`` (its hostname) with its own home."""
        home = home or self.root / f"home-{name}-{len(self.hosts)}"
        home.mkdir(parents=True, exist_ok=True)
        proc = WorkerProc(
            self.address, home, self.task_queue, self.root / "logs" / f"{name}-{len(self.hosts)}.log",
            hostname=name, hide=hide, env=env,
        )
        self.hosts.append(proc)
        proc.start()
        if wait:
            await proc.wait_ready()
        return proc

    def kill_for_good(self, proc: WorkerProc) -> None:
        """A host that dies: its worker and every tool process it ran."""
        proc.kill()
        kill_leftover_tool_groups(proc.home)

    def stop_all(self) -> None:
        for proc in self.hosts:
            proc.stop()
            kill_leftover_tool_groups(proc.home)

    def logs(self) -> str:
        return "\n".join(f"--- {p.hostname} {p.log_path.name}\n{p.log()}" for p in self.hosts)


@pytest_asyncio.fixture
async def fleet(client: Client, task_queue: str, tmp_path: Path) -> AsyncIterator[Fleet]:
    f = Fleet(client, task_queue, tmp_path / "fleet")
    try:
        yield f
    finally:
        f.stop_all()


def _limits(**kw: Any) -> TaskLimits:
    return TaskLimits(
        host_lost_after_s=LOST_S, claim_timeout_s=CLAIM_S, heartbeat_timeout_s=2.0,
        **kw,
    )


async def _start(
    client: Client, task_queue: str, server: Any, workspace: Path, *, host: str | None = None,
    task_id: str | None = None, limits: TaskLimits | None = None, **fields: Any,
) -> Any:
    return await client.start_workflow(
        "AgentTask",
        AgentTaskInput(
            prompt="do the task", model="anthropic:scripted", base_url=server.url,
            workspace=str(workspace), limits=limits or _limits(), host=host, **fields,
        ),
        id=task_id or f"task-{uuid.uuid4().hex[:10]}",
        task_queue=task_queue,
        result_type=AgentTaskResult,
    )


async def _result(handle: Any, fleet: Fleet, timeout: float = RESULT_TIMEOUT_S) -> AgentTaskResult:
    try:
        return await asyncio.wait_for(handle.result(), timeout)
    except asyncio.TimeoutError:
        raise AssertionError(f"task did not finish; host logs:\n{fleet.logs()}") from None


async def _until(cond: Any, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _rows(home: Path, task_id: str) -> list[LedgerRow]:
    path = LedgerStore(home / "ledger").path(task_id)
    return LedgerStore.read_path(path) if path.exists() else []


def _texts(body: dict[str, Any]) -> str:
    return json.dumps(body["messages"])


def _cli(fleet: Fleet, home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``stopline ...`` from "another machine": its own empty home, no worker."""
    import os
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("STOPLINE_")}
    env.update(TEMPORAL_ADDRESS=fleet.address, STOPLINE_HOME=str(home),
               STOPLINE_TASK_QUEUE=fleet.task_queue)
    return subprocess.run([sys.executable, "-m", "stopline.cli", *args], capture_output=True,
                          text=True, env=env, timeout=60)


# ----------------------------------------------------------------- placement


async def test_a_client_without_a_worker_runs_on_the_pool_and_a_pin_runs_where_asked(
    client: Client, task_queue: str, scripted: Any, workspace: Path, fleet: Fleet,
) -> None:
    a = await fleet.start("host-a")
    b = await fleet.start("host-b")
    b_id = host_id_for(b.home)
    hostname = {"command": "hostname"}
    free = scripted(scenario("anthropic",
        entry(anthropic_message(tool_calls=[("c1", "shell", hostname)])),
        entry(anthropic_message("done"))))
    pinned = scripted(scenario("anthropic",
        entry(anthropic_message(tool_calls=[("c1", "shell", hostname)])),
        entry(anthropic_message("done"))))

    first = await _start(client, task_queue, free, workspace)
    second = await _start(client, task_queue, pinned, workspace, host=b_id)
    r1, r2 = await _result(first, fleet), await _result(second, fleet)

    assert r1.status == "completed" and r2.status == "completed", (r1, r2)
    assert r1.host_id in {host_id_for(a.home), b_id}
    assert r2.host_id == b_id
    # the tool ran on B: B's hostname, and the ledger in B's home only
    assert "host-b" in _texts(pinned.requests()[1]["body"])
    assert _rows(b.home, second.id) and not _rows(a.home, second.id)
    desc = await second.describe()
    assert desc.typed_search_attributes.get(sa.HOST) == b_id
    assert desc.typed_search_attributes.get(sa.STATUS) == "completed"

    # from a machine with an empty home: the transcript comes from Temporal
    laptop = fleet.root / "laptop"
    res = await asyncio.to_thread(_cli, fleet, laptop, "transcript", second.id, "--json")
    assert res.returncode == 0, res.stderr
    served = [LedgerRow.model_validate_json(line) for line in res.stdout.splitlines()]
    assert served == _rows(b.home, second.id)
    res = await asyncio.to_thread(_cli, fleet, laptop, "hosts", "--json")
    assert res.returncode == 0, res.stderr
    listed = {h["host_id"]: h for h in map(json.loads, res.stdout.splitlines())}
    assert set(listed) == {host_id_for(a.home), b_id}
    assert listed[b_id]["hostname"] == "host-b" and listed[b_id]["capacity"] == 8


async def test_a_full_pool_makes_a_task_wait_visibly_for_a_host(
    client: Client, task_queue: str, scripted: Any, workspace: Path, fleet: Fleet,
) -> None:
    await fleet.start("host-a", STOPLINE_HOST_CAPACITY="1")
    slow = scripted(scenario("anthropic", entry(anthropic_message("slow"), delay_s=6)))
    quick = scripted(scenario("anthropic", entry(anthropic_message("quick"))))
    first = await _start(client, task_queue, slow, workspace)
    await _until(lambda: slow.request_count() >= 1, "the first task to sample")
    second = await _start(client, task_queue, quick, workspace)
    await asyncio.sleep(1.0)
    st = await second.query("status", result_type=TaskStatus)
    assert st.state == "waiting_for_host" and st.host is None, st
    assert quick.request_count() == 0
    desc = await second.describe()
    assert desc.typed_search_attributes.get(sa.STATUS) == "waiting_for_host"
    res = await asyncio.to_thread(_cli, fleet, fleet.root / "laptop", "hosts", "--json")
    assert res.returncode == 0, res.stderr
    (host,) = map(json.loads, res.stdout.splitlines())
    assert host["task_ids"] == [first.id] and host["tasks"] == 1 and host["capacity"] == 1, host
    r1, r2 = await _result(first, fleet), await _result(second, fleet)
    assert (r1.status, r2.status) == ("completed", "completed")


async def test_run_says_when_its_task_waits_for_a_host(
    client: Client, task_queue: str, scripted: Any, workspace: Path, fleet: Fleet, tmp_path: Path,
) -> None:
    """The event stream is silent while a task waits for a slot: `run`,
    following it, says so on stderr instead of sitting silent, then goes on."""
    import json as _json

    await fleet.start("host-a", STOPLINE_HOST_CAPACITY="1")
    slow = scripted(scenario("anthropic", entry(anthropic_message("slow"), delay_s=6)))
    first = await _start(client, task_queue, slow, workspace)
    await _until(lambda: slow.request_count() >= 1, "the first task to sample")
    quick = tmp_path / "quick.json"
    quick.write_text(_json.dumps(scenario("anthropic", entry(anthropic_message("quick")))))
    res = await asyncio.to_thread(_cli, fleet, fleet.root / "laptop", "run", "go", "--model",
                                  f"scripted:{quick}", "--workspace", str(workspace), "--id", "waits-1")
    assert res.returncode == 0, res.stdout + res.stderr
    said = [ln for ln in res.stderr.splitlines() if "waits for a host" in ln]
    assert said == ["waits-1 waits for a host: none has a free slot or takes its queue; it goes on when "
                    "one does (`stopline hosts` shows each host's tasks)"], res.stderr
    assert "quick" in res.stdout
    assert (await _result(first, fleet)).status == "completed"


async def test_two_workers_on_one_home_the_second_refuses(
    client: Client, task_queue: str, fleet: Fleet, tmp_path: Path,
) -> None:
    home = tmp_path / "shared-home"
    await fleet.start("host-a", home=home)
    second = await fleet.start("host-a2", home=home, wait=False)
    rc = await second.wait_exit(30)
    assert rc == 2  # a set-up error
    assert "already serves" in second.log() and host_id_for(home) in second.log(), second.log()


async def test_a_worker_whose_home_is_deleted_stops_and_a_new_one_takes_the_path(
    client: Client, task_queue: str, fleet: Fleet, tmp_path: Path,
) -> None:
    """The lock went with the deleted home: the old worker must not go on
    serving beside the next one on that path (two processes, one home)."""
    import shutil

    home = tmp_path / "doomed-home"
    old = await fleet.start("host-old", home=home)
    first_id = host_id_for(home)
    shutil.rmtree(home)
    rc = await old.wait_exit(30)
    assert rc == 1 and "removed or replaced" in old.log(), old.log()
    new = await fleet.start("host-new", home=home)
    assert json.loads((home / "host.json").read_text())["host_id"] != first_id  # a new home, a new host
    assert new.alive()


async def test_replicas_sharing_one_volume_take_home_slots(
    client: Client, task_queue: str, fleet: Fleet, tmp_path: Path,
) -> None:
    """``STOPLINE_HOME_SLOTS``: replicas on one volume each take a free slot
    (their own host id); one more than the slots refuses; a replica started
    after one died takes the dead one's slot, and so its host id."""
    volume = tmp_path / "volume"
    first = await fleet.start("rep-1", home=volume, STOPLINE_HOME_SLOTS="2")
    second = await fleet.start("rep-2", home=volume, STOPLINE_HOME_SLOTS="2")
    ids = {host_id_for(volume / "slot-1"), host_id_for(volume / "slot-2")}
    assert len(ids) == 2
    third = await fleet.start("rep-3", home=volume, STOPLINE_HOME_SLOTS="2", wait=False)
    assert await third.wait_exit(30) != 0 and "all 2 host homes" in third.log(), third.log()
    fleet.kill_for_good(first)
    fourth = await fleet.start("rep-4", home=volume, STOPLINE_HOME_SLOTS="2")
    assert f"host_id={host_id_for(volume / 'slot-1')}" in fourth.log(), fourth.log()
    assert second.alive()


# ---------------------------------------------------------------- host loss


async def test_a_host_killed_mid_tool_moves_the_task_to_a_host_with_the_workspace(
    client: Client, task_queue: str, scripted: Any, workspace: Path, fleet: Fleet,
) -> None:
    a = await fleet.start("host-a")
    b = await fleet.start("host-b")
    server = scripted(scenario("anthropic",
        entry(anthropic_message(tool_calls=[("c1", "shell", {"command": "touch started; sleep 60"})])),
        entry(anthropic_message(tool_calls=[("c2", "shell", {"command": "hostname"})])),
        entry(anthropic_message("done"))))
    handle = await _start(client, task_queue, server, workspace, host=host_id_for(a.home))
    await _until(lambda: (workspace / "started").exists(), "the tool to start on A")
    killed = time.monotonic()
    fleet.kill_for_good(a)
    result = await _result(handle, fleet)
    took = time.monotonic() - killed

    assert result.status == "completed", result
    assert result.host_id == host_id_for(b.home)
    assert took < 60, took
    rows = _rows(b.home, handle.id)  # rebuilt on B from history, then continued
    (c1,) = [r for r in rows if r.kind == "tool_result" and r.call_id == "c1"]
    assert c1.text.startswith("lost:") and c1.ok is False, c1.text
    (lost,) = [r for r in rows if r.kind == "host_lost"]
    assert lost.model_visible and lost.meta["host_id"] == host_id_for(a.home)
    assert "host-b" in _texts(server.requests()[2]["body"])  # c2 ran on B
    assert [r.seq for r in rows] == list(range(1, len(rows) + 1))
    # the request made on A counts (the call ran in its sampling activity there)
    assert result.provider_calls == server.request_count() == 3, result
    print(f"\n[fleet] host killed mid-tool -> continued on B, task finished {took:.1f}s after the kill")


async def test_a_host_killed_mid_sampling_without_the_workspace_elsewhere_stops_host_lost(
    client: Client, task_queue: str, scripted: Any, tmp_path: Path, fleet: Fleet,
) -> None:
    private = tmp_path / "private"
    workspace = private / "ws"
    workspace.mkdir(parents=True)
    a = await fleet.start("host-a")
    await fleet.start("host-b", hide=(private,))  # B has no such workspace
    server = scripted(scenario("anthropic",
        entry(anthropic_message("held until A dies"), delay_s=60)))
    handle = await _start(client, task_queue, server, workspace, host=host_id_for(a.home))
    await _until(lambda: server.request_count() >= 1, "the model call on A")
    killed = time.monotonic()
    fleet.kill_for_good(a)
    result = await _result(handle, fleet)
    took = time.monotonic() - killed

    assert result.status == "stopped", result
    assert f"host {host_id_for(a.home)}" in result.reason and "lost; workspace unavailable" in result.reason
    assert took < 60, took
    # the ledger rows no host could take are in the result (and so in history)
    assert any(r.kind == "host_lost" for r in result.unflushed_rows)
    desc = await handle.describe()
    assert desc.status == WorkflowExecutionStatus.COMPLETED
    assert desc.typed_search_attributes.get(sa.STATUS) == "stopped"
    print(f"\n[fleet] host killed mid-sampling, no other host has the workspace -> stopped {took:.1f}s after")


async def test_a_host_restarted_under_a_new_hostname_keeps_its_tasks(
    client: Client, task_queue: str, scripted: Any, workspace: Path, fleet: Fleet, tmp_path: Path,
) -> None:
    home = tmp_path / "home-a"
    a = await fleet.start("host-a1", home=home)
    server = scripted(scenario("anthropic",
        entry(anthropic_message(tool_calls=[("c1", "shell", {"command": "hostname > first; sleep 60"})])),
        entry(anthropic_message(tool_calls=[("c2", "shell", {"command": "hostname"})])),
        entry(anthropic_message("done"))))
    handle = await _start(client, task_queue, server, workspace)
    await _until(lambda: (workspace / "first").exists(), "the first tool call")
    fleet.kill_for_good(a)
    await fleet.start("host-a2", home=home)
    result = await _result(handle, fleet)

    assert result.status == "completed", result
    assert result.host_id == host_id_for(home)
    assert (workspace / "first").read_text().strip() == "host-a1"
    assert "host-a2" in _texts(server.requests()[2]["body"])


# ------------------------------------------------- the transcript outlives its host


async def test_a_deleted_home_is_rebuilt_from_history_byte_for_byte(
    client: Client, task_queue: str, scripted: Any, workspace: Path, fleet: Fleet, tmp_path: Path,
) -> None:
    home = tmp_path / "home-a"
    a = await fleet.start("host-a", home=home)
    server = scripted(scenario("anthropic",
        entry(anthropic_message("looking", tool_calls=[("c1", "write_file", {"path": "f.txt", "content": "x\n"})])),
        entry(anthropic_message(tool_calls=[("c2", "read_file", {"path": "f.txt"})])),
        entry(anthropic_message("held until the home is gone"), delay_s=60),
        entry(anthropic_message("done"))))
    handle = await _start(client, task_queue, server, workspace)
    await _until(lambda: server.request_count() >= 3, "the third model call")
    original = LedgerStore(home / "ledger").path(handle.id).read_bytes()
    fleet.kill_for_good(a)
    shutil.rmtree(home)
    b = await fleet.start("host-a", home=home)  # same machine, an empty home: a new host id
    result = await _result(handle, fleet)

    assert result.status == "completed", result
    assert result.host_id == host_id_for(b.home)
    rebuilt = LedgerStore(home / "ledger").path(handle.id).read_bytes()
    assert rebuilt.startswith(original), "the rebuilt ledger differs from the original"
    reqs = server.requests()
    before, after = reqs[2]["body"]["messages"], reqs[3]["body"]["messages"]
    # the request the new host sent holds exactly what the original host had
    # sent for the same round, plus the host_lost marker (which joins the
    # last user message: the Messages API merges consecutive user turns)
    assert after[: len(before) - 1] == before[:-1]
    last_before, last_after = before[-1], after[len(before) - 1]
    assert last_after["role"] == last_before["role"] == "user"
    assert last_after["content"][: len(last_before["content"])] == last_before["content"]
    assert "<host_lost>" in json.dumps(last_after["content"][len(last_before["content"]):])
    assert len(after) == len(before)


async def test_reset_forks_the_ledger_and_the_model_never_sees_the_abandoned_branch(
    client: Client, task_queue: str, scripted: Any, workspace: Path, fleet: Fleet,
) -> None:
    a = await fleet.start("host-a")
    server = scripted(scenario("anthropic",
        entry(anthropic_message(tool_calls=[("c1", "shell", {"command": "echo one"})])),
        entry(anthropic_message("ABANDONED-BRANCH", tool_calls=[("c2", "shell", {"command": "echo two"})])),
        entry(anthropic_message("first run done")),
        # after the reset: the round-2 call again, then the end
        entry(anthropic_message("new branch", tool_calls=[("c3", "shell", {"command": "echo three"})])),
        entry(anthropic_message("second run done"))))
    handle = await _start(client, task_queue, server, workspace)
    first = await _result(handle, fleet)
    assert first.final_text == "first run done"
    history = await handle.fetch_history()
    # reset to the workflow task that completed right after round 1's tool
    # result: its sampling activity ran the call (DESIGN §1)
    tool_done = next(
        e.event_id for e in history.events
        if e.HasField("activity_task_completed_event_attributes")
        and e.activity_task_completed_event_attributes.scheduled_event_id in {
            s.event_id for s in history.events
            if s.HasField("activity_task_scheduled_event_attributes")
            and s.activity_task_scheduled_event_attributes.activity_type.name == "stopline.sample"
        }
    )
    wft = next(e.event_id for e in history.events
               if e.event_id > tool_done and e.HasField("workflow_task_completed_event_attributes"))
    resp = await client.workflow_service.reset_workflow_execution(ResetWorkflowExecutionRequest(
        namespace=client.namespace,
        workflow_execution=WorkflowExecution(workflow_id=handle.id, run_id=first_run(handle)),
        reason="test: fork", workflow_task_finish_event_id=wft, request_id=str(uuid.uuid4()),
    ))
    new = client.get_workflow_handle(handle.id, run_id=resp.run_id, result_type=AgentTaskResult)
    second = await _result(new, fleet)

    assert second.status == "completed" and second.final_text == "second run done", second
    reqs = server.requests()
    assert len(reqs) == 5
    assert "ABANDONED-BRANCH" in _texts(reqs[2]["body"])
    for req in reqs[3:]:
        assert "ABANDONED-BRANCH" not in _texts(req["body"]), "the model saw the abandoned branch"
        assert "echo two" not in _texts(req["body"])
    store = LedgerStore(a.home / "ledger")
    rows = store.read(handle.id)
    assert not any(r.text and "ABANDONED" in r.text for r in rows)
    assert [r.seq for r in rows] == list(range(1, len(rows) + 1))
    (fork,) = store.forks(handle.id)
    assert any(r.text == "ABANDONED-BRANCH" for r in fork)  # kept for audit
    res = await asyncio.to_thread(_cli, fleet, fleet.root / "laptop", "transcript", handle.id)
    assert res.returncode == 0 and "ABANDONED" not in res.stdout, res.stdout + res.stderr
    res = await asyncio.to_thread(
        _cli, fleet, fleet.root / "laptop", "transcript", handle.id, "--all-runs")
    assert res.returncode == 0 and "ABANDONED-BRANCH" in res.stdout, res.stdout + res.stderr


def first_run(handle: Any) -> str:
    return handle.result_run_id or handle.first_execution_run_id or ""


# ------------------------------------------------- a refusal guard no disk can lose


def _refusal() -> dict[str, Any]:
    return entry(anthropic_message("I can't help with that.", stop_reason="refusal"))


async def _reset_to_start(client: Client, handle: Any) -> Any:
    history = await handle.fetch_history()
    wft = next(e.event_id for e in history.events if e.HasField("workflow_task_completed_event_attributes"))
    resp = await client.workflow_service.reset_workflow_execution(ResetWorkflowExecutionRequest(
        namespace=client.namespace,
        workflow_execution=WorkflowExecution(workflow_id=handle.id, run_id=first_run(handle)),
        reason="test: reset after refusal", workflow_task_finish_event_id=wft,
        request_id=str(uuid.uuid4()),
    ))
    return client.get_workflow_handle(handle.id, run_id=resp.run_id, result_type=AgentTaskResult)


@pytest.mark.parametrize("kind", ["task", "fix"])
async def test_a_refused_task_reset_on_an_empty_home_never_reaches_the_provider(
    client: Client, task_queue: str, scripted: Any, workspace: Path, fleet: Fleet, tmp_path: Path,
    kind: str,
) -> None:
    home = tmp_path / "home-a"
    a = await fleet.start("host-a", home=home)
    first = scripted(scenario("anthropic", *[_refusal() for _ in range(6)]))
    second = scripted(scenario("anthropic", *[_refusal() for _ in range(6)]))
    extra: dict[str, Any] = {}
    if kind == "fix":
        extra = {"usage_source": "fix:ci", "reprobe_limit": 0, "quarantine_retries": 0,
                 "candidates": [ModelCandidate(model="anthropic:scripted", base_url=second.url)]}
    handle = await _start(client, task_queue, first, workspace, **extra)
    result = await _result(handle, fleet)
    assert result.status == "stopped" and result.refused, result
    calls = (first.request_count(), second.request_count())
    assert calls[0] >= 1

    fleet.kill_for_good(a)
    shutil.rmtree(home)
    await fleet.start("host-a", home=home)  # an empty home: no ledger, no refusal row on disk
    again = await _result(await _reset_to_start(client, handle), fleet)

    assert again.status == "stopped" and again.refused, again
    assert (first.request_count(), second.request_count()) == calls, "a reset reached the provider"


# ---------------------------------------------------- kills only where the process lives


def test_a_call_record_from_another_host_is_never_acted_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from stopline.activities.tools._state import call_record_path
    from stopline.activities.tools.procs import kill_call_groups, reap_orphan_calls
    from stopline.settings import load_settings

    home = tmp_path / "home-b"
    monkeypatch.setenv("STOPLINE_HOME", str(home))
    settings = load_settings()
    victim = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        record = call_record_path(settings, "task-x", "call-1")
        record.parent.mkdir(parents=True)
        # host A's record naming a pgid that, on this host, is an unrelated process
        record.write_text(json.dumps({
            "pgid": victim.pid, "pid": victim.pid, "started_at": time.time(),
            "host_id": "h-0000aaaa0000", "boot_id": "other-boot", "pid_ns": "pid:[1]",
        }))
        assert kill_call_groups("task-x", ["call-1"], settings=settings) == []
        assert reap_orphan_calls(settings) == []
        time.sleep(0.2)
        assert victim.poll() is None, "host B signalled a process because of host A's record"
        assert record.exists()  # not ours to remove either
    finally:
        victim.kill()
        victim.wait()


# ------------------------------------------------------------ an operator's move


async def test_an_operator_moves_a_waiting_task_and_a_running_one(
    client: Client, task_queue: str, scripted: Any, workspace: Path, fleet: Fleet,
) -> None:
    a = await fleet.start("host-a", STOPLINE_HOST_CAPACITY="1")
    b = await fleet.start("host-b")
    a_id, b_id = host_id_for(a.home), host_id_for(b.home)
    busy = scripted(scenario("anthropic",
        entry(anthropic_message(tool_calls=[("c1", "shell", {"command": "touch busy; sleep 8; hostname"})])),
        entry(anthropic_message(tool_calls=[("c2", "shell", {"command": "hostname"})])),
        entry(anthropic_message("done"))))
    stuck = scripted(scenario("anthropic", entry(anthropic_message("ran somewhere"))))
    first = await _start(client, task_queue, busy, workspace, host=a_id)
    await _until(lambda: (workspace / "busy").exists(), "the first task's tool on A")
    second = await _start(client, task_queue, stuck, workspace, host=a_id)  # A is full
    await asyncio.sleep(1.0)
    assert (await second.query("status", result_type=TaskStatus)).state == "waiting_for_host"

    res = await asyncio.to_thread(_cli, fleet, fleet.root / "laptop", "move", second.id, "--to", b_id)
    assert res.returncode == 0 and "waits to host" in res.stdout, res.stdout + res.stderr
    res = await asyncio.to_thread(_cli, fleet, fleet.root / "laptop", "move", first.id, "--to", b_id)
    assert res.returncode == 0 and "next round boundary" in res.stdout, res.stdout + res.stderr
    r1, r2 = await _result(first, fleet), await _result(second, fleet)

    assert (r1.status, r2.status) == ("completed", "completed"), (r1, r2)
    assert r2.host_id == b_id and r1.host_id == b_id
    reqs = busy.requests()
    assert "host-a" in _texts(reqs[1]["body"])  # round 1 ran on A
    assert "host-b" in _texts(reqs[2]["body"])  # round 2 on B after the move
    rows = _rows(b.home, first.id)  # rebuilt on B from history
    assert any(r.kind == "system" and "moved from host" in (r.text or "") for r in rows)
    assert not any(r.kind == "host_lost" for r in rows)  # nothing was lost
    res = await asyncio.to_thread(_cli, fleet, fleet.root / "laptop", "move", first.id)
    assert res.returncode == 2 and "completed" in res.stderr, res.stdout + res.stderr
