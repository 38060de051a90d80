"""Sending a sub-task a message: the ``stopline.task_message`` activity and
the client-side function the CLI uses.

Every way in checks the persisted ``provider-refusal-stop`` row in the
task's ledger store — a store that outlives the workflow run — not a flag in
memory (seed 000 §5): a refused task is answered with the one sentence
``task_stop`` and ``task_status`` use, and its workflow is never touched.
"""

from __future__ import annotations

from temporalio import activity
from temporalio.client import Client, WorkflowUpdateFailedError
from temporalio.service import RPCError

from stopline.activities.ledger import LedgerStore, default_store
from stopline.core.contracts import (
    TASK_MESSAGE_ACTIVITY,
    MessageAck,
    RespondToModel,
    TaskMessageInput,
)
from stopline.core.errors import StoplineError
from stopline.core.refusal import NOT_CONTINUABLE


class TaskNotContinuable(StoplineError):
    """The task cannot take a message (refused, ended, or unknown)."""


def refusal_row_exists(store: LedgerStore, task_id: str) -> bool:
    """Whether the task's ledger holds a ``provider-refusal-stop`` row."""
    return any(r.kind == "provider-refusal-stop" for r in store.read(task_id))


async def send_task_message(client: Client, store: LedgerStore, task_id: str, text: str) -> MessageAck:
    """Send ``text`` to a task through its ``message`` Update.

    Args:
        client: Temporal client.
        store: The ledger store (for the persisted refusal row).
        task_id: The task's workflow id.
        text: The message.

    Returns:
        The Update's acknowledgement.

    Raises:
        TaskNotContinuable: With :data:`NOT_CONTINUABLE` for a refused task,
            or why else the task took no message (ended, validator).
    """
    if refusal_row_exists(store, task_id):
        raise TaskNotContinuable(NOT_CONTINUABLE)
    handle = client.get_workflow_handle(task_id)
    try:
        return await handle.execute_update("message", text, result_type=MessageAck)
    except WorkflowUpdateFailedError as err:
        cause = err.cause
        raise TaskNotContinuable(str(getattr(cause, "message", None) or cause or err)) from None
    except RPCError as err:
        raise TaskNotContinuable(f"task {task_id} takes no message: {err.message}") from None


@activity.defn(name=TASK_MESSAGE_ACTIVITY)
async def task_message(inp: TaskMessageInput) -> RespondToModel:
    """The ``task_message`` tool: send a sub-task a message.

    Returns:
        ``RespondToModel`` — ok when the task accepted it; ``ok=False`` with
        the reason (for a refused task, :data:`NOT_CONTINUABLE`).
    """
    if not inp.task_id or not inp.text.strip():
        return RespondToModel(text="task_message needs a task `id` and a non-empty `text`", ok=False)
    try:
        ack = await send_task_message(activity.client(), default_store(), inp.task_id, inp.text)
    except TaskNotContinuable as err:
        return RespondToModel(text=str(err), ok=False)
    return RespondToModel(text=f"message delivered to task {inp.task_id} (it is {ack.state})")
