"""The JSON-lines logs of a run read back after a crash."""

import json

import pytest

from geofm.errors import GeoFMError
from geofm.runlog import MetricsLog


def test_resume_drops_records_after_the_checkpoint_and_a_line_cut_short_by_a_kill(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in (5, 10, 15)) + '{"step": 20, "lo')
    log = MetricsLog(path, resume_step=10)
    assert [r["step"] for r in log.read()] == [5, 10], "kept: the steps up to the checkpoint resumed from"
    log.write({"step": 15, "loss": 0.5})
    assert [r["step"] for r in MetricsLog(path, resume_step=15).read()] == [5, 10, 15]


def test_a_damaged_line_before_the_last_is_an_error_naming_the_file_and_line(tmp_path):
    path = tmp_path / "rounds.jsonl"
    path.write_text('{"round": 1}\nnot json\n{"round": 3}\n')
    with pytest.raises(GeoFMError, match=r"rounds\.jsonl, line 2: not a JSON record"):
        MetricsLog(path, resume_step=3, key="round")
