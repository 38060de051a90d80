"""What a test or benchmark checks about processes a tool call started."""

from __future__ import annotations

import os

import psutil


def group_alive(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group ``pgid``.

    Args:
        pgid: A process group id (a tool call's group leader's pid).

    Returns:
        Their pids; empty when the group is gone.
    """
    alive = []
    for p in psutil.process_iter(["pid", "status"]):
        try:
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                alive.append(p.pid)
        except (ProcessLookupError, psutil.Error):
            continue
    return alive
