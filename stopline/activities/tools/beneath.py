"""Race-free file access beneath the workspace: open by descriptor, never follow a link.

Why this module exists: checking a path and then opening it is two steps,
and a process the model started can swap a directory for a symlink in
between (a symlink flipper racing ``write_file`` landed 1 write in 80
outside the workspace). Here the check *is* the open: every path is resolved
by the kernel relative to a descriptor of the workspace, beneath it, with no
symbolic link followed at any step:

- ``openat2(2)`` with ``RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS`` (Linux 5.6+,
  called through ``ctypes``: Python has no binding), or, where it is
  missing or filtered (an old kernel, a seccomp profile that answers
  ``ENOSYS``/``EPERM``),
- one ``openat(2)`` per path component with ``O_NOFOLLOW``, each relative to
  the descriptor of the directory before it.

Paths are normalized lexically first (``a/../b`` is ``b``); since no link is
followed, that is exactly what the kernel would resolve, and a path that
climbs above the workspace is refused before any I/O. Changes are made
relative to the descriptor of the parent directory (``mkdirat``,
``renameat``, ``unlinkat``), so they land where the open landed.

What it must never do: follow a symbolic link (a link inside the workspace is
refused with a message naming its target, so the model can use the real
path), resolve ``..`` through the kernel, or build a path string and open it
again after the check.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import posixpath
import stat as stat_mod
from pathlib import Path

from stopline.core.errors import ToolError

from .workspace import OutsideWorkspace

__all__ = ["Beneath", "SymlinkRefused", "openat2_available"]

#: ``openat2`` syscall number (the same on every Linux architecture with the
#: unified syscall table: x86_64, arm64, riscv64, ...).
SYS_OPENAT2 = 437
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
_RESOLVE = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS


class SymlinkRefused(ToolError):
    """A path passes through a symbolic link; file tools never follow one.

    Attributes:
        path: The path as the model gave it.
        link: The link, relative to the workspace.
        target: What the link points to.
        outside: The target is outside the workspace.
    """

    def __init__(self, path: str, link: str, target: str, *, outside: bool) -> None:
        self.path, self.link, self.target, self.outside = path, link, target, outside
        where = (
            "outside the workspace" if outside else "inside the workspace; use that path instead"
        )
        super().__init__(
            f"path {path!r} passes through the symbolic link {link!r} -> {target!r}, which "
            f"points {where}. File tools do not follow symbolic links"
        )


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:  # pragma: no cover - no libc to load
        return None


def _openat2(dirfd: int, path: str, flags: int, mode: int) -> int:
    """``openat2(dirfd, path, {flags, mode, RESOLVE_BENEATH|NO_SYMLINKS})``.

    Raises:
        OSError: With the kernel's errno (``EXDEV``: would leave ``dirfd``;
            ``ELOOP``: a symbolic link on the way; ``ENOSYS``: no openat2).
    """
    libc = _libc()
    if libc is None:
        raise OSError(errno.ENOSYS, "no libc")
    tmpfile = getattr(os, "O_TMPFILE", 0)
    creates = bool(flags & os.O_CREAT) or (tmpfile and flags & tmpfile == tmpfile)
    # openat2 rejects a mode without O_CREAT / O_TMPFILE (EINVAL)
    how = _OpenHow(flags | os.O_CLOEXEC, mode if creates else 0, _RESOLVE)
    fd = libc.syscall(SYS_OPENAT2, ctypes.c_int(dirfd), os.fsencode(path), ctypes.byref(how), ctypes.sizeof(how))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    return int(fd)


@functools.cache
def openat2_available() -> bool:
    """Whether this kernel (and its seccomp profile) lets us call ``openat2``."""
    if not os.uname().sysname == "Linux":
        return False
    root = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.close(_openat2(root, ".", os.O_PATH, 0))
    except OSError:
        return False
    finally:
        os.close(root)
    return True


class Beneath:
    """A workspace opened once; every path is resolved beneath it.

    Use as a context manager (the root descriptor is closed at the end).

    Args:
        root: The workspace's real path.
        alias: The workspace as the task named it (absolute paths under
            either are accepted).
        use_openat2: Force one resolution method (tests); default: openat2
            where available.
    """

    def __init__(self, root: Path, *, alias: str | None = None, use_openat2: bool | None = None) -> None:
        self.root = root
        self._prefixes = [str(root)]
        if alias and posixpath.isabs(alias):
            self._prefixes.append(posixpath.normpath(alias))
        self.fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        self.use_openat2 = openat2_available() if use_openat2 is None else use_openat2

    def __enter__(self) -> Beneath:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the root descriptor (idempotent)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    # ------------------------------------------------------------- paths

    def relative(self, path: str) -> str:
        """The workspace-relative, normalized form of a path a tool was given.

        Args:
            path: Relative to the workspace, or absolute inside it.

        Returns:
            ``"."`` for the workspace itself, else ``"a/b"`` (no ``.`` or
            ``..`` components).

        Raises:
            OutsideWorkspace: The path climbs above the workspace or is an
                absolute path elsewhere.
            ValueError: The path holds a NUL byte.
        """
        if "\x00" in path:
            raise ValueError(f"path {path!r} contains a NUL byte")
        rel = path
        if posixpath.isabs(path):
            norm = posixpath.normpath(path)
            for prefix in self._prefixes:
                if norm == prefix:
                    return "."
                if norm.startswith(prefix.rstrip("/") + "/"):
                    rel = norm[len(prefix.rstrip("/")) + 1 :]
                    break
            else:
                raise OutsideWorkspace(path, Path(norm), self.root)
        rel = posixpath.normpath(rel or ".")
        if rel == ".." or rel.startswith("../"):
            raise OutsideWorkspace(path, Path(posixpath.normpath(posixpath.join(str(self.root), rel))), self.root)
        return rel

    def symlink_refusal(self, path: str, rel: str) -> SymlinkRefused | None:
        """The refusal for the first component of ``rel`` that is a symbolic link, if any.

        Only for the message (where the link points, inside or outside); the
        refusal itself was the kernel's.
        """
        parts = rel.split("/")
        for i in range(1, len(parts) + 1):
            sub = "/".join(parts[:i])
            try:
                st = os.stat(sub, dir_fd=self.fd, follow_symlinks=False)
            except OSError:
                return None
            if stat_mod.S_ISLNK(st.st_mode):
                try:
                    target = os.readlink(sub, dir_fd=self.fd)
                except OSError:
                    target = "?"
                where = posixpath.normpath(
                    posixpath.join(str(self.root), posixpath.dirname(sub), target)
                )
                outside = not (where == str(self.root) or where.startswith(str(self.root).rstrip("/") + "/"))
                return SymlinkRefused(path, sub, target, outside=outside)
        return None

    def open(self, path: str, flags: int, mode: int = 0o666) -> int:
        """Open ``path`` beneath the workspace without following any link.

        Args:
            path: As the tool was given it.
            flags: ``os.open`` flags (``O_NOFOLLOW`` and ``O_CLOEXEC`` are added).
            mode: For ``O_CREAT``.

        Returns:
            A descriptor (close it).

        Raises:
            OutsideWorkspace: The path is not beneath the workspace.
            SymlinkRefused: A component is a symbolic link.
            OSError: Anything else (``FileNotFoundError``, ``IsADirectoryError``, ...).
        """
        rel = self.relative(path)
        try:
            return self._open_rel(rel, flags, mode)
        except OSError as err:
            if err.errno in (errno.ELOOP, errno.EXDEV, errno.ENOTDIR):
                refused = self.symlink_refusal(path, rel)
                if refused is not None:
                    raise refused from None
                if err.errno == errno.EXDEV:
                    raise OutsideWorkspace(path, self.root / rel, self.root) from None
            raise

    def _open_rel(self, rel: str, flags: int, mode: int) -> int:
        flags |= os.O_NOFOLLOW | os.O_CLOEXEC
        if self.use_openat2:
            return _openat2(self.fd, rel, flags, mode)
        # one component at a time, each relative to the directory before it
        parts = [] if rel == "." else rel.split("/")
        current = os.dup(self.fd)
        try:
            for part in parts[:-1]:
                nxt = os.open(part, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=current)
                os.close(current)
                current = nxt
            if not parts:
                return os.open(".", flags, mode, dir_fd=current)
            return os.open(parts[-1], flags, mode, dir_fd=current)
        finally:
            os.close(current)

    # ----------------------------------------------------------- helpers

    def lstat(self, path: str) -> os.stat_result | None:
        """``lstat`` of a path beneath the workspace (``None`` when it does not exist).

        Raises:
            OutsideWorkspace, SymlinkRefused: For a parent directory (the
                final component itself may be a link: it is reported, not
                followed).
        """
        rel = self.relative(path)
        if rel == ".":
            return os.stat(self.fd)
        parent, name = posixpath.split(rel)
        try:
            pfd = self._open_rel(parent or ".", os.O_PATH | os.O_DIRECTORY, 0)
        except FileNotFoundError:
            return None
        except OSError as err:
            if err.errno in (errno.ELOOP, errno.EXDEV, errno.ENOTDIR):
                refused = self.symlink_refusal(path, rel)
                if refused is not None:
                    raise refused from None
                if err.errno == errno.ENOTDIR:
                    return None
            raise
        try:
            return os.stat(name, dir_fd=pfd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        finally:
            os.close(pfd)

    def open_parent(self, path: str, *, create: bool) -> tuple[int, str]:
        """Open the directory that holds ``path`` (creating missing ones when asked).

        Returns:
            ``(dir descriptor, final name)``: change things with ``dir_fd=``.

        Raises:
            OutsideWorkspace, SymlinkRefused, OSError: As :meth:`open`;
            ``IsADirectoryError`` when ``path`` is the workspace itself.
        """
        rel = self.relative(path)
        if rel == ".":
            raise IsADirectoryError(errno.EISDIR, "is the workspace itself", path)
        parent, name = posixpath.split(rel)
        if create and parent:
            self._makedirs(path, parent)
        return self.open(parent or ".", os.O_PATH | os.O_DIRECTORY), name

    def _makedirs(self, path: str, parent: str) -> None:
        current = os.dup(self.fd)
        try:
            for part in parent.split("/"):
                try:
                    os.mkdir(part, 0o777, dir_fd=current)
                except FileExistsError:
                    pass
                try:
                    nxt = os.open(part, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=current)
                except OSError as err:
                    if err.errno in (errno.ELOOP, errno.ENOTDIR):
                        refused = self.symlink_refusal(path, parent)
                        if refused is not None:
                            raise refused from None
                    raise
                os.close(current)
                current = nxt
        finally:
            os.close(current)
