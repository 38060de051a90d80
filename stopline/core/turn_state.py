"""The turn engine's plain state records: how a turn ends, a running tool
call, a sub-task, the thread's counters.

Pure data with no behaviour, kept out of the workflow modules so the
workflow sandbox passes them through instead of re-creating the classes
for every workflow run (a dataclass is built by ``exec``; the four cost
about a fifth of creating an ``AgentTask`` instance, bench/bench_throughput.py).
Deterministic (DESIGN §1).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from stopline.core.contracts import ChildInfo, ToolCall


@dataclass
class End:
    """How a turn (and, for a task, the task) ends."""

    status: str
    reason: str
    refused: bool = False
    #: The thread cannot go on at all (no host reaches its workspace): a
    #: chat thread ends too, not just the turn.
    final: bool = False


@dataclass
class RunningCall:
    """A tool call of the current turn: its activity (or sub-task) handle."""

    call: ToolCall
    handle: Any
    started_at: datetime
    settled: bool = False


@dataclass
class Child:
    """A sub-task this thread started, with its child-workflow handle."""

    info: ChildInfo
    handle: Any = None


@dataclass
class Counters:
    """What the thread counts and remembers across rounds."""

    rounds: int = 0
    provider_calls: int = 0
    aborts_done: int = 0
    final_text: str = ""
    last_tool: str | None = None
    last_tool_args: str | None = None
    last_tool_outcome: str | None = None
    changed_paths: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
