"""Run a real stopline worker in a subprocess, for crash and shutdown tests.

The worker is ``python -m stopline.worker.main`` in its own session, with
``TEMPORAL_ADDRESS`` pointing at the test session's dev server,
``STOPLINE_HOME`` at the test's home and both task queues set to the test's
fresh queue. It is stopped by its own PID only (never by name): ``kill()``
sends SIGKILL (a crash), ``terminate()`` SIGTERM (a graceful shutdown), and
``stop()`` — for ``finally`` blocks — SIGKILLs it if it is still alive and
reaps it.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
from temporalio.client import Client

REPO = Path(__file__).resolve().parent.parent


def server_address(client: Client) -> str:
    """The ``host:port`` of the dev server a client talks to."""
    return client.service_client.config.target_host


class WorkerProc:
    """One worker subprocess.

    Args:
        address: Temporal frontend ``host:port``.
        home: ``$STOPLINE_HOME`` for the worker.
        task_queue: Workflow and host task queue (one worker serves both).
        log_path: Where its stdout and stderr go.
    """

    def __init__(
        self,
        address: str,
        home: Path,
        task_queue: str,
        log_path: Path,
        *,
        hostname: str | None = None,
        hide: tuple[Path, ...] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        self.address = address
        self.home = home
        self.task_queue = task_queue
        self.log_path = log_path
        self.hostname = hostname
        self.hide = hide
        self.extra_env = env or {}
        self.popen: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.popen is not None, "worker not started"
        return self.popen.pid

    def start(self) -> WorkerProc:
        """Spawn the worker in its own session (returns at once; see :meth:`wait_ready`)."""
        env = dict(os.environ)
        # Hermetic: no provider keys; no payload codec (the test client has
        # none); no metrics listener (two workers overlap in the SIGTERM test).
        for var in (
            "ANTHROPIC_API_KEY", "OPENAI_API_KEY", "STOPLINE_CODEC_KEY",
            "STOPLINE_CODEC_PREVIOUS_KEYS", "STOPLINE_METRICS_BIND", "STOPLINE_OTEL",
        ):
            env.pop(var, None)
        env.update(
            TEMPORAL_ADDRESS=self.address,
            STOPLINE_HOME=str(self.home),
            STOPLINE_TASK_QUEUE=self.task_queue,
            PYTHONUNBUFFERED="1",
            # These tests give tasks 1-2 s heartbeat timeouts so a killed
            # worker is noticed fast. The SDK spaces heartbeats at 0.8 × the
            # timeout at most — 1.6 s for 2 s, too thin on a loaded machine —
            # unless the worker's throttle is lower: an explicit limit here,
            # not the 5 s default meant for 30 s timeouts.
            STOPLINE_HEARTBEAT_THROTTLE_S="0.25",
        )
        env.update(self.extra_env)
        argv = [sys.executable, "-m", "stopline.worker.main"]
        if self.hostname is not None or self.hide:
            # Another host: its own UTS namespace (its own hostname) and
            # mount namespace, where each hidden directory is covered by an
            # empty tmpfs (a path this host does not have). unshare and sh
            # exec in place, so the PID we hold is the worker's.
            steps = []
            if self.hostname is not None:
                steps.append(f"hostname {shlex.quote(self.hostname)}")
            steps += [f"mount -t tmpfs tmpfs {shlex.quote(str(d))}" for d in self.hide]
            steps.append("exec " + " ".join(shlex.quote(a) for a in argv))
            argv = ["unshare", "--uts", "--mount", "--propagation", "private",
                    "sh", "-c", " && ".join(steps)]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.popen = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=REPO,
                env=env,
                start_new_session=True,
            )
        return self

    def log(self) -> str:
        """The worker's output so far."""
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def alive(self) -> bool:
        """Whether the process has not exited (it is reaped when it has)."""
        return self.popen is not None and self.popen.poll() is None

    async def wait_ready(self, timeout_s: float = 30.0) -> None:
        """Wait until the worker logged ``worker_started`` (it is about to poll)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if "worker_started" in self.log():
                return
            if not self.alive():
                raise AssertionError(f"worker exited before it started:\n{self.log()}")
            await asyncio.sleep(0.05)
        raise AssertionError(f"worker did not start in {timeout_s}s:\n{self.log()}")

    def kill(self) -> None:
        """SIGKILL the worker (a crash) and reap it."""
        self._signal(signal.SIGKILL)
        assert self.popen is not None
        self.popen.wait(timeout=10)

    def terminate(self) -> None:
        """SIGTERM the worker (a graceful shutdown); does not wait."""
        self._signal(signal.SIGTERM)

    async def wait_exit(self, timeout_s: float = 30.0) -> int:
        """Wait for the worker to exit; its return code."""
        assert self.popen is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            rc = self.popen.poll()
            if rc is not None:
                return rc
            await asyncio.sleep(0.05)
        raise AssertionError(f"worker {self.pid} did not exit in {timeout_s}s:\n{self.log()}")

    def stop(self) -> None:
        """For ``finally``: SIGKILL the worker by its PID if still alive, and reap it."""
        if self.popen is None:
            return
        if self.popen.poll() is None:
            self._signal(signal.SIGKILL)
        try:
            self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def _signal(self, sig: int) -> None:
        assert self.popen is not None
        if self.popen.poll() is None:
            try:
                os.kill(self.popen.pid, sig)
            except ProcessLookupError:
                pass


def kill_leftover_tool_groups(home: Path) -> list[int]:
    """SIGKILL the process groups of foreground tool calls whose worker died.

    A foreground call records ``{"pgid", "pid", "started_at"}`` under
    ``$STOPLINE_HOME/procs/<task>/<call>.json`` and removes it when it
    returns; a record left behind is a call whose worker was killed. Each
    group is signalled by its recorded id, only if its leader is the process
    that was recorded (same start time), never by name.

    Returns:
        The pgids signalled.
    """
    killed: list[int] = []
    for record in sorted((home / "procs").glob("*/*.json")):
        try:
            data = json.loads(record.read_text())
            pgid = int(data["pgid"])
            started_at = float(data.get("started_at", 0.0))
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if pgid <= 1:
            continue
        try:
            if psutil.Process(pgid).create_time() > started_at + 2.0:
                continue  # the pid was reused: not ours
        except psutil.Error:
            continue  # the leader is gone
        try:
            os.killpg(pgid, signal.SIGKILL)
            killed.append(pgid)
        except (ProcessLookupError, PermissionError):
            pass
    return killed


class Workers:
    """Every worker subprocess a test starts; ``stop_all()`` in ``finally``."""

    def __init__(self, client: Client, home: Path, task_queue: str, log_dir: Path) -> None:
        self._address = server_address(client)
        self._home = home
        self._tq = task_queue
        self._log_dir = log_dir
        self.started: list[WorkerProc] = []

    async def start(self) -> WorkerProc:
        """Start one more worker and wait until it is up."""
        n = len(self.started) + 1
        proc = WorkerProc(self._address, self._home, self._tq, self._log_dir / f"worker-{n}.log")
        self.started.append(proc)
        proc.start()
        await proc.wait_ready()
        return proc

    def stop_all(self) -> None:
        """SIGKILL (by PID) every worker still alive, then every tool process
        group a dead worker left behind (see :func:`kill_leftover_tool_groups`)."""
        for proc in self.started:
            proc.stop()
        kill_leftover_tool_groups(self._home)

    def logs(self) -> str:
        """All workers' output, for assertion messages."""
        return "\n".join(
            f"--- {p.log_path.name} (pid {p.popen.pid if p.popen else '?'})\n{p.log()}"
            for p in self.started
        )
