"""File tools against a process racing them: no path check can be split from its open.

A real symlink flipper (a separate process) swaps a workspace directory for
a link to a directory outside, as fast as it can, while the file tools read
and write through it. An escape is a file written outside or a read that
returns the outside file's content; there must be none, with ``openat2``
and with the per-component ``O_NOFOLLOW`` fallback alike.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import stopline.activities.tools.beneath as beneath
from stopline.activities.tools import run_tool
from stopline.activities.tools.beneath import Beneath, SymlinkRefused
from stopline.activities.tools.workspace import OutsideWorkspace
from stopline.core.contracts import RespondToModel, ToolCall, ToolCallInput

FLIPPER = r"""
import ctypes, os, sys
ws, outside = sys.argv[1], sys.argv[2]
os.chdir(ws)
os.symlink(outside, "l")
libc = ctypes.CDLL(None, use_errno=True)
exchange = libc.renameat2  # glibc >= 2.28
AT_FDCWD, RENAME_EXCHANGE = -100, 2
flips = 0
# swap "d" (a real directory) and "l" (a link to outside) atomically, as fast
# as possible: "d" is always one or the other, never missing
while not os.path.exists("stop"):
    for _ in range(1000):
        if exchange(AT_FDCWD, b"d", AT_FDCWD, b"l", RENAME_EXCHANGE) == 0:
            flips += 1
print(flips)
"""

CALLS = 200


def _call(ws: Path, i: int, name: str, args: dict[str, object]) -> ToolCallInput:
    return ToolCallInput(task_id="race", call=ToolCall(id=f"c{i}", name=name, arguments=args), workspace=str(ws))


@pytest.mark.parametrize("use_openat2", [True, False], ids=["openat2", "nofollow-walk"])
async def test_a_symlink_flipper_racing_200_file_calls_never_escapes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, use_openat2: bool
) -> None:
    if use_openat2 and not beneath.openat2_available():
        pytest.skip("this kernel has no openat2")
    monkeypatch.setattr(beneath, "openat2_available", lambda: use_openat2)
    monkeypatch.setenv("STOPLINE_HOME", str(tmp_path / "home"))
    ws = tmp_path / "ws"
    (ws / "d").mkdir(parents=True)
    (ws / "d" / "secret.txt").write_text("inside\n")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("OUTSIDE-SECRET\n")
    flipper = subprocess.Popen(
        [sys.executable, "-c", FLIPPER, str(ws), str(outside)],
        stdout=subprocess.PIPE, text=True, start_new_session=True,
    )
    outcomes: dict[str, int] = {"wrote": 0, "read": 0, "refused": 0, "missing": 0}
    escapes: list[str] = []
    try:
        time.sleep(0.05)
        for i in range(CALLS):
            if i % 2:
                out = await run_tool(_call(ws, i, "read_file", {"path": "d/secret.txt"}))
            else:
                out = await run_tool(_call(ws, i, "write_file", {"path": f"d/w{i}.txt", "content": "payload\n"}))
            assert isinstance(out, RespondToModel)
            if "OUTSIDE-SECRET" in out.text:
                escapes.append(f"read #{i}: {out.text!r}")
            if out.ok:
                outcomes["wrote" if i % 2 == 0 else "read"] += 1
            elif "symbolic link" in out.text or "outside the workspace" in out.text:
                outcomes["refused"] += 1
            else:
                outcomes["missing"] += 1
    finally:
        (ws / "stop").touch()
        try:
            flips = int((flipper.communicate(timeout=10)[0] or "0").strip() or 0)
        finally:
            if flipper.poll() is None:
                os.killpg(flipper.pid, 9)
                flipper.wait()
    escapes += [f"written outside: {p.name}" for p in outside.iterdir() if p.name != "secret.txt"]
    assert escapes == [], escapes
    assert (outside / "secret.txt").read_text() == "OUTSIDE-SECRET\n"
    assert flips > CALLS, flips  # the race really ran
    # both states were hit: calls that went through, and calls the link stopped
    assert outcomes["wrote"] + outcomes["read"] > 0 and outcomes["refused"] > 0, outcomes
    # every write that said it wrote, wrote into the real directory
    real = next(p for p in (ws / "d", ws / "l") if not p.is_symlink())
    written = [f.name for f in real.iterdir() if f.name.startswith("w")]
    assert len(written) == outcomes["wrote"], (written, outcomes)


def test_paths_resolve_beneath_without_links(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    (ws / "sub").mkdir(parents=True)
    (ws / "sub" / "f.txt").write_text("x")
    (ws / "inner").symlink_to(ws / "sub")
    (ws / "out").symlink_to(tmp_path)
    for use_openat2 in ([True, False] if beneath.openat2_available() else [False]):
        with Beneath(ws, use_openat2=use_openat2) as b:
            assert b.relative("sub/../sub/./f.txt") == "sub/f.txt"
            assert b.relative(str(ws / "sub")) == "sub" and b.relative("") == "."
            fd = b.open("sub/f.txt", os.O_RDONLY)
            assert os.read(fd, 10) == b"x"
            os.close(fd)
            for bad in ("..", "../x", "sub/../../x", "/etc/passwd", str(tmp_path / "ws-evil")):
                with pytest.raises(OutsideWorkspace):
                    b.open(bad, os.O_RDONLY)
            with pytest.raises(SymlinkRefused) as inner:
                b.open("inner/f.txt", os.O_RDONLY)
            assert not inner.value.outside and "use that path instead" in str(inner.value)
            with pytest.raises(SymlinkRefused) as out:
                b.open("out/ws/sub/f.txt", os.O_RDONLY)
            assert out.value.outside and "outside the workspace" in str(out.value)
            with pytest.raises(FileNotFoundError):
                b.open("sub/missing", os.O_RDONLY)
