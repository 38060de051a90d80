"""The README's reference of the model's tools is generated from the tool
specs (``stopline.tooldoc``): it cannot drift from what the model is sent."""

from __future__ import annotations

from pathlib import Path

from stopline.tooldoc import BEGIN, END, main, render

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_tools_reference_matches_the_specs() -> None:
    text = README.read_text(encoding="utf-8")
    block = text[text.index(BEGIN) + len(BEGIN):text.index(END)]
    assert block.strip() == render().strip(), "run `python -m stopline.tooldoc README.md`"
    assert main([str(README), "--check"]) == 0


def test_every_tool_and_argument_is_documented() -> None:
    from stopline.activities.tools import TOOL_SPECS
    from stopline.core.task_tools import TASK_TOOL_SPECS

    doc = render()
    for spec in [*TOOL_SPECS, *TASK_TOOL_SPECS]:
        assert f"#### `{spec.name}`" in doc
        for arg in spec.input_schema.get("properties", {}):
            section = doc.split(f"#### `{spec.name}`", 1)[1].split("#### ", 1)[0]
            assert f"| `{arg}` |" in section, (spec.name, arg)
