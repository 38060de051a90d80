"""The team's worker, with stopline plugged in.

    TEMPORAL_ADDRESS=localhost:7233 python worker.py

One ``Worker`` on the team's task queue runs the team's workflows and
activities *and* stopline's (``StoplinePlugin``); the plugin also runs this
machine's stopline host workers beside it (the pool and the host's own
queue), so agent tasks started here can claim this machine as their host.
"""

from __future__ import annotations

import asyncio
import os

from temporalio.client import Client
from temporalio.worker import Worker

from activities.tickets import lookup_ticket
from stopline import StoplinePlugin
from workflows.triage import TriageTicket

TASK_QUEUE = os.environ.get("TEAM_TASK_QUEUE", "team")


async def build(client: Client) -> Worker:
    """The team's worker; stopline comes with the client's plugin."""
    return Worker(client, task_queue=TASK_QUEUE, workflows=[TriageTicket], activities=[lookup_ticket])


async def main() -> None:
    client = await Client.connect(
        os.environ.get("TEMPORAL_ADDRESS", "localhost:7233"), plugins=[StoplinePlugin()]
    )
    await (await build(client)).run()


if __name__ == "__main__":
    asyncio.run(main())
