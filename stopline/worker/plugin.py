"""``StoplinePlugin``: stopline inside a team's own Temporal client and worker.

Teams already run Temporal workers; stopline plugs into them the way the
SDK's own integrations do, as a ``temporalio.plugin.SimplePlugin``::

    plugin = StoplinePlugin()
    client = await Client.connect("temporal:7233", plugins=[plugin])
    worker = Worker(client, task_queue="my-queue", workflows=[MyWorkflow],
                    activities=[lookup_ticket])   # the plugin comes with the client
    await worker.run()

What it brings:

- to the client: stopline's data converter (pydantic for its contracts, and
  the payload codec when ``STOPLINE_CODEC_KEY`` is set) and its interceptors
  (OpenTelemetry tracing when ``STOPLINE_OTEL`` is on);
- to a worker on a workflow task queue: the ``AgentTask`` and ``ChatThread``
  workflows, the activities any host may run (``task_message``,
  ``list_hosts``, ``round_record``), a sandbox that passes stopline's pure core through, the
  worker settings stopline's semantics need (heartbeat throttling, the
  graceful-shutdown grace, a short sticky-queue timeout) and, with
  ``host=True``, an identity naming this host;
- with ``host=True`` (the default), running that worker also runs this
  machine's host workers beside it — the pool's queue (host sessions, at
  most ``STOPLINE_HOST_CAPACITY``) and the host's own queue (sampling, tool
  calls, ledger writes) — so the team's worker process *is* a stopline host
  (DESIGN §7). ``host=False`` for a worker that should only run workflows.

stopline's own worker and CLI are built with this plugin too
(:mod:`stopline.worker.runtime`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

from temporalio.plugin import SimplePlugin
from temporalio.worker import Worker, WorkerConfig
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner, SandboxRestrictions

from stopline.settings import Settings, load_settings

__all__ = ["StoplinePlugin"]


def _sandbox(existing: Any) -> Any:
    """The workflow runner: the SDK's sandbox, with stopline's pure core and
    pydantic passed through (imported once, shared; they do no I/O)."""
    if existing is not None and not isinstance(existing, SandboxedWorkflowRunner):
        return existing  # a team's own runner choice (e.g. unsandboxed) stands
    restrictions = SandboxRestrictions.default.with_passthrough_modules("pydantic", "stopline.core")
    return SandboxedWorkflowRunner(restrictions=restrictions)


class StoplinePlugin(SimplePlugin):
    """stopline's workflows, activities, data converter and worker settings.

    Args:
        settings: stopline settings (default: from the environment).
        host: Run this machine's host workers (pool and own queue) beside
            every workflow-queue worker the plugin configures.
    """

    def __init__(self, settings: Settings | None = None, *, host: bool = True) -> None:
        from stopline.activities.host import list_hosts, round_record
        from stopline.activities.tasks import task_message
        from stopline.worker.codec import data_converter
        from stopline.worker.telemetry import tracing_interceptors
        from stopline.workflows.agent_task import AgentTask
        from stopline.workflows.chat_thread import ChatThread

        self.settings = settings or load_settings()
        self.host = host
        self._host_queues: set[str] = set()
        super().__init__(
            "stopline.StoplinePlugin",
            data_converter=data_converter(self.settings),
            interceptors=tracing_interceptors(self.settings),
            workflows=[AgentTask, ChatThread],
            activities=[task_message, list_hosts, round_record],
            workflow_runner=_sandbox,
        )

    def worker_options(self) -> dict[str, Any]:
        """The worker settings stopline's semantics need (DESIGN §3, §5):
        heartbeat throttling, the shutdown grace in-flight calls get."""
        s = self.settings
        throttle = timedelta(seconds=s.heartbeat_throttle_s)
        return {
            "max_heartbeat_throttle_interval": throttle,
            "default_heartbeat_throttle_interval": throttle,
            "graceful_shutdown_timeout": timedelta(seconds=s.worker_shutdown_grace_s),
        }

    def configure_worker(self, config: WorkerConfig) -> WorkerConfig:
        """Add stopline to a workflow-queue worker; only settings to its own
        host workers (which carry no workflows)."""
        own = config.get("task_queue") in self._host_queues
        if not own:
            config = super().configure_worker(config)
            # After a crash the next workflow task first goes to the dead
            # worker's sticky queue; 2 s (not the SDK's 10 s) until it falls
            # back to the normal queue bounds how long a crash stalls a task.
            config["sticky_queue_schedule_to_start_timeout"] = timedelta(seconds=2)
            if self.host and not config.get("identity"):
                config["identity"] = self._identity()
        for key, value in self.worker_options().items():
            config[key] = value  # type: ignore[literal-required]
        return config

    def _identity(self) -> str:
        from stopline.activities.host import identity, worker_identity

        return worker_identity(identity(self.settings), self.settings.host_capacity)

    def host_workers(self, client: Any, task_queue: str) -> list[Worker]:
        """This machine's host workers for ``task_queue``: the pool's queue
        and the host's own (see :func:`stopline.worker.runtime.build_host_workers`)."""
        from stopline.worker.runtime import build_host_workers

        workers = build_host_workers(client, self.settings, task_queue=task_queue, plugin=self)
        return workers

    def remember_host_queues(self, *queues: str) -> None:
        """Mark queues as this plugin's own host workers (no workflows there)."""
        self._host_queues.update(queues)

    async def run_worker(self, worker: Worker, next: Callable[[Worker], Awaitable[None]]) -> None:
        """Run the worker; with ``host=True`` and a workflow-queue worker,
        run this machine's host workers beside it and stop them with it."""
        if not self.host or worker.task_queue in self._host_queues:
            await next(worker)
            return
        from stopline.activities.host import HomeLock

        # One host per STOPLINE_HOME, as stopline-worker (DESIGN §7): the
        # host id and the ledgers live there. Raises HostInUse, naming the pid.
        lock = HomeLock(self.settings.home).acquire()
        try:
            extra = self.host_workers(worker.client, worker.task_queue)
            runs = [asyncio.create_task(w.run()) for w in extra]
            try:
                await next(worker)
            finally:
                await asyncio.gather(*(w.shutdown() for w in extra), return_exceptions=True)
                await asyncio.gather(*runs, return_exceptions=True)
        finally:
            lock.release()
