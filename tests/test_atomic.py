"""Files and folders are written whole or not at all."""

import os

import pytest

from rlsched.atomic import atomic_folder, atomic_path, write_text_atomic


def test_a_file_is_replaced_whole_or_left_as_it_was(tmp_path):
    path = tmp_path / "out" / "a.json"
    write_text_atomic(path, "old")
    with pytest.raises(RuntimeError), atomic_path(path) as tmp:
        tmp.write_text("half")
        raise RuntimeError("killed mid-write")
    assert path.read_text() == "old" and os.listdir(path.parent) == ["a.json"]
    with atomic_path(path, fsync=True) as tmp:
        tmp.write_text("new")
        assert path.read_text() == "old"  # nothing visible until the block ends
    assert path.read_text() == "new" and os.listdir(path.parent) == ["a.json"]
    assert oct(path.stat().st_mode & 0o777) == oct(0o644)


def test_a_folder_is_replaced_whole_or_left_as_it_was(tmp_path):
    out = tmp_path / "run"
    with atomic_folder(out) as tmp:
        (tmp / "x").write_text("1")
    with pytest.raises(RuntimeError), atomic_folder(out) as tmp:
        (tmp / "y").write_text("2")
        raise RuntimeError("killed mid-write")
    assert sorted(os.listdir(out)) == ["x"] and os.listdir(tmp_path) == ["run"]
    with atomic_folder(out) as tmp:
        (tmp / "y").write_text("2")
    assert sorted(os.listdir(out)) == ["y"] and os.listdir(tmp_path) == ["run"]
