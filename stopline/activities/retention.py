"""Retention: remove finished tasks' bulky files from ``$STOPLINE_HOME``.

Why this module exists: every call whose output outgrew the inline cap
leaves a blob beside the ledger, every staged row a file, every background
shell a log — and nothing removed them, so a busy host's disk filled. This
module removes them for tasks that are over: ``stopline gc`` on demand, and
the worker on a timer with an age limit (``STOPLINE_RETENTION_DAYS``).

What goes, per finished task (a task whose workflow is closed, or unknown to
the server — it was deleted there by the namespace's own retention):

- ``<ledger_dir>/<task>/blobs/`` (full tool outputs) and ``staged/``;
- its background shells' records and logs, except shells still running (a
  refused task leaves its shells as they are, DESIGN §4: they stay until
  they exit);
- its leftover per-call process records.

What stays: the ledger JSONL itself (the transcript is the audit trail; a
row's ``output_ref`` then names a blob that is gone, which ``transcript``
shows as it is).

What it must never do: touch a task the server says is running, or one it
could not ask about (an unreachable server keeps everything); follow a link
out of ``$STOPLINE_HOME``.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from stopline.settings import Settings

__all__ = ["GcReport", "collect", "task_id_file", "workflow_closed_probe"]

#: Name of the file beside a ledger that holds the task id as given (a
#: directory name is the id made file-safe, which may not be reversible).
TASK_ID_FILE = "task_id"

#: ``await closed(task_id)``: ``True`` closed or unknown, ``False`` running,
#: ``None`` could not tell.
ClosedProbe = Callable[[str], Awaitable[bool | None]]


@dataclass
class GcReport:
    """What one collection did.

    Attributes:
        removed_tasks: Task ids whose files were removed.
        kept_running: Task ids kept because they are running.
        kept_unknown: Task ids kept because the server could not be asked.
        kept_shells: ``task_id/shell_id`` of background shells still running.
        freed_bytes: Bytes of files removed.
    """

    removed_tasks: list[str] = field(default_factory=list)
    kept_running: list[str] = field(default_factory=list)
    kept_unknown: list[str] = field(default_factory=list)
    kept_shells: list[str] = field(default_factory=list)
    freed_bytes: int = 0


def task_id_file(ledger_task_dir: Path) -> Path:
    """Where the task id is kept beside a task's ledger."""
    return ledger_task_dir / TASK_ID_FILE


def _size(path: Path) -> int:
    if path.is_symlink() or path.is_file():
        return path.lstat().st_size
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def _remove(path: Path) -> int:
    """Remove a file or a directory tree (links are removed, never followed)."""
    if not os.path.lexists(path):
        return 0
    freed = _size(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
    return freed


def _last_change(paths: list[Path]) -> float:
    newest = 0.0
    for path in paths:
        for p in [path, *(path.rglob("*") if path.is_dir() else [])]:
            try:
                newest = max(newest, p.lstat().st_mtime)
            except OSError:
                pass
    return newest


def _shell_running(record: Path) -> bool:
    from stopline.activities.tools._state import read_json
    from stopline.activities.tools.procs import group_members

    data = read_json(record)
    if data is None:
        return False
    try:
        pgid = int(data.get("pgid", 0))
    except (TypeError, ValueError):
        return False
    return pgid > 1 and bool(group_members(pgid))


def _collect_shells(directory: Path, task_id: str, report: GcReport) -> int:
    """Remove a finished task's exited shells' files; keep running ones'."""
    freed = 0
    if not directory.is_dir():
        return 0
    keep: set[str] = set()
    for record in directory.glob("sh-*.json"):
        if _shell_running(record):
            keep.add(record.stem)
            report.kept_shells.append(f"{task_id}/{record.stem}")
    for path in directory.iterdir():
        if path.name.split(".", 1)[0] not in keep:
            freed += _remove(path)
    if not keep:
        freed += _remove(directory)
    return freed


async def collect(
    settings: Settings,
    closed: ClosedProbe,
    *,
    older_than_s: float = 0.0,
    now: float | None = None,
) -> GcReport:
    """Remove finished tasks' blobs, staged rows, shell logs and process records.

    Args:
        settings: Where the state lives.
        closed: Asks the server whether a task is over (see :data:`ClosedProbe`).
        older_than_s: Only tasks whose files last changed at least this many
            seconds ago (the worker's age limit; ``0``: any finished task).
        now: The current time (Unix seconds; tests).

    Returns:
        What was removed and what was kept.
    """
    now = time.time() if now is None else now
    report = GcReport()
    # file-system work runs in a thread: the worker's event loop also runs
    # activities, whose heartbeats must not wait for a large directory walk
    candidates = await asyncio.to_thread(_candidates, settings, older_than_s, now)
    for name, task_id in candidates:
        verdict = await closed(task_id)
        if verdict is None:
            report.kept_unknown.append(task_id)
            continue
        if not verdict:
            report.kept_running.append(task_id)
            continue
        await asyncio.to_thread(_remove_task_files, settings, name, task_id, report)
        report.removed_tasks.append(task_id)
    return report


def _candidates(settings: Settings, older_than_s: float, now: float) -> list[tuple[str, str]]:
    """``(directory name, task id)`` of tasks with bulky files old enough to consider."""
    names: set[str] = set()
    for root in (settings.ledger_dir, settings.shells_dir, settings.procs_dir):
        if root.is_dir():
            names.update(p.name for p in root.iterdir() if p.is_dir() and not p.is_symlink())
    out = []
    for name in sorted(names):
        ledger_dir = settings.ledger_dir / name
        shells = settings.shells_dir / name
        procs = settings.procs_dir / name
        bulky = [ledger_dir / "blobs", ledger_dir / "staged", shells, procs]
        if not any(os.path.lexists(p) for p in bulky):
            continue
        if older_than_s > 0 and now - _last_change([ledger_dir, shells, procs]) < older_than_s:
            continue
        try:
            task_id = task_id_file(ledger_dir).read_text(encoding="utf-8").strip() or name
        except OSError:
            task_id = name
        out.append((name, task_id))
    return out


def _remove_task_files(settings: Settings, name: str, task_id: str, report: GcReport) -> None:
    ledger_dir = settings.ledger_dir / name
    freed = _remove(ledger_dir / "blobs") + _remove(ledger_dir / "staged")
    freed += _collect_shells(settings.shells_dir / name, task_id, report)
    freed += _remove(settings.procs_dir / name)
    report.freed_bytes += freed


def workflow_closed_probe(client: object) -> ClosedProbe:
    """A :data:`ClosedProbe` that asks Temporal (``describe``) about the task's workflow.

    Args:
        client: A connected ``temporalio.client.Client``.
    """
    from temporalio.client import Client, WorkflowExecutionStatus
    from temporalio.service import RPCError, RPCStatusCode

    assert isinstance(client, Client)

    async def closed(task_id: str) -> bool | None:
        try:
            desc = await client.get_workflow_handle(task_id).describe()
        except RPCError as err:
            return True if err.status == RPCStatusCode.NOT_FOUND else None
        return desc.status != WorkflowExecutionStatus.RUNNING

    return closed
