"""Worker interceptors: how a worker-level setting reaches its activities.

Why this module exists: an activity needs to know things about the worker
running it — which registry of running calls a pushed cancel reaches, how
often to heartbeat (``stopline.activities.running.HostConfig``). The SDK's
extension point for that is an activity interceptor; it lives here, on the
worker side, so that importing activity code (the CLI reads the ledger
through ``stopline.activities``) never imports ``temporalio.worker``.

What it must never do: change an activity's input or result.
"""

from __future__ import annotations

from typing import Any

from temporalio.worker import ActivityInboundInterceptor, ExecuteActivityInput, Interceptor

from stopline.activities.running import HostConfig, using


class HostActivities(Interceptor):
    """Each activity of the worker runs with this worker's :class:`HostConfig`.

    Through the interceptor rather than module globals, so two workers in
    one process — a test, a benchmark's side-by-side — can differ.

    Args:
        config: What the worker's activities see through
            ``stopline.activities.running.current()``.
    """

    def __init__(self, config: HostConfig) -> None:
        self.config = config

    def intercept_activity(self, next: ActivityInboundInterceptor) -> ActivityInboundInterceptor:
        """Wrap activity execution (SDK hook)."""
        return _HostInbound(next, self.config)


class _HostInbound(ActivityInboundInterceptor):
    def __init__(self, next: ActivityInboundInterceptor, config: HostConfig) -> None:
        super().__init__(next)
        self._config = config

    async def execute_activity(self, input: ExecuteActivityInput) -> Any:
        with using(self._config):
            return await self.next.execute_activity(input)
