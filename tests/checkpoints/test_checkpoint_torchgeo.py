"""torchgeo_weights: an export as a torchgeo WeightsEnum member, usable by torchgeo users and trainers."""

from __future__ import annotations

import timm
import torch
from torchvision.models import WeightsEnum

from geofm.checkpoints import export_backbone, torchgeo_weights
from geofm.models.backbones import backbone_kwargs, create_backbone
from tests.conftest import EXPORT_BANDS as BANDS
from tests.conftest import EXPORT_NORMALISATION as NORMALISATION

METADATA = {
    "bands": BANDS,
    "normalisation": NORMALISATION,
    "gsd": [0.5, 10.0],
    "method": "gfm",
    "data": [{"name": "aerial", "root": "/a"}, {"name": "s2", "root": "/b"}],
}


def test_member_follows_torchgeo_and_loads_into_timm(kit, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "hub"))
    source = kit.make_swin(in_chans=4, seed=1)
    export_backbone(
        source, tmp_path / "export", arch=kit.SWIN, create_kwargs=kit.swin_kwargs(in_chans=4), metadata=METADATA
    )

    weights = torchgeo_weights(tmp_path / "export")

    assert isinstance(weights, WeightsEnum) and repr(weights) == "GeoFM_swin_tiny_patch4_window7_224_Weights.GFM_4BAND"
    assert weights.url == (tmp_path / "export" / "backbone.safetensors").resolve().as_uri()
    meta = weights.meta
    assert {k: meta[k] for k in ("dataset", "in_chans", "model", "publication", "ssl_method", "bands")} == {
        "dataset": "aerial, s2",
        "in_chans": 4,
        "model": kit.SWIN,
        "publication": "https://arxiv.org/abs/2302.04476",
        "ssl_method": "gfm",
        "bands": tuple(BANDS),
    }
    assert meta["img_size"] == kit.IMG and meta["window_size"] == 4 and meta["gsd"] == [0.5, 10.0] and "repo" in meta

    # what a torchgeo user does with any weights entry: build the model with timm, load the state dict
    model = timm.create_model(meta["model"], **meta["timm_kwargs"]).eval()
    model.load_state_dict(weights.get_state_dict(progress=False))
    torch.testing.assert_close(kit.features(model, in_chans=4), kit.features(source, in_chans=4), rtol=0, atol=0)
    assert not (tmp_path / "hub").exists(), "the local file is read in place, not copied into torch hub's cache"


def test_transforms_normalise_raw_values_as_in_training(kit, tmp_path):
    export_backbone(
        kit.make_swin(in_chans=4), tmp_path, arch=kit.SWIN, create_kwargs=kit.swin_kwargs(in_chans=4), metadata=METADATA
    )
    raw = torch.rand(2, 4, 8, 8) * 3000

    weights = torchgeo_weights(tmp_path)  # aerial lacks nir: the first source covering the bands is s2
    assert weights.meta["normalisation_source"] == "s2"
    s2 = NORMALISATION["s2"]
    order = [s2["bands"].index(b) for b in BANDS]
    mean = torch.tensor([s2["mean"][i] for i in order]).view(1, 4, 1, 1)
    std = torch.tensor([s2["std"][i] for i in order]).view(1, 4, 1, 1)
    torch.testing.assert_close(weights.transforms(raw.clone()), (raw * 1e-4 - mean) / std)

    bare = torchgeo_weights(tmp_path, source="s2", name="my weights", dataset="GeoPile")
    assert repr(bare).endswith(".MY_WEIGHTS") and bare.meta["dataset"] == "GeoPile"


def test_torchgeo_classification_trainer_takes_the_weights(tmp_path):
    """torchgeo's trainers build the named timm model at its default sizes: here test_vit at 160 px.

    torchgeo 0.10 renamed ``torchgeo.trainers.ClassificationTask`` to ``torchgeo.tasks.Classification``
    (the old name stays as a deprecated alias); 0.9 has only the old one.
    """
    try:
        from torchgeo.tasks import Classification as ClassificationTask
    except ImportError:  # torchgeo 0.9
        from torchgeo.trainers import ClassificationTask

    kwargs = backbone_kwargs(in_chans=4, img_size=160)
    torch.manual_seed(0)
    backbone = create_backbone("test_vit", kwargs)
    export_backbone(backbone, tmp_path, arch="test_vit", create_kwargs=kwargs, metadata=METADATA)
    weights = torchgeo_weights(tmp_path)

    task = ClassificationTask(model="test_vit", weights=weights, in_channels=4, num_classes=3)

    loaded = task.model.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in backbone.state_dict().items())
    assert task.model.head.out_features == 3
