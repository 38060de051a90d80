"""Your own activities as the agent's tools: :func:`activity_tool`.

A team already has activities that look things up or change things in its
systems. Any of them that takes one pydantic model can be offered to the
model as a tool: name, description, JSON schema of its input, where it runs
and its timeouts travel in the task's input (:class:`ActivityTool`), so a
task names the tools it may use and no stopline worker is redeployed. The
activity runs on its own task queue, on the team's workers, under the same
outcome rules as stopline's tools (DESIGN §2): a return value or an exception
is a tool result the model reads; only :class:`stopline.FatalToolError` fails
the task.

Pure: no I/O. Usable in workflow code (a team's workflow building an agent
task's input) as well as in clients.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel

from stopline.core.contracts import ActivityTool

__all__ = ["activity_tool"]


def _activity_name(fn: Callable[..., Any]) -> str:
    defn = getattr(fn, "__temporal_activity_definition", None)
    name = getattr(defn, "name", None)
    if not isinstance(name, str) or not name:
        raise TypeError(f"{getattr(fn, '__qualname__', fn)!r} is not an activity (decorate it with @activity.defn)")
    return name


def _input_model(fn: Callable[..., Any]) -> type[BaseModel]:
    params = [p for p in inspect.signature(fn).parameters.values() if p.name != "self"]
    hints = typing.get_type_hints(fn)
    if len(params) != 1 or not (
        isinstance(hints.get(params[0].name), type) and issubclass(hints[params[0].name], BaseModel)
    ):
        raise TypeError(
            f"activity {_activity_name(fn)!r} must take exactly one argument annotated with a "
            f"pydantic model, so its JSON schema can be offered to the model"
        )
    return hints[params[0].name]


def activity_tool(
    fn: Callable[..., Any],
    *,
    name: str | None = None,
    description: str | None = None,
    task_queue: str | None = None,
    start_to_close_s: float = 300.0,
    heartbeat_timeout_s: float | None = None,
    max_attempts: int = 1,
) -> ActivityTool:
    """Describe an activity as a tool the model may call.

    Args:
        fn: An ``@activity.defn`` function (or method) taking one pydantic
            model, e.g. ``async def lookup_ticket(inp: TicketQuery) -> Ticket``.
        name: The tool's name for the model (default: the activity's name
            with anything but letters, digits, ``_`` and ``-`` made ``_``;
            providers accept only those).
        description: What it does, for the model (default: the first
            paragraph of the function's docstring).
        task_queue: Where it runs (default: the task's workflow queue, i.e.
            workers with :class:`stopline.StoplinePlugin` must register it).
        start_to_close_s: Timeout of one call, seconds.
        heartbeat_timeout_s: Heartbeat timeout, seconds; an activity that
            heartbeats learns of an interrupt on its next heartbeat.
        max_attempts: Attempts per call (default 1: at most once, DESIGN §2).

    Returns:
        The :class:`ActivityTool` to put in ``AgentTaskInput.tools``.

    Raises:
        TypeError: ``fn`` is not an activity taking one pydantic model, or
            has no description.
    """
    activity_name = _activity_name(fn)
    model = _input_model(fn)
    text = description or inspect.getdoc(fn) or ""
    text = text.split("\n\n", 1)[0].strip()
    if not text:
        raise TypeError(f"activity {activity_name!r} needs a description (a docstring, or description=)")
    tool_name = name or "".join(c if c.isalnum() or c in "_-" else "_" for c in activity_name)
    return ActivityTool(
        name=tool_name,
        description=" ".join(text.split()),
        input_schema=model.model_json_schema(),
        activity=activity_name,
        task_queue=task_queue,
        start_to_close_s=start_to_close_s,
        heartbeat_timeout_s=heartbeat_timeout_s,
        max_attempts=max_attempts,
    )
