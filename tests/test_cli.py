import pytest
import yaml

from geofm.cli import main


def test_demo_data_and_stats_commands(tmp_path, capsys):
    assert main(["demo-data", "--out", str(tmp_path / "demo")]) == 0
    assert "satellite_4band" in capsys.readouterr().out
    args = ["data", "stats", str(tmp_path / "demo/satellite_4band"), "--bands", "blue", "green", "red", "nir"]
    assert main([*args, "--pattern", "*.tif", "--scale", "0.0001", "--nodata", "0"]) == 0
    out = capsys.readouterr().out
    snippet = yaml.safe_load("\n".join(line for line in out.splitlines() if not line.startswith("#")))
    assert len(snippet["mean"]) == len(snippet["std"]) == 4
    assert all(0 < m < 1 for m in snippet["mean"]), "reflectance scale applied, nodata left out"


def test_pretrain_is_registered_and_config_errors_exit_cleanly(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["pretrain", "--help"])
    assert "--config" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text("run: {output_dir: x}\nmodel: {arch: swin_tiny_patch4_window7_224, img_size: 64, windw: 4}\n")
    assert main(["pretrain", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "bad.yaml" in err and "model.windw: unknown key" in err and "data: Field required" in err


def test_deepspeed_launcher_local_rank_argument_is_accepted(tmp_path):
    assert main(["--local_rank=0", "demo-data", "--out", str(tmp_path / "demo")]) == 0
