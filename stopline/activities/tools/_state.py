"""Where tool state lives under ``$STOPLINE_HOME``: one place owns the layout.

Why this module exists: three kinds of files outlive a tool call and are read
by someone else later — full-output blobs (read by whoever renders the ledger,
referenced by ``RespondToModel.output_ref``), per-call process-group records
(read by the hard abort and crash recovery, :func:`kill_call_groups`), and
background-shell records and logs (read by ``shell_status`` / ``shell_kill``,
possibly from another worker process). Their paths are built here only, from
:class:`stopline.settings.Settings`.

Layout (ids pass through :func:`safe_component` first)::

    <ledger_dir>/<task_id>/blobs/<call_id>.out     full tool output
    <procs_dir>/<task_id>/<call_id>.json          {"pgid", "pid", "started_at"}
    <shells_dir>/<task_id>/<shell_id>.json        background-shell record
    <shells_dir>/<task_id>/<shell_id>.log         its stdout+stderr

What it must never do: build a path from an id without
:func:`safe_component` (a workflow id may contain ``/``).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from stopline.settings import Settings

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def safe_component(name: str) -> str:
    """Map an id (task id, call id, shell id) to one safe file-name component.

    Characters outside ``[A-Za-z0-9._-]`` become ``_``; ``""``, ``.`` and
    ``..`` become ``_``-prefixed so they never mean "here" or "up".

    Args:
        name: The id.

    Returns:
        A file-name component without ``/``.
    """
    cleaned = _UNSAFE.sub("_", name)
    if cleaned in ("", ".", ".."):
        cleaned = "_" + cleaned
    return cleaned


def blob_path(settings: Settings, task_id: str, call_id: str) -> Path:
    """Full-output blob of one call: ``<ledger_dir>/<task>/blobs/<call>.out``."""
    return settings.ledger_dir / safe_component(task_id) / "blobs" / f"{safe_component(call_id)}.out"


def blob_ref(settings: Settings, path: Path) -> str:
    """``path`` relative to the ledger dir (what ``RespondToModel.output_ref`` holds)."""
    return path.relative_to(settings.ledger_dir).as_posix()


def call_record_path(settings: Settings, task_id: str, call_id: str) -> Path:
    """Process-group record of one foreground call."""
    return settings.procs_dir / safe_component(task_id) / f"{safe_component(call_id)}.json"


def shells_task_dir(settings: Settings, task_id: str) -> Path:
    """Directory of one task's background-shell records and logs."""
    return settings.shells_dir / safe_component(task_id)


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as JSON to ``path`` atomically (temp file + rename).

    Readers see either the old file or the new one, never half of one.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def read_json(path: Path) -> dict[str, Any] | None:
    """Read a JSON object from ``path``; ``None`` when missing or unreadable."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
