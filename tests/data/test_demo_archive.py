from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from geofm.config import DataConfig, SourceConfig
from geofm.data.demo import make_demo_archive
from geofm.data.pile import PileIndex, PretrainPile
from geofm.data.readers import read_raster

SOURCES = {
    "aerial_rgb": (["red", "green", "blue"], 1 / 255, None, "uint8", 96, 0.5),
    "satellite_4band": (["blue", "green", "red", "nir"], 1e-4, 0, "uint16", 64, 10.0),
    "uav_rgbn": (["red", "green", "blue", "nir"], 1 / 255, None, "uint8", 80, 0.1),
    "public_rgb": (["red", "green", "blue"], 1 / 255, None, "uint8", 96, 1.0),
}
COUNTS = {"aerial_rgb": 24, "satellite_4band": 24, "uav_rgbn": 24, "public_rgb": 16}


@pytest.fixture(scope="module")
def archive(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_demo_archive(tmp_path_factory.mktemp("demo"))


def _pixels(paths: dict[str, Path]) -> dict[str, np.ndarray]:
    return {
        f"{name}/{f.name}": read_raster(f, len(SOURCES[name][0])).data
        for name, folder in paths.items()
        if name in SOURCES
        for f in sorted(folder.glob("*.tif"))
    }


def test_layout_and_metadata(archive: dict[str, Path]) -> None:
    assert set(archive) == set(SOURCES) | {"classification", "multilabel", "segmentation", "change", "superres"}
    root = archive["aerial_rgb"].parent
    assert "not real imagery" in (root / "README.txt").read_text().lower()
    for name, (bands, _, nodata, dtype, size, _) in SOURCES.items():
        files = sorted(archive[name].glob("*.tif"))
        assert len(files) == COUNTS[name]
        raster = read_raster(files[0], len(bands))
        assert raster.data.shape == (len(bands), size, size)
        assert raster.dtype == dtype
        assert raster.nodata == nodata


def test_georeferencing(archive: dict[str, Path]) -> None:
    import rasterio

    for name, (*_, resolution) in SOURCES.items():
        with rasterio.open(sorted(archive[name].glob("*.tif"))[5]) as src:
            assert src.crs.to_epsg() == 32632
            assert src.transform.a == resolution and src.transform.e == -resolution
            assert 100_000 < src.transform.c < 900_000


def test_content(archive: dict[str, Path]) -> None:
    pixels = _pixels(archive)
    satellite = np.stack([v for k, v in pixels.items() if k.startswith("satellite")])
    nodata_scenes = (satellite == 0).all(axis=1).any(axis=(1, 2))
    assert 0 < nodata_scenes.sum() < 24
    assert ((satellite == 0).all(axis=1) == (satellite == 0).any(axis=1)).all(), "nodata must cover all bands"
    assert satellite.max() <= 10000
    valid = satellite[:, :, satellite.min(axis=(0, 1)) > 0]
    assert valid[:, 3].mean() > valid[:, 2].mean(), "vegetated scenes: nir above red"
    aerial = np.stack([v for k, v in pixels.items() if k.startswith("aerial")])
    assert aerial.std() > 10
    assert len({v.tobytes() for v in aerial}) == 24
    uav = np.stack([v for k, v in pixels.items() if k.startswith("uav")]).astype(float)
    vegetation = uav[:, 1] > uav[:, 0] + 10
    assert uav[:, 3][vegetation].mean() > uav[:, 3][~vegetation].mean() + 20, "drone nir is bright on vegetation"
    public = {v.tobytes() for k, v in pixels.items() if k.startswith("public")}
    assert len(public) == 16 and not public & {v.tobytes() for v in aerial}, "the public set is its own scenes"


def test_deterministic_and_seeded(archive: dict[str, Path], tmp_path: Path) -> None:
    again = make_demo_archive(tmp_path / "again")
    first, second = _pixels(archive), _pixels(again)
    assert first.keys() == second.keys()
    assert all(np.array_equal(first[k], second[k]) for k in first)
    for family in ("classification", "multilabel", "segmentation", "change", "superres"):
        files = sorted(p.relative_to(archive[family]) for p in archive[family].rglob("*") if p.is_file())
        assert files == sorted(p.relative_to(again[family]) for p in again[family].rglob("*") if p.is_file())
        for rel in files:
            assert (archive[family] / rel).read_bytes() == (again[family] / rel).read_bytes(), f"{family}/{rel} differs"
    other = _pixels(make_demo_archive(tmp_path / "other", seed=1))
    assert not np.array_equal(first["aerial_rgb/scene_000.tif"], other["aerial_rgb/scene_000.tif"])


def test_complete_archive_not_rewritten(tmp_path: Path) -> None:
    paths = make_demo_archive(tmp_path)
    scene = paths["aerial_rgb"] / "scene_000.tif"
    scene.write_bytes(b"edited")
    assert make_demo_archive(tmp_path) == paths
    assert scene.read_bytes() == b"edited", "a complete archive for the same seed is kept"
    make_demo_archive(tmp_path, seed=1)
    assert read_raster(scene, 3).data.shape == (3, 96, 96), "another seed regenerates the archive"


@pytest.mark.parametrize("model_bands", [["blue", "green", "red", "nir"], ["red", "green", "blue"]])
def test_demo_feeds_the_pile(archive: dict[str, Path], model_bands: list[str]) -> None:
    sources = [
        SourceConfig(
            name=name,
            root=archive[name],
            pattern="*.tif",
            bands=bands,
            scale=scale,
            nodata=nodata,
            mean=[0.0] * len(bands),
            std=[1.0] * len(bands),
        )
        for name, (bands, scale, nodata, *_) in SOURCES.items()
    ]
    pile = PretrainPile(DataConfig(bands=model_bands, sources=sources), img_size=32)
    sample = pile[PileIndex(1, 0, 0)]
    assert sample["image"].shape == (len(model_bands), 32, 32)
    assert not sample["valid"].all(), "scene 0 of the satellite source has a nodata edge"
    assert sample["valid"].any()


def test_demo_configs_carry_the_archive_statistics(tmp_path):
    """The demo configs' mean/std are what `geofm data stats` computes on the generated archive."""
    from geofm.config import PretrainConfig, read_config_tree
    from geofm.data.stats import compute_band_stats

    roots = make_demo_archive(tmp_path / "demo")
    from geofm.config.federated import FederatedConfig

    configs = Path(__file__).parents[2] / "configs"
    demos = [(path, PretrainConfig) for path in configs.glob("pretrain/demo_*.yaml")]
    demos += [  # the federated pretraining demos on this archive (the federated finetuning demos read the
        # central ones' data; the real-imagery demo reads data/demo/real/, which this archive does not hold)
        (path, FederatedConfig)
        for path, tree in ((path, read_config_tree(path)) for path in configs.glob("federated/demo_*.yaml"))
        if tree.get("task", "mim") in ("mim", "dino") and all(s["name"] in roots for s in tree["data"]["sources"])
    ]
    assert sorted(path.name for path, _ in demos) == [
        "demo_dino_fedavg_swin_micro__3inst.yaml",
        "demo_dino_fedema_swin_micro__3inst.yaml",
        "demo_dino_fedmkd_swin_micro__3inst.yaml",
        "demo_dino_fedsense_swin_micro__3inst__1bit_ef.yaml",
        "demo_dino_fedu2_swin_micro__3inst.yaml",
        "demo_dino_ldawa_swin_micro__3inst.yaml",
        "demo_dino_swin_micro__img64_win4__4band.yaml",
        "demo_fedsense_swin_micro__3inst__1bit_ef.yaml",
        "demo_fedsense_swin_micro__3inst__1bit_ef__2proc.yaml",
        "demo_gfm_swin_micro__img64_win4__4band.yaml",
        "demo_simmim_swin_micro__img64_win4__rgb_teacher.yaml",
    ]
    for path, schema in demos:
        for source in schema.from_file(path).data.sources:
            stats = compute_band_stats(
                root=roots[source.name],
                pattern=source.pattern,
                bands=source.bands,
                scale=source.scale,
                nodata=source.nodata,
            )
            assert np.allclose(stats.mean, source.mean, rtol=1e-4), (path.name, source.name)
            assert np.allclose(stats.std, source.std, rtol=1e-4), (path.name, source.name)
