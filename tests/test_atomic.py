"""run/atomic.py, the one way files and folders of a run, sweep or study are written: a failure part-way
leaves the old version and no stray temporary; a success replaces it whole."""

import json
import stat

import pytest

from run import atomic


class Boom(Exception):
    pass


def test_write_text_and_json_replace_the_file_whole_with_the_runs_mode(tmp_path):
    path = tmp_path / "a" / "b.json"
    atomic.write_json(path, {"x": 1.5})
    assert json.loads(path.read_text()) == {"x": 1.5} and not path.read_text().endswith("\n")
    atomic.write_json(path, {"y": [1, 2]}, newline=True, fsync=True)
    assert path.read_text() == '{\n  "y": [\n    1,\n    2\n  ]\n}\n'
    assert stat.S_IMODE(path.stat().st_mode) == 0o644  # (mkstemp's temporaries are 0600)
    atomic.write_text(path, b"\x00raw")
    assert path.read_bytes() == b"\x00raw"
    assert sorted(p.name for p in path.parent.iterdir()) == ["b.json"]  # no temporary left beside it


def test_json_that_cannot_be_written_leaves_the_old_file(tmp_path):
    path = tmp_path / "r.json"
    atomic.write_json(path, {"ok": True})
    with pytest.raises(ValueError):
        atomic.write_json(path, {"bad": float("nan")}, allow_nan=False)
    with pytest.raises(TypeError):
        atomic.write_json(path, {"bad": object()}, default=None)
    assert json.loads(path.read_text()) == {"ok": True} and [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_a_folder_is_swapped_in_whole_or_not_at_all(tmp_path):
    final = tmp_path / "data"
    with atomic.folder(final) as tmp:
        (tmp / "one").write_text("1")
    assert [p.name for p in final.iterdir()] == ["one"]
    with pytest.raises(Boom), atomic.folder(final) as tmp:
        (tmp / "two").write_text("2")
        raise Boom
    assert [p.name for p in final.iterdir()] == ["one"]  # the old folder, untouched
    with atomic.folder(final) as tmp:
        (tmp / "three").write_text("3")
    assert [p.name for p in final.iterdir()] == ["three"]  # replaced, not merged
    assert [p.name for p in tmp_path.iterdir()] == ["data"]  # no temporary or old folder left


def test_on_object_storage_the_object_is_put_whole():
    from upath import UPath

    path = UPath("memory://atomic-test/run/report/report.json")
    atomic.write_json(path, {"a": 1}, newline=True)
    assert json.loads(path.read_text()) == {"a": 1}
    atomic.write_text("memory://atomic-test/run/report/report.md", "# r\n")  # a URL given as text
    assert UPath("memory://atomic-test/run/report/report.md").read_text() == "# r\n"
