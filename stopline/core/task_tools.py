"""Sub-task tools: run by the workflow itself (child workflows), not by the
tool activity. Specs and argument models only; no I/O (imported inside the
workflow sandbox).

``task_start`` starts a child ``AgentTask``; ``task_wait`` waits for
settlements; ``task_stop`` cancels a child and returns its stop evidence;
``task_status`` reports what the parent knows; ``task_message`` sends a child
a message through an activity (an Update on the child whose validator, like
the activity, refuses a task a provider refusal stopped — seed 000 §5).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from stopline.core.contracts import ToolSpec

TASK_TOOL_NAMES = frozenset({"task_start", "task_wait", "task_stop", "task_status", "task_message"})


class _Args(BaseModel):
    model_config = ConfigDict(extra="forbid")


#: What a ``task_start`` id suffix may hold (it becomes part of a workflow id).
TASK_ID_SUFFIX_PATTERN = r"^[A-Za-z0-9_-]{1,40}$"


class TaskStartArgs(_Args):
    """``task_start``: start a sub-task (a child AgentTask)."""

    # (Docstrings of these models reach the model as the schema's
    # description: keep them one line.) ``id`` names the sub-task, so a
    # scenario or script knows its task id in advance; ``model`` may be
    # ``scripted:FILE``, FILE read from the workspace on the host.

    prompt: str = Field(min_length=1, description="What the sub-task should do.")
    id: str | None = Field(
        default=None, pattern=TASK_ID_SUFFIX_PATTERN,
        description="Name the sub-task: its id becomes `<this task's id>.<id>` "
        "(letters, digits, `-`, `_`; default `sub1`, `sub2`, ...).",
    )
    model: str | None = Field(
        default=None,
        description="provider:model for the sub-task (default: this task's model); "
        "`scripted:FILE` serves a scripted scenario, FILE relative to the workspace.",
    )
    base_url: str | None = Field(default=None, description="Provider base URL override.")
    max_rounds: int | None = Field(default=None, ge=1, description="Sampling rounds before it stops.")


class TaskWaitArgs(_Args):
    """``task_wait``: wait until the tasks settle or ``timeout_s`` passes."""

    ids: list[str] = Field(min_length=1, description="Task ids returned by task_start.")
    timeout_s: float = Field(default=300.0, gt=0, le=86_400, description="Seconds to wait at most.")


class TaskIdArgs(_Args):
    """``task_stop`` / ``task_status``: one task id."""

    id: str = Field(description="A task id returned by task_start.")


class TaskMessageArgs(_Args):
    """``task_message``: send a running sub-task a message."""

    # ``wait`` (sync): after the message is accepted, wait like ``task_wait``
    # for the task to settle. Sync or async, a refused task is rejected with
    # the same sentence before anything is sent (seed 000 §5).

    id: str = Field(description="The task id.")
    text: str = Field(min_length=1, description="The message.")
    wait: bool = Field(default=False, description="Also wait until the task settles (sync mode).")
    timeout_s: float = Field(
        default=300.0, gt=0, le=86_400, description="With `wait`: seconds to wait at most."
    )


TASK_TOOL_SPECS: list[ToolSpec] = [
    ToolSpec(
        name="task_start",
        description=(
            "Start a sub-task: another agent working in the same workspace on `prompt`, on the "
            "same host as this task (so it sees the same files and shares this task's place "
            "there). Optional `id` (names it: its task id is this task's id, a dot, and `id`), "
            "`model` (provider:model) and `max_rounds`. Returns the task id at once; use "
            "task_wait to get its result."
        ),
        input_schema=TaskStartArgs.model_json_schema(),
    ),
    ToolSpec(
        name="task_wait",
        description=(
            "Wait until every task in `ids` has settled, or `timeout_s` seconds pass. Each "
            "task's result is delivered once, as a task result in the conversation."
        ),
        input_schema=TaskWaitArgs.model_json_schema(),
    ),
    ToolSpec(
        name="task_stop",
        description="Stop a sub-task. Returns where it stopped (last message, last tool, changed paths).",
        input_schema=TaskIdArgs.model_json_schema(),
    ),
    ToolSpec(
        name="task_status",
        description="Report a sub-task's state, and its result if it has settled.",
        input_schema=TaskIdArgs.model_json_schema(),
    ),
    ToolSpec(
        name="task_message",
        description=(
            "Send a message to a running or waiting sub-task. With `wait: true`, also wait "
            "(up to `timeout_s`) until it settles."
        ),
        input_schema=TaskMessageArgs.model_json_schema(),
    ),
]
