"""CLI benchmark: what token streaming costs and buys, and what a cold start costs.

1. Token streaming. A model answer of 200 text chunks spread over 10 s
   (scripted, SSE), watched by the CLI's own follower
   (``stopline.cli._follow``). For each ``STOPLINE_STREAM_DELTAS_S`` —
   0 (off: the baseline, watchers see the whole message), 0.25, 0.1 — it
   reports when the watcher saw text first (from the request reaching the
   provider), how many renders it got before the message ended, and what it
   cost the task's history: Signals (each one Action on Temporal Cloud) and
   events.
2. Cold start. ``stopline run`` with a one-answer scenario as a user types
   it, in a subprocess: warm (after ``stopline up``: the baseline), cold (no
   server: it starts the embedded server and worker, and stops them after),
   and five cold runs started at once (one server, one worker for all).

Run: ``.venv/bin/python bench/bench_cli.py`` (about 2 minutes). Prints the
load average: the machine is shared, and the figures move with it.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import (  # noqa: E402
    console,
    dev_server,
    fmt_ms,
    fresh_queue,
    fresh_workspace,
    median,
    running,
    stopline_home,
    task_input,
)
from stopline.cli import _follow  # noqa: E402
from stopline.core.contracts import AgentTaskResult, TaskEvent  # noqa: E402
from stopline.settings import load_settings  # noqa: E402
from stopline.testing.scripted import ScriptedServer, anthropic_message, entry, scenario  # noqa: E402
from stopline.worker.runtime import build_workers, free_port  # noqa: E402

CHUNKS = 200
SPREAD_S = 10.0
INTERVALS = (0.0, 0.25, 0.1)
COLD_TRIES = 3


def _chunked_answer() -> dict[str, Any]:
    def ev(kind: str, **data: Any) -> dict[str, Any]:
        return {"event": kind, "data": {"type": kind, **data}}

    events = [
        ev("message_start", message={"id": "m", "type": "message", "role": "assistant", "model": "m",
                                     "content": [], "stop_reason": None,
                                     "usage": {"input_tokens": 1, "output_tokens": 0}}),
        ev("content_block_start", index=0, content_block={"type": "text", "text": ""}),
        *[ev("content_block_delta", index=0, delta={"type": "text_delta", "text": f"t{i} "})
          for i in range(CHUNKS)],
        ev("content_block_stop", index=0),
        ev("message_delta", delta={"stop_reason": "end_turn"}, usage={"output_tokens": CHUNKS}),
        ev("message_stop"),
    ]
    return {"stream_events": events, "event_delay_s": SPREAD_S / len(events)}


async def streaming() -> list[dict[str, Any]]:
    rows = []
    with stopline_home() as home:
        async with dev_server() as env:
            client = env.client
            for interval in INTERVALS:
                os.environ["STOPLINE_STREAM_DELTAS_S"] = str(interval)  # activities read it per call
                queue = fresh_queue("stream")
                workers = build_workers(client, load_settings(), task_queue=queue)
                async with running(workers):
                    with ScriptedServer({"wire": "anthropic", "responses": [_chunked_answer()]}) as server:
                        handle = await client.start_workflow(
                            "AgentTask", task_input(server, fresh_workspace(home), queue),
                            id=f"bench-{uuid.uuid4().hex[:10]}", task_queue=queue,
                            result_type=AgentTaskResult,
                        )
                        seen: list[tuple[float, TaskEvent]] = []
                        await _follow(client, handle.id, lambda ev: seen.append((time.time(), ev)))
                        await handle.result()
                        asked = server.requests()[0]["received_at"]
                history = await handle.fetch_history()
                kinds = [e.event_type for e in history.events]
                from temporalio.api.enums.v1 import EventType

                signals = kinds.count(EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED)
                text_at = next(at for at, ev in seen if ev.kind == "assistant_text")
                first = next(at for at, ev in seen if ev.kind in ("assistant_delta", "assistant_text"))
                renders = sum(1 for at, ev in seen if ev.kind == "assistant_delta" and at < text_at)
                rows.append({"interval": interval, "first_text_s": first - asked, "whole_s": text_at - asked,
                             "renders": renders, "signals": signals, "events": len(kinds)})
            os.environ.pop("STOPLINE_STREAM_DELTAS_S", None)
    return rows


def _cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "stopline.cli", *args], env=env,
                          capture_output=True, text=True, timeout=300)


def cold_starts() -> list[dict[str, Any]]:
    with stopline_home() as home:
        env = dict(os.environ)
        env.update(STOPLINE_DEV_SERVER_PORT=str(free_port()), STOPLINE_DEV_SERVER_UI_PORT=str(free_port()))
        scen = home / "tiny.json"
        scen.write_text(json.dumps(scenario("anthropic", entry(anthropic_message("done")))))
        ws = fresh_workspace(home)

        def run() -> float:
            t = time.monotonic()
            proc = _cli(env, "run", "go", "--model", f"scripted:{scen}", "--workspace", str(ws), "--json")
            if proc.returncode != 0:
                raise RuntimeError(proc.stderr)
            return time.monotonic() - t

        rows = []
        try:
            assert _cli(env, "up").returncode == 0
            warm = [run() for _ in range(COLD_TRIES)]
            assert _cli(env, "down").returncode == 0
            rows.append({"what": "warm: after `stopline up` (baseline)", "median_s": median(warm)})
            cold = [run() for _ in range(COLD_TRIES)]
            rows.append({"what": "cold: starts and stops server + worker", "median_s": median(cold)})
            t = time.monotonic()
            with ThreadPoolExecutor(5) as pool:
                list(pool.map(lambda _: run(), range(5)))
            rows.append({"what": "5 cold at once: wall time for all", "median_s": time.monotonic() - t})
        finally:
            _cli(env, "down")
    return rows


def main() -> None:
    load = os.getloadavg()
    console.print(f"load average: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} CPUs")
    rows = asyncio.run(streaming())
    table = Table(title=f"token streaming: {CHUNKS} chunks over {SPREAD_S:g} s, one watcher")
    for col in ("STOPLINE_STREAM_DELTAS_S", "first text seen", "whole message seen", "renders before it",
                "Signals (Cloud Actions)", "history events"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row("0 (off, baseline)" if r["interval"] == 0 else f"{r['interval']:g}",
                      fmt_ms(r["first_text_s"]), fmt_ms(r["whole_s"]), str(r["renders"]),
                      str(r["signals"]), str(r["events"]))
    console.print(table)
    cold = cold_starts()
    table = Table(title=f"`stopline run`, one-answer scenario (median of {COLD_TRIES})")
    table.add_column("start")
    table.add_column("seconds", justify="right")
    for r in cold:
        table.add_row(r["what"], f"{r['median_s']:.2f}")
    console.print(table)
    load = os.getloadavg()
    console.print(f"load average after: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)
