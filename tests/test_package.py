"""The distribution as a team installs it: one top-level name, and a project
with its own ``workflows`` package running stopline inside its worker.

Builds the wheel offline (``--no-build-isolation``: the test extra brings
setuptools), installs it into a fresh virtualenv — its dependencies come
from this venv's site-packages through a plain path entry, so nothing is
downloaded and this checkout's editable install is not seen — and runs
``examples/team_worker``'s own test there, from a copy outside the
repository.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from stopline.worker.runtime import temporal_binary

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    res = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "-q", "-w", str(out), str(REPO)],
        capture_output=True, text=True, timeout=300,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    (whl,) = out.glob("stopline-*.whl")
    return whl


def test_the_wheel_installs_stopline_and_nothing_else_at_top_level(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        tops = {name.split("/", 1)[0] for name in z.namelist()}
        entry_points = z.read(next(n for n in z.namelist() if n.endswith("entry_points.txt"))).decode()
    assert {t for t in tops if not t.endswith(".dist-info")} == {"stopline"}, tops
    assert "stopline = stopline.cli:entry" in entry_points
    assert "stopline-worker = stopline.worker.main:main" in entry_points


def test_a_project_with_its_own_workflows_package_runs_on_the_installed_wheel(
    wheel: Path, tmp_path: Path
) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    res = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    # the dependencies (temporalio, pydantic, pytest ...) from this venv, as a plain path:
    # .pth files there (this checkout's editable finder) are not processed
    Path(site, "deps-from-dev-venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    project = tmp_path / "team_worker"
    shutil.copytree(REPO / "examples" / "team_worker", project,
                    ignore=shutil.ignore_patterns("__pycache__", ".pytest_cache"))
    where = subprocess.run([str(py), "-c", "import stopline, workflows; print(stopline.__file__); "
                            "print(workflows.__file__)"], cwd=project, capture_output=True, text=True)
    assert where.returncode == 0, where.stderr
    stopline_file, workflows_file = where.stdout.split()
    assert stopline_file.startswith(site), stopline_file  # the installed wheel, not this checkout
    assert workflows_file.startswith(str(project)), workflows_file  # the project's own package

    res = subprocess.run(
        [str(py), "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
        cwd=project, capture_output=True, text=True, timeout=300,
        env={"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "TEMPORAL_CLI": temporal_binary(),
             "HOME": str(tmp_path)},
    )
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    assert "1 passed" in res.stdout
