"""The baselines the benchmarks compare stopline with: an agent loop as a
Temporal user would first write it, with the SDK's defaults.

- :class:`NaiveLoop` — a minimal workflow that, per round, calls a model
  activity (the whole conversation as its input, one non-streamed HTTP
  request to the scripted model) and then one tool activity per tool call
  (``list_dir`` as ``os.listdir``), and stops when the model answers without
  a tool call. No ledger, no events, no search attributes, no refusal or
  abort path: the floor of what a round on Temporal costs.
- :func:`naive_tool` heartbeats like the SDK's cancellation sample
  (``activity.heartbeat()`` every second, ``heartbeat_timeout`` 2 s) when
  ``heartbeat`` is ``"sample"``; ``"none"`` heartbeats never — the default of
  agent frameworks whose activities have only a start-to-close timeout.

Run as ``python bench/_naive.py ADDRESS TASK_QUEUE [--activity-queue Q]
[--metrics HOST:PORT]`` it is a worker process for these (until SIGTERM), so
the benchmark can measure its CPU apart from its own. ``--activity-queue``
serves the activities on a second task queue (the loop is then started with
``activity_queue``): what host-bound activities cost, without eager
dispatch. ``--metrics``: its Temporal runtime serves Prometheus metrics.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from temporalio import activity, workflow

#: Workflow type name of the naive loop.
NAIVE_WORKFLOW = "NaiveLoop"


@dataclass
class ModelInput:
    """What the naive model activity gets: the whole conversation, every round."""

    url: str
    messages: list[dict[str, Any]]


@dataclass
class ModelOutput:
    """The model's answer: its text and its tool calls (id, name, input)."""

    text: str
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class ToolInput:
    """One tool call of the naive loop."""

    workspace: str
    name: str
    arguments: dict[str, Any]
    run_s: float = 0.0  # a long call (heartbeat benchmark): sleep this long first
    heartbeat: str = "none"


@dataclass
class LoopInput:
    """The naive loop's input."""

    url: str
    workspace: str
    prompt: str = "do the task"
    max_rounds: int = 50
    tool_run_s: float = 0.0
    heartbeat: str = "none"  # "sample" | "none"
    activity_queue: str | None = None  # None: the workflow's own queue (eager dispatch)


_http: Any = None


def _client() -> Any:
    """One HTTP client per worker process (a client per call would rebuild
    its TLS context every time: ~25 ms of CPU the baseline should not pay)."""
    global _http
    if _http is None:
        import httpx

        _http = httpx.AsyncClient(timeout=60)
    return _http


@activity.defn(name="naive.model")
async def naive_model(inp: ModelInput) -> ModelOutput:
    """One non-streamed Anthropic Messages request to the scripted model."""
    resp = await _client().post(
        f"{inp.url}/v1/messages",
        json={"model": "scripted", "max_tokens": 1024, "messages": inp.messages},
    )
    resp.raise_for_status()
    body = resp.json()
    text = "".join(b.get("text", "") for b in body["content"] if b["type"] == "text")
    calls = [
        {"id": b["id"], "name": b["name"], "input": b["input"]}
        for b in body["content"]
        if b["type"] == "tool_use"
    ]
    return ModelOutput(text=text, tool_calls=calls)


@activity.defn(name="naive.tool")
async def naive_tool(inp: ToolInput) -> str:
    """``list_dir`` as ``os.listdir``; heartbeats as configured while it runs."""
    if inp.run_s > 0:
        if inp.heartbeat == "sample":
            loops = int(inp.run_s)
            for _ in range(loops):
                activity.heartbeat()
                await asyncio.sleep(1)
        else:
            await asyncio.sleep(inp.run_s)
    path = os.path.join(inp.workspace, str(inp.arguments.get("path", ".")))
    return "\n".join(sorted(os.listdir(path))) or "(empty)"


@workflow.defn(name=NAIVE_WORKFLOW)
class NaiveLoop:
    """Model activity, then tool activities, until the model stops calling tools."""

    @workflow.run
    async def run(self, inp: LoopInput) -> int:
        messages: list[dict[str, Any]] = [{"role": "user", "content": inp.prompt}]
        heartbeat_timeout = timedelta(seconds=2) if inp.heartbeat == "sample" else None
        for rnd in range(1, inp.max_rounds + 1):
            out = await workflow.execute_activity(
                naive_model, ModelInput(inp.url, messages), task_queue=inp.activity_queue,
                start_to_close_timeout=timedelta(seconds=60),
            )
            content: list[dict[str, Any]] = [{"type": "text", "text": out.text}] if out.text else []
            content += [{"type": "tool_use", **c} for c in out.tool_calls]
            messages.append({"role": "assistant", "content": content})
            if not out.tool_calls:
                return rnd
            results = []
            for c in out.tool_calls:
                text = await workflow.execute_activity(
                    naive_tool,
                    ToolInput(inp.workspace, c["name"], c["input"], inp.tool_run_s, inp.heartbeat),
                    task_queue=inp.activity_queue,
                    start_to_close_timeout=timedelta(seconds=max(60, inp.tool_run_s * 2)),
                    heartbeat_timeout=heartbeat_timeout,
                )
                results.append({"type": "tool_result", "tool_use_id": c["id"], "content": text})
            messages.append({"role": "user", "content": results})
        return inp.max_rounds


async def _serve(address: str, queue: str, activity_queue: str | None, metrics_bind: str | None) -> None:
    from temporalio.client import Client
    from temporalio.runtime import PrometheusConfig, Runtime, TelemetryConfig
    from temporalio.worker import Worker

    runtime = None
    if metrics_bind:
        runtime = Runtime(telemetry=TelemetryConfig(metrics=PrometheusConfig(bind_address=metrics_bind)))
    client = await Client.connect(address, runtime=runtime)
    activities = [naive_model, naive_tool]
    if activity_queue:
        workers = [
            Worker(client, task_queue=queue, workflows=[NaiveLoop]),
            Worker(client, task_queue=activity_queue, activities=activities),
        ]
    else:
        workers = [Worker(client, task_queue=queue, workflows=[NaiveLoop], activities=activities)]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    runs = [asyncio.create_task(w.run()) for w in workers]
    print("worker_started", flush=True)
    await stop.wait()
    await asyncio.gather(*(w.shutdown() for w in workers))
    await asyncio.gather(*runs, return_exceptions=True)


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description="a worker for the naive loop")
    p.add_argument("address")
    p.add_argument("queue")
    p.add_argument("--activity-queue", help="serve the activities on this second queue")
    p.add_argument("--metrics", help="host:port for the runtime's Prometheus endpoint")
    a = p.parse_args()
    asyncio.run(_serve(a.address, a.queue, a.activity_queue, a.metrics))
    sys.stdout.flush()
    os._exit(0)
