"""File tools: ``read_file``, ``write_file``, ``list_dir``, ``apply_patch``.

Why this module exists: the model's file access, confined to the workspace
and bounded (reads and listings are capped so a huge file never floods the
result). Every path is opened through :class:`.beneath.Beneath`: resolved by
the kernel beneath a descriptor of the workspace, following no symbolic link,
and every change is made relative to the descriptor of its directory — so a
process racing the tool (swapping a directory for a link) cannot make it
read or write outside. ``apply_patch`` is all-or-nothing: :mod:`.patch`
plans every file first, and only then is anything written.

What it must never do: touch a path outside the workspace or follow a link;
write part of a patch; read a whole large file into memory to show a few
lines; raise for a bad argument (that is ``RespondToModel(ok=False)``,
DESIGN §2).

These handlers do blocking file I/O directly on the event loop: each call
is bounded (capped reads, one write of model-sized content), and it keeps a
file tool atomic with respect to cancellation (it cannot be interrupted half
way; a cancel arriving meanwhile finds it terminal and its real result kept).
"""

from __future__ import annotations

import contextlib
import os
import secrets as _random
import stat as stat_mod

from stopline.core.contracts import WORKSPACE_MARKER_FILE, RespondToModel

from ._context import ToolContext
from .beneath import Beneath, SymlinkRefused
from .capture import clip_text
from .patch import PatchError, parse_patch, plan_patch

#: Lines ``read_file`` returns when ``max_lines`` is not given.
DEFAULT_MAX_LINES = 2000
#: Entries ``list_dir`` shows at most.
MAX_DIR_ENTRIES = 1000


def _encode(text: str) -> bytes:
    return text.encode("utf-8", errors="surrogateescape")


def _decode(raw: bytes) -> str:
    return raw.decode("utf-8", errors="surrogateescape")


def _workspace(ctx: ToolContext) -> Beneath:
    return Beneath(ctx.workspace, alias=ctx.inp.workspace)


def write_atomic_at(dir_fd: int, name: str, data: bytes) -> None:
    """Replace ``name`` in the directory ``dir_fd`` with ``data`` (temp file + rename).

    Keeps an existing file's mode; a new file gets ``0o666 & ~umask``. The
    rename replaces the directory entry itself (a link there is replaced,
    never followed).

    Raises:
        OSError: The write failed; nothing was replaced.
    """
    try:
        mode: int | None = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode & 0o7777
    except FileNotFoundError:
        mode = None
    tmp = f".stopline-{_random.token_hex(6)}.tmp"
    fd = os.open(
        tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd
    )
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            os.fchmod(f.fileno(), mode if mode is not None else 0o666 & ~_umask())
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=dir_fd)
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
        directory, a link, or outside the workspace.
    """
    with _workspace(ctx) as ws:
        rel = ws.relative(path)
        try:
            # O_NONBLOCK: opening a FIFO must not block the worker's event loop
            fd = ws.open(path, os.O_RDONLY | os.O_NONBLOCK)
        except (FileNotFoundError, NotADirectoryError):
            return RespondToModel(ok=False, text=f"file {path!r} not found in the workspace")
    st = os.fstat(fd)
    if not stat_mod.S_ISREG(st.st_mode):
        os.close(fd)
        if stat_mod.S_ISDIR(st.st_mode):
            return RespondToModel(ok=False, text=f"{path!r} is a directory; use list_dir")
        return RespondToModel(ok=False, text=f"{path!r} is not a regular file (a FIFO, socket or device)")
    os.set_blocking(fd, True)
    with os.fdopen(fd, "rb") as f:
        text, seen, last, more = _read_lines(ctx, f, offset_line, max_lines)
    ctx.progress.terminal = True
    if not text:
        if seen == 0:
            return RespondToModel(text=f"[{rel} is empty]")
        return RespondToModel(
            text=f"[{rel}: no lines at offset_line={offset_line}; the file has {seen} line(s)]"
        )
    if more:
        if not text.endswith("\n"):
            text += "\n"
        text += f"[lines {offset_line}-{last} of {rel}; more follow: use offset_line={last + 1}]"
    return RespondToModel(text=clip_text(text, ctx.inp.output_cap_bytes))


def _read_lines(ctx: ToolContext, f: object, offset_line: int, max_lines: int | None) -> tuple[str, int, int, bool]:
    """``(text, lines seen, last line shown, more follow)`` of a bounded read."""
    limit = max_lines if max_lines is not None else DEFAULT_MAX_LINES
    budget = max(ctx.inp.output_cap_bytes - 256, 256)
    out: list[str] = []
    used = 0
    more = False
    last = offset_line - 1
    seen = 0
    # readline is bounded: a multi-GB file without newlines is never pulled
    # into memory whole
    for number, raw in enumerate(iter(lambda: f.readline(budget + 1), b""), 1):  # type: ignore[attr-defined]
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
    return "".join(out), seen, last, more


async def write_file(ctx: ToolContext, path: str, content: str) -> RespondToModel:
    """Write ``content`` (UTF-8) to a workspace file, creating parent directories.

    Returns:
        ``ok=True`` ``"wrote N bytes to path"``; ``ok=False`` for a directory,
        a link, or a path outside the workspace.
    """
    with _workspace(ctx) as ws:
        rel = ws.relative(path)
        if rel == ".":
            return RespondToModel(ok=False, text=f"{path!r} is a directory; give a file path")
        try:
            dir_fd, name = ws.open_parent(path, create=True)
        except (FileExistsError, NotADirectoryError):
            return RespondToModel(ok=False, text=f"a parent of {path!r} is not a directory")
        try:
            try:
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                st = None
            if st is not None and stat_mod.S_ISDIR(st.st_mode):
                return RespondToModel(ok=False, text=f"{path!r} is a directory; give a file path")
            if st is not None and stat_mod.S_ISLNK(st.st_mode):
                raise ws.symlink_refusal(path, rel) or SymlinkRefused(
                    path, rel, os.readlink(name, dir_fd=dir_fd), outside=True
                )
            data = _encode(content)
            write_atomic_at(dir_fd, name, data)
        finally:
            os.close(dir_fd)
    ctx.progress.terminal = True
    verb = "overwrote" if st is not None else "created"
    return RespondToModel(text=f"wrote {len(data)} bytes to {rel} ({verb})")


async def list_dir(ctx: ToolContext, path: str) -> RespondToModel:
    """List a workspace directory: sorted names, directories with a trailing ``/``,
    links as ``name -> target`` (not followed).

    Returns:
        ``ok=True`` one entry per line (at most :data:`MAX_DIR_ENTRIES`, then
        ``[... N more entries]``); ``ok=False`` when missing or not a directory.
    """
    with _workspace(ctx) as ws:
        rel = ws.relative(path)
        # stopline's own marker (DESIGN §7) is not the project's: not listed
        hidden = {WORKSPACE_MARKER_FILE} if rel in (".", "") else set()
        try:
            fd = ws.open(path, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:
            return RespondToModel(ok=False, text=f"directory {path!r} not found in the workspace")
        except NotADirectoryError:
            return RespondToModel(ok=False, text=f"{path!r} is a file, not a directory; use read_file")
    names = []
    try:
        with os.scandir(fd) as it:
            for entry in it:
                if entry.name in hidden:
                    continue
                try:
                    if entry.is_symlink():
                        names.append(f"{entry.name} -> {os.readlink(entry.name, dir_fd=fd)}")
                        continue
                    is_dir = entry.is_dir(follow_symlinks=False)
                except OSError:
                    is_dir = False
                names.append(entry.name + ("/" if is_dir else ""))
    finally:
        os.close(fd)
    names.sort()
    shown = names[:MAX_DIR_ENTRIES]
    lines = shown if shown else [f"({rel} is empty)"]
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
    with _workspace(ctx) as ws:
        for fp in files:
            for name in (fp.old_path, fp.new_path):
                if name is not None and ws.relative(name) == ".":
                    return RespondToModel(ok=False, text=f"apply_patch: {name!r} is the workspace itself")

        def read(name: str) -> str | None:
            st = ws.lstat(name)
            if st is None:
                return None
            if stat_mod.S_ISDIR(st.st_mode):
                raise PatchError(f"{name}: is a directory")
            if stat_mod.S_ISLNK(st.st_mode):
                raise PatchError(f"{name}: is a symbolic link (file tools do not follow links)")
            if not stat_mod.S_ISREG(st.st_mode):
                raise PatchError(f"{name}: is not a regular file (a FIFO, socket or device)")
            try:
                fd = ws.open(name, os.O_RDONLY | os.O_NONBLOCK)
            except FileNotFoundError:
                return None
            if not stat_mod.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                raise PatchError(f"{name}: is not a regular file")
            with os.fdopen(fd, "rb") as f:
                return _decode(f.read())

        try:
            plan = plan_patch(files, read)
        except PatchError as err:
            return RespondToModel(ok=False, text=f"apply_patch: nothing was written: {err}")
        for name, content in plan.writes.items():
            dir_fd, leaf = ws.open_parent(name, create=content is not None)
            try:
                if content is None:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(leaf, dir_fd=dir_fd)
                else:
                    write_atomic_at(dir_fd, leaf, _encode(content))
            finally:
                os.close(dir_fd)
    ctx.progress.terminal = True
    if not plan.applied:
        files_txt = ", ".join(plan.already_applied)
        return RespondToModel(text=f"patch already applied to {files_txt}; nothing changed")
    lines = ["applied patch:"] + [f"  {path}: {summary}" for path, summary in plan.applied]
    if plan.already_applied:
        lines.append("already applied (left unchanged): " + ", ".join(plan.already_applied))
    return RespondToModel(text="\n".join(lines))
