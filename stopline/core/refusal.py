"""Refusal as an outcome (seed 000; DESIGN §4): pure policies, no I/O.

A provider refusal is the provider's verdict on a request. Retrying the same
history, routing to another model and continuing with a new message all
resend the same content, so none of them is a remedy. What a thread does
depends on its kind (:func:`thread_kind`), decided by :func:`disposition`.

This module must never forward trigger content upstream: receipts and
``task_stop`` evidence carry where the task stopped (provider, category,
round, last tool name, the assistant's own accepted text) — never tool
arguments, tool results or user input (seed 000 §4).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from stopline.core.contracts import RefusalStop

#: A usage source starting with this marks an automatic-fix task (seed 000 §2).
FIX_USAGE_PREFIX = "fix:"

#: The one sentence task_message, task_stop and task_status use (seed 000 §5).
NOT_CONTINUABLE = (
    "This task was stopped by a provider refusal and cannot be continued with "
    "task_message. Start a new task with task_start and another model; it may "
    "reference this task's artifact paths or branch."
)

#: The same sentence for a person at the CLI (``message``, ``status``,
#: ``stop``), naming the CLI's verbs; the model-facing one above keeps
#: naming the tools the model has.
NOT_CONTINUABLE_CLI = (
    "This task was stopped by a provider refusal and cannot be continued with "
    "`stopline message`. Start a new task with another model — `stopline run "
    "--model PROVIDER:MODEL …`; it may reference this task's artifact paths or branch."
)

#: What stands in for a quarantined external increment (seed 000 §2).
QUARANTINE_PLACEHOLDER = (
    "[an external update was withheld here because the provider declined to "
    "process it]"
)

#: Replaces stripped evidence fields in a refused task's task_stop evidence.
NOT_FORWARDED = "[refusal trigger content not forwarded]"
NOT_FORWARDED_SHORT = "[not forwarded]"

ThreadKind = Literal["task", "chat", "fix"]


def thread_kind(route: str, execution_scope: str, usage_source: str) -> ThreadKind:
    """Classify a thread for refusal disposition (seed 000 §2).

    A *fix* task is one whose usage source starts with :data:`FIX_USAGE_PREFIX`;
    a *task* is a sub-agent or anything whose execution scope is ``worker``,
    even on a chat route; everything else is a *chat* thread.

    Args:
        route: ``chat`` | ``subagent``.
        execution_scope: ``thread`` | ``worker``.
        usage_source: Free-form usage source (e.g. ``cli``, ``fix:ci``).

    Returns:
        ``task`` | ``chat`` | ``fix``.
    """
    if usage_source.startswith(FIX_USAGE_PREFIX):
        return "fix"
    if route == "subagent" or execution_scope == "worker":
        return "task"
    return "chat"


Action = Literal["stop", "quarantine_retry", "stop_notify", "switch_candidate", "reprobe", "freeze"]


@dataclass(frozen=True)
class Disposition:
    """What to do after a refusal.

    Attributes:
        action: ``stop`` (task: at once, no quarantine) | ``quarantine_retry``
            (withhold the unaccepted increments, retry the same provider) |
            ``stop_notify`` (chat: quarantine exhausted — stop with one
            critical notification) | ``switch_candidate`` (fix: skip this
            provider for the rest of the segment) | ``reprobe`` (fix: every
            candidate skipped; probe the first again, bounded) | ``freeze``
            (fix: re-probes exhausted — stop).
        candidate: Index of the candidate to use next (fix task only).
    """

    action: Action
    candidate: int | None = None


def disposition(
    kind: ThreadKind,
    *,
    unaccepted_increments: int,
    quarantine_retries_used: int,
    quarantine_retries: int,
    candidates: int = 1,
    skipped: frozenset[int] = frozenset(),
    current: int = 0,
    reprobes_used: int = 0,
    reprobe_limit: int = 1,
) -> Disposition:
    """The disposition matrix of seed 000 §2 / DESIGN §4.

    | thread | first refusal | quarantine exhausted | switch model |
    | task   | stop now; no quarantine | — | never |
    | chat   | quarantine unaccepted increment, retry same provider | stop + notify | never |
    | fix    | quarantine, retry; skip provider in segment, re-probe, freeze | — | yes |

    Args:
        kind: From :func:`thread_kind`.
        unaccepted_increments: External increments (inbox summaries,
            cross-thread events, sub-task results) in the refused request the
            provider has not accepted yet and that are not yet quarantined.
        quarantine_retries_used: Retries already made after quarantining.
        quarantine_retries: Bound on those retries.
        candidates: Number of candidate models (fix task).
        skipped: Candidate indexes skipped in this segment (fix task).
        current: Candidate index that just refused (fix task).
        reprobes_used: Re-probes already made (fix task).
        reprobe_limit: Bound on re-probes (fix task).

    Returns:
        The :class:`Disposition`.
    """
    if kind == "task":
        return Disposition("stop")
    can_quarantine = quarantine_retries_used < quarantine_retries and (
        unaccepted_increments > 0 or quarantine_retries_used > 0
    )
    if kind == "chat":
        return Disposition("quarantine_retry" if can_quarantine else "stop_notify")
    # fix task: quarantine first, then choosing candidates is its job.
    if can_quarantine:
        return Disposition("quarantine_retry", candidate=current)
    now_skipped = skipped | {current}
    for i in range(candidates):
        if i not in now_skipped:
            return Disposition("switch_candidate", candidate=i)
    if reprobes_used < reprobe_limit:
        return Disposition("reprobe", candidate=min(now_skipped))
    return Disposition("freeze")


def refusal_receipt(stop: RefusalStop, assistant_text: str) -> str:
    """The receipt a parent gets for a refused child (seed 000 §4).

    Carries provider, category, round, last tool name and the assistant's own
    text of that turn (already accepted by the provider). Never tool
    arguments, tool results or user input, and no pointer to "read the full
    history" (the full history is the trigger scene).

    Args:
        stop: Where it stopped.
        assistant_text: The assistant's own text in the refused turn ("" if
            none).

    Returns:
        The receipt text.
    """
    category = f"{stop.category} " if stop.category else ""
    tool = f" (last tool: {stop.tool})" if stop.tool else ""
    text = (
        f"Task stopped by a {category}refusal from {stop.provider}. It stopped at round "
        f"{stop.round}{tool}. The workspace and artifacts are left as they are; the "
        f"content that triggered the refusal is not forwarded. {NOT_CONTINUABLE}"
    )
    if assistant_text.strip():
        text += f"\n\nThe task's own last words:\n{assistant_text.strip()}"
    return text


#: The longest ``args_firstline`` and ``outcome`` of stop evidence, in characters.
ARGS_FIRSTLINE_CHARS = 200


def arguments_first_line(raw: str | None) -> str:
    """A tool call's arguments as one short line, for stop evidence.

    Arguments are JSON, where a newline inside a value is the two characters
    ``\\n``: the raw text's first line would be all of it. An object is shown
    as ``key=value`` pairs with each string value decoded, so the line ends
    where the first value's first line does (a shell ``command`` shows its
    first line only). Anything else: the raw text's first line.

    Args:
        raw: The raw arguments, as the model sent them; ``None``: none.

    Returns:
        At most :data:`ARGS_FIRSTLINE_CHARS` characters.
    """
    import json

    if not raw:
        return ""
    try:
        args = json.loads(raw)
    except ValueError:
        args = None
    if isinstance(args, dict) and args:
        shown = " ".join(
            f"{k}={v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}" for k, v in args.items()
        )
    else:
        shown = raw
    return _first_line(shown)


def _first_line(text: str | None) -> str:
    """``text``'s first line, at most :data:`ARGS_FIRSTLINE_CHARS` characters."""
    lines = (text or "").splitlines()
    return lines[0][:ARGS_FIRSTLINE_CHARS] if lines else ""


def stop_evidence(
    *,
    refused: bool,
    last_message: str,
    last_tool: str | None,
    last_tool_args: str | None,
    last_tool_outcome: str | None,
    changed_paths: list[str],
) -> dict[str, Any]:
    """Evidence ``task_stop`` returns about a stopped task (seed 000 §4).

    For a refused task the argument line and outcome of the last tool become
    a "not forwarded" placeholder and ``changed_paths`` is empty: paths are
    parsed out of tool results, which may be the trigger itself.

    Args:
        refused: Whether a refusal stopped the task (also when ``task_stop``
            raced it).
        last_message: The assistant's last text.
        last_tool: The last tool's name.
        last_tool_args: The last tool's raw arguments (shown by
            :func:`arguments_first_line`).
        last_tool_outcome: The last tool's result text.
        changed_paths: Paths written by the task's tools.

    Returns:
        ``{"last_message", "last_tool": {"tool", "args_firstline", "outcome"},
        "changed_paths", "refused"}``.
    """
    first = arguments_first_line(last_tool_args)
    outcome = _first_line(last_tool_outcome)
    return {
        "last_message": last_message,
        "last_tool": {
            "tool": last_tool,
            "args_firstline": NOT_FORWARDED if refused else first,
            "outcome": NOT_FORWARDED_SHORT if refused else outcome,
        },
        "changed_paths": [] if refused else list(changed_paths),
        "refused": refused,
    }


def delivery_status(status: str) -> str:
    """Delivery status of a child's result row: ``stopped`` → ``cancelled``."""
    return {"completed": "delivered", "stopped": "cancelled", "failed": "failed"}.get(status, status)
