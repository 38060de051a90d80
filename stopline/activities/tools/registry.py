"""The tool registry: specs offered to the model, argument models, dispatch, the boundary.

Why this module exists: one place maps a tool name to its JSON Schema (what
the model is told), its pydantic argument model (what is checked — the error
names the wrong field) and its handler; and :func:`run_tool` is the tool
boundary of DESIGN §2: whatever a handler does, the caller gets
``RespondToModel`` or ``Fatal``, never an exception. An unknown name,
arguments that did not parse or do not validate, a path outside the
workspace, and any exception escaping a handler all become
``RespondToModel(ok=False)`` — tool failure is not turn failure (seed 002).

What it must never do: let an ``Exception`` escape :func:`run_tool`, or
return ``Fatal`` for anything a model could cause (``Fatal`` is for a broken
engine). ``asyncio.CancelledError`` is not an ``Exception``: it passes
through to the activity, which owns cancellation.
"""

from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from stopline.core.contracts import Fatal, RespondToModel, ToolCallInput, ToolSpec
from stopline.core.errors import ToolError
from stopline.secrets import current_redactor
from stopline.settings import Settings, load_settings

from . import files, shell
from ._context import CallProgress, ToolContext
from .workspace import resolve_in_workspace

# ---------------------------------------------------------------------------
# Argument models (extra fields are rejected so a misspelt name is reported).
# ---------------------------------------------------------------------------


class _Args(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ShellArgs(_Args):
    """Arguments of ``shell``."""

    command: str | list[str]
    cwd: str | None = None
    timeout_s: float | None = Field(default=None, gt=0)
    background: bool = False

    @field_validator("command")
    @classmethod
    def _non_empty(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, str):
            if not value.strip():
                raise ValueError("must not be empty")
        elif not value or not value[0]:
            raise ValueError("argv list must be non-empty and start with a program name")
        return value


class ShellIdArgs(_Args):
    """Arguments of ``shell_status`` and ``shell_kill``."""

    shell_id: str


class ReadFileArgs(_Args):
    """Arguments of ``read_file``."""

    path: str
    offset_line: int = Field(default=1, ge=1)
    max_lines: int | None = Field(default=None, ge=1)


class WriteFileArgs(_Args):
    """Arguments of ``write_file``."""

    path: str
    content: str


class ListDirArgs(_Args):
    """Arguments of ``list_dir``."""

    path: str = "."


class ApplyPatchArgs(_Args):
    """Arguments of ``apply_patch``."""

    patch: str


# ---------------------------------------------------------------------------
# Handlers: arguments in, outcome out.
# ---------------------------------------------------------------------------


async def _shell(ctx: ToolContext, args: ShellArgs) -> RespondToModel:
    cwd = resolve_in_workspace(ctx.workspace, args.cwd or ".")
    if not cwd.is_dir():
        return RespondToModel(ok=False, text=f"cwd {args.cwd!r} is not a directory in the workspace")
    if args.background:
        return await shell.start_background(ctx, args.command, cwd)
    limit = ctx.inp.timeout_s
    timeout = min(args.timeout_s, limit) if args.timeout_s is not None else limit
    return await shell.run_foreground(ctx, args.command, cwd, timeout)


async def _shell_status(ctx: ToolContext, args: ShellIdArgs) -> RespondToModel:
    return await shell.shell_status(ctx, args.shell_id)


async def _shell_kill(ctx: ToolContext, args: ShellIdArgs) -> RespondToModel:
    return await shell.shell_kill(ctx, args.shell_id)


async def _read_file(ctx: ToolContext, args: ReadFileArgs) -> RespondToModel:
    return await files.read_file(ctx, args.path, args.offset_line, args.max_lines)


async def _write_file(ctx: ToolContext, args: WriteFileArgs) -> RespondToModel:
    return await files.write_file(ctx, args.path, args.content)


async def _list_dir(ctx: ToolContext, args: ListDirArgs) -> RespondToModel:
    return await files.list_dir(ctx, args.path)


async def _apply_patch(ctx: ToolContext, args: ApplyPatchArgs) -> RespondToModel:
    return await files.apply_patch(ctx, args.patch)


Handler = Callable[[ToolContext, Any], Awaitable[RespondToModel | Fatal]]


@dataclass(frozen=True)
class Tool:
    """One tool: what the model is told, what is validated, what runs."""

    spec: ToolSpec
    args: type[BaseModel]
    handler: Handler


def _obj(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }


_SHELL_ID = {"type": "string", "description": "The id returned when the background shell was started (sh-xxxxxxxx)."}

#: name -> tool. Tests may replace an entry (``monkeypatch.setitem``).
TOOLS: dict[str, Tool] = {
    "shell": Tool(
        ToolSpec(
            name="shell",
            description=(
                "Run a command in the workspace and return its exit code, elapsed time, stdout "
                "and stderr (long output is cut to its beginning and end). A string command runs "
                "with `bash -c`; a list is run directly as argv. A non-zero exit code is reported, "
                "not an error. When the call returns, every process it started is stopped, "
                "including ones put in the background with `&`; for servers or watchers that must "
                "keep running set background=true: the command then starts in a background shell "
                "whose id you use with shell_status and shell_kill. stdin is empty."
            ),
            input_schema=_obj(
                {
                    "command": {
                        "anyOf": [
                            {"type": "string"},
                            {"type": "array", "items": {"type": "string"}, "minItems": 1},
                        ],
                        "description": "Shell command line (string, run with bash -c) or argv list.",
                    },
                    "cwd": {
                        "type": "string",
                        "description": "Working directory relative to the workspace (default: the workspace).",
                    },
                    "timeout_s": {
                        "type": "number",
                        "exclusiveMinimum": 0,
                        "description": "Seconds before the command is stopped (default and maximum: the task's per-call limit).",
                    },
                    "background": {
                        "type": "boolean",
                        "description": "Start a background shell that keeps running after this call (default false).",
                    },
                },
                ["command"],
            ),
        ),
        ShellArgs,
        _shell,
    ),
    "shell_status": Tool(
        ToolSpec(
            name="shell_status",
            description="Show whether a background shell is running or has exited (with its exit code), its pid, and the tail of its output log.",
            input_schema=_obj({"shell_id": _SHELL_ID}, ["shell_id"]),
        ),
        ShellIdArgs,
        _shell_status,
    ),
    "shell_kill": Tool(
        ToolSpec(
            name="shell_kill",
            description="Stop a background shell and every process it started (SIGTERM, then SIGKILL after a short grace).",
            input_schema=_obj({"shell_id": _SHELL_ID}, ["shell_id"]),
        ),
        ShellIdArgs,
        _shell_kill,
    ),
    "read_file": Tool(
        ToolSpec(
            name="read_file",
            description=(
                "Read a text file from the workspace, starting at a line. Long files are returned "
                "in pieces; the result then says which offset_line to ask for next."
            ),
            input_schema=_obj(
                {
                    "path": {"type": "string", "description": "File path relative to the workspace."},
                    "offset_line": {"type": "integer", "minimum": 1, "description": "First line to return, 1-based (default 1)."},
                    "max_lines": {"type": "integer", "minimum": 1, "description": "Most lines to return (default 2000)."},
                },
                ["path"],
            ),
        ),
        ReadFileArgs,
        _read_file,
    ),
    "write_file": Tool(
        ToolSpec(
            name="write_file",
            description="Create or overwrite a workspace file with the given content; missing parent directories are created.",
            input_schema=_obj(
                {
                    "path": {"type": "string", "description": "File path relative to the workspace."},
                    "content": {"type": "string", "description": "The complete new content of the file."},
                },
                ["path", "content"],
            ),
        ),
        WriteFileArgs,
        _write_file,
    ),
    "list_dir": Tool(
        ToolSpec(
            name="list_dir",
            description="List a workspace directory: one name per line, sorted, directories marked with a trailing '/'.",
            input_schema=_obj(
                {"path": {"type": "string", "description": "Directory relative to the workspace (default '.')."}},
                [],
            ),
        ),
        ListDirArgs,
        _list_dir,
    ),
    "apply_patch": Tool(
        ToolSpec(
            name="apply_patch",
            description=(
                "Apply a unified diff (as produced by `diff -u` or `git diff`) to workspace files. "
                "Use '--- a/path' and '+++ b/path' headers ('--- /dev/null' to create a file, "
                "'+++ /dev/null' to delete one) and '@@ -l,n +l,n @@' hunks whose counts match "
                "their lines. Context lines must match the file exactly (a hunk may sit a few lines "
                "from its stated position). Either every file is changed or none is; on failure the "
                "result says which hunk did not match and what line was found instead. Applying a "
                "patch that is already applied changes nothing and says so."
            ),
            input_schema=_obj(
                {"patch": {"type": "string", "description": "The unified diff text."}},
                ["patch"],
            ),
        ),
        ApplyPatchArgs,
        _apply_patch,
    ),
}

#: The tools offered to the model, in a stable order.
TOOL_SPECS: list[ToolSpec] = [tool.spec for tool in TOOLS.values()]


# ---------------------------------------------------------------------------
# Dispatch and the boundary.
# ---------------------------------------------------------------------------


def _validation_text(name: str, err: ValidationError) -> str:
    problems = []
    for item in err.errors(include_url=False):
        loc = ".".join(str(part) for part in item["loc"]) or "(arguments)"
        problems.append(f"{loc}: {item['msg']}")
    return f"invalid arguments for {name}: " + "; ".join(problems)


async def _dispatch(
    inp: ToolCallInput, progress: CallProgress, settings: Settings | None
) -> RespondToModel | Fatal:
    name = inp.call.name
    tool = TOOLS.get(name)
    if tool is None:
        return RespondToModel(
            ok=False, text=f"unknown tool {name!r}; available tools: {', '.join(TOOLS)}"
        )
    if inp.call.arguments is None:
        why = inp.call.parse_error or "they could not be parsed"
        return RespondToModel(ok=False, text=f"arguments were not valid JSON: {why}")
    try:
        args = tool.args.model_validate(inp.call.arguments)
    except ValidationError as err:
        return RespondToModel(ok=False, text=_validation_text(name, err))
    workspace = Path(os.path.realpath(inp.workspace))
    if not workspace.is_dir():
        return RespondToModel(
            ok=False, text=f"workspace {inp.workspace!r} does not exist or is not a directory"
        )
    ctx = ToolContext(inp, settings or load_settings(), workspace, progress)
    try:
        return await tool.handler(ctx, args)
    except ToolError as err:  # a path outside the workspace, or through a link
        return RespondToModel(ok=False, text=f"{name}: {err}")


async def run_tool(
    inp: ToolCallInput,
    *,
    progress: CallProgress | None = None,
    settings: Settings | None = None,
) -> RespondToModel | Fatal:
    """Run one tool call and classify how it ended (DESIGN §2).

    Args:
        inp: The call (name, parsed arguments, workspace, timeouts, caps).
        progress: Terminal-state flag shared with the activity's heartbeat;
            set to ``True`` once the call reaches its terminal state (left
            ``False`` for an aborted call).
        settings: State directories; default :func:`load_settings`.

    Returns:
        ``RespondToModel``: ``ok=True`` when the handler finished (including
        a non-zero exit, a timeout, a user abort with ``aborted=True``),
        ``ok=False`` when the call could not be made — unknown tool,
        arguments not JSON (``"arguments were not valid JSON: ..."``) or
        invalid (``"invalid arguments for <tool>: <field>: <why>"``), a path
        outside the workspace, or ``"tool <name> raised <Type>: <msg>"`` for
        an exception escaping the handler. ``elapsed_s`` is always set.
        ``Fatal`` only if a handler returns one (none of these do). Every
        configured secret value in the text is replaced (``stopline.secrets``).

    Raises:
        asyncio.CancelledError: Only from handlers that do not own their
            cancellation (the foreground shell does and returns
            ``aborted=True`` instead); the activity turns it into an abort.
    """
    progress = progress if progress is not None else CallProgress()
    started = time.monotonic()
    settings = settings or load_settings()
    name = inp.call.name
    try:
        outcome = await _dispatch(inp, progress, settings)
    except Exception as err:  # noqa: BLE001 - the tool boundary: DESIGN §2
        outcome = RespondToModel(ok=False, text=f"tool {name} raised {type(err).__name__}: {err}")
    redactor = current_redactor(settings)
    match outcome:
        case RespondToModel():
            if not outcome.aborted:
                progress.terminal = True
            if not outcome.elapsed_s:
                outcome.elapsed_s = round(time.monotonic() - started, 3)
            outcome.text = redactor.text(outcome.text)
        case Fatal():
            progress.terminal = True
            outcome.reason = redactor.text(outcome.reason)
    return outcome
