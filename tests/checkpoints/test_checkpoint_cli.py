"""``geofm checkpoint convert`` and ``geofm checkpoint inspect``, run in-process."""

from __future__ import annotations

import json
import re

import pytest
import timm
import torch

from geofm.checkpoints import build_backbone, read_export_sidecar
from geofm.cli import main


@pytest.fixture
def gfm_file(kit, save_with_yacs):
    """A GFM checkpoint (yacs config, student, teacher, decoder, projector) and its student."""
    source = kit.make_swin(seed=1)
    microsoft = kit.microsoft_swin_state(source)
    model = {
        **kit.prefixed("encoder.", microsoft),
        "encoder.mask_token": torch.zeros(1, 1, 16),
        **kit.prefixed("teacher.", microsoft),
        **kit.decoder_state(),
        "projector.weight": torch.randn(512, 128),
    }
    path = save_with_yacs({"model": model, **kit.TRAINING_STATE}, kit.yacs_config("swin", kit.IMG), "gfm.pth")
    return path, source, len(model)


def _timm_load(export_dir) -> torch.nn.Module:
    meta = read_export_sidecar(export_dir)
    overlay = dict(file=str(export_dir / "backbone.safetensors"), **meta["timm_pretrained_cfg_overlay"])
    return timm.create_model(
        meta["arch"], pretrained=True, pretrained_cfg_overlay=overlay, **meta["timm_kwargs"]
    ).eval()


def test_convert_writes_an_export_timm_loads_and_prints_the_report(kit, gfm_file, tmp_path, capsys):
    path, source, keys = gfm_file
    out = tmp_path / "export"

    assert (
        main(
            [
                "checkpoint",
                "convert",
                str(path),
                str(out),
                "--bands",
                "red",
                "green",
                "blue",
                "nir",
                "--window-size",
                "2",
            ]
        )
        == 0
    )

    printed = capsys.readouterr().out
    used = len(source.state_dict())
    assert f"used {used}, dropped {keys - used}, missing 0, unexpected 0" in printed
    assert "gfm checkpoint from" in printed and "3 -> 4 bands, from checkpoint bands [0, 1, 2, None]" in printed
    assert "(window 4 -> 2)" in printed and "architecture from weights+checkpoint config" in printed
    assert sorted(p.name for p in out.iterdir()) == ["MODEL_CARD.md", "backbone.json", "backbone.safetensors"]

    sidecar = read_export_sidecar(out)
    assert (
        sidecar["arch"] == kit.SWIN
        and sidecar["timm_kwargs"]["window_size"] == 2
        and sidecar["timm_kwargs"]["in_chans"] == 4
    )
    assert sidecar["bands"] == ["red", "green", "blue", "nir"] and sidecar["img_size"] == kit.IMG
    assert sidecar["method"] == "gfm" and sidecar["gsd"] is None and sidecar["epoch"] == 99
    assert sidecar["normalisation"]["imagenet"]["bands"] == ["red", "green", "blue"]
    assert sidecar["converted_from"]["layout"] == "gfm" and len(sidecar["converted_from"]["sha256"]) == 64
    assert sidecar["config"]["MODEL.SWIN.EMBED_DIM"] == 16 and sidecar["num_params"] > 0

    via_timm = _timm_load(out)
    via_geofm, report, _ = build_backbone(out)
    assert report.layout == "geofm_export" and not report.adapted
    torch.testing.assert_close(kit.features(via_timm, in_chans=4), kit.features(via_geofm, in_chans=4), rtol=0, atol=0)


def test_convert_round_trip_keeps_the_features(kit, gfm_file, tmp_path, capsys):
    path, source, _ = gfm_file
    assert main(["checkpoint", "convert", str(path), str(tmp_path / "out")]) == 0
    torch.testing.assert_close(kit.features(_timm_load(tmp_path / "out")), kit.features(source), rtol=0, atol=0)


def test_convert_verbose_lists_every_key(gfm_file, tmp_path, capsys):
    path, _, _ = gfm_file
    assert main(["checkpoint", "convert", str(path), str(tmp_path / "out"), "--verbose"]) == 0
    printed = capsys.readouterr().out
    assert "\ndropped:\n" in printed and "\n  teacher.layers.0.downsample.reduction.weight\n" in printed
    assert "\n  encoder.mask_token\n" in printed and "\nmissing:\nunexpected:\n" in printed


def test_convert_options_for_a_vit_without_config(kit, save, tmp_path, capsys):
    path = save(kit.make_vit(seed=1).state_dict(), "vit.pth")
    assert main(["checkpoint", "convert", str(path), str(tmp_path / "a")]) == 2
    assert "attention heads" in capsys.readouterr().err
    args = ["--arch", kit.VIT, "--timm-kwargs", '{"num_heads": 2}', "--img-size", "32"]
    assert main(["checkpoint", "convert", str(path), str(tmp_path / "b"), *args]) == 0
    sidecar = read_export_sidecar(tmp_path / "b")
    assert (
        sidecar["arch"] == kit.VIT
        and sidecar["timm_kwargs"]["num_heads"] == 2
        and sidecar["timm_kwargs"]["img_size"] == 32
    )
    assert "pos_embed: 17 -> 5 positions" in capsys.readouterr().out


def test_inspect_prints_a_table_and_json(kit, gfm_file, capsys):
    path, source, _ = gfm_file
    assert main(["checkpoint", "inspect", str(path)]) == 0
    table = capsys.readouterr().out
    rows = dict(line.split(None, 1) for line in table.splitlines() if line and not line.startswith("config"))
    assert rows["format"].startswith("torch, layout gfm") and rows["family"] == "swin (Microsoft names)"
    assert rows["architecture"] == f"{kit.SWIN} (from weights+checkpoint config)"
    assert rows["bands"] == "red, green, blue" and rows["method"] == "gfm" and rows["epoch"] == "99"
    assert "config MODEL.SWIN.DEPTHS" in table and "config DATA.DATA_PATH" in table

    assert main(["checkpoint", "inspect", str(path), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["layout"] == "gfm" and result["arch"] == kit.SWIN and result["family"] == "swin"
    assert result["parameters"] == sum(p.numel() for p in source.parameters())
    assert (
        result["timm_kwargs"] == {**kit.swin_kwargs()} and result["img_size"] == kit.IMG and result["window_size"] == 4
    )
    assert result["tensors"]["used"] == len(source.state_dict()) and result["tensors"]["missing"] == 0
    assert result["provenance"]["config"]["MODEL.TYPE"] == "swin" and result["provenance"]["method"] == "gfm"


def test_inspect_a_training_run(kit, tmp_path, capsys):
    run_dir = kit.write_run(tmp_path, kit.make_swin(in_chans=4))
    assert main(["checkpoint", "inspect", str(run_dir), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["layout"] == "geofm_train" and result["inferred_from"] == "run config"
    assert result["bands"] == ["red", "green", "blue", "nir"] and result["timm_kwargs"]["in_chans"] == 4
    origin = result["provenance"]
    assert origin["method"] == "simmim" and origin["steps"] == 12 and origin["gsd"] == [0.5, 10.0]
    last_epoch = range(7, 13)  # 6 steps per epoch; records after the checkpoint's step 12 are left out
    assert origin["metrics"] == {
        "step": 12,
        "epoch": 2.0,
        "loss": pytest.approx(sum(1 / s for s in last_epoch) / 6, abs=1e-6),
        "loss_mim": pytest.approx(sum(0.5 / s for s in last_epoch) / 6, abs=1e-6),
        "averaged_over": "steps 7-12 (the last epoch, 6 logged intervals)",
    }
    assert [d["name"] for d in origin["data"]] == ["aerial", "s2"] and origin["config"]["model"]["arch"] == kit.SWIN


def test_inspect_prints_a_recorded_null_as_none_not_unknown(kit, tmp_path, capsys):
    run_dir = kit.write_run(tmp_path, kit.make_swin(in_chans=4))
    assert main(["checkpoint", "inspect", str(run_dir)]) == 0
    rows = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in capsys.readouterr().out.splitlines())
    assert rows["config task_options.teacher"] == "none" and rows["config run.stop_after_steps"] == "none"
    assert "unknown" not in rows.values()


def test_inspect_reports_an_unknown_architecture_instead_of_failing(kit, save, capsys):
    path = save(kit.make_vit().state_dict(), "vit.pth")
    assert main(["checkpoint", "inspect", str(path)]) == 0
    rows = dict(line.split(None, 1) for line in capsys.readouterr().out.splitlines())
    assert rows["architecture"].startswith(f"unknown: {path}: the number of attention heads")
    assert (
        rows["parameters"] == f"{sum(p.numel() for p in kit.make_vit().parameters()):,} in the file's backbone tensors"
    )


def test_errors_exit_2_with_a_message(kit, save, tmp_path, capsys):
    assert main(["checkpoint", "inspect", str(save({"model": {"conv1.weight": torch.ones(1)}}))]) == 2
    err = capsys.readouterr().err
    assert err.startswith("geofm: error:") and "microsoft_swin" in err and "geofm_export" in err
    marker = tmp_path / "pwned"
    torch.save({"model": {"a.weight": torch.ones(1)}, "config": kit.Exploit(marker)}, tmp_path / "evil.pth")
    assert main(["checkpoint", "convert", str(tmp_path / "evil.pth"), str(tmp_path / "out")]) == 2
    assert "refused to unpickle" in capsys.readouterr().err and not marker.exists()
    assert main(["checkpoint", "inspect", str(tmp_path / "missing.pth")]) == 2
    with pytest.raises(SystemExit):
        main(["checkpoint", "convert", "a", "b", "--timm-kwargs", "[1]"])


def test_inspect_names_a_federated_exports_step_count_rounds(kit, tmp_path, capsys):
    from geofm.checkpoints.export import export_backbone

    metadata = {"bands": ["red", "green", "blue"], "steps": 12, "federation": {"algorithm": "fedavg", "rounds": 12}}
    out = export_backbone(
        kit.make_swin(), tmp_path / "fed", arch=kit.SWIN, create_kwargs=kit.swin_kwargs(), metadata=metadata
    )
    assert main(["checkpoint", "inspect", str(out)]) == 0
    rows = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in capsys.readouterr().out.splitlines())
    assert rows["rounds"] == "12" and "steps" not in rows
