"""Tools the model can call, and the ``stopline.tool`` activity that runs them.

Why this package exists: every way a tool call ends — finished (any exit
code), could not be made, timed out, aborted by the user — becomes data
(``RespondToModel | Fatal``, DESIGN §2), and a foreground call leaves no
process behind (DESIGN §3). Modules, one concern each:

- :mod:`.workspace` — path confinement of a shell ``cwd`` (:func:`resolve_in_workspace`).
- :mod:`.beneath` — race-free opens beneath the workspace (``openat2``), no links.
- :mod:`.sandbox` — the bubblewrap sandbox of every command, the environment
  allowlist, and the policy where the sandbox cannot run.
- :mod:`.procs` — process groups and sandboxes: members, TERM/grace/KILL,
  per-call records, :func:`kill_call_groups`.
- :mod:`.capture` — head + tail output capture with a capped blob spill.
- :mod:`.shell` — ``shell`` (foreground / background), ``shell_status``,
  ``shell_kill``, :func:`close_unattended_shells`.
- :mod:`._logrelay` — the capped, rotating log of a background shell.
- :mod:`.files` — ``read_file``, ``write_file``, ``list_dir``, ``apply_patch``.
- :mod:`.patch` — the pure unified-diff applier.
- :mod:`.registry` — specs, argument models, :func:`run_tool` (the boundary).
- :mod:`.activity` — :func:`tool_activity`.

Nothing here may be imported by workflow code (it does I/O); workflows
reach the activity by its name, ``stopline.core.contracts.TOOL_ACTIVITY``.
"""

from __future__ import annotations

from .activity import tool_activity
from .procs import kill_call_groups
from .registry import TOOL_SPECS, run_tool
from .shell import close_unattended_shells
from .workspace import OutsideWorkspace, resolve_in_workspace

__all__ = [
    "TOOL_SPECS",
    "OutsideWorkspace",
    "close_unattended_shells",
    "kill_call_groups",
    "resolve_in_workspace",
    "run_tool",
    "tool_activity",
]
