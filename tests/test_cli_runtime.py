"""One embedded server and one worker for many CLI commands at once.

``stopline run`` without ``up`` leases the embedded dev server and this
home's worker (``stopline.worker.runtime.acquire_embedded``): concurrent cold
starts start one server and one worker, none stops what another still uses,
and the last one out stops both. Each test has its own ``STOPLINE_HOME`` and
free ports, and must leave nothing running.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

from stopline.testing.scripted import anthropic_message, entry, scenario
from stopline.worker.runtime import free_port, port_open


def _stopline(env: dict[str, str], *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "stopline.cli", *args],
        env=env, capture_output=True, text=True, timeout=timeout,
    )


def _tiny(tmp_path: Path) -> tuple[Path, Path]:
    scen = tmp_path / "tiny.json"
    scen.write_text(json.dumps(scenario("anthropic", entry(anthropic_message("done")))))
    ws = tmp_path / "ws"
    ws.mkdir(exist_ok=True)
    return scen, ws


def _nothing_left(env: dict[str, str]) -> None:
    """No server on the port, no PID file, no process of this home alive."""
    assert not port_open("127.0.0.1", int(env["STOPLINE_DEV_SERVER_PORT"]))
    run = Path(env["STOPLINE_HOME"]) / "run"
    assert not list(run.glob("*.pid")), list(run.glob("*.pid"))
    assert not (run / "pinned").exists()
    home = env["STOPLINE_HOME"]
    stray = []
    for p in psutil.process_iter(["cmdline", "environ"]):
        try:
            if home in " ".join(p.info["cmdline"] or []) or (p.info["environ"] or {}).get("STOPLINE_HOME") == home:
                stray.append(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    assert not stray, f"processes of {home} still alive: {stray}"


def test_ten_concurrent_cold_runs_share_one_server(cli_env: dict[str, str], tmp_path: Path) -> None:
    scen, ws = _tiny(tmp_path)

    def run(i: int) -> subprocess.CompletedProcess[str]:
        return _stopline(cli_env, "run", f"go {i}", "--model", f"scripted:{scen}",
                         "--workspace", str(ws), "--id", f"cold-{i}", "--json")

    try:
        with ThreadPoolExecutor(10) as pool:
            procs = list(pool.map(run, range(10)))
        for i, proc in enumerate(procs):
            assert proc.returncode == 0, f"run {i}: {proc.stderr}{proc.stdout}"
            result = json.loads(proc.stdout.strip().splitlines()[-1])
            assert result == {**result, "task_id": f"cold-{i}", "status": "completed"}
            assert "Traceback" not in proc.stderr and "WARN" not in proc.stderr, proc.stderr
        # one server was started for all of them (one log line per start)
        log = (Path(cli_env["STOPLINE_HOME"]) / "run" / "worker.log").read_text()
        assert log.count("worker_started") == 1, log
    finally:
        _stopline(cli_env, "down")
    _nothing_left(cli_env)


def test_twenty_sequential_cold_starts(cli_env: dict[str, str], tmp_path: Path) -> None:
    scen, ws = _tiny(tmp_path)
    try:
        for i in range(20):
            started = time.monotonic()
            proc = _stopline(cli_env, "run", "go", "--model", f"scripted:{scen}", "--workspace", str(ws),
                             "--json")
            assert proc.returncode == 0, f"start {i} ({time.monotonic() - started:.1f}s): {proc.stderr}"
            assert json.loads(proc.stdout.strip().splitlines()[-1])["status"] == "completed"
            # each run stopped what it started: the next one is cold again
            assert not port_open("127.0.0.1", int(cli_env["STOPLINE_DEV_SERVER_PORT"])), f"start {i}"
    finally:
        _stopline(cli_env, "down")
    _nothing_left(cli_env)


def test_up_pins_the_server_and_runs_lease_it(cli_env: dict[str, str], tmp_path: Path) -> None:
    """`up` keeps the server up across runs; a foreground `stopline worker`
    on the same home is that home's one host, not a second worker."""
    scen, ws = _tiny(tmp_path)
    try:
        up = _stopline(cli_env, "up")
        assert up.returncode == 0, up.stderr
        run = _stopline(cli_env, "run", "go", "--model", f"scripted:{scen}", "--workspace", str(ws))
        assert run.returncode == 0, run.stderr
        assert port_open("127.0.0.1", int(cli_env["STOPLINE_DEV_SERVER_PORT"]))
        second = _stopline(cli_env, "worker", timeout=60)
        assert second.returncode == 2  # a set-up error
        assert "already serves" in second.stderr and "one worker per STOPLINE_HOME" in second.stderr
    finally:
        down = _stopline(cli_env, "down")
    assert down.returncode == 0, down.stderr
    _nothing_left(cli_env)


async def test_a_worker_started_with_the_server_waits_for_it(tmp_path: Path) -> None:
    """The embedded runtime starts the worker while the server starts: a
    worker whose server does not answer yet waits for it (bounded) instead
    of exiting, even when it is the faster of the two."""
    import asyncio

    from stopline.settings import load_settings
    from stopline.worker import runtime

    settings = load_settings(home=tmp_path / "home", dev_server_port=free_port(), dev_server_ui_port=free_port())
    os.environ.pop("TEMPORAL_ADDRESS", None)
    address = f"127.0.0.1:{settings.dev_server_port}"
    worker = runtime.background_worker(settings)
    server = runtime.dev_server(settings)
    try:
        saved = os.environ.get("STOPLINE_HOME")
        os.environ["STOPLINE_HOME"] = str(settings.home)
        try:
            runtime.start_background_worker(settings, address)  # nothing answers there yet
        finally:
            if saved is None:
                os.environ.pop("STOPLINE_HOME", None)
            else:
                os.environ["STOPLINE_HOME"] = saved
        await asyncio.sleep(3.0)
        assert worker.pid() is not None, worker.log_file.read_text()
        runtime.start_dev_server(settings)
        await runtime.wait_frontend_ready(settings, address, managed=server)
        await runtime.wait_worker_ready(settings, address)
        assert "waiting_for_temporal" in worker.log_file.read_text()
    finally:
        worker.stop()
        server.stop()
    assert worker.pid() is None and server.pid() is None


def test_a_worker_that_cannot_start_takes_the_server_it_came_with_down(
    cli_env: dict[str, str], tmp_path: Path
) -> None:
    """run started the embedded server and this home's worker; the worker
    failed (its metrics address is taken): the command fails saying why, and
    leaves no server or process behind."""
    import socket

    scen, ws = _tiny(tmp_path)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        env = {**cli_env, "STOPLINE_METRICS_BIND": f"127.0.0.1:{taken.getsockname()[1]}"}
        run = _stopline(env, "run", "go", "--model", f"scripted:{scen}", "--workspace", str(ws))
    assert run.returncode == 2, run.stdout + run.stderr
    assert "worker exited while starting" in run.stderr, run.stderr
    _nothing_left(cli_env)


def test_free_ports_are_outside_the_ephemeral_range() -> None:
    """A stopped embedded server's port must not be the next bind(0)'s: the
    dev server picks its internal ports by bind(0) while it starts, so a
    server restarted on a port from the ephemeral range can collide with
    itself and exit (seen once in CI, at the eighth of twenty cold starts)."""
    import socket

    from stopline.worker.runtime import _ephemeral_range

    low, high = _ephemeral_range()
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert all(not low <= p <= high and p >= 1024 for p in ports), [p for p in ports if low <= p <= high]
    with socket.socket() as s:  # free when handed out
        s.bind(("127.0.0.1", ports[-1]))


def test_a_dev_server_that_cannot_start_says_why(cli_env: dict[str, str], tmp_path: Path) -> None:
    """The embedded server exits at once when its UI port is taken: the
    command quotes the server's own reason and leaves nothing running."""
    import socket

    scen, ws = _tiny(tmp_path)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        env = {**cli_env, "STOPLINE_DEV_SERVER_UI_PORT": str(taken.getsockname()[1])}
        run = _stopline(env, "run", "go", "--model", f"scripted:{scen}", "--workspace", str(ws))
    assert run.returncode == 2, run.stdout + run.stderr
    assert "dev server exited while starting" in run.stderr, run.stderr
    assert env["STOPLINE_DEV_SERVER_UI_PORT"] in run.stderr, run.stderr
    assert "address already in use" in run.stderr, run.stderr
    _nothing_left(cli_env)


def test_a_stopline_folder_in_the_current_directory_does_not_shadow_the_package(
    cli_env: dict[str, str], tmp_path: Path
) -> None:
    """From the parent of a clone, ``./stopline`` is the repository, not the
    package: the background worker must still import the installed one."""
    shadow = tmp_path / "cwd" / "stopline"
    shadow.mkdir(parents=True)
    (shadow / "worker.py").write_text("raise SystemExit('imported the wrong stopline')\n")
    try:
        # the console script, as a person runs it (`python -m` would itself
        # import ./stopline first)
        script = Path(sys.executable).parent / "stopline"
        up = subprocess.run([str(script), "up"], env=cli_env, cwd=shadow.parent,
                            capture_output=True, text=True, timeout=240)
        assert up.returncode == 0, up.stderr
    finally:
        _stopline(cli_env, "down")
    _nothing_left(cli_env)
