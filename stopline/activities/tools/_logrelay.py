"""Copy a background shell's output to its log, keeping at most a cap on disk.

Why this module exists: a background shell outlives its call, an interrupt
and the worker that started it, and may print forever (a dev server in watch
mode). Its stdout and stderr go into a pipe; this relay, a small process of
its own started beside the shell (``python -I _logrelay.py LOG CAP``, stdlib
only, so it starts in milliseconds and imports nothing of stopline), copies
the pipe to ``LOG`` and rotates: when ``LOG`` reaches half the cap it becomes
``LOG.1`` (replacing the older half) and a new ``LOG`` starts. On disk there
are never more than ``CAP`` bytes, and they are the newest output.
``LOG.cut`` records how many older bytes were dropped (JSON ``{"dropped": N,
"cap": CAP}``), which ``shell_status`` reports.

It exits when every writer of the pipe has closed it (the shell and all it
started are gone). What it must never do: stop reading while the shell runs
(a full pipe would block the shell), or hold anything but the pipe and the
log.
"""

from __future__ import annotations

import json
import os
import sys

#: Bytes per read of the pipe.
CHUNK = 1 << 16


class _RotatingLog:
    """``LOG`` and ``LOG.1``, each at most ``cap // 2`` bytes."""

    def __init__(self, log: str, cap: int) -> None:
        self.log = log
        self.cap = cap
        self.half = max(cap // 2, 1)
        self.out = open(log, "ab", buffering=0)  # noqa: SIM115 - replaced on rotation
        self.size = self.out.tell()
        self.older = os.path.getsize(f"{log}.1") if os.path.exists(f"{log}.1") else 0
        self.dropped = 0

    def write(self, data: bytes) -> None:
        while data:
            room = self.half - self.size
            if room <= 0:
                self._rotate()
                continue
            piece, data = data[:room], data[room:]
            self.out.write(piece)
            self.size += len(piece)

    def _rotate(self) -> None:
        self.out.close()
        self.dropped += self.older
        os.replace(self.log, f"{self.log}.1")
        self.older, self.size = self.size, 0
        self.out = open(self.log, "ab", buffering=0)  # noqa: SIM115
        tmp = f"{self.log}.cut.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"dropped": self.dropped, "cap": self.cap}, f)
        os.replace(tmp, f"{self.log}.cut")

    def close(self) -> None:
        self.out.close()


def relay(source: int, log: str, cap: int) -> None:
    """Copy ``source`` to ``log`` until EOF, rotating at ``cap // 2`` bytes.

    A write that fails (disk full) stops the copying but not the reading, so
    the shell is never blocked on a full pipe.

    Args:
        source: File descriptor of the shell's output pipe.
        log: Path of the log.
        cap: The most bytes ``log`` and ``log.1`` hold together.
    """
    out = _RotatingLog(log, cap)
    broken = False
    try:
        while True:
            data = os.read(source, CHUNK)
            if not data:
                return
            if broken:
                continue
            try:
                out.write(data)
            except OSError:
                broken = True
    finally:
        out.close()


def main(argv: list[str]) -> int:
    """``_logrelay.py LOG CAP``: relay stdin to LOG."""
    if len(argv) != 3:
        print("usage: _logrelay.py LOG CAP_BYTES", file=sys.stderr)
        return 2
    try:
        relay(0, argv[1], int(argv[2]))
    except KeyboardInterrupt:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
