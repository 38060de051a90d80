"""The tool sandbox: what a model's command can see, touch and reach (bubblewrap).

Why this module exists: a ``shell`` call runs a command the model chose, on a
team's host, as the worker's user. Checking paths in the file tools does not
confine a command. Each call therefore runs in its own bubblewrap sandbox
(``bwrap``: Linux namespaces, no daemon, no root needed) built here:

- the workspace read-write, at its own path; the system directories
  (:data:`SYSTEM_RO_PATHS`, plus ``STOPLINE_SANDBOX_RO_PATHS``) read-only;
  nothing else of the host — not ``$STOPLINE_HOME`` (ledgers, blobs, shell
  logs), not other workspaces, not the worker's home;
- a private ``/tmp`` (size-capped tmpfs) and ``HOME=/tmp/home``;
- its own PID namespace (no other process is visible: no ``/proc/<pid>/environ``
  of the worker, the dev server or the CLI), IPC and UTS namespaces;
- no network unless the task allows it (``--unshare-net`` leaves only a
  loopback of its own: ``127.0.0.1`` is not the host's);
- no capabilities, even when the worker runs as root (``--cap-drop ALL``:
  root in the sandbox cannot remount the read-only system);
- an environment by allowlist (:func:`tool_env`): ``PATH``, locale,
  ``TERM``, ``HOME`` and the variables the task passes, nothing else.

A foreground call's sandbox also has ``--die-with-parent`` and
``--new-session``. Its command runs under :data:`SUPERVISOR`, a few lines of
``/bin/sh`` that are PID 2 of the sandbox: when the command exits, whatever it
left running in the sandbox (children, ``setsid`` escapers) gets SIGTERM, then
SIGKILL after the call's grace, and the supervisor reports how many on its
stdin (a pipe to the worker), so the result can tell the model (DESIGN §3).
When the supervisor exits, bubblewrap exits, its PID 1 dies with it and the
kernel kills anything left in the namespace — nothing outlives the call. To
stop a call early the worker sends SIGTERM to the sandbox's session (the
supervisor defers it; the command and its group get it, so ``trap`` cleanup
runs) and, after the grace, SIGKILL to the sandbox's PID 1
(:mod:`.procs`). A background shell's sandbox has neither flag: it outlives
the call, an interrupt and a worker restart, and its whole tree is one process
group (bubblewrap, its PID 1, the shell), stopped by ``shell_kill``.

Where bubblewrap cannot run (not installed, no user namespaces, a container
profile that forbids them) :func:`sandbox_status` says why, the worker logs it
at start, and each task's ``allow_unconfined`` decides (:func:`confine`):
refuse ``shell`` calls, or run them unconfined with a ledger row saying so.

What it must never do: bind ``$STOPLINE_HOME`` or any host path beyond the
workspace and the read-only system; pass the worker's environment; keep
capabilities; let a foreground sandbox outlive its call.

What it does not guarantee (README, "The sandbox"): the system directories
are readable (``/etc`` included); a command with network allowed reaches
whatever the host reaches; CPU and memory are not limited; the kernel is
shared (a kernel exploit escapes any namespace sandbox).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from stopline.core.contracts import ToolCallInput
from stopline.settings import Settings

__all__ = [
    "SANDBOX_HOME",
    "SUPERVISOR",
    "SYSTEM_RO_PATHS",
    "Confinement",
    "SandboxStatus",
    "bwrap_argv",
    "confine",
    "sandbox_status",
    "supervised",
    "tool_env",
]

#: Host directories every sandbox shows read-only (those that exist; a
#: top-level symlink such as a merged-/usr ``/bin`` is recreated as a symlink).
SYSTEM_RO_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/opt")
#: ``HOME`` inside the sandbox: on its private ``/tmp``, empty at every call.
SANDBOX_HOME = "/tmp/home"
#: ``PATH`` when the worker has none.
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: Seconds the probe may take (bubblewrap starts in milliseconds).
PROBE_TIMEOUT_S = 10.0

#: PID 2 of a foreground sandbox. ``$1``: the grace in centiseconds (timed
#: by ``/proc/uptime``, so a loaded machine does not stretch it); the rest:
#: the command's argv. Its stdin is a pipe to the worker: it writes
#: ``notfound`` when the program does not exist and ``left N SIGTERM|SIGKILL``
#: when N processes were still running after the command exited. It defers
#: SIGTERM (a handler, not "ignore", so the command does not inherit it) so
#: it outlives the command it waits for. dash's ``kill`` has no ``-1``: each
#: process found in /proc (the sandbox's own) is signalled by pid — for the
#: KILL, all are stopped first, so none runs on when its child dies before
#: it (``/proc`` lists pids in text order: a child can come first).
SUPERVISOR = r"""t=$1; shift
trap : TERM INT HUP
if ! command -v -- "$1" >/dev/null 2>&1; then printf 'notfound\n' >&0; exit 127; fi
( exec "$@" 0</dev/null )
rc=$?
left() {
  c=0
  for d in /proc/[0-9]*; do
    p=${d#/proc/}
    case $p in 1|$$) continue ;; esac
    { read -r s < "$d/stat"; } 2>/dev/null || continue
    s=${s##*) }
    case $s in Z*|X*) continue ;; esac
    c=$((c+1))
    [ -n "$1" ] && kill -s "$1" "$p" 2>/dev/null
  done
}
now() {
  read -r u _ < /proc/uptime; u=${u%.*}${u#*.}
  while [ "${u#0}" != "$u" ]; do u=${u#0}; done; u=${u:-0}
}
left TERM
if [ "$c" -gt 0 ]; then
  n=$c; how=SIGTERM; now; end=$((u+t))
  while sleep 0.01; left; [ "$c" -gt 0 ]; do
    now
    if [ "$u" -ge "$end" ]; then how=SIGKILL; left STOP; left KILL; break; fi
  done
  printf 'left %s %s\n' "$n" "$how" >&0
fi
exit $rc
"""


@dataclass(frozen=True)
class SandboxStatus:
    """Whether bubblewrap works on this host.

    Attributes:
        available: It ran a probe command with the flags tool calls use.
        detail: Its version and path, or why it is not available (with
            what to install or change).
        bwrap: The program's path (``None`` when not found).
        tmp_size: The bubblewrap supports ``--size`` (0.8+), so the private
            ``/tmp`` is capped.
    """

    available: bool
    detail: str
    bwrap: str | None = None
    tmp_size: bool = False


@dataclass(frozen=True)
class Confinement:
    """How one call runs.

    Attributes:
        sandbox: The sandbox to run in; ``None``: unconfined.
        unconfined_reason: Why it runs unconfined (``None`` when sandboxed);
            the workflow records it as a ledger row.
    """

    sandbox: SandboxStatus | None
    unconfined_reason: str | None = None


def _probe_argv(bwrap: str, tmp_size: bool) -> list[str]:
    argv = _isolation_flags(bwrap, network=False, foreground=True)
    argv += _system_binds([])
    argv += ["--proc", "/proc", "--dev", "/dev"]
    if tmp_size:
        argv += ["--size", str(16 * 1024 * 1024)]
    argv += ["--tmpfs", "/tmp", "--", "/bin/sh", "-c", ":"]
    return argv


@functools.lru_cache(maxsize=8)
def _probe(mode: str, program: str) -> SandboxStatus:
    if mode == "off":
        return SandboxStatus(False, "the operator turned the sandbox off (STOPLINE_SANDBOX=off)")
    path = shutil.which(program)
    if path is None:
        return SandboxStatus(
            False,
            f"bubblewrap is not installed (no {program!r} on PATH); install the `bubblewrap` "
            "package (Debian/Ubuntu: apt-get install bubblewrap) or set STOPLINE_BWRAP",
        )
    try:
        helptext = subprocess.run(
            [path, "--help"], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, check=False
        ).stdout
        tmp_size = "--size" in helptext
        done = subprocess.run(
            _probe_argv(path, tmp_size),
            capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, check=False,
            stdin=subprocess.DEVNULL, env={"PATH": DEFAULT_PATH},
        )
        version = subprocess.run(
            [path, "--version"], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, check=False
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError) as err:
        return SandboxStatus(False, f"bubblewrap ({path}) could not be run: {err}", path)
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        return SandboxStatus(
            False,
            f"bubblewrap ({path}) cannot create a sandbox here: {why}. It needs user "
            "namespaces (sysctl kernel.unprivileged_userns_clone=1 / user.max_user_namespaces > 0; "
            "in a container, a seccomp/AppArmor profile that allows them) or a root worker",
            path,
        )
    return SandboxStatus(True, f"{version or 'bubblewrap'} at {path}", path, tmp_size)


def sandbox_status(settings: Settings) -> SandboxStatus:
    """Whether tool commands can run sandboxed here (probed once per process).

    Args:
        settings: ``sandbox`` (``auto`` | ``off``) and ``bwrap``.

    Returns:
        The status; ``detail`` says why not when it is not available.
    """
    return _probe(settings.sandbox, settings.bwrap)


def confine(settings: Settings, inp: ToolCallInput) -> Confinement | str:
    """Decide how a call that runs a command is confined (DESIGN §2).

    Args:
        settings: The host's sandbox settings.
        inp: The call (its task's ``allow_unconfined``).

    Returns:
        A :class:`Confinement`, or the text of a refusal (the call is not
        run: the sandbox is not available and the task does not allow
        running unconfined).
    """
    status = sandbox_status(settings)
    if status.available:
        return Confinement(status)
    if settings.sandbox == "off" or inp.allow_unconfined:
        return Confinement(None, status.detail)
    return (
        f"refused: commands run only in a sandbox, and it is not available on this host: "
        f"{status.detail}. This task does not allow running them unconfined "
        f"(allow_unconfined is off). The file tools (read_file, write_file, list_dir, "
        f"apply_patch) still work."
    )


def tool_env(inp: ToolCallInput, *, home: str, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a tool process: an allowlist, never the worker's environment.

    Args:
        inp: The call; its ``env`` (variables the task passes) is added last.
        home: ``HOME`` (the sandbox's home, or the workspace when unconfined).
        base: Where ``PATH`` and locale come from (default ``os.environ``).

    Returns:
        ``PATH``, ``LANG``/``LANGUAGE``/``LC_*``/``TZ``, ``TERM`` (``dumb``
        when the worker has none), ``HOME``, then the task's variables.
    """
    source = os.environ if base is None else base
    env = {
        k: v
        for k, v in source.items()
        if k in ("PATH", "LANG", "LANGUAGE", "TZ") or k.startswith("LC_")
    }
    env.setdefault("PATH", DEFAULT_PATH)
    env["TERM"] = source.get("TERM", "dumb")
    env["HOME"] = home
    env.update(inp.env)
    return env


def _isolation_flags(bwrap: str, *, network: bool, foreground: bool) -> list[str]:
    argv = [bwrap]
    if foreground:
        argv += ["--die-with-parent", "--new-session"]
    argv += ["--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    if not network:
        argv.append("--unshare-net")
    argv += ["--cap-drop", "ALL"]
    return argv


def _system_binds(extra: list[Path]) -> list[str]:
    argv: list[str] = []
    for top in SYSTEM_RO_PATHS:
        if os.path.islink(top):
            argv += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            argv += ["--ro-bind", top, top]
    for path in extra:
        argv += ["--ro-bind-try", str(path), str(path)]
    return argv


def _under(path: Path, parents: list[Path]) -> bool:
    return any(path == p or p in path.parents for p in parents)


#: Bytes of the sandbox's ``/dev/shm`` (at most the ``/tmp`` cap): shared
#: memory for semaphores and small buffers, not a second scratch disk.
SHM_BYTES = 64 * 1024 * 1024


def bwrap_argv(
    status: SandboxStatus,
    settings: Settings,
    *,
    workspace: Path,
    cwd: Path,
    network: bool,
    foreground: bool,
    info_fd: int | None = None,
) -> list[str]:
    """The ``bwrap`` command line that wraps one call's command (append the argv).

    Args:
        status: An available :class:`SandboxStatus`.
        settings: ``home`` (hidden), ``sandbox_ro_paths``, ``sandbox_tmp_bytes``.
        workspace: The workspace's real path (bound read-write at that path).
        cwd: The working directory (inside the workspace).
        network: Keep the host's network (the task allows it).
        foreground: A foreground call (``--die-with-parent``, ``--new-session``);
            ``False`` for a background shell.
        info_fd: A descriptor (passed to ``bwrap``) where it writes JSON
            with ``child-pid``: the host pid of the sandbox's PID 1.

    Returns:
        ``[bwrap, flags..., "--"]``.
    """
    assert status.bwrap is not None
    extra = settings.extra_ro_paths()
    argv = _isolation_flags(status.bwrap, network=network, foreground=foreground)
    if info_fd is not None:
        argv += ["--info-fd", str(info_fd)]
    argv += _system_binds(extra)
    if network:
        # /etc/resolv.conf is often a link into /run (systemd-resolved)
        resolv = Path(os.path.realpath("/etc/resolv.conf"))
        if not _under(resolv, [Path(p) for p in SYSTEM_RO_PATHS]):
            argv += ["--ro-bind-try", str(resolv), str(resolv)]
    argv += ["--proc", "/proc", "--dev", "/dev"]
    # /dev is a tmpfs bwrap makes, with no size, and /dev/shm a directory on
    # it: shared memory gets a tmpfs of its own, capped, and /dev itself is
    # made read-only below (device nodes still work).
    if status.tmp_size:
        argv += ["--size", str(min(settings.sandbox_tmp_bytes, SHM_BYTES))]
    argv += ["--tmpfs", "/dev/shm"]
    if status.tmp_size:
        argv += ["--size", str(settings.sandbox_tmp_bytes)]
    argv += ["--tmpfs", "/tmp", "--dir", SANDBOX_HOME]
    home = Path(os.path.realpath(settings.home))
    shown = [Path(os.path.realpath(p)) for p in SYSTEM_RO_PATHS if os.path.exists(p)] + [
        Path(os.path.realpath(p)) for p in extra
    ]
    if _under(workspace, [home]):
        # a workspace inside STOPLINE_HOME: hide the rest of it, then show the workspace
        if _under(home, shown):
            argv += ["--tmpfs", str(home)]
        argv += ["--bind", str(workspace), str(workspace)]
    else:
        argv += ["--bind", str(workspace), str(workspace)]
        if _under(home, [*shown, workspace]):
            argv += ["--tmpfs", str(home)]
    # The sandbox's own root is a tmpfs bwrap makes, with no size: left
    # writable, a command could fill memory under / past the /tmp cap.
    # Read-only once every mount point on it exists (/tmp, /dev/shm and the
    # workspace are mounts of their own and stay writable).
    argv += ["--remount-ro", "/dev", "--remount-ro", "/", "--chdir", str(cwd), "--"]
    return argv


def supervised(argv: list[str], grace_s: float) -> list[str]:
    """``argv`` run under :data:`SUPERVISOR` (``/bin/sh`` inside the sandbox).

    Args:
        argv: The command.
        grace_s: Seconds between SIGTERM and SIGKILL for processes the
            command left running.

    Returns:
        ``["/bin/sh", "-c", SUPERVISOR, "sh", ticks, *argv]``.
    """
    ticks = max(int(round(grace_s / 0.01)), 1)
    return ["/bin/sh", "-c", SUPERVISOR, "sh", str(ticks), *argv]
