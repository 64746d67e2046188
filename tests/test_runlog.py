"""The JSON-lines logs of a run read back after a crash."""

import json

import pytest

from geofm.errors import GeoFMError
from geofm.runlog import LOSS_KEYS, MetricsLog, loss_lines, plot_rounds


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


def test_a_loss_component_equal_to_the_total_is_named_in_its_label_not_drawn_under_it():
    teacher = [{"loss": 0.5, "loss_mim": 0.5, "loss_distill": 0.0}, {"loss": 0.4, "loss_mim": 0.4, "loss_distill": 0.0}]
    assert loss_lines(teacher, LOSS_KEYS) == [("loss", "loss (= loss_mim)")]
    gfm = [{"loss": 1.5, "loss_mim": 0.5, "loss_distill": 1.0}]
    assert loss_lines(gfm, LOSS_KEYS) == [("loss", "loss"), ("loss_mim", "loss_mim"), ("loss_distill", "loss_distill")]


def test_rounds_figure_names_server_distillation_only_when_there_is_one(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    saved: list[Figure] = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, path, **kwargs: saved.append(fig))
    fedavg = [{"round": r, "loss": 1.0 / r, "uplink_bytes": 100, "downlink_bytes": 100, "clients": [0]} for r in (1, 2)]
    fedsense = [{**record, "loss_similarity": 0.1, "uplink_bytes": 4} for record in fedavg]
    plot_rounds(fedavg, tmp_path / "a.png")
    plot_rounds(fedsense, tmp_path / "b.png")
    (loss_a, bytes_a), (loss_b, bytes_b) = (fig.axes[:2] for fig in saved)
    assert loss_a.get_ylabel() == "loss (clients' mean)"
    assert "server's distillation" in loss_b.get_ylabel()
    assert [line.get_label() for line in bytes_a.get_lines()] == ["uplink = downlink"]
    assert [line.get_label() for line in bytes_b.get_lines()] == ["uplink", "downlink"]


def test_the_metric_curve_names_its_metric_counts_whole_steps_and_marks_the_kept_step(tmp_path, monkeypatch):
    from geofm import runlog

    figures, make = [], runlog.figure
    monkeypatch.setattr(runlog, "figure", lambda *size: figures.append(make(*size)) or figures[-1])
    records = [{"step": 2, "val": {"miou": 0.3}}, {"step": 3, "loss": 1.0}, {"step": 4, "val": {"miou": 0.5}}]
    runlog.plot_metric_curve(records, "val", ["miou"], tmp_path / "val_curve.png", kept=4)

    ax = figures[0].axes[0]
    assert ax.get_ylabel() == "val miou"
    ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks
    kept = [line for line in ax.get_lines() if line.get_label() == "kept weights (step 4)"]
    assert len(kept) == 1 and list(kept[0].get_xdata()) == [4, 4]
    assert (tmp_path / "val_curve.png").is_file()
