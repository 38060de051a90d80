"""The ledger store: one append-only JSONL file per task on the host that runs it.

The workflow decides what enters the ledger; this module only writes what it
is given, in seq order, and reads it back. Rows are never rewritten: an
append whose rows are already in the file (a retried activity, a replayed
flush after a worker crash) skips them, so a row is there exactly once after
a crash (DESIGN §5). The truth is Temporal history — every row enters it
once — and the file is this host's cache of it: a host that lacks rows
rebuilds them from history (:func:`append_rows`, DESIGN §7). The flushes at
an abort and at a task's end are fsynced (a watcher re-reads the file the
moment it sees the event, seed 002); the rows riding on a model call need
not be.

Ledger writes cost no round trip of their own: the sampling activity appends
the workflow's pending rows before it reads the transcript
(``SampleInput.pending_rows``). The ``stopline.ledger_flush`` activity exists
for the moments with no sampling call to ride on: the end of a task, and an
abort, where the marker must be on disk before the ``turn_aborted`` event is
published (seed 002: write, flush, then publish).

Every configured secret value (``stopline.secrets``) is replaced in what is
written — rows and staged content alike — so the file never holds one, even
when a tool's output or a provider's error quoted it (DESIGN §5).

Must never: rewrite or truncate a row, reorder rows, or write a row the
workflow did not hand it.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections import OrderedDict
from pathlib import Path

import structlog
from temporalio import activity
from temporalio.exceptions import ApplicationError

from stopline.activities.tools._state import safe_component
from stopline.core.contracts import (
    LEDGER_FLUSH_ACTIVITY,
    LedgerFlushInput,
    LedgerRow,
    ToolCall,
)
from stopline.core.errors import StoplineError
from stopline.secrets import Redactor, current_redactor
from stopline.settings import load_settings

log = structlog.get_logger("stopline.ledger")


class LedgerCorrupt(StoplineError, RuntimeError):
    """The ledger file cannot take the rows it is given."""


class LedgerGap(LedgerCorrupt):
    """The file lacks rows the workflow already sent: a host that never held
    the task, or lost its home. Rebuilt from Temporal history (DESIGN §7)."""


class StagedMissing(LedgerCorrupt):
    """A row's content was staged on another host (or a lost home): it is in
    the activity result in history, and is rebuilt from there."""


def same_row(a: LedgerRow, b: LedgerRow) -> bool:
    """Whether two rows are the same append (seq, kind, round, call, time).

    Rows a reset re-creates while replaying up to its reset point are the
    same; rows of the new branch carry a later ``at`` (``workflow.now()`` of
    a new workflow task): a different row under an old seq is a fork.
    """
    return (a.seq, a.kind, a.round, a.call_id, a.at) == (b.seq, b.kind, b.round, b.call_id, b.at)


_locks: dict[Path, threading.RLock] = {}
# Parsed rows per ledger file: (bytes consumed, rows). Only complete lines.
_cache: dict[Path, tuple[int, list[LedgerRow]]] = {}
_locks_guard = threading.Lock()


class _StagedContent:
    """Staged row content of this worker process, bounded (oldest dropped).

    An entry lives from the activity that produced it until the next
    activity of its task appends the row (normally one round). One that is
    dropped, or never here (a restart, another host), is rebuilt from
    history; the bound only keeps tasks that vanished mid-round from holding
    memory.
    """

    def __init__(self, max_bytes: int = 64 * 1024 * 1024) -> None:
        self._items: OrderedDict[tuple[str, str, str], bytes] = OrderedDict()
        self._bytes = 0
        self._max = max_bytes
        self._lock = threading.Lock()

    def put(self, key: tuple[str, str, str], data: bytes) -> None:
        with self._lock:
            old = self._items.pop(key, None)
            self._bytes += len(data) - (len(old) if old else 0)
            self._items[key] = data
            while self._bytes > self._max and len(self._items) > 1:
                _, dropped = self._items.popitem(last=False)
                self._bytes -= len(dropped)

    def take(self, key: tuple[str, str, str]) -> bytes | None:
        with self._lock:
            data = self._items.pop(key, None)
            if data is not None:
                self._bytes -= len(data)
            return data


_staged = _StagedContent()


def _lock_for(path: Path) -> threading.RLock:
    with _locks_guard:
        return _locks.setdefault(path, threading.RLock())


class LedgerStore:
    """Per-task JSONL ledgers under a directory.

    Layout: ``<root>/<task_id>/ledger.jsonl`` (one :class:`LedgerRow` JSON
    object per line) and ``<root>/<task_id>/blobs/`` (large outputs).

    Args:
        root: Ledger directory (``Settings.ledger_dir``).
        redactor: Replaces secret values in what is written (default: the
            secrets configured in the environment).
    """

    def __init__(self, root: Path, *, redactor: Redactor | None = None) -> None:
        self.root = Path(root)
        self.redactor = redactor if redactor is not None else current_redactor()

    def path(self, task_id: str) -> Path:
        """Path of a task's JSONL ledger file."""
        return self.root / safe_component(task_id) / "ledger.jsonl"

    def read(self, task_id: str, upto_seq: int | None = None) -> list[LedgerRow]:
        """Read a task's rows in order.

        Reads incrementally: rows already parsed by this process are kept in
        memory (keyed by file offset), so reading the transcript every round
        costs only the new rows, not the whole file (a 2,000-round task).

        Args:
            task_id: Task id.
            upto_seq: Last seq to return (inclusive); ``None`` for all.

        Returns:
            The rows; empty when the file does not exist. A torn last line
            (a crash mid-write, never fsynced) is ignored.
        """
        path = self.path(task_id)
        with _lock_for(path):
            rows = self._read_cached(path)
        if upto_seq is None:
            return list(rows)
        return [r for r in rows if r.seq <= upto_seq]

    def last_seq(self, task_id: str) -> int:
        """The seq of the last complete row in the file, 0 when empty."""
        rows = self.read(task_id)
        return rows[-1].seq if rows else 0

    def _read_cached(self, path: Path) -> list[LedgerRow]:
        if not path.exists():
            _cache.pop(path, None)
            return []
        size = path.stat().st_size
        offset, rows = _cache.get(path, (0, []))
        if size < offset:  # file replaced (a new store at the same path)
            offset, rows = 0, []
        if size > offset:
            with path.open("rb") as fh:
                fh.seek(offset)
                for raw in fh:
                    if not raw.endswith(b"\n"):
                        break  # torn tail: never acknowledged, never counted
                    rows.append(LedgerRow.model_validate_json(raw))
                    offset += len(raw)
            _cache[path] = (offset, rows)
        return rows

    def append(self, task_id: str, rows: list[LedgerRow], *, durable: bool = True) -> int:
        """Append rows not yet in the file, then fsync (when ``durable``).

        A row whose seq the file already holds is skipped when it is the same
        append (a retried activity); when it is not, the workflow was reset
        and this is a new branch: the file's rows from that seq on are moved
        to ``forks/<n>.jsonl`` (kept for audit, never shown to the model) and
        the new branch continues the file (DESIGN §7: a reset forks the
        ledger).

        Args:
            task_id: Task id.
            rows: Rows in seq order.
            durable: fsync before returning. The flush at an abort and at a
                task's end must (a watcher re-reads the file at the event,
                seed 002); the rows a sampling call carries need not — the
                file is a cache of Temporal history, and rows a machine
                crash took are rebuilt from it (:class:`LedgerGap`).

        Returns:
            The number of rows written.

        Raises:
            LedgerGap: If the first new row does not follow the file's last
                seq (this host lacks rows: rebuild from history).
            StagedMissing: If a staged row's content is not on this host.
            LedgerCorrupt: If the rows are out of order.
        """
        path = self.path(task_id)
        with _lock_for(path):
            path.parent.mkdir(parents=True, exist_ok=True)
            last = self._last_seq_repairing(path)
            if rows and rows[0].seq <= last:
                have = self._read_cached(path)
                for r in rows:
                    if r.seq > last:
                        break
                    if r.seq - 1 >= len(have) or not same_row(have[r.seq - 1], r):
                        self._fork(path, r.seq)
                        last = r.seq - 1
                        break
            new = [r for r in rows if r.seq > last]
            expected = last + 1
            for r in new:
                if r.seq != expected:
                    if r is new[0]:
                        raise LedgerGap(f"ledger {path}: has rows up to {last}, got row {r.seq}")
                    raise LedgerCorrupt(
                        f"ledger {path}: expected row seq {expected}, got {r.seq}"
                    )
                expected += 1
            if not new:
                return 0
            new = [self._unstage(task_id, r) for r in new]
            data = b"".join(
                self.redactor.bytes(r.model_dump_json().encode()) + b"\n" for r in new
            )
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, data)
                if durable:
                    os.fsync(fd)
            finally:
                os.close(fd)
            if last == 0:
                # the task id as given, for retention (a directory name is the
                # id made file-safe, not always reversible)
                (path.parent / "task_id").write_text(task_id, encoding="utf-8")
                _fsync_dir(path.parent)
            return len(new)

    def _fork(self, path: Path, seq: int) -> None:
        """Move the file's rows from ``seq`` on to ``forks/<n>.jsonl``."""
        data = path.read_bytes()
        lines = data.splitlines(keepends=True)
        keep = b"".join(lines[: seq - 1])
        forks = path.parent / "forks"
        forks.mkdir(exist_ok=True)
        n = len(list(forks.glob("*.jsonl"))) + 1
        archive = forks / f"{n}.jsonl"
        fd = os.open(archive, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, data[len(keep):])
            os.fsync(fd)
        finally:
            os.close(fd)
        with path.open("rb+") as fh:
            fh.truncate(len(keep))
            fh.flush()
            os.fsync(fh.fileno())
        _cache.pop(path, None)

    def forget(self, task_id: str) -> None:
        """Drop this process's parsed rows of a task's file (the task let go
        of this host). Only a cache: a later read parses the file again. A
        worker that kept every task it ever served paid for them in every
        garbage collection — its CPU per round grew with the tasks it had
        run (``bench/bench_throughput.py``, repeated levels)."""
        _cache.pop(self.path(task_id), None)

    def forks(self, task_id: str) -> list[list[LedgerRow]]:
        """Rows of the branches resets abandoned, oldest first (for audit)."""
        forks = self.path(task_id).parent / "forks"
        if not forks.is_dir():
            return []
        paths = sorted(forks.glob("*.jsonl"), key=lambda p: int(p.stem) if p.stem.isdigit() else 0)
        return [self.read_path(p) for p in paths]

    def stage(self, task_id: str, key: str, content: dict[str, object]) -> None:
        """Keep a row's bulky content on this host until its row is appended.

        The activity that produced it (a tool call's result text, a sampling
        call's text and tool calls) stages it here; the workflow then sends
        the row with ``meta["staged"] = key`` and no content, so the content
        enters workflow history once — as the activity's result — not again
        in the next activity's input (DESIGN §5).

        Kept in this worker process's memory, not on disk: the next activity
        of the task on this host (the one that appends the row) runs in the
        same process, and when it does not find the content — a restarted
        worker, an evicted entry, another host — the row is rebuilt from the
        activity result in Temporal history (:class:`StagedMissing`, DESIGN
        §7). So a round writes and fsyncs no staging file (it used to write
        two).

        Args:
            task_id: Task id.
            key: ``call-<call id>`` or ``round-<n>``.
            content: ``{"text": ...}`` and, for a sampling call,
                ``{"tool_calls": [...]}``.
        """
        _staged.put((str(self.root), task_id, key), self.redactor.bytes(json.dumps(content).encode()))

    def _staged_path(self, task_id: str, key: str) -> Path:
        return self.path(task_id).parent / "staged" / f"{safe_component(key)}.json"

    def _unstage(self, task_id: str, row: LedgerRow) -> LedgerRow:
        """Fill a staged row's content from this process's staging (or a
        staging file an earlier version left)."""
        key = row.meta.get("staged")
        if not key:
            return row
        raw = _staged.take((str(self.root), task_id, str(key)))
        try:
            content = json.loads(raw if raw is not None else self._staged_path(task_id, str(key)).read_bytes())
        except (OSError, ValueError) as err:
            raise StagedMissing(
                f"row {row.seq} of {task_id}: staged content {key!r} is not on this host ({err})"
            ) from None
        meta = {k: v for k, v in row.meta.items() if k != "staged"}
        update: dict[str, object] = {"text": content.get("text"), "meta": meta}
        if "tool_calls" in content:
            update["tool_calls"] = [ToolCall.model_validate(c) for c in content["tool_calls"]]
        return row.model_copy(update=update)

    def _last_seq_repairing(self, path: Path) -> int:
        """Last complete seq; a torn (unterminated) tail is cut off first.

        The torn bytes were never fsynced-and-acknowledged, so no reader has
        relied on them; cutting them is not rewriting history.
        """
        if not path.exists():
            return 0
        size = path.stat().st_size
        if size == 0:
            return 0
        with path.open("rb+") as fh:
            fh.seek(size - 1)
            if fh.read(1) != b"\n":
                fh.seek(0)
                content = fh.read()
                cut = content.rfind(b"\n") + 1
                fh.truncate(cut)
                fh.flush()
                os.fsync(fh.fileno())
        rows = self._read_cached(path)
        return rows[-1].seq if rows else 0

    @staticmethod
    def read_path(path: Path) -> list[LedgerRow]:
        """Read rows from a ledger file path (complete lines only)."""
        out: list[LedgerRow] = []
        with path.open("rb") as fh:
            for raw in fh:
                if raw.endswith(b"\n"):
                    out.append(LedgerRow.model_validate_json(raw))
        return out

def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def default_store() -> LedgerStore:
    """The store under ``$STOPLINE_HOME/ledger``."""
    settings = load_settings()
    return LedgerStore(settings.ledger_dir, redactor=current_redactor(settings))


async def append_rows(
    store: LedgerStore, task_id: str, rows: list[LedgerRow], *, durable: bool = True
) -> int:
    """Append rows; when this host lacks earlier rows, rebuild them from
    Temporal history first (DESIGN §7: the transcript outlives its host).

    Must run inside an activity of the task's workflow (its history is
    fetched with the activity's client). ``durable``: fsync (see
    :meth:`LedgerStore.append`).

    Returns:
        The number of rows written by the final append.

    Raises:
        ApplicationError: ``LedgerCorrupt`` (non-retryable) when even the
            history cannot make the file whole.
    """
    # The appends fsync: in a thread, so the worker's other calls never
    # wait on this disk (3-10 ms per fsync, bench/bench_throughput.py).
    try:
        try:
            return await asyncio.to_thread(store.append, task_id, rows, durable=durable)
        except (LedgerGap, StagedMissing) as why:
            from stopline.activities.history import rows_from_history

            info = activity.info()
            full = await rows_from_history(activity.client(), info.workflow_id, info.workflow_run_id)
            log.warning("ledger_rebuilt", task_id=task_id, reason=str(why), rows=len(full))
            await asyncio.to_thread(store.append, task_id, full, durable=durable)
            return await asyncio.to_thread(store.append, task_id, rows, durable=durable)
    except LedgerCorrupt as err:
        raise ApplicationError(str(err), type="LedgerCorrupt", non_retryable=True) from None


@activity.defn(name=LEDGER_FLUSH_ACTIVITY)
async def ledger_flush(inp: LedgerFlushInput) -> int:
    """Append rows to the task's ledger and fsync; kill aborted calls' groups.

    Order matters (seed 002): the process groups of aborted calls are killed
    first (the irreversible step: nothing of theirs goes on writing), then
    the receipts and marker are appended and fsynced; the workflow publishes
    ``turn_aborted`` only after this returns.

    Args:
        inp: Task id, rows, call ids to kill, whether to close shells.

    Returns:
        The last seq now in the ledger file.

    Raises:
        ApplicationError: ``LedgerCorrupt`` (non-retryable) when the file
            cannot be made whole, even from history.
    """
    from stopline.activities.host import release_session
    from stopline.activities.tools import close_unattended_shells, kill_call_groups

    if inp.kill_calls:
        kill_call_groups(inp.task_id, inp.kill_calls)
    if inp.close_shells:
        # blocks up to grace + 1 s while shells exit: off the event loop
        await asyncio.to_thread(close_unattended_shells, inp.task_id)
    store = default_store()
    await append_rows(store, inp.task_id, inp.rows)
    last = store.last_seq(inp.task_id)
    if inp.release_session:
        release_session(inp.task_id)
        store.forget(inp.task_id)
    return last
