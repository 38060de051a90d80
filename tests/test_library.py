"""The public API is what docs/library.md says it is, and every name of it
resolves (``stopline.__all__`` is lazy)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import stopline

REPO = Path(__file__).resolve().parent.parent


def _documented() -> set[str]:
    text = (REPO / "docs" / "library.md").read_text()
    reference = text.split("## Reference", 1)[1]
    return set(re.findall(r"^\| `([A-Za-z_]+)` \|", reference, re.MULTILINE))


def test_all_matches_the_reference_in_docs_library() -> None:
    assert set(stopline.__all__) == _documented()


def test_every_exported_name_resolves() -> None:
    for name in stopline.__all__:
        assert getattr(stopline, name) is not None, name
    assert sorted(dir(stopline)) == sorted(stopline.__all__)


def test_importing_stopline_loads_nothing_heavy() -> None:
    code = ("import sys, stopline; heavy = [m for m in ('temporalio.worker', 'httpx', "
            "'cryptography', 'stopline.worker', 'stopline.activities') if m in sys.modules]; "
            "print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_the_readme_links_the_library_doc() -> None:
    assert "docs/library.md" in (REPO / "README.md").read_text()
