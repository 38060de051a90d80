"""File tools: ``read_file``, ``write_file``, ``list_dir``, ``apply_patch``.

Why this module exists: the model's file access, confined to the workspace
(:func:`.workspace.resolve_in_workspace` on every path) and bounded (reads and
listings are capped so a huge file never floods the result). ``apply_patch``
is all-or-nothing: :mod:`.patch` plans every file first, and only then is
anything written.

What it must never do: touch a path outside the workspace; write part of a
patch; read a whole large file into memory to show a few lines; raise for
a bad argument (that is ``RespondToModel(ok=False)``, DESIGN §2).

These handlers do blocking file I/O directly on the event loop: each call
is bounded (capped reads, one write of model-sized content), and it keeps a
file tool atomic with respect to cancellation (it cannot be interrupted half
way; a cancel arriving meanwhile finds it terminal and its real result kept).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from stopline.core.contracts import RespondToModel

from ._context import ToolContext
from .capture import clip_text
from .patch import PatchError, parse_patch, plan_patch
from .workspace import resolve_in_workspace

#: Lines ``read_file`` returns when ``max_lines`` is not given.
DEFAULT_MAX_LINES = 2000
#: Entries ``list_dir`` shows at most.
MAX_DIR_ENTRIES = 1000


def _rel(ctx: ToolContext, path: Path) -> str:
    rel = path.relative_to(ctx.workspace).as_posix()
    return rel if rel != "." else "."


def _encode(text: str) -> bytes:
    return text.encode("utf-8", errors="surrogateescape")


def _decode(raw: bytes) -> str:
    return raw.decode("utf-8", errors="surrogateescape")


def write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` (temp file + rename; keeps an existing file's mode)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        mode: int | None = path.stat().st_mode & 0o7777
    except FileNotFoundError:
        mode = None
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        if mode is not None:
            os.chmod(tmp, mode)
        else:
            os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


async def read_file(ctx: ToolContext, path: str, offset_line: int, max_lines: int | None) -> RespondToModel:
    """Read lines ``offset_line ..`` of a workspace file, capped at ``output_cap_bytes``.

    Returns:
        ``ok=True``: the lines, then ``[lines A-B of path; more follow: use
        offset_line=C]`` when there is more; ``ok=False``: missing file, a
        directory, or outside the workspace.
    """
    real = resolve_in_workspace(ctx.workspace, path)
    if real.is_dir():
        return RespondToModel(ok=False, text=f"{path!r} is a directory; use list_dir")
    if not real.exists():
        return RespondToModel(ok=False, text=f"file {path!r} not found in the workspace")
    if not real.is_file():
        # a FIFO or device would block the worker's event loop on open/read
        return RespondToModel(ok=False, text=f"{path!r} is not a regular file (a FIFO, socket or device)")
    limit = max_lines if max_lines is not None else DEFAULT_MAX_LINES
    budget = max(ctx.inp.output_cap_bytes - 256, 256)
    out: list[str] = []
    used = 0
    more = False
    last = offset_line - 1
    seen = 0
    with open(real, "rb") as f:
        # readline is bounded: a multi-GB file without newlines is never
        # pulled into memory whole
        for number, raw in enumerate(iter(lambda: f.readline(budget + 1), b""), 1):
            seen = number
            if number < offset_line:
                continue
            if len(out) >= limit:
                more = True
                break
            line = raw.decode("utf-8", errors="replace")
            if used + len(raw) > budget:
                if not out:  # one huge line: show its start
                    out.append(line[: budget // 2] + f"\n[... line {number} is {len(raw)} bytes; cut ...]\n")
                    last = number
                more = True
                break
            out.append(line)
            used += len(raw)
            last = number
    ctx.progress.terminal = True
    rel = _rel(ctx, real)
    if not out:
        if seen == 0:
            return RespondToModel(text=f"[{rel} is empty]")
        return RespondToModel(
            text=f"[{rel}: no lines at offset_line={offset_line}; the file has {seen} line(s)]"
        )
    text = "".join(out)
    if more:
        if not text.endswith("\n"):
            text += "\n"
        text += f"[lines {offset_line}-{last} of {rel}; more follow: use offset_line={last + 1}]"
    return RespondToModel(text=clip_text(text, ctx.inp.output_cap_bytes))


async def write_file(ctx: ToolContext, path: str, content: str) -> RespondToModel:
    """Write ``content`` (UTF-8) to a workspace file, creating parent directories.

    Returns:
        ``ok=True`` ``"wrote N bytes to path"``; ``ok=False`` for a directory
        or a path outside the workspace.
    """
    real = resolve_in_workspace(ctx.workspace, path)
    if real == ctx.workspace or real.is_dir():
        return RespondToModel(ok=False, text=f"{path!r} is a directory; give a file path")
    data = _encode(content)
    existed = real.exists()
    write_atomic(real, data)
    ctx.progress.terminal = True
    verb = "overwrote" if existed else "created"
    return RespondToModel(text=f"wrote {len(data)} bytes to {_rel(ctx, real)} ({verb})")


async def list_dir(ctx: ToolContext, path: str) -> RespondToModel:
    """List a workspace directory: sorted names, directories with a trailing ``/``.

    Returns:
        ``ok=True`` one entry per line (at most :data:`MAX_DIR_ENTRIES`, then
        ``[... N more entries]``); ``ok=False`` when missing or not a directory.
    """
    real = resolve_in_workspace(ctx.workspace, path)
    if not real.exists():
        return RespondToModel(ok=False, text=f"directory {path!r} not found in the workspace")
    if not real.is_dir():
        return RespondToModel(ok=False, text=f"{path!r} is a file, not a directory; use read_file")
    names = []
    with os.scandir(real) as it:
        for entry in it:
            try:
                is_dir = entry.is_dir()
            except OSError:
                is_dir = False
            names.append(entry.name + ("/" if is_dir else ""))
    names.sort()
    shown = names[:MAX_DIR_ENTRIES]
    lines = shown if shown else [f"({_rel(ctx, real)} is empty)"]
    if len(names) > len(shown):
        lines.append(f"[... {len(names) - len(shown)} more entries]")
    ctx.progress.terminal = True
    return RespondToModel(text=clip_text("\n".join(lines), ctx.inp.output_cap_bytes))


async def apply_patch(ctx: ToolContext, patch: str) -> RespondToModel:
    """Apply a unified diff to the workspace, all-or-nothing (DESIGN §2, §3).

    Returns:
        ``ok=True``: ``"applied patch:\\n  path: modified, 2 hunk(s)..."``, or
        ``"patch already applied: ... nothing changed"`` when every file's
        reverse applies (the same patch a second time); ``ok=False`` with the
        parse error, or which file/hunk failed and what line was expected
        versus found — and nothing written.
    """
    try:
        files = parse_patch(patch)
    except PatchError as err:
        return RespondToModel(ok=False, text=f"apply_patch: could not parse the patch: {err}")
    real: dict[str, Path] = {}
    for fp in files:
        for name in (fp.old_path, fp.new_path):
            if name is not None and name not in real:
                real[name] = resolve_in_workspace(ctx.workspace, name)
                if real[name] == ctx.workspace:
                    return RespondToModel(ok=False, text=f"apply_patch: {name!r} is the workspace itself")

    def read(name: str) -> str | None:
        target = real[name]
        if target.is_dir():
            raise PatchError(f"{name}: is a directory")
        if target.exists() and not target.is_file():
            raise PatchError(f"{name}: is not a regular file (a FIFO, socket or device)")
        try:
            return _decode(target.read_bytes())
        except FileNotFoundError:
            return None

    try:
        plan = plan_patch(files, read)
    except PatchError as err:
        return RespondToModel(ok=False, text=f"apply_patch: nothing was written: {err}")
    for name, content in plan.writes.items():
        target = real[name]
        if content is None:
            try:
                target.unlink()
            except FileNotFoundError:
                pass
        else:
            write_atomic(target, _encode(content))
    ctx.progress.terminal = True
    if not plan.applied:
        files_txt = ", ".join(plan.already_applied)
        return RespondToModel(text=f"patch already applied to {files_txt}; nothing changed")
    lines = ["applied patch:"] + [f"  {path}: {summary}" for path, summary in plan.applied]
    if plan.already_applied:
        lines.append("already applied (left unchanged): " + ", ".join(plan.already_applied))
    return RespondToModel(text="\n".join(lines))
