"""What every tool handler receives besides its arguments.

Why this module exists: handlers need the call's input (workspace, caps,
timeouts), the settings (state directories) and a way to say "this call has
reached its terminal state" to the activity's heartbeat (DESIGN §3: heartbeat
details say whether the call is terminal). Kept apart from the registry so
handler modules can import it without a cycle.

What it must never do: carry secrets (``Settings`` holds API keys as
``SecretStr``; handlers read only the directory fields).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from stopline.core.contracts import ToolCallInput
from stopline.settings import Settings


@dataclass
class CallProgress:
    """Mutable progress of one call, read by the heartbeat loop.

    Attributes:
        terminal: The call reached its terminal state (process exited or was
            timed out, file written, result ready). Set once, never unset.
    """

    terminal: bool = False


@dataclass
class ToolContext:
    """One tool call's context.

    Attributes:
        inp: The activity input.
        settings: Where tool state lives.
        workspace: The workspace's real path (exists, is a directory).
        progress: Terminal-state flag the handler sets.
    """

    inp: ToolCallInput
    settings: Settings
    workspace: Path
    progress: CallProgress = field(default_factory=CallProgress)
