"""A pure-Python unified-diff applier: parse, apply, reverse, plan.

Why this module exists: ``apply_patch`` must not depend on a ``patch``
binary, must apply all-or-nothing (nothing is written unless every hunk of
every file applies), must say exactly which file and hunk failed and what
line was expected versus found (DESIGN §2: a context mismatch is a call that
could not be made, ``ok=False``), and must report "already applied" when the
same patch is applied twice (DESIGN §3) instead of applying it again.

What it must never do: I/O. File contents come in through a ``read``
callable and leave as a :class:`PatchPlan`; the tool handler
(:mod:`.files`) confines paths to the workspace and writes.

Supported: several files per patch; ``--- a/x`` / ``+++ b/x`` headers (one
``a/`` or ``b/`` prefix stripped; a tab-separated timestamp ignored; git's
quoted names); new files (``--- /dev/null``), deleted files
(``+++ /dev/null``), renames (different old and new names); several hunks per
file with their header counts (a missing count means 1); ``\\ No newline at
end of file``; blank lines inside a hunk read as empty context lines.
Context must match exactly; a hunk may be found at an offset from its
header's line (the nearest match wins, searching the whole file, as GNU
``patch`` does with fuzz 0). Lines keep their endings, so CRLF files
round-trip.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from stopline.core.errors import ToolError

__all__ = [
    "FilePatch",
    "Hunk",
    "HunkMismatch",
    "PatchConflict",
    "PatchError",
    "PatchParseError",
    "PatchPlan",
    "apply_file_patch",
    "parse_patch",
    "plan_patch",
    "split_lines",
]


class PatchError(ToolError):
    """Root of every reason a patch cannot be applied.

    ::

        PatchError
        ├── PatchParseError   the text is not a unified diff we understand
        ├── HunkMismatch      a hunk's context / removed lines are not in the file
        └── PatchConflict     file-level: creating an existing file, patching a
                              missing one, deleting a file that would not be empty
    """


class PatchParseError(PatchError):
    """The patch text is malformed (message names the line)."""


class PatchConflict(PatchError):
    """A file-level precondition of the patch does not hold."""


class HunkMismatch(PatchError):
    """A hunk does not apply.

    Attributes:
        path: File the hunk belongs to.
        hunk: 1-based hunk number within that file.
        line: 1-based line of the file where the first difference is.
        expected: The line the hunk expected there (without line ending).
        found: The line found there, or ``None`` at end of file.
    """

    def __init__(
        self, path: str, hunk: int, header: str, line: int, expected: str, found: str | None
    ) -> None:
        self.path = path
        self.hunk = hunk
        self.line = line
        self.expected = expected
        self.found = found
        what = "end of file" if found is None else repr(found)
        super().__init__(
            f"{path}: hunk {hunk} ({header}) does not apply: expected line {line} to be "
            f"{expected!r} but found {what} (its context was not found anywhere else in the "
            "file either)"
        )


def split_lines(text: str) -> list[str]:
    """Split on ``\\n`` only, keeping each line's ending (the last line may have none)."""
    parts = text.split("\n")
    lines = [p + "\n" for p in parts[:-1]]
    if parts[-1]:
        lines.append(parts[-1])
    return lines


def _show(line: str) -> str:
    return line[:-1] if line.endswith("\n") else line


@dataclass(frozen=True)
class Hunk:
    """One ``@@ -a,b +c,d @@`` hunk.

    Attributes:
        old_start: First old line (1-based; for ``old_len == 0`` the line
            after which the new lines go).
        old_len: Old lines covered (context + removed).
        new_start: First new line.
        new_len: New lines (context + added).
        lines: ``(tag, text)`` with tag ``" "``, ``"-"`` or ``"+"`` and
            ``text`` including its line ending.
    """

    old_start: int
    old_len: int
    new_start: int
    new_len: int
    lines: tuple[tuple[str, str], ...]

    @property
    def header(self) -> str:
        """The ``@@ -a,b +c,d @@`` header."""
        return f"@@ -{self.old_start},{self.old_len} +{self.new_start},{self.new_len} @@"

    def old_lines(self) -> list[str]:
        """Lines the file must contain (context and removed)."""
        return [text for tag, text in self.lines if tag in " -"]

    def new_lines(self) -> list[str]:
        """Lines the file will contain (context and added)."""
        return [text for tag, text in self.lines if tag in " +"]

    def reversed(self) -> Hunk:
        """The hunk that undoes this one."""
        swap = {" ": " ", "-": "+", "+": "-"}
        return Hunk(
            self.new_start,
            self.new_len,
            self.old_start,
            self.old_len,
            tuple((swap[tag], text) for tag, text in self.lines),
        )


@dataclass(frozen=True)
class FilePatch:
    """The hunks for one file.

    Attributes:
        old_path: Path before (``None`` for ``/dev/null``: a new file).
        new_path: Path after (``None`` for ``/dev/null``: a deleted file).
        hunks: In file order.
    """

    old_path: str | None
    new_path: str | None
    hunks: tuple[Hunk, ...]

    @property
    def path(self) -> str:
        """The name to report: the new path, or the old one for a deletion."""
        return self.new_path or self.old_path or "?"

    @property
    def is_new(self) -> bool:
        """Creates a file."""
        return self.old_path is None

    @property
    def is_delete(self) -> bool:
        """Deletes a file."""
        return self.new_path is None

    def reversed(self) -> FilePatch:
        """The file patch that undoes this one."""
        return FilePatch(self.new_path, self.old_path, tuple(h.reversed() for h in self.hunks))


# ---------------------------------------------------------------------------
# Parsing.
# ---------------------------------------------------------------------------

_HUNK_HEADER = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
_OCTAL = re.compile(rb"\\([0-7]{3}|.)")
_ESCAPES = {b"n": b"\n", b"t": b"\t", b'"': b'"', b"\\": b"\\", b"a": b"\a", b"b": b"\b",
            b"f": b"\f", b"r": b"\r", b"v": b"\v"}


def _unquote(name: str) -> str:
    """Undo git's C-style quoting of a path (``"a/caf\\303\\251"``)."""
    raw = name[1:-1].encode("utf-8", errors="surrogateescape")

    def sub(m: re.Match[bytes]) -> bytes:
        esc = m.group(1)
        if len(esc) == 3:
            return bytes([int(esc, 8)])
        return _ESCAPES.get(esc, esc)

    return _OCTAL.sub(sub, raw).decode("utf-8", errors="surrogateescape")


def _parse_path(raw: str) -> str | None:
    name = raw.rstrip("\r").split("\t", 1)[0].rstrip()
    if len(name) >= 2 and name.startswith('"') and name.endswith('"'):
        name = _unquote(name)
    if name == "/dev/null":
        return None
    if name.startswith(("a/", "b/")):
        name = name[2:]
    if not name:
        raise PatchParseError(f"empty file name in header {raw!r}")
    return name


def _parse_hunk(lines: list[str], i: int, path: str, number: int) -> tuple[Hunk, int]:
    header = lines[i].rstrip("\r")
    m = _HUNK_HEADER.match(header)
    if not m:
        raise PatchParseError(f"{path}: hunk {number}: malformed hunk header {header!r}")
    old_start, new_start = int(m.group(1)), int(m.group(3))
    old_len = int(m.group(2)) if m.group(2) is not None else 1
    new_len = int(m.group(4)) if m.group(4) is not None else 1
    need_old, need_new = old_len, new_len
    body: list[list[str]] = []
    i += 1
    while need_old > 0 or need_new > 0:
        if i >= len(lines):
            raise PatchParseError(
                f"{path}: hunk {number} ({header}) ends early: its header counts "
                f"{old_len} old and {new_len} new lines but the patch ends "
                f"{need_old} old / {need_new} new line(s) short"
            )
        line = lines[i]
        if line.startswith("\\"):
            if body and body[-1][1].endswith("\n"):
                body[-1][1] = body[-1][1][:-1]
            i += 1
            continue
        if line in ("", "\r"):
            tag, text = " ", line
        else:
            tag, text = line[0], line[1:]
        if tag == " ":
            need_old -= 1
            need_new -= 1
        elif tag == "-":
            need_old -= 1
        elif tag == "+":
            need_new -= 1
        else:
            raise PatchParseError(
                f"{path}: hunk {number} ({header}): line {line!r} does not start with "
                f"' ', '-' or '+' ({need_old} old / {need_new} new line(s) still expected "
                "by the header counts)"
            )
        if need_old < 0 or need_new < 0:
            raise PatchParseError(
                f"{path}: hunk {number} ({header}): more lines than its header counts "
                f"({old_len} old, {new_len} new) at {line!r}"
            )
        body.append([tag, text + "\n"])
        i += 1
    if i < len(lines) and lines[i].startswith("\\"):
        if body and body[-1][1].endswith("\n"):
            body[-1][1] = body[-1][1][:-1]
        i += 1
    if i < len(lines) and lines[i][:1] in ("+", "-") and lines[i].rstrip("\r") != "-- ":
        starts_file = lines[i].startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ ")
        if not starts_file:
            raise PatchParseError(
                f"{path}: hunk {number} ({header}): more lines than its header counts "
                f"({old_len} old, {new_len} new): {lines[i]!r} follows the hunk"
            )
    return Hunk(old_start, old_len, new_start, new_len, tuple((t, x) for t, x in body)), i


def parse_patch(text: str) -> list[FilePatch]:
    """Parse a unified diff (one or more files).

    Lines before, between and after file sections that are not part of a
    hunk (``diff --git``, ``index``, mode lines, commit messages) are ignored.

    Args:
        text: The patch.

    Returns:
        One :class:`FilePatch` per ``---``/``+++`` header pair, in order.

    Raises:
        PatchParseError: No file header, a malformed hunk header, hunk
            counts that disagree with the body, or a file with no hunks.
    """
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    files: list[FilePatch] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            old = _parse_path(line[4:])
            new = _parse_path(lines[i + 1][4:])
            if old is None and new is None:
                raise PatchParseError(f"both sides of {line!r} / {lines[i + 1]!r} are /dev/null")
            label = new or old or "?"
            i += 2
            hunks: list[Hunk] = []
            while i < len(lines) and lines[i].startswith("@@"):
                hunk, i = _parse_hunk(lines, i, label, len(hunks) + 1)
                hunks.append(hunk)
            if not hunks and old is not None and new is not None and old == new:
                raise PatchParseError(f"{label}: file header without any '@@' hunk")
            files.append(FilePatch(old, new, tuple(hunks)))
            continue
        if line.startswith("@@"):
            raise PatchParseError(
                f"hunk header {line!r} before any '--- a/path' / '+++ b/path' file header"
            )
        i += 1
    if not files:
        raise PatchParseError(
            "no file header found: a unified diff needs '--- a/path' then '+++ b/path' "
            "lines before its '@@' hunks"
        )
    return files


# ---------------------------------------------------------------------------
# Applying.
# ---------------------------------------------------------------------------


def _find(lines: list[str], old: list[str], expected: int, lo: int) -> int | None:
    """Nearest index >= ``lo`` where ``old`` occurs, searching outward from ``expected``."""
    hi = len(lines) - len(old)
    if hi < lo:
        return None
    if not old:
        return min(max(expected, lo), len(lines))
    first = old[0]
    for off in range(0, max(expected - lo, hi - expected) + 1):
        for cand in (expected - off, expected + off) if off else (expected,):
            if lo <= cand <= hi and lines[cand] == first and lines[cand : cand + len(old)] == old:
                return cand
    return None


def _mismatch(path: str, number: int, hunk: Hunk, lines: list[str], at: int) -> HunkMismatch:
    old = hunk.old_lines()
    at = max(at, 0)
    for j, want in enumerate(old):
        have = lines[at + j] if at + j < len(lines) else None
        if have != want:
            return HunkMismatch(
                path, number, hunk.header, at + j + 1, _show(want), None if have is None else _show(have)
            )
    # Matched at the expected place but overlaps an earlier hunk.
    return HunkMismatch(path, number, hunk.header, at + 1, _show(old[0]) if old else "", "an earlier hunk's lines")


def apply_file_patch(fp: FilePatch, text: str | None) -> tuple[str | None, list[int]]:
    """Apply one file's hunks to its current text.

    Args:
        fp: The file patch.
        text: The file's current content; ``None`` when it does not exist.

    Returns:
        ``(new_text, offsets)``: the new content (``None`` when the patch
        deletes the file) and, per hunk, how many lines from its header's
        position it was found at.

    Raises:
        PatchConflict: Creating a file that exists, patching one that does
            not, or deleting one whose content the hunks do not cover.
        HunkMismatch: A hunk's lines are not in the file.
    """
    if fp.is_new and text is not None:
        raise PatchConflict(f"{fp.path}: the patch creates this file but it already exists")
    if not fp.is_new and text is None:
        raise PatchConflict(f"{fp.old_path}: file not found")
    lines = split_lines(text or "")
    out: list[str] = []
    offsets: list[int] = []
    pos = 0
    delta = 0
    for number, hunk in enumerate(fp.hunks, 1):
        old = hunk.old_lines()
        base = hunk.old_start - 1 if hunk.old_len > 0 else hunk.old_start
        expected = base + delta
        at = _find(lines, old, expected, pos)
        if at is None:
            raise _mismatch(fp.old_path or fp.path, number, hunk, lines, max(expected, pos))
        offsets.append(at - base)
        delta = at - base
        out.extend(lines[pos:at])
        out.extend(hunk.new_lines())
        pos = at + len(old)
    out.extend(lines[pos:])
    if fp.is_delete:
        if out:
            raise PatchConflict(
                f"{fp.path}: the patch deletes this file but it has {len(out)} line(s) the "
                f"patch does not remove (first: {_show(out[0])!r})"
            )
        return None, offsets
    return "".join(out), offsets


@dataclass
class PatchPlan:
    """What applying a patch will do; nothing has been written yet.

    Attributes:
        writes: path -> new content, or ``None`` to delete the path, in order.
        applied: Files the patch changes, as ``(path, summary)``.
        already_applied: Files whose reverse applies cleanly (left alone).
    """

    writes: dict[str, str | None] = field(default_factory=dict)
    applied: list[tuple[str, str]] = field(default_factory=list)
    already_applied: list[str] = field(default_factory=list)


def _summary(fp: FilePatch, offsets: list[int]) -> str:
    kind = "created" if fp.is_new else "deleted" if fp.is_delete else "modified"
    if fp.old_path and fp.new_path and fp.old_path != fp.new_path:
        kind = f"renamed from {fp.old_path}"
    text = f"{kind}, {len(fp.hunks)} hunk(s)"
    moved = [f"hunk {n} at offset {off:+d}" for n, off in enumerate(offsets, 1) if off]
    if moved:
        text += " (" + ", ".join(moved) + " line(s))"
    return text


def plan_patch(files: list[FilePatch], read: Callable[[str], str | None]) -> PatchPlan:
    """Decide, file by file, whether to apply or whether it is already applied.

    A file whose hunks apply forward is applied; one whose hunks do not
    apply forward but whose reverse applies cleanly is "already applied"
    (DESIGN §3: the same patch twice is not applied twice). When both apply
    (repetitive text), the direction found nearer the headers' positions
    wins, forward on a tie. Files later in the patch see earlier files'
    planned content.

    Args:
        files: From :func:`parse_patch`.
        read: path -> current content, ``None`` when the file does not exist.

    Returns:
        The plan (apply it only if this returns: all-or-nothing).

    Raises:
        PatchError: Some file neither applies nor is already applied; the
            message is the forward failure.
    """
    plan = PatchPlan()

    def current(path: str | None) -> str | None:
        if path is None:
            return None
        if path in plan.writes:
            return plan.writes[path]
        return read(path)

    for fp in files:
        forward: tuple[str | None, list[int]] | None = None
        backward: tuple[str | None, list[int]] | None = None
        try:
            forward = apply_file_patch(fp, current(fp.old_path or fp.new_path))
        except PatchError as err:
            fwd_err: PatchError | None = err
        else:
            fwd_err = None
        try:
            backward = apply_file_patch(fp.reversed(), current(fp.new_path or fp.old_path))
        except PatchError:
            backward = None
        if forward is not None and (
            backward is None or sum(map(abs, forward[1])) <= sum(map(abs, backward[1]))
        ):
            new_text, offsets = forward
            if fp.old_path is not None and fp.new_path != fp.old_path:
                plan.writes[fp.old_path] = None
            if fp.new_path is not None:
                plan.writes[fp.new_path] = new_text
            plan.applied.append((fp.path, _summary(fp, offsets)))
        elif backward is not None:
            plan.already_applied.append(fp.path)
        else:
            assert fwd_err is not None
            raise fwd_err
    return plan
