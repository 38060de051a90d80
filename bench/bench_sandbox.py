"""Wall time a shell call gains in the bubblewrap sandbox, against the same call unconfined.

What is measured: ``--calls`` (default 100) foreground ``shell`` calls of
``true`` (argv form, so no ``bash``), each through the tool boundary
(``stopline.activities.tools.run_tool``: argument checks, the sandbox or
process group, output capture, the process-record file, teardown), in
three modes, run round-robin (one call of each mode in turn) after a warm-up
that is not counted:

- unconfined (``STOPLINE_SANDBOX=off``: a plain process group), the baseline;
- sandboxed, no network (the default);
- sandboxed, the task allows the network (no network namespace to create).

Reported: median and p95 wall time per call in each mode and the median
added by the sandbox, plus, for context, one bare ``bwrap ... true`` (the
same command line, no stopline around it). The 1-, 5- and 15-minute load
average is printed before and after: on a shared machine other work moves
these figures.

Run: ``.venv/bin/python bench/bench_sandbox.py [--calls 100]``. Needs
bubblewrap (``./dev.sh`` installs it when it can).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import time
from pathlib import Path

from _common import console, fresh_workspace, median, p95, stopline_home
from rich.table import Table

from stopline.activities.tools import run_tool
from stopline.activities.tools.sandbox import bwrap_argv, sandbox_status
from stopline.core.contracts import RespondToModel, ToolCall, ToolCallInput
from stopline.settings import load_settings

MODES = ("unconfined", "sandbox", "sandbox + network")


def load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} / {five:.2f} / {fifteen:.2f} (1 / 5 / 15 min, {os.cpu_count()} CPUs)"


async def one_call(ws: Path, mode: str, n: int) -> float:
    os.environ["STOPLINE_SANDBOX"] = "off" if mode == "unconfined" else "auto"
    inp = ToolCallInput(
        task_id="bench-sandbox",
        call=ToolCall(id=f"c{n}", name="shell", arguments={"command": ["true"]}),
        workspace=str(ws),
        network=mode == "sandbox + network",
        allow_unconfined=True,
    )
    t0 = time.perf_counter()
    out = await run_tool(inp)
    took = time.perf_counter() - t0
    assert isinstance(out, RespondToModel) and out.text.startswith("exit code 0"), out
    assert (out.unconfined_reason is None) == (mode != "unconfined"), (mode, out.unconfined_reason)
    return took


def bare_bwrap(ws: Path, calls: int) -> float:
    settings = load_settings()
    argv = bwrap_argv(
        sandbox_status(settings), settings, workspace=ws, cwd=ws, network=False, foreground=True
    ) + ["true"]
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        subprocess.run(argv, check=True)
        times.append(time.perf_counter() - t0)
    return median(times)


async def main(args: argparse.Namespace) -> None:
    status = sandbox_status(load_settings())
    if not status.available:
        console.print(f"[red]no sandbox here:[/] {status.detail}")
        raise SystemExit(1)
    saved = os.environ.get("STOPLINE_SANDBOX")
    try:
        with stopline_home() as home:
            ws = fresh_workspace(home)
            before = load()
            console.print(f"[dim]{status.detail}; warm-up ({args.warmup} calls per mode, not counted)…[/]")
            n = 0
            for _ in range(args.warmup):
                for mode in MODES:
                    n += 1
                    await one_call(ws, mode, n)
            times: dict[str, list[float]] = {m: [] for m in MODES}
            for _ in range(args.calls):
                for mode in MODES:
                    n += 1
                    times[mode].append(await one_call(ws, mode, n))
            bare = bare_bwrap(ws, args.calls // 4 or 1)
            after = load()
    finally:
        if saved is None:
            os.environ.pop("STOPLINE_SANDBOX", None)
        else:
            os.environ["STOPLINE_SANDBOX"] = saved
    base = median(times["unconfined"])
    table = Table(title=f"shell call of `true`: median of {args.calls} calls per mode, round-robin")
    table.add_column("mode", no_wrap=True)
    table.add_column("median", justify="right")
    table.add_column("p95", justify="right")
    table.add_column("added vs unconfined (median)", justify="right")
    for mode in MODES:
        med = median(times[mode])
        added = "—" if mode == "unconfined" else f"+{(med - base) * 1000:.1f} ms"
        table.add_row(mode, f"{med * 1000:.1f} ms", f"{p95(times[mode]) * 1000:.1f} ms", added)
    table.add_row("bare `bwrap … true` (no stopline; context)", f"{bare * 1000:.1f} ms", "", "")
    console.print(table)
    console.print(f"load average: before {before}; after {after}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=100, help="timed calls per mode (default 100)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed calls per mode first (default 5)")
    asyncio.run(main(parser.parse_args()))
