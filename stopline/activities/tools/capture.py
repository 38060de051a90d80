"""Bounded capture of a process's output: head + tail in memory, the rest on disk.

Why this module exists: a command may print 50 MB; the model must see a
bounded, still useful excerpt (the first half and the last half of the
budget, with a marker saying how much was left out), and the whole output
must not sit in the worker's memory nor in workflow history (DESIGN §5:
large values are stored beside the ledger and referenced). When the output
outgrows the budget it is streamed, in arrival order, to a blob file whose
path goes into ``RespondToModel.output_ref``.

The blob is bounded too (``store_cap``): a command that prints 1 GiB keeps
its first ``store_cap`` bytes on disk, a closing line says how much was not
kept, and :attr:`OutputCapture.store_cut` lets the result say so. Configured
secret values are replaced in the blob as it is written
(:class:`stopline.secrets.StreamRedactor`), so the full output beside the
ledger never holds one either.

What it must never do: keep more than ``2 x budget`` bytes per call in
memory, write more than ``store_cap`` bytes (plus one line) to disk, or block
on anything but a local file write.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Literal

if TYPE_CHECKING:
    from stopline.secrets import Redactor, StreamRedactor

StreamName = Literal["stdout", "stderr"]


def omitted_marker(n: int) -> str:
    """The line put where bytes were cut out of the middle of an output."""
    return f"[... {n} bytes omitted ...]"


class HeadTail:
    """Keep the first ``capacity // 2`` and the last ``capacity - capacity // 2`` bytes.

    Attributes:
        size: Bytes fed so far.
    """

    def __init__(self, capacity: int) -> None:
        self._head_cap = max(capacity // 2, 0)
        self._tail_cap = max(capacity - self._head_cap, 0)
        self._head = bytearray()
        self._tail = bytearray()
        self.size = 0

    @property
    def capacity(self) -> int:
        """Bytes this buffer can hold."""
        return self._head_cap + self._tail_cap

    def feed(self, data: bytes) -> None:
        """Append ``data``; the middle beyond the capacity is forgotten."""
        self.size += len(data)
        room = self._head_cap - len(self._head)
        if room > 0:
            self._head += data[:room]
            data = data[room:]
        if not data or self._tail_cap == 0:
            return
        if len(data) >= self._tail_cap:
            self._tail = bytearray(data[-self._tail_cap :])
            return
        self._tail += data
        excess = len(self._tail) - self._tail_cap
        if excess > 0:
            del self._tail[:excess]

    def excerpt(self, budget: int) -> tuple[bytes, bytes, int]:
        """The head and tail to show within ``budget`` bytes.

        Args:
            budget: Bytes that may be shown (clamped to the capacity).

        Returns:
            ``(head, tail, omitted)``: when everything fits, ``head`` is the
            whole output, ``tail`` is empty and ``omitted`` is 0.
        """
        budget = max(0, min(budget, self.capacity))
        kept = bytes(self._head) + bytes(self._tail)
        if self.size <= budget:
            return kept, b"", 0
        h = budget // 2
        t = budget - h
        complete = len(kept) == self.size
        head = kept[:h]
        tail_src = kept if complete else bytes(self._tail)
        tail = tail_src[len(tail_src) - t :] if t else b""
        return head, tail, self.size - h - t

    def render(self, budget: int) -> str:
        """Text of the excerpt (UTF-8, invalid bytes replaced), with the marker line."""
        head, tail, omitted = self.excerpt(budget)
        text = head.decode("utf-8", errors="replace")
        if omitted:
            text += f"\n{omitted_marker(omitted)}\n" + tail.decode("utf-8", errors="replace")
        return text


class OutputCapture:
    """stdout + stderr of one call, capped together, spilled to a blob when too big.

    Args:
        budget: Bytes of output (both streams together) the model may see.
        spill_path: Where to stream the full output once the total exceeds
            ``budget``; ``None`` never spills. stdout and stderr chunks are
            written interleaved in arrival order, like a terminal shows them.
        store_cap: The most bytes of output written to ``spill_path``
            (``None``: no cap).
        redactor: Replaces secret values in what is written to the blob.
    """

    def __init__(
        self,
        budget: int,
        spill_path: Path | None = None,
        *,
        store_cap: int | None = None,
        redactor: Redactor | None = None,
    ) -> None:
        self.budget = max(budget, 0)
        self.streams: dict[StreamName, HeadTail] = {
            "stdout": HeadTail(self.budget),
            "stderr": HeadTail(self.budget),
        }
        self.spill_path = spill_path
        self.spill_error: str | None = None
        self.store_cap = store_cap
        #: Bytes of output not written to the blob because of ``store_cap``.
        self.store_dropped = 0
        self._stored = 0
        self._early: list[bytes] = []
        self._early_size = 0
        self._spill: BinaryIO | None = None
        self._spilled = False
        self._redact: StreamRedactor | None = redactor.stream() if redactor else None

    @property
    def store_cut(self) -> bool:
        """Whether the blob holds less than the whole output (``store_cap``)."""
        return self.store_dropped > 0

    @property
    def total(self) -> int:
        """Bytes received on both streams."""
        return self.streams["stdout"].size + self.streams["stderr"].size

    @property
    def spilled(self) -> bool:
        """Whether the full output was written to :attr:`spill_path` (and no write failed)."""
        return self._spilled and self.spill_error is None

    def feed(self, stream: StreamName, data: bytes) -> None:
        """Record a chunk read from ``stream``."""
        if not data:
            return
        self.streams[stream].feed(data)
        if self.spill_path is None or self.spill_error is not None:
            return
        try:
            if self._spill is not None:
                self._store(data)
                return
            self._early.append(data)
            self._early_size += len(data)
            if self._early_size > self.budget:
                self.spill_path.parent.mkdir(parents=True, exist_ok=True)
                self._spill = open(self.spill_path, "wb")  # noqa: SIM115 - closed in close()
                self._spilled = True
                for chunk in self._early:
                    self._store(chunk)
                self._early.clear()
        except OSError as err:
            self.spill_error = f"{type(err).__name__}: {err}"
            self._early.clear()
            self.close()

    def _store(self, data: bytes) -> None:
        """Write a chunk of output to the blob, up to ``store_cap`` bytes of output."""
        assert self._spill is not None
        if self.store_cap is not None:
            room = self.store_cap - self._stored
            if room < len(data):
                self.store_dropped += len(data) - max(room, 0)
                data = data[: max(room, 0)]
        if not data:
            return
        self._stored += len(data)
        if self._redact is not None:
            data = self._redact.feed(data)
        self._spill.write(data)

    def close(self) -> None:
        """Close the blob file, ending it with a line saying what was cut (idempotent)."""
        if self._spill is not None:
            try:
                if self._redact is not None:
                    self._spill.write(self._redact.flush())
                if self.store_dropped:
                    self._spill.write(
                        f"\n[... {self.store_dropped} more bytes of output not stored: "
                        f"the stored copy is capped at {self.store_cap} bytes ...]\n".encode()
                    )
                self._spill.close()
            except OSError as err:
                self.spill_error = self.spill_error or f"{type(err).__name__}: {err}"
            self._spill = None
        self._early.clear()

    def render(self) -> str:
        """Both streams as sections, sharing :attr:`budget` fairly.

        When both fit, both are whole. Otherwise the smaller stream gets up to
        half the budget and the larger one the rest; each is cut head + tail.

        Returns:
            ``"--- stdout ---\\n...\\n--- stderr ---\\n..."``; an empty stream
            shows ``(empty)``.
        """
        out, err = self.streams["stdout"], self.streams["stderr"]
        if out.size + err.size <= self.budget:
            b_out, b_err = out.size, err.size
        else:
            small = min(out.size, err.size, self.budget // 2)
            if out.size <= err.size:
                b_out, b_err = small, self.budget - small
            else:
                b_out, b_err = self.budget - small, small
        parts = []
        for name, buf, b in (("stdout", out, b_out), ("stderr", err, b_err)):
            body = buf.render(b) if buf.size else "(empty)"
            parts.append(f"--- {name} ---\n{body}")
        return "\n".join(parts)


def clip_text(text: str, cap_bytes: int) -> str:
    """Last-resort head + tail cut so ``text`` encodes to at most ``cap_bytes`` (UTF-8)."""
    raw = text.encode("utf-8", errors="replace")
    if len(raw) <= cap_bytes:
        return text
    buf = HeadTail(max(cap_bytes - 64, 0))
    buf.feed(raw)
    return buf.render(buf.capacity)
