"""Output files are written whole or not at all, with errors that name the file."""

import os
import stat

import pytest

from npukit.errors import UserError
from npukit.files import atomic_open, atomic_path, write_text_atomic


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "report.json"
    target.write_text("old")
    with pytest.raises(RuntimeError), atomic_open(target) as handle:
        handle.write("half of the new")
        raise RuntimeError("crash while writing")
    assert target.read_text() == "old"
    assert [path.name for path in tmp_path.iterdir()] == ["report.json"]


def test_the_file_appears_complete_with_the_usual_permissions(tmp_path):
    target = tmp_path / "new" / "folder" / "out.csv"  # missing folders are created
    write_text_atomic(target, "a,b\n")
    assert target.read_text() == "a,b\n"
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE(target.stat().st_mode) == 0o666 & ~mask  # not mkstemp's 0600


def test_a_directory_in_the_way_is_a_user_error_naming_it(tmp_path):
    (tmp_path / "out.json").mkdir()
    with pytest.raises(UserError, match="out.json: is a directory"):
        write_text_atomic(tmp_path / "out.json", "{}")


def test_an_os_error_names_the_file(tmp_path):
    blocker = tmp_path / "blocker"
    blocker.write_text("a file, where a folder is needed")
    with pytest.raises(UserError, match=r"blocker/out.json: cannot write"):
        write_text_atomic(blocker / "out.json", "{}")


def test_atomic_path_hands_out_a_path_for_writers_that_want_a_file_name(tmp_path):
    target = tmp_path / "trace.json"
    with atomic_path(target) as temporary:
        assert temporary.parent == tmp_path and temporary != target
        temporary.write_text("[]")
        assert not target.exists()
    assert target.read_text() == "[]"
