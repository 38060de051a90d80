"""Unit tests of the pure unified-diff applier (activities/tools/patch.py): no I/O."""

from __future__ import annotations

import pytest

from stopline.activities.tools.patch import (
    HunkMismatch,
    PatchConflict,
    PatchError,
    PatchParseError,
    apply_file_patch,
    parse_patch,
    plan_patch,
    split_lines,
)

BASE = "".join(f"line {i}\n" for i in range(1, 21))

MODIFY = """\
diff --git a/src/x.txt b/src/x.txt
index 1111111..2222222 100644
--- a/src/x.txt
+++ b/src/x.txt
@@ -2,3 +2,4 @@
 line 2
-line 3
+line three
+line 3.5
 line 4
@@ -15,3 +16,3 @@ some section
 line 15
-line 16
+line sixteen
 line 17
"""


def reader(files: dict[str, str]):
    return lambda path: files.get(path)


def test_split_lines_keeps_endings_and_last_line() -> None:
    assert split_lines("a\nb") == ["a\n", "b"]
    assert split_lines("a\r\nb\n") == ["a\r\n", "b\n"]
    assert split_lines("") == []


def test_parse_headers_prefixes_and_counts() -> None:
    [fp] = parse_patch(MODIFY)
    assert fp.old_path == fp.new_path == "src/x.txt"
    assert len(fp.hunks) == 2
    h1, h2 = fp.hunks
    assert (h1.old_start, h1.old_len, h1.new_start, h1.new_len) == (2, 3, 2, 4)
    assert h1.old_lines() == ["line 2\n", "line 3\n", "line 4\n"]
    assert h1.new_lines() == ["line 2\n", "line three\n", "line 3.5\n", "line 4\n"]
    assert h2.old_start == 15


def test_apply_several_hunks() -> None:
    [fp] = parse_patch(MODIFY)
    new, offsets = apply_file_patch(fp, BASE)
    assert offsets == [0, 0]
    assert new is not None
    lines = new.splitlines()
    assert lines[1:5] == ["line 2", "line three", "line 3.5", "line 4"]
    assert "line sixteen" in lines and "line 16" not in lines
    assert len(lines) == 21


def test_hunk_found_at_offset() -> None:
    [fp] = parse_patch(MODIFY)
    shifted = "header a\nheader b\nheader c\n" + BASE
    new, offsets = apply_file_patch(fp, shifted)
    assert offsets == [3, 3]
    assert new is not None and "line three" in new and "line sixteen" in new


def test_context_mismatch_names_file_hunk_and_lines() -> None:
    [fp] = parse_patch(MODIFY)
    broken = BASE.replace("line 16\n", "LINE 16 changed\n")
    with pytest.raises(HunkMismatch) as info:
        apply_file_patch(fp, broken)
    err = info.value
    assert err.path == "src/x.txt" and err.hunk == 2 and err.line == 16
    assert err.expected == "line 16" and err.found == "LINE 16 changed"
    msg = str(err)
    assert "src/x.txt" in msg and "hunk 2" in msg and "'line 16'" in msg and "LINE 16 changed" in msg


def test_mismatch_at_end_of_file() -> None:
    [fp] = parse_patch(MODIFY)
    with pytest.raises(HunkMismatch) as info:
        apply_file_patch(fp, "line 1\nline 2\nline 3\nline 4\n")
    assert info.value.hunk == 2
    assert "end of file" in str(info.value)


def test_new_and_deleted_files() -> None:
    patch = """\
--- /dev/null
+++ b/new/file.py
@@ -0,0 +1,2 @@
+print("hi")
+print("there")
--- a/old.txt
+++ /dev/null
@@ -1,2 +0,0 @@
-gone 1
-gone 2
"""
    new_fp, del_fp = parse_patch(patch)
    assert new_fp.is_new and new_fp.path == "new/file.py"
    assert del_fp.is_delete and del_fp.path == "old.txt"
    assert apply_file_patch(new_fp, None) == ('print("hi")\nprint("there")\n', [0])
    assert apply_file_patch(del_fp, "gone 1\ngone 2\n") == (None, [0])
    with pytest.raises(PatchConflict, match="already exists"):
        apply_file_patch(new_fp, "something\n")
    with pytest.raises(PatchConflict, match="does not remove"):
        apply_file_patch(del_fp, "gone 1\ngone 2\nkept\n")
    plan = plan_patch([new_fp, del_fp], reader({"old.txt": "gone 1\ngone 2\n"}))
    assert plan.writes == {"new/file.py": 'print("hi")\nprint("there")\n', "old.txt": None}


def test_missing_file_is_a_conflict() -> None:
    [fp] = parse_patch(MODIFY)
    with pytest.raises(PatchConflict, match="not found"):
        apply_file_patch(fp, None)


def test_no_newline_at_end_of_file() -> None:
    patch = """\
--- a/f
+++ b/f
@@ -1,2 +1,2 @@
 a
-b
\\ No newline at end of file
+c
\\ No newline at end of file
"""
    [fp] = parse_patch(patch)
    assert apply_file_patch(fp, "a\nb") == ("a\nc", [0])
    with pytest.raises(HunkMismatch):
        apply_file_patch(fp, "a\nb\n")  # 'b' has a newline: not the same line


def test_add_trailing_newline() -> None:
    patch = "--- a/f\n+++ b/f\n@@ -1 +1 @@\n-x\n\\ No newline at end of file\n+x\n"
    [fp] = parse_patch(patch)
    assert apply_file_patch(fp, "x") == ("x\n", [0])


def test_crlf_file_round_trips() -> None:
    patch = "--- a/w.txt\r\n+++ b/w.txt\r\n@@ -1,2 +1,2 @@\r\n one\r\n-two\r\n+TWO\r\n"
    [fp] = parse_patch(patch)
    assert fp.path == "w.txt"
    assert apply_file_patch(fp, "one\r\ntwo\r\nthree\r\n") == ("one\r\nTWO\r\nthree\r\n", [0])


def test_blank_context_line_without_leading_space() -> None:
    patch = "--- a/f\n+++ b/f\n@@ -1,3 +1,3 @@\n a\n\n-c\n+C\n"
    [fp] = parse_patch(patch)
    assert apply_file_patch(fp, "a\n\nc\n") == ("a\n\nC\n", [0])


def test_timestamps_and_quoted_names() -> None:
    patch = (
        '--- "a/caf\\303\\251 menu.txt"\t2024-01-01 00:00:00\n'
        '+++ "b/caf\\303\\251 menu.txt"\t2024-01-02 00:00:00\n'
        "@@ -1 +1 @@\n-x\n+y\n"
    )
    [fp] = parse_patch(patch)
    assert fp.path == "café menu.txt"


def test_rename_with_change() -> None:
    patch = "--- a/old.py\n+++ b/new.py\n@@ -1,2 +1,2 @@\n keep\n-old\n+new\n"
    [fp] = parse_patch(patch)
    plan = plan_patch([fp], reader({"old.py": "keep\nold\n"}))
    assert plan.writes == {"old.py": None, "new.py": "keep\nnew\n"}
    again = plan_patch([fp], reader({"new.py": "keep\nnew\n"}))
    assert again.writes == {} and again.already_applied == ["new.py"]


@pytest.mark.parametrize(
    ("patch", "needle"),
    [
        ("just some text\n", "no file header"),
        ("@@ -1 +1 @@\n-a\n+b\n", "before any"),
        ("--- a/f\n+++ b/f\n@@ -1,3 +1,3 @@\n a\n-b\n+c\n", "ends early"),
        ("--- a/f\n+++ b/f\n@@ -1,1 +1,1 @@\n a\n-b\n+c\n", "more lines than its header"),
        ("--- a/f\n+++ b/f\n@@ bogus @@\n-a\n", "malformed hunk header"),
        ("--- a/f\n+++ b/f\n", "without any '@@' hunk"),
        ("--- a/f\n+++ b/f\n@@ -1,2 +1,2 @@\n a\n?b\n", "does not start with"),
    ],
)
def test_parse_errors(patch: str, needle: str) -> None:
    with pytest.raises(PatchParseError, match=needle):
        parse_patch(patch)


def test_plan_is_all_or_nothing() -> None:
    patch = MODIFY + "--- a/other.txt\n+++ b/other.txt\n@@ -1 +1 @@\n-expected\n+changed\n"
    files = parse_patch(patch)
    with pytest.raises(HunkMismatch, match="other.txt: hunk 1"):
        plan_patch(files, reader({"src/x.txt": BASE, "other.txt": "something else\n"}))


def test_plan_detects_already_applied() -> None:
    files = parse_patch(MODIFY)
    first = plan_patch(files, reader({"src/x.txt": BASE}))
    assert [p for p, _ in first.applied] == ["src/x.txt"] and not first.already_applied
    patched = first.writes["src/x.txt"]
    assert patched is not None
    second = plan_patch(files, reader({"src/x.txt": patched}))
    assert second.writes == {} and second.applied == [] and second.already_applied == ["src/x.txt"]


def test_plan_new_file_already_applied_only_with_same_content() -> None:
    files = parse_patch("--- /dev/null\n+++ b/n.txt\n@@ -0,0 +1 @@\n+hello\n")
    assert plan_patch(files, reader({"n.txt": "hello\n"})).already_applied == ["n.txt"]
    with pytest.raises(PatchConflict, match="already exists"):
        plan_patch(files, reader({"n.txt": "other\n"}))


def test_plan_prefers_direction_at_stated_position() -> None:
    # Pure insertion whose context also occurs elsewhere: after applying, the
    # forward context still matches further down, but the reverse matches
    # exactly where the header says, so it is "already applied".
    original = "a\nb\nfiller\na\nb\n"
    files = parse_patch("--- a/f\n+++ b/f\n@@ -1,2 +1,3 @@\n a\n+X\n b\n")
    first = plan_patch(files, reader({"f": original}))
    assert first.writes["f"] == "a\nX\nb\nfiller\na\nb\n"
    second = plan_patch(files, reader({"f": first.writes["f"]}))
    assert second.already_applied == ["f"]


def test_later_file_sections_see_earlier_ones() -> None:
    patch = (
        "--- a/f\n+++ b/f\n@@ -1 +1 @@\n-one\n+two\n"
        "--- a/f\n+++ b/f\n@@ -1 +1 @@\n-two\n+three\n"
    )
    plan = plan_patch(parse_patch(patch), reader({"f": "one\n"}))
    assert plan.writes == {"f": "three\n"}


def test_errors_share_one_root() -> None:
    for cls in (PatchParseError, PatchConflict, HunkMismatch):
        assert issubclass(cls, PatchError) and issubclass(cls, ValueError)


def test_git_format_patch_email_is_accepted() -> None:
    email = (
        "From 1234 Mon Sep 17 00:00:00 2001\nSubject: [PATCH] change\n\n---\n f | 2 +-\n\n"
        "diff --git a/f b/f\nindex 1..2 100644\n--- a/f\n+++ b/f\n@@ -1 +1 @@\n-a\n+b\n"
        "-- \n2.39.2\n"
    )
    [fp] = parse_patch(email)
    assert apply_file_patch(fp, "a\n") == ("b\n", [0])
