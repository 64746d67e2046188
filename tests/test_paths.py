"""Output paths are checked before a command builds anything: below a file, of the wrong kind, read-only."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from geofm.errors import OutputPathError
from geofm.paths import check_writable, output_write_error


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


def test_a_folder_refusing_writes_is_named_though_os_access_says_yes(tmp_path, monkeypatch):
    """Root is told yes by ``os.access`` on /sys or a read-only mount; the check writes a probe file instead."""
    read_only = tmp_path / "read_only"
    read_only.mkdir()
    probe = tempfile.NamedTemporaryFile

    def refusing(*args, dir, **kwargs):
        if Path(dir) == read_only:
            raise PermissionError(13, "Permission denied")
        return probe(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "NamedTemporaryFile", refusing)
    with pytest.raises(
        OutputPathError, match=f"cannot be written: {read_only} is not writable \\(Permission denied\\)"
    ):
        check_writable(read_only / "a" / "run", "run.output_dir", folder=True)
    with pytest.raises(OutputPathError, match=f"^--output {read_only / 'x.tif'} cannot be written"):
        check_writable(read_only / "x.tif", "--output", folder=False)
    check_writable(tmp_path / "x.tif", "--output", folder=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["read_only"], "the probe leaves nothing behind"


@pytest.mark.skipif(not Path("/sys/kernel").is_dir(), reason="a Linux /sys")
def test_sys_is_refused_even_to_root():
    with pytest.raises(
        OutputPathError, match=r"^run\.output_dir /sys/geofm-run cannot be written: /sys is not writable"
    ):
        check_writable("/sys/geofm-run", "run.output_dir", folder=True)


def test_a_failed_write_to_a_checked_output_is_one_line_naming_its_option(tmp_path):
    run = tmp_path / "run"
    check_writable(run, "run.output_dir", folder=True)
    check_writable(tmp_path / "out.tif", "--output", folder=False)
    error = output_write_error(OSError(28, "No space left on device", str(run / "checkpoints" / "step_1")))
    assert str(error) == (
        f"run.output_dir {run} cannot be written ({run / 'checkpoints' / 'step_1'}): No space left on device; "
        "choose another path"
    )
    partial = output_write_error(PermissionError(13, "Permission denied", str(tmp_path / "out.tif.partial")))
    assert str(partial).startswith(
        f"--output {tmp_path / 'out.tif'} cannot be written ({tmp_path / 'out.tif.partial'})"
    )
    assert output_write_error(OSError(2, "No such file", str(tmp_path / "input.tif"))) is None


def test_a_relative_path_is_named_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("")
    with pytest.raises(OutputPathError, match=f"^--out {tmp_path / 'afile' / 'x'} cannot be written"):
        check_writable("afile/x", "--out", folder=True)
