"""The ``shell`` tool: foreground commands that leave nothing behind, background shells that do.

Why this module exists: DESIGN §3 gives a foreground ``shell`` call strict
edges. It owns one process group (``start_new_session=True``) and, when the
call returns, that whole group is gone — after a normal exit (left-over
children are stopped too), a timeout, or a user interrupt. Stopping is
SIGTERM to the group first (so ``trap ... TERM`` cleanup runs), SIGKILL after
``kill_grace_s``. Output is captured head + tail (:mod:`.capture`) and drained
with a bounded deadline, so a grandchild that left the group (``setsid``) but
still holds the pipe cannot hang the call. Background shells are started
explicitly and are the only processes that outlive a call; they are not
stopped by an interrupt (DESIGN §3), only by ``shell_kill`` or
:func:`close_unattended_shells` when a task completes normally.

Cancellation: Temporal delivers an interrupt as ``asyncio.CancelledError``
inside the activity. The foreground runner catches it, stops the group, and
*returns* ``RespondToModel(aborted=True, terminal=False)`` with the output so
far — it never re-raises — unless the process had already exited, in which
case the real result is returned (``terminal=True``).

Why not ``asyncio.create_subprocess_exec``: its ``Process.wait()`` only
returns once every pipe is closed, so a grandchild holding stdout would hang
the call. Here the leader's exit is watched through a pidfd and the pipes are
read with ``loop.add_reader``, both owned and closed by this module.

Confinement (:mod:`.sandbox`): each command runs in a bubblewrap sandbox —
the workspace read-write, the system read-only, its own PID namespace, no
network unless the task allows it. In a foreground sandbox the command runs
under a small supervisor that stops what it left behind and says so; the
sandbox's PID namespace makes "the whole group is gone" hold for ``setsid``
escapers too. Where the sandbox cannot run, the task's ``allow_unconfined``
decides: refuse the call (``ok=False``, the model reads why) or run it as a
plain process group (the result carries ``unconfined_reason``, which the
workflow records). The environment is an allowlist either way
(:func:`.sandbox.tool_env`).

Disk: a call's full output is stored up to ``tool_output_store_cap_bytes``
(the result says where it was cut) and a background shell's log through a
rotating relay (:mod:`._logrelay`) capped at ``shell_log_cap_bytes``.

What it must never do: return while a process of a foreground call is alive;
keep more than the capture budget in memory; pass the worker's environment
to a child (anything a command prints reaches the model and the ledger;
DESIGN §5).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from stopline.core.contracts import RespondToModel
from stopline.core.policies import background_shell_id
from stopline.secrets import service_env
from stopline.settings import Settings, load_settings

from ._context import ToolContext
from ._state import (
    blob_path,
    blob_ref,
    read_json,
    shells_task_dir,
    write_json_atomic,
)
from .capture import OutputCapture, StreamName, clip_text, omitted_marker
from .procs import (
    forget_call,
    group_members,
    kill_sandbox,
    pipe_holders,
    record_call,
    sandbox_init_pid,
    terminate_group,
    terminate_groups_sync,
    terminate_sandbox,
    uncancel_current_task,
)
from .sandbox import SANDBOX_HOME, Confinement, bwrap_argv, confine, supervised, tool_env

#: Seconds to keep reading output after the group is gone (a process that
#: escaped the group may hold the pipe open forever).
DRAIN_DEADLINE_S = 0.5
#: The same after an abort: the interrupt's grace is short (DESIGN §3), so
#: an escaped pipe holder delays the aborted result by at most this much.
ABORT_DRAIN_DEADLINE_S = 0.05
#: Bytes per ``os.read`` of an output pipe.
READ_CHUNK = 1 << 20
#: Bytes reserved in ``output_cap_bytes`` for the status line, section
#: headers, omission markers and notes.
TEXT_OVERHEAD_BYTES = 512

#: The log relay of background shells (a stdlib-only script run by path).
LOG_RELAY = Path(__file__).with_name("_logrelay.py")


def content_budget(cap_bytes: int) -> int:
    """Bytes of stdout+stderr shown inline for an ``output_cap_bytes`` cap."""
    return max(cap_bytes - TEXT_OVERHEAD_BYTES, cap_bytes // 2, 0)


def display_command(command: str | list[str]) -> str:
    """The command as one line for result texts and records."""
    return command if isinstance(command, str) else shlex.join(command)


def to_argv(command: str | list[str]) -> list[str]:
    """A string runs with ``bash -c``; a list is the argv itself."""
    return ["bash", "-c", command] if isinstance(command, str) else list(command)


def _signal_name(number: int) -> str | None:
    try:
        return signal.Signals(number).name
    except ValueError:
        return None


def _describe_exit(returncode: int, *, sandboxed: bool = False) -> str:
    """``exit code N`` or ``killed by signal NAME``.

    In a sandbox the code comes through a shell (bubblewrap's supervisor), so
    a death by signal N arrives as 128+N and is said as such.
    """
    if returncode < 0:
        return f"killed by signal {_signal_name(-returncode) or -returncode}"
    name = _signal_name(returncode - 128) if sandboxed and returncode > 128 else None
    if name:
        return f"exit code {returncode} (128+{returncode - 128}: killed by signal {name})"
    return f"exit code {returncode}"


def _refused(text: str) -> RespondToModel:
    return RespondToModel(ok=False, text=f"shell {text}")


def _missing_program(argv: list[str], cwd: Path, env: dict[str, str]) -> str | None:
    """Why ``argv[0]`` cannot be started (checked before a sandbox spawn), or ``None``."""
    program = argv[0]
    if "/" in program:
        path = Path(program) if os.path.isabs(program) else cwd / program
        if not path.exists():
            return f"could not start {program!r}: program not found (No such file or directory)"
        if not os.access(path, os.X_OK) or path.is_dir():
            return f"could not start {program!r}: Permission denied"
        return None
    if shutil.which(program, path=env.get("PATH")) is None:
        return f"could not start {program!r}: program not found (not on PATH)"
    return None


def _spawn_error(argv: list[str], cwd: Path, err: OSError) -> str:
    what = err.strerror or str(err)
    if err.filename is not None and os.fspath(err.filename) == os.fspath(cwd):
        return f"could not start {argv[0]!r}: working directory {str(cwd)!r}: {what}"
    if isinstance(err, FileNotFoundError):
        return f"could not start {argv[0]!r}: program not found ({what})"
    return f"could not start {argv[0]!r}: {what}"


def _abort_cause() -> str:
    """Why the activity was cancelled, in the words of the result text."""
    from temporalio import activity

    details = None
    if activity.in_activity():
        with contextlib.suppress(Exception):
            details = activity.cancellation_details()
    if details is not None:
        if details.worker_shutdown:
            return "aborted because the worker is shutting down"
        if details.timed_out:
            return "aborted because the activity timed out"
        if details.paused:
            return "aborted because the activity was paused"
    return "aborted by user"


# ---------------------------------------------------------------------------
# Foreground.
# ---------------------------------------------------------------------------


class _PipeReader:
    """Read one output pipe from the event loop into the capture until EOF."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        fd: int,
        stream: StreamName,
        capture: OutputCapture,
    ) -> None:
        self._loop = loop
        self.fd = fd
        self._stream = stream
        self._capture = capture
        self.eof = asyncio.Event()
        os.set_blocking(fd, False)
        with contextlib.suppress(OSError, AttributeError):
            fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, READ_CHUNK)
        loop.add_reader(fd, self._ready)

    def _ready(self) -> None:
        self._read_once()

    def _read_once(self) -> bool:
        """One read into the capture; closes at EOF. False when nothing more is there now."""
        try:
            data = os.read(self.fd, READ_CHUNK)
        except BlockingIOError:
            return False
        except OSError:
            data = b""
        if not data:
            self.close()
            return False
        self._capture.feed(self._stream, data)
        return True

    def read_available(self) -> None:
        """Take whatever is in the pipe right now, without waiting."""
        while self.fd >= 0 and self._read_once():
            pass

    def close(self) -> None:
        """Stop reading and close the fd (idempotent)."""
        if self.fd < 0:
            return
        with contextlib.suppress(Exception):
            self._loop.remove_reader(self.fd)
        with contextlib.suppress(OSError):
            os.close(self.fd)
        self.fd = -1
        self.eof.set()


class _ExitWatcher:
    """Learn the moment the leader exits (pidfd), without waiting for its pipes."""

    def __init__(self, loop: asyncio.AbstractEventLoop, popen: subprocess.Popen[bytes]) -> None:
        self._loop = loop
        self._popen = popen
        self._event = asyncio.Event()
        self._pidfd = -1
        try:
            self._pidfd = os.pidfd_open(popen.pid)
            loop.add_reader(self._pidfd, self._on_exit)
        except (AttributeError, OSError):
            self.close()

    def _on_exit(self) -> None:
        with contextlib.suppress(Exception):
            self._loop.remove_reader(self._pidfd)
        self._event.set()

    async def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` seconds for the leader to exit (and reap it).

        Returns:
            ``True`` when it exited, ``False`` on timeout.
        """
        deadline = time.monotonic() + timeout_s
        while self._popen.poll() is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            if self._pidfd >= 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._event.wait(), min(remaining, 1.0))
            else:
                await asyncio.sleep(min(remaining, 0.01))
        return True

    def close(self) -> None:
        """Release the pidfd (idempotent)."""
        if self._pidfd >= 0:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(self._pidfd)
            with contextlib.suppress(OSError):
                os.close(self._pidfd)
            self._pidfd = -1


class _Foreground:
    """One foreground run: spawn, wait, stop what it started, drain, render.

    Unconfined, "what it started" is its process group. Sandboxed
    (``report_fd`` set), it is everything in the sandbox: the supervisor
    reports what the command left running through ``report_fd``, and
    stopping early is :func:`.procs.terminate_sandbox`.
    """

    def __init__(
        self,
        ctx: ToolContext,
        popen: subprocess.Popen[bytes],
        readers: list[_PipeReader],
        capture: OutputCapture,
        started: float,
        *,
        command: str | list[str],
        confinement: Confinement,
        report_fd: int = -1,
        info_fd: int = -1,
    ) -> None:
        self.ctx = ctx
        self.command = command
        self.popen = popen
        self.pgid = popen.pid  # start_new_session: the leader's pid is the group id
        self.readers = readers
        self.capture = capture
        self.started = started
        self.grace_s = ctx.inp.kill_grace_s
        self.watcher = _ExitWatcher(asyncio.get_running_loop(), popen)
        self.confinement = confinement
        self.sandboxed = confinement.sandbox is not None
        self.report_fd = report_fd
        self.info_fd = info_fd
        self._info = b""
        self._init: int | None = None
        self.notes: list[str] = []

    def _reap(self) -> None:
        self.popen.poll()

    def _exited(self) -> bool:
        return self.popen.poll() is not None

    def _init_pid(self) -> int | None:
        """Host pid of the sandbox's PID 1, from bubblewrap's ``--info-fd`` JSON."""
        if self._init is None and self.info_fd >= 0:
            with contextlib.suppress(OSError):
                while True:
                    data = os.read(self.info_fd, 4096)
                    if not data:
                        break
                    self._info += data
            found = re.search(rb'"child-pid"\s*:\s*(\d+)', self._info)
            if found:
                self._init = int(found.group(1))
        return self._init

    async def _stop(self) -> str:
        """TERM, grace, KILL: the group (unconfined) or the sandbox."""
        if self.sandboxed:
            return await terminate_sandbox(
                self.popen.pid, self.grace_s, exited=self._exited, init_pid=self._init_pid()
            )
        return await terminate_group(self.pgid, self.grace_s, reap=self._reap)

    def _report(self) -> list[str]:
        """What the supervisor wrote (it has exited: the pipe holds all of it)."""
        if self.report_fd < 0:
            return []
        chunks = []
        with contextlib.suppress(OSError):
            while True:
                data = os.read(self.report_fd, 4096)
                if not data:
                    break
                chunks.append(data)
        return b"".join(chunks).decode("ascii", "replace").split()

    async def run(self, timeout_s: float) -> RespondToModel:
        try:
            exited = await self.watcher.wait(timeout_s)
        except asyncio.CancelledError:
            uncancel_current_task()
            if self.popen.poll() is None:
                return await self._abort()
            exited = True  # terminal before the cancel arrived: keep the real result
        self.ctx.progress.terminal = True
        elapsed = time.monotonic() - self.started
        if exited:
            if self.sandboxed:
                report = self._report()
                if report[:1] == ["notfound"]:
                    await self._drain()
                    self.capture.close()
                    argv = to_argv(self.command)
                    return RespondToModel(ok=False, text=(
                        f"could not start {argv[0]!r}: program not found in the sandbox (it shows "
                        "the workspace and the system directories)"
                    ))
                if report[:1] == ["left"] and len(report) >= 3:
                    self.notes.append(self._leftover_note(int(report[1]), report[2]))
                # the sandbox's PID 1 dies with bwrap (and the kernel empties
                # its namespace first): wait until it has
                await terminate_sandbox(
                    self.popen.pid, 0.0, exited=self._exited, init_pid=self._init_pid()
                )
            else:
                leftover = group_members(self.pgid)
                if leftover:
                    end = await terminate_group(self.pgid, self.grace_s, reap=self._reap)
                    self.notes.append(self._leftover_note(len(leftover), end))
            code = _describe_exit(self.popen.returncode or 0, sandboxed=self.sandboxed)
            status = f"{code} after {elapsed:.1f}s"
        else:
            end = await self._stop()
            how = "SIGTERM" if end != "SIGKILL" else "SIGKILL: it did not exit on SIGTERM"
            what = "its sandbox was" if self.sandboxed else "its process group was"
            status = f"timed out after {timeout_s:g}s; {what} stopped ({how})"
        await self._drain()
        return self._result(status, terminal=True)

    @staticmethod
    def _leftover_note(count: int, end: str) -> str:
        return (
            f"note: {count} process(es) the command started were still running after it "
            f"exited (children, or ones that left its process group with setsid) and were "
            f"stopped ({end}); use background=true for processes that must keep running"
        )

    async def _abort(self) -> RespondToModel:
        """Cancelled before the process exited: TERM now, KILL after the grace (DESIGN §3)."""
        cancelled_at = time.monotonic() - self.started
        end = await self._stop()
        if end == "SIGKILL":
            self.notes.append("note: it did not exit on SIGTERM and was killed with SIGKILL")
        await self._drain(ABORT_DRAIN_DEADLINE_S)
        status = (
            f"{_abort_cause()} after {cancelled_at:.1f}s; the command may have partly run. "
            "Output so far:"
        )
        return self._result(status, terminal=False, aborted=True)

    async def _drain(self, deadline_s: float = DRAIN_DEADLINE_S) -> None:
        """Read what is left, for at most ``deadline_s`` seconds after the group is gone."""
        deadline = time.monotonic() + deadline_s
        try:
            for reader in self.readers:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(reader.eof.wait(), remaining)
        except asyncio.CancelledError:
            uncancel_current_task()
        holders: set[int] = set()
        held = False
        for reader in self.readers:
            reader.read_available()
            if reader.fd >= 0:
                held = True
                holders.update(pipe_holders(reader.fd))
                reader.close()
        if held:
            # A process holding the call's output pipe was spawned by the
            # call (it inherited the pipe), even if it left the group with
            # setsid: it goes too, so nothing of the call keeps writing
            # (DESIGN §3). Background shells never hold a call's pipe. (In
            # a sandbox every holder died with it; this is the unconfined case.)
            for pid in holders:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            who = ", ".join(str(p) for p in sorted(holders)) or "unknown"
            self.notes.append(
                f"note: process(es) {who} left the command's process group (e.g. setsid) "
                f"but still held its output pipe after {deadline_s:g}s; they were killed (SIGKILL)"
            )

    def _result(self, status: str, *, terminal: bool, aborted: bool = False) -> RespondToModel:
        self.capture.close()
        elapsed = time.monotonic() - self.started
        output_ref = None
        if self.capture.spilled and self.capture.spill_path is not None:
            output_ref = blob_ref(self.ctx.settings, self.capture.spill_path)
            if self.capture.store_cut:
                self.notes.append(
                    f"note: the output was {self.capture.total} bytes; the stored copy keeps its "
                    f"first {self.capture.store_cap} bytes (STOPLINE_TOOL_OUTPUT_STORE_CAP_BYTES)"
                )
        elif self.capture.spill_error:
            self.notes.append(f"note: the full output could not be saved: {self.capture.spill_error}")
        text = "\n".join([status, *self.notes, self.capture.render()])
        return RespondToModel(
            text=clip_text(text, self.ctx.inp.output_cap_bytes),
            ok=True,
            terminal=terminal,
            aborted=aborted,
            elapsed_s=round(elapsed, 3),
            output_ref=output_ref,
            unconfined_reason=self.confinement.unconfined_reason,
        )

    def cleanup(self) -> None:
        """Last line of defence (sync): no process, fd or record of the call survives it."""
        if self.sandboxed:
            if self.popen.poll() is None:
                kill_sandbox(self.popen.pid, self._init_pid() or sandbox_init_pid(self.popen.pid))
        elif group_members(self.pgid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=1.0)
        self.watcher.close()
        for reader in self.readers:
            reader.close()
        for fd in (self.report_fd, self.info_fd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.report_fd = self.info_fd = -1
        self.capture.close()
        forget_call(self.ctx.settings, self.ctx.inp.task_id, self.ctx.inp.call.id)


async def run_foreground(
    ctx: ToolContext, command: str | list[str], cwd: Path, timeout_s: float
) -> RespondToModel:
    """Run ``command`` (sandboxed when it can be) and return when all it started is gone.

    Args:
        ctx: The call's context (``kill_grace_s``, ``output_cap_bytes``,
            network and unconfined policy, state directories).
        command: A string (run with ``bash -c``) or an argv list.
        cwd: Working directory, already confined to the workspace.
        timeout_s: Seconds before the command is stopped (SIGTERM, grace,
            SIGKILL) and the result says "timed out".

    Returns:
        ``ok=True`` when it ran (any exit code, timeout, abort); ``ok=False``
        when it could not be spawned, or was refused (no sandbox here and
        the task does not allow running unconfined). On cancellation:
        ``aborted=True``, ``terminal=False`` (never raises ``CancelledError``).
    """
    confinement = confine(ctx.settings, ctx.inp)
    if isinstance(confinement, str):
        return _refused(confinement)
    argv = to_argv(command)
    inp = ctx.inp
    capture = OutputCapture(
        content_budget(inp.output_cap_bytes),
        blob_path(ctx.settings, inp.task_id, inp.call.id),
        store_cap=ctx.settings.tool_output_store_cap_bytes,
        redactor=_redactor(ctx.settings),
    )
    # sandboxed: the supervisor reports on its stdin (report_w); bwrap says
    # its PID 1's host pid on info_w
    report_r = report_w = info_r = info_w = -1
    if confinement.sandbox is not None:
        report_r, report_w = os.pipe()
        info_r, info_w = os.pipe()
        os.set_blocking(report_r, False)
        os.set_blocking(info_r, False)
        spawn_argv = bwrap_argv(
            confinement.sandbox, ctx.settings, workspace=ctx.workspace, cwd=cwd,
            network=inp.network, foreground=True, info_fd=info_w,
        ) + supervised(argv, inp.kill_grace_s)
        env = tool_env(inp, home=SANDBOX_HOME)
        spawn_cwd: Path = Path("/")
        stdin: int = report_w
        pass_fds: tuple[int, ...] = (info_w,)
    else:
        spawn_argv, env, spawn_cwd = argv, tool_env(inp, home=str(ctx.workspace)), cwd
        stdin, pass_fds = subprocess.DEVNULL, ()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    started = time.monotonic()
    try:
        try:
            popen = subprocess.Popen(
                spawn_argv,
                stdin=stdin,
                stdout=out_w,
                stderr=err_w,
                cwd=spawn_cwd,
                env=env,
                start_new_session=True,
                pass_fds=pass_fds,
            )
        finally:
            for fd in (out_w, err_w, report_w, info_w):
                if fd >= 0:
                    os.close(fd)
    except OSError as err:
        for fd in (out_r, err_r, report_r, info_r):
            if fd >= 0:
                os.close(fd)
        return RespondToModel(ok=False, text=_spawn_error(argv, cwd, err))
    loop = asyncio.get_running_loop()
    readers: list[_PipeReader] = []
    run: _Foreground | None = None
    try:
        readers.append(_PipeReader(loop, out_r, "stdout", capture))
        readers.append(_PipeReader(loop, err_r, "stderr", capture))
        run = _Foreground(
            ctx, popen, readers, capture, started, command=command, confinement=confinement,
            report_fd=report_r, info_fd=info_r,
        )
        record_call(
            ctx.settings, inp.task_id, inp.call.id, pid=popen.pid, pgid=popen.pid,
            sandbox=confinement.sandbox is not None,
        )
        return await run.run(timeout_s)
    finally:
        if run is not None:
            run.cleanup()
        else:  # failed between spawn and run: still leave nothing behind
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(popen.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                popen.wait(timeout=1.0)
            for fd in (out_r, err_r, report_r, info_r):
                if fd >= 0 and not any(r.fd == fd for r in readers):
                    with contextlib.suppress(OSError):
                        os.close(fd)
            for reader in readers:
                reader.close()
            capture.close()


def _redactor(settings: Settings) -> Any:
    from stopline.secrets import current_redactor

    return current_redactor(settings)


# ---------------------------------------------------------------------------
# Background shells.
# ---------------------------------------------------------------------------

#: Background shells this worker process started: (task_id, shell_id, pid) -> Popen.
#: Held so a waiter thread reaps each child when it exits (no zombies). The
#: pid is part of the key: a shell id is stable per (task, call), and two
#: state directories may hold the same one.
_BACKGROUND: dict[tuple[str, str, int], subprocess.Popen[bytes]] = {}
#: Exit codes the waiter threads saw: (task_id, shell_id, pid) -> returncode.
_BACKGROUND_EXIT: dict[tuple[str, str, int], int] = {}
_BACKGROUND_LOCK = threading.Lock()


def shell_id_for(task_id: str, call_id: str) -> str:
    """The background shell id a call gets (see
    :func:`stopline.core.policies.background_shell_id`)."""
    return background_shell_id(task_id, call_id)


def _record_path(settings: Settings, task_id: str, shell_id: str) -> Path:
    return shells_task_dir(settings, task_id) / f"{shell_id}.json"


def _wait_background(
    key: tuple[str, str, int],
    popen: subprocess.Popen[bytes],
    record: Path,
    relay: subprocess.Popen[bytes] | None,
) -> None:
    """Thread body: reap the child (and its log relay) when it exits; note its exit code."""
    try:
        rc = popen.wait()
        with _BACKGROUND_LOCK:
            _BACKGROUND_EXIT[key] = rc
        data = read_json(record)
        if data is not None:
            data.update(exit_code=rc, ended_at=time.time())
            write_json_atomic(record, data)
        if relay is not None:
            relay.wait()  # exits once everything the shell started is gone
    except Exception:  # noqa: BLE001 - a reaper thread must never raise
        pass


def _start_relay(log: Path, cap: int) -> tuple[subprocess.Popen[bytes], int]:
    """Start the log relay for a background shell; returns it and the pipe's write end."""
    read_end, write_end = os.pipe()
    with contextlib.suppress(OSError, AttributeError):
        fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, READ_CHUNK)
    try:
        relay = subprocess.Popen(
            [sys.executable, "-I", str(LOG_RELAY), str(log), str(cap)],
            stdin=read_end,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=service_env({k: v for k, v in os.environ.items() if k in ("PATH", "LANG")}),
            start_new_session=True,  # not in the shell's group: shell_kill leaves it to drain
        )
    except OSError:
        os.close(write_end)
        raise
    finally:
        os.close(read_end)
    return relay, write_end


async def start_background(ctx: ToolContext, command: str | list[str], cwd: Path) -> RespondToModel:
    """Start ``command`` as a background shell that outlives the call (DESIGN §3).

    It runs in a sandbox of its own (the same confinement as a foreground
    call, without ``--die-with-parent``: it survives the call, an interrupt
    and a worker restart). Its stdout+stderr go through a relay
    (:mod:`._logrelay`) to ``<shells_dir>/<task>/<shell_id>.log``, capped at
    ``shell_log_cap_bytes`` (the newest output is kept), and
    ``<shell_id>.json`` records ``shell_id, pid, pgid, command, started_at,
    log``. Starting the same call twice (a retried activity) reports the
    shell already started instead of starting another.

    Returns:
        ``ok=True`` with the shell id and pid; ``ok=False`` when it could
        not be spawned or was refused (no sandbox, unconfined not allowed).
    """
    inp = ctx.inp
    shell_id = shell_id_for(inp.task_id, inp.call.id)
    directory = shells_task_dir(ctx.settings, inp.task_id)
    directory.mkdir(parents=True, exist_ok=True)
    record = directory / f"{shell_id}.json"
    log = directory / f"{shell_id}.log"
    existing = read_json(record)
    if existing is not None:
        ctx.progress.terminal = True
        return RespondToModel(
            text=(
                f"background shell {shell_id} was already started by this call "
                f"(pid {existing.get('pid')}). "
                f"Use shell_status / shell_kill with shell_id={shell_id!r}."
            )
        )
    confinement = confine(ctx.settings, inp)
    if isinstance(confinement, str):
        return _refused(confinement)
    argv = to_argv(command)
    if confinement.sandbox is not None:
        env = tool_env(inp, home=SANDBOX_HOME)
        spawn_argv = bwrap_argv(
            confinement.sandbox, ctx.settings, workspace=ctx.workspace, cwd=cwd,
            network=inp.network, foreground=False,
        ) + argv
        spawn_cwd = Path("/")
    else:
        env = tool_env(inp, home=str(ctx.workspace))
        spawn_argv, spawn_cwd = argv, cwd
    missing = _missing_program(argv, cwd, env)
    if missing is not None:
        return RespondToModel(ok=False, text=missing)
    cap = ctx.settings.shell_log_cap_bytes
    try:
        relay, write_end = _start_relay(log, cap)
    except OSError as err:
        return RespondToModel(ok=False, text=f"could not start the log relay of the shell: {err}")
    try:
        popen = subprocess.Popen(
            spawn_argv,
            stdin=subprocess.DEVNULL,
            stdout=write_end,
            stderr=subprocess.STDOUT,
            cwd=spawn_cwd,
            env=env,
            start_new_session=True,
        )
    except OSError as err:
        os.close(write_end)
        relay.wait()
        return RespondToModel(ok=False, text=_spawn_error(argv, cwd, err))
    os.close(write_end)
    key = (inp.task_id, shell_id, popen.pid)
    data: dict[str, Any] = {
        "shell_id": shell_id,
        "pid": popen.pid,
        "pgid": popen.pid,
        "command": display_command(command),
        "cwd": str(cwd),
        "started_at": time.time(),
        "log": str(log),
        "log_cap": cap,
        "call_id": inp.call.id,
        "sandbox": confinement.sandbox is not None,
    }
    write_json_atomic(record, data)
    with _BACKGROUND_LOCK:
        _BACKGROUND[key] = popen
    threading.Thread(
        target=_wait_background, args=(key, popen, record, relay), name=f"reap-{shell_id}",
        daemon=True,
    ).start()
    ctx.progress.terminal = True
    return RespondToModel(
        text=(
            f"started background shell {shell_id} (pid {popen.pid}); its stdout and stderr go "
            f"to a log (the newest {cap} bytes are kept) that shell_status shows the tail of. "
            f"It keeps running after this call and after an interrupt; use shell_kill to stop "
            f"it (shell_id={shell_id!r})."
        ),
        unconfined_reason=confinement.unconfined_reason,
    )


def _shell_state(settings: Settings, task_id: str, data: dict[str, Any]) -> tuple[bool, int | None]:
    """``(running, exit_code)`` of a background shell record.

    Running means some process of its group is alive (the leader, or children
    it left behind). The exit code is known when this worker reaped it or a
    waiter wrote it to the record.
    """
    shell_id = str(data.get("shell_id"))
    pgid = int(data.get("pgid", 0))
    with _BACKGROUND_LOCK:
        rc = _BACKGROUND_EXIT.get((task_id, shell_id, pgid))
    if rc is None and isinstance(data.get("exit_code"), int):
        rc = int(data["exit_code"])
    running = pgid > 1 and bool(group_members(pgid))
    popen = _BACKGROUND.get((task_id, shell_id, pgid))
    if not running and rc is None and popen is not None:
        # Gone but not yet reaped by its waiter thread: that takes a moment.
        with contextlib.suppress(subprocess.TimeoutExpired):
            rc = popen.wait(timeout=0.2)
    if running and rc is None and popen is None:
        # Started by another worker process: make sure the pid was not reused.
        import psutil

        try:
            if psutil.Process(pgid).create_time() > float(data.get("started_at", 0)) + 2.0:
                running = False
        except psutil.Error:
            pass
    return running, rc


def _log_tail(path: Path, budget: int) -> str:
    """The last ``budget`` bytes of a background shell's log (``LOG.1`` then ``LOG``).

    Says how much is left out: the part of the log not shown, and the
    output the relay dropped to keep the log within its cap.
    """
    parts: list[bytes] = []
    total = 0
    try:
        for piece in (Path(f"{path}.1"), path):
            if not piece.exists():
                continue
            size = piece.stat().st_size
            total += size
            with open(piece, "rb") as f:
                if size > budget:
                    f.seek(size - budget)
                parts.append(f.read(budget))
    except OSError as err:
        return f"(log unreadable: {err.strerror or err})"
    raw = b"".join(parts)[-budget:] if budget > 0 else b""
    text = raw.decode("utf-8", errors="replace") or "(empty)"
    lines = []
    cut = read_json(Path(f"{path}.cut"))
    if cut is not None and int(cut.get("dropped", 0)) > 0:
        lines.append(
            f"[log capped at {cut.get('cap')} bytes: the oldest {cut['dropped']} bytes of output "
            "were dropped]"
        )
    if total > len(raw):
        lines.append(omitted_marker(total - len(raw)))
    return "\n".join([*lines, text])


def _known_shells(settings: Settings, task_id: str) -> list[str]:
    directory = shells_task_dir(settings, task_id)
    try:
        return sorted(p.stem for p in directory.glob("sh-*.json"))
    except OSError:
        return []


def _unknown_shell(settings: Settings, task_id: str, shell_id: str) -> RespondToModel:
    known = _known_shells(settings, task_id)
    hint = f"known shells of this task: {', '.join(known)}" if known else "this task has no background shells"
    return RespondToModel(ok=False, text=f"unknown shell_id {shell_id!r}; {hint}")


def _lookup(settings: Settings, task_id: str, shell_id: str) -> dict[str, Any] | None:
    if not re.fullmatch(r"sh-[0-9a-f]{8}", shell_id):
        return None
    return read_json(_record_path(settings, task_id, shell_id))


async def shell_status(ctx: ToolContext, shell_id: str) -> RespondToModel:
    """Report a background shell: running or exited, pid, and its log's tail (capped).

    Returns:
        ``ok=True`` with ``"shell <id>: running (pid N, started Ts ago)"`` or
        ``"shell <id>: exited with exit code C (pid N)"``, the command, the log
        path and ``--- log tail ---``; ``ok=False`` for an unknown id.
    """
    settings, task_id = ctx.settings, ctx.inp.task_id
    data = _lookup(settings, task_id, shell_id)
    if data is None:
        return _unknown_shell(settings, task_id, shell_id)
    running, rc = _shell_state(settings, task_id, data)
    pid = data.get("pid")
    age = time.time() - float(data.get("started_at", time.time()))
    sandboxed = bool(data.get("sandbox"))
    if running and rc is None:
        state = f"running (pid {pid}, started {age:.1f}s ago)"
    elif running:
        state = f"leader exited with {_describe_exit(rc, sandboxed=sandboxed)} but processes of its group are still running (pid {pid})"  # type: ignore[arg-type]
    elif rc is not None:
        state = f"exited with {_describe_exit(rc, sandboxed=sandboxed)} (pid {pid})"
    else:
        state = f"exited, exit code unknown (pid {pid}; started by another worker process)"
    log = Path(str(data.get("log", "")))
    tail = _log_tail(log, content_budget(ctx.inp.output_cap_bytes))
    ctx.progress.terminal = True
    text = f"shell {shell_id}: {state}\ncommand: {data.get('command')}\nlog: {log}\n--- log tail ---\n{tail}"
    return RespondToModel(text=clip_text(text, ctx.inp.output_cap_bytes))


async def shell_kill(ctx: ToolContext, shell_id: str) -> RespondToModel:
    """Stop a background shell's whole group: SIGTERM, ``kill_grace_s``, SIGKILL.

    Returns:
        ``ok=True`` saying how it ended (or that it had already exited);
        ``ok=False`` for an unknown id.
    """
    settings, task_id = ctx.settings, ctx.inp.task_id
    data = _lookup(settings, task_id, shell_id)
    if data is None:
        return _unknown_shell(settings, task_id, shell_id)
    running, rc = _shell_state(settings, task_id, data)
    pid = data.get("pid")
    if not running:
        ctx.progress.terminal = True
        how = _describe_exit(rc, sandboxed=bool(data.get("sandbox"))) if rc is not None else "exit code unknown"
        return RespondToModel(text=f"shell {shell_id} (pid {pid}) had already exited ({how}); nothing to stop")
    end = await terminate_group(int(data["pgid"]), ctx.inp.kill_grace_s)
    ctx.progress.terminal = True
    how = "SIGTERM" if end != "SIGKILL" else "SIGKILL: it did not exit on SIGTERM"
    return RespondToModel(text=f"shell {shell_id} (pid {pid}) stopped ({how})")


def close_unattended_shells(
    task_id: str, *, settings: Settings | None = None, grace_s: float = 0.1
) -> list[str]:
    """Stop every still-running background shell of a task that completed normally.

    DESIGN §3/§4: a normal finish closes the task's background shells; an
    interrupt or a refusal leaves them running (do not call this then).
    Blocking: all groups get SIGTERM at once, then share one grace of
    ``grace_s`` seconds, then SIGKILL (run it in a thread from async code if
    that matters).

    Args:
        task_id: The task.
        settings: Where state lives; default :func:`load_settings`.
        grace_s: Seconds between SIGTERM and SIGKILL.

    Returns:
        The shell ids that were running and were stopped, sorted.
    """
    settings = settings or load_settings()
    running: dict[int, str] = {}
    for shell_id in _known_shells(settings, task_id):
        data = read_json(_record_path(settings, task_id, shell_id))
        if data is None:
            continue
        alive, _ = _shell_state(settings, task_id, data)
        if alive:
            running[int(data["pgid"])] = shell_id
    if running:
        terminate_groups_sync(list(running), grace_s)
    return sorted(running.values())
