"""Output paths are checked before a command builds anything: below a file, of the wrong kind, read-only."""

from __future__ import annotations

import os

import pytest

from geofm.errors import OutputPathError
from geofm.paths import check_writable


def test_a_writable_folder_or_file_passes(tmp_path):
    check_writable(tmp_path / "new" / "run", "run.output_dir", folder=True)
    check_writable(tmp_path, "run.output_dir", folder=True)
    check_writable(tmp_path / "new" / "out.tif", "--output", folder=False)


@pytest.mark.parametrize(
    "folder, reason",
    [(True, "it is a file, not a folder"), (False, "it is a folder, not a file")],
)
def test_an_output_of_the_wrong_kind_is_refused(tmp_path, folder, reason):
    path = tmp_path / "out"
    if folder:
        path.write_text("")
    else:
        path.mkdir()
    with pytest.raises(OutputPathError, match=f"^--out {path} cannot be written: {reason}; choose another path$"):
        check_writable(path, "--out", folder=folder)


def test_a_read_only_ancestor_is_named(tmp_path, monkeypatch):
    """Root writes anywhere whatever the permissions, so the test takes write access away from ``os.access``."""
    read_only = tmp_path / "read_only"
    read_only.mkdir()
    monkeypatch.setattr(os, "access", lambda path, mode: os.fspath(path) != os.fspath(read_only))
    with pytest.raises(OutputPathError, match=f"cannot be written: {read_only} is not writable"):
        check_writable(read_only / "a" / "run", "run.output_dir", folder=True)


def test_a_relative_path_is_named_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("")
    with pytest.raises(OutputPathError, match=f"^--out {tmp_path / 'afile' / 'x'} cannot be written"):
        check_writable("afile/x", "--out", folder=True)
