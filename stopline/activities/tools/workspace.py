"""Workspace confinement by path: where a path given to a tool resolves.

Why this module exists: the model chooses paths, and a path is the one
argument that can reach outside the task (``../../etc``, an absolute path, a
symlink planted inside the workspace that points elsewhere). A shell call's
``cwd`` goes through :func:`resolve_in_workspace` before the command starts
(DESIGN §2: "a path outside the workspace" is a call that could not be made,
``ok=False``).

What it must never do: touch the file system beyond reading link targets
(no creating, no opening), or accept a path by string prefix alone
(``/ws-evil`` is not inside ``/ws``).

Known limit: the check is made once, before the I/O; a link swapped in
between is not defended here. That is why the file tools do not use it: they
open through :mod:`.beneath`, where the check is the open. For a ``cwd`` the
limit does not matter when the command is sandboxed (the sandbox shows only
the workspace).
"""

from __future__ import annotations

import os
from pathlib import Path

from stopline.core.errors import ToolError

__all__ = ["OutsideWorkspace", "resolve_in_workspace"]


class OutsideWorkspace(ToolError):
    """A tool path resolves outside the task's workspace (DESIGN §2: ``ok=False``).

    Attributes:
        path: The path as the model gave it.
        resolved: Where it really points (symlinks and ``..`` resolved).
        workspace: The workspace's real path.
    """

    def __init__(self, path: str, resolved: Path, workspace: Path) -> None:
        self.path = path
        self.resolved = resolved
        self.workspace = workspace
        super().__init__(
            f"path {path!r} resolves to {str(resolved)!r}, which is outside the "
            f"workspace {str(workspace)!r}"
        )


def resolve_in_workspace(workspace: str | Path, path: str) -> Path:
    """Resolve ``path`` against ``workspace`` and check it stays inside.

    Relative paths are relative to the workspace; absolute paths are allowed
    when they land inside it. Symlinks and ``..`` are resolved (the path need
    not exist; its existing prefix is resolved, the rest normalized).

    Args:
        workspace: The task's workspace directory.
        path: The path a tool was given (``""`` and ``"."`` mean the
            workspace itself).

    Returns:
        The real (symlink-free, absolute) path, inside the workspace's real
        path or equal to it.

    Raises:
        OutsideWorkspace: The real path is not inside the workspace's real
            path (DESIGN §2).
        ValueError: ``path`` contains a NUL byte.
    """
    if "\x00" in path:
        raise ValueError(f"path {path!r} contains a NUL byte")
    root = Path(os.path.realpath(workspace))
    candidate = Path(path)
    if not candidate.is_absolute():
        candidate = root / candidate
    real = Path(os.path.realpath(candidate))
    if real != root and root not in real.parents:
        raise OutsideWorkspace(path, real, root)
    return real
