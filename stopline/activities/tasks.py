"""Sending a sub-task a message: the ``stopline.task_message`` activity and
the client-side function the CLI uses, and :func:`bounded_update`, how every
Update a person or a model sends to a task is waited for.

Every way in checks the persisted ``provider-refusal-stop`` row in the
task's ledger store — a store that outlives the workflow run — not a flag in
memory (seed 000 §5): a refused task is answered with the one sentence
``task_stop`` and ``task_status`` use, and its workflow is never touched.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

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


#: Seconds an Update may wait to be accepted before the caller is told no
#: worker took it up. A live worker accepts it in its next workflow task:
#: well under a second on an idle server, a few seconds under load. A
#: worker that died a moment ago still counts as a recent poller for a
#: minute or more, so this wait is what tells the caller.
UPDATE_ACCEPT_WAIT_S = 20.0
#: Seconds an accepted ``interrupt`` or ``message`` Update may take to
#: finish. An interrupt's abort takes the grace, and on its fallback path
#: one heartbeat interval plus margin (DESIGN §3): far less than this.
UPDATE_FINISH_WAIT_S = 120.0


class UpdateNotAnswered(StoplineError):
    """An Update was not accepted, or not finished, within its bound."""


#: What :func:`bounded_update`'s waits return when their time ran out.
_NOT_IN_TIME = object()


async def bounded_update(
    handle: Any,
    update: str,
    *args: Any,
    result_type: type | None = None,
    accept_s: float = UPDATE_ACCEPT_WAIT_S,
    finish_s: float | None = UPDATE_FINISH_WAIT_S,
) -> Any:
    """Send an Update and wait for it in two bounded steps, never forever.

    ``execute_update`` waits as long as no worker runs the workflow: a task
    whose worker died would hang the command that asked. This waits for the
    Update to be accepted (a worker ran the workflow task that took it up),
    then for its result.

    Args:
        handle: The task's ``WorkflowHandle``.
        update: The Update's name (``interrupt``, ``message``, …).
        *args: Its arguments.
        result_type: The type its result decodes to.
        accept_s: Bound on acceptance, seconds.
        finish_s: Bound on the accepted Update's result, seconds; ``None``
            for none (an Update that waits for a whole turn).

    Returns:
        The Update's result.

    Raises:
        UpdateNotAnswered: No worker accepted it within ``accept_s`` (it
            stays queued on the server and may still run when a worker
            serves the task again), or it did not finish within ``finish_s``.
        temporalio.client.WorkflowUpdateFailedError: Its validator or
            handler rejected it.
    """
    import time
    import uuid
    from datetime import timedelta

    from temporalio.client import (
        WorkflowUpdateRPCTimeoutOrCancelledError,
        WorkflowUpdateStage,
    )

    async def within(seconds: float | None, call: Callable[[timedelta | None], Awaitable[Any]]) -> Any:
        # Each RPC carries the time left as its deadline; the server also
        # ends a long wait by itself (~10 s). Either way the SDK raises
        # WorkflowUpdateRPCTimeoutOrCancelledError, as it does for a
        # cancel: asked again while time is left, unless this task is
        # being cancelled (so no asyncio.wait_for: its cancel would be
        # taken for a timeout and asked again). _NOT_IN_TIME past it.
        deadline = None if seconds is None else time.monotonic() + seconds
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return _NOT_IN_TIME
            try:
                return await call(None if left is None else timedelta(seconds=left))
            except WorkflowUpdateRPCTimeoutOrCancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise
                await asyncio.sleep(0.2 if left is None else min(0.2, max(left, 0.0)))

    update_id = str(uuid.uuid4())  # asked again under one id: the server dedups it
    accepted = await within(accept_s, lambda rpc_timeout: handle.start_update(
        update, args=list(args), id=update_id, wait_for_stage=WorkflowUpdateStage.ACCEPTED,
        result_type=result_type, rpc_timeout=rpc_timeout,
    ))
    if accepted is _NOT_IN_TIME:
        raise UpdateNotAnswered(
            f"no worker took up the {update!r} Update of task {handle.id} within {accept_s:g}s: its "
            f"worker is gone or stuck (`stopline status {handle.id}`, `stopline hosts`). The server "
            f"keeps the request, so it may still run when a worker serves the task again"
        )
    result = await within(finish_s, lambda rpc_timeout: accepted.result(rpc_timeout=rpc_timeout))
    if result is _NOT_IN_TIME:
        raise UpdateNotAnswered(
            f"task {handle.id} accepted the {update!r} Update but did not finish it within "
            f"{finish_s:g}s: its worker stopped while handling it (`stopline status {handle.id}`)"
        )
    return result


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
        UpdateNotAnswered: No worker took the message up, or finished it,
            within the bounds of :func:`bounded_update`.
    """
    if refusal_row_exists(store, task_id):
        raise TaskNotContinuable(NOT_CONTINUABLE)
    handle = client.get_workflow_handle(task_id)
    try:
        return await bounded_update(handle, "message", text, result_type=MessageAck)
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
    except (TaskNotContinuable, UpdateNotAnswered) as err:
        return RespondToModel(text=str(err), ok=False)
    return RespondToModel(text=f"message delivered to task {inp.task_id} (it is {ack.state})")
