"""A benchmark's work folder: finished parts survive a rerun, a change of what shapes them starts afresh."""

from __future__ import annotations

from pathlib import Path

from benchmarks.workdir import Parts, work_folder


def test_growing_settings_keep_the_folder_and_shaping_ones_change_it(tmp_path: Path) -> None:
    settings = {"chip_size": 32, "seeds": [0, 1], "work_dir": "a"}
    folder = work_folder(tmp_path, settings, growing=("seeds",))
    assert work_folder(tmp_path, {**settings, "seeds": [0, 1, 2], "work_dir": "b"}, ("seeds",)) == folder
    assert work_folder(tmp_path, {**settings, "chip_size": 64}, ("seeds",)) != folder
    assert folder.parent == tmp_path


def test_a_part_is_kept_once_put(tmp_path: Path) -> None:
    parts = Parts(tmp_path)
    assert parts.get("r1_b4_central_p0") is None
    parts.put("r1_b4_central_p0", {"scores": {"frozen": {"0": 0.5}}})
    assert Parts(tmp_path).get("r1_b4_central_p0") == {"scores": {"frozen": {"0": 0.5}}}
    assert not list(tmp_path.rglob("*.tmp")), "no half-written part is left"
