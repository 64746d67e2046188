"""The chip store: prepared from any layout, read back as the live source reads, mixed, sharded, partitioned."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from geofm.cli import main
from geofm.config import DataConfig, SourceConfig
from geofm.data.chipstore import INDEX, ChipDataset, ChipSampler, ChipStore, write_synthetic_store
from geofm.data.pile import PileSampler, PretrainPile
from geofm.data.prepare import prepare_store
from geofm.data.products.synthetic import write_band, write_sentinel2_safe
from geofm.data.sources import ImageSource
from geofm.errors import DataMismatchError, DatasetNotFoundError, InvalidChipError, RasterReadError
from geofm.fl.partitions.files import share_dirichlet

REPO = Path(__file__).parents[2]


def _file_source(folder: Path, write_tif) -> SourceConfig:
    """Three uint16 GeoTIFFs with nodata 0: two 20 x 20 (cut into 8 px chips) and one 6 x 10 (padded)."""
    rng = np.random.default_rng(1)
    for name, shape in (("a", (20, 20)), ("b", (20, 20)), ("c", (6, 10))):
        pixels = rng.integers(1, 5000, (3, *shape)).astype(np.uint16)
        pixels[0, :3, :3] = 0
        pixels[2, -2:, :] = 0
        write_tif(folder / f"{name}.tif", pixels, nodata=0)
    return SourceConfig(
        name="tifs",
        root=folder,
        pattern="*.tif",
        bands=["blue", "green", "red"],
        scale=1e-4,
        mean=[0.1, 0.2, 0.3],
        std=[0.05, 0.1, 0.2],
    )


def _band_files_source(folder: Path) -> SourceConfig:
    """A 24 x 40 band_files scene of two bands with nodata 0 and a pre-collection BQA: cloud in columns 0-3
    (a quarter of the first chips) and 28-39 (three quarters of the last column's chips, which are left out)."""
    rng = np.random.default_rng(2)
    bqa = np.full((24, 40), 0x5000, dtype=np.uint16)
    bqa[:, :4] = bqa[:, 28:] = 0xD000
    for band_id in ("B4", "B5"):
        pixels = rng.integers(1, 30000, (24, 40)).astype(np.uint16)
        pixels[5:7, 10:20] = 0
        write_band(folder / f"LC08_{band_id}.tif", pixels, 30.0)
    write_band(folder / "LC08_BQA.tif", bqa, 30.0)
    return SourceConfig(
        name="scene",
        root=folder,
        layout="band_files",
        bands=["red", "nir"],
        options={"filename_regex": r"(?P<scene>\w+)_(?P<band>B\w+)\.tif", "band_ids": "landsat8"},
        scale=2e-5,
        offset=-0.1,
        nodata=0,
        quality={"band": "BQA", "generation": "landsat_pre_collection"},
        mean=[0.2, 0.3],
        std=[0.1, 0.2],
    )


def _store_source(live: SourceConfig, store: Path) -> SourceConfig:
    return SourceConfig(
        name=f"{live.name}_chips", root=store, layout="chips", bands=live.bands, mean=live.mean, std=live.std
    )


def _assert_reads_as_live(live_cfg: SourceConfig, store: Path, size: int) -> int:
    """Every chip of the store equals the live source's sample it came from (padding: invalid zeros)."""
    live = ImageSource(live_cfg.model_copy(update={"chip_size": size}), live_cfg.bands)
    chips = ImageSource(_store_source(live_cfg, store), live_cfg.bands)
    store_index = ChipStore(store)
    for index, chip in enumerate(chips.chips):
        image, valid = chips.load(index)
        want_image, want_valid = live.load(store_index.sample_of(chip.file, chip.item))
        _, height, width = want_image.shape
        assert torch.equal(image[:, :height, :width], want_image)
        assert torch.equal(valid[:, :height, :width], want_valid)
        assert not valid[:, height:].any() and not valid[:, :, width:].any()
        assert not image[:, height:].any() and not image[:, :, width:].any()
    return len(chips)


def test_prepare_file_layout_reads_back_as_the_live_source_with_nodata_alone_or_with_workers(tmp_path, write_tif):
    cfg = _file_source(tmp_path / "tifs", write_tif)
    summary = prepare_store(cfg, tmp_path / "store", size=8, chips_per_shard=4, progress=False)
    assert summary["chips"] == summary["samples"] == 2 * 9 + 2 == 20
    assert summary["shards"] == 5
    assert _assert_reads_as_live(cfg, tmp_path / "store", 8) == 20
    chips = ImageSource(_store_source(cfg, tmp_path / "store"), cfg.bands)
    assert not chips.load(0)[1][0, :3, :3].any(), "nodata travels with the chip as its valid mask"

    prepare_store(cfg, tmp_path / "by_workers", size=8, chips_per_shard=4, workers=2, progress=False)
    alone, by_workers = ChipStore(tmp_path / "store"), ChipStore(tmp_path / "by_workers")
    assert alone.shards == by_workers.shards
    for a, b in zip(alone.shard_paths(), by_workers.shard_paths(), strict=True):
        assert all(np.array_equal(x, y) for x, y in zip(alone.read(a, 3), by_workers.read(b, 3), strict=True))


def test_prepare_band_files_with_quality_band_leaves_out_mostly_invalid_chips(tmp_path):
    cfg = _band_files_source(tmp_path / "scene")
    summary = prepare_store(cfg, tmp_path / "store", size=16, chips_per_shard=3, progress=False)
    live = ImageSource(cfg.model_copy(update={"chip_size": 16}), cfg.bands)
    mostly_cloud = [i for i in range(len(live)) if live.chips[i].window[1] == 24]
    for i in mostly_cloud:
        with pytest.raises(InvalidChipError):
            live.load(i)
    assert summary["left_out_mostly_invalid"] == len(mostly_cloud) == 2
    assert summary["chips"] == len(live) - 2 == 4
    assert _assert_reads_as_live(cfg, tmp_path / "store", 16) == 4
    _, valid = ImageSource(_store_source(cfg, tmp_path / "store"), cfg.bands).load(0)
    assert not valid[:, :, :4].any() and valid[:, :5, 4:].all(), "the quality band's cloud travels with the chip"


def test_prepare_sentinel2_products_keeps_each_products_scaling_and_its_scl_mask(tmp_path):
    """Two L2A products of baselines 03.00 (no offset) and 04.00 (offset -1000), a 20 m band read onto
    the 10 m grid, SCL cloud in a corner of one."""
    rng = np.random.default_rng(3)
    for name, baseline in (("old", "03.00"), ("new", "04.00")):
        scl = np.full((8, 8), 4, dtype=np.uint8)
        scl[:2, :2] = 9 if name == "new" else 4
        bands = {"B04": (rng.integers(1000, 5000, (16, 16)).astype(np.uint16), 10)}
        bands["B05"] = (rng.integers(1000, 5000, (8, 8)).astype(np.uint16), 20)
        write_sentinel2_safe(tmp_path / "s2", name, bands, baseline=baseline, scl=scl)
    cfg = SourceConfig(
        name="s2",
        root=tmp_path / "s2",
        layout="sentinel2_safe",
        bands=["red", "rededge1"],
        quality={},
        mean=[0.1, 0.2],
        std=[0.05, 0.1],
    )
    summary = prepare_store(cfg, tmp_path / "store", size=8, progress=False)
    assert summary["chips"] == 8 and summary["left_out_mostly_invalid"] == 0
    assert _assert_reads_as_live(cfg, tmp_path / "store", 8) == 8
    store = ChipStore(tmp_path / "store")
    offsets = {round(float(store.read(store.shard_paths()[0], k)[3][0]), 6) for k in range(8)}
    assert offsets == {0.0, -0.1}, "each chip keeps its own product's offset"


def test_a_killed_prepare_continues_after_its_last_finished_shard(tmp_path, write_tif, monkeypatch):
    cfg = _file_source(tmp_path / "tifs", write_tif)
    read = ImageSource.read
    seen: list[int] = []
    killed: list[int] = []

    def killed_at_seven(self, index):
        if index == 7 and not killed:
            killed.append(index)
            raise KeyboardInterrupt
        seen.append(index)
        return read(self, index)

    monkeypatch.setattr(ImageSource, "read", killed_at_seven)
    with pytest.raises(KeyboardInterrupt):
        prepare_store(cfg, tmp_path / "store", size=8, chips_per_shard=3, progress=False)
    index = json.loads((tmp_path / "store" / INDEX).read_text())
    assert not index["complete"] and [s["chips"] for s in index["shards"]] == [3, 3]
    with pytest.raises(
        DatasetNotFoundError, match=r"store is unfinished: its geofm data prepare stopped after 2 shard"
    ):
        ChipStore(tmp_path / "store")

    (tmp_path / "store" / "00002.pixels.npy").write_bytes(b"a shard the index never listed")  # killed mid-shard
    (tmp_path / "store" / "00002.valid.npy.tmp").write_bytes(b"half")
    seen.clear()
    summary = prepare_store(cfg, tmp_path / "store", size=8, chips_per_shard=3, progress=False)
    assert seen[0] == 6 and summary["resumed_at_sample"] == 6, "samples of finished shards are not read again"
    monkeypatch.setattr(ImageSource, "read", read)
    prepare_store(cfg, tmp_path / "clean", size=8, chips_per_shard=3, progress=False)
    resumed, clean = ChipStore(tmp_path / "store"), ChipStore(tmp_path / "clean")
    assert resumed.shards == clean.shards
    for path, other in zip(resumed.shard_paths(), clean.shard_paths(), strict=True):
        for chip in range(resumed.shard(path).chips):
            for a, b in zip(resumed.read(path, chip), clean.read(other, chip), strict=True):
                assert np.array_equal(a, b)

    again = prepare_store(cfg, tmp_path / "store", size=8, chips_per_shard=3, progress=False)
    assert again["chips"] == 20 and again["chips_per_s"] is None, "a complete store is left as it is"
    with pytest.raises(DataMismatchError, match=r"index.json: size is 8, this prepare's is 4"):
        prepare_store(cfg, tmp_path / "store", size=4, chips_per_shard=3, progress=False)


def test_chips_mix_with_a_live_source_in_one_pile_sharded_by_rank(tmp_path, write_tif):
    live = _file_source(tmp_path / "tifs", write_tif)
    prepare_store(_band_files_source(tmp_path / "scene"), tmp_path / "store", size=16, progress=False)
    chips = SourceConfig(
        name="chips", root=tmp_path / "store", layout="chips", bands=["red", "nir"], mean=[0.2, 0.3], std=[0.1, 0.2]
    )
    data = DataConfig(bands=["red", "green", "blue", "nir"], sources=[live, chips], samples_per_epoch=16)
    pile = PretrainPile(data, img_size=8)
    assert pile.source_sizes == [3, 4]
    shares = []
    for rank in range(2):
        sampler = PileSampler(pile.source_sizes, pile.weights, pile.samples_per_epoch, seed=3, rank=rank, world_size=2)
        shares.append(list(sampler))
    for rank in range(2):
        sampler = PileSampler(pile.source_sizes, pile.weights, pile.samples_per_epoch, seed=3, rank=rank, world_size=2)
        sampler.set_start(3)
        assert list(sampler) == shares[rank][3:], "a rank resumes mid-epoch"
    assert not {i.sample_seed for i in shares[0]} & {i.sample_seed for i in shares[1]}
    drawn = {i.source for share in shares for i in share}
    assert drawn == {0, 1}
    for index in shares[0] + shares[1]:
        sample = pile[index]
        assert sample["image"].shape == sample["valid"].shape == (4, 8, 8)
        present = [0, 1, 2] if index.source == 0 else [0, 3]  # live: blue green red; store: red nir
        assert not sample["valid"][[b for b in range(4) if b not in present]].any()


def test_a_federated_partition_deals_a_stores_shards(tmp_path, write_tif):
    cfg = _file_source(tmp_path / "tifs", write_tif)
    prepare_store(cfg, tmp_path / "store", size=8, chips_per_shard=2, progress=False)
    chips = _store_source(cfg, tmp_path / "store")
    shards = ImageSource(chips, cfg.bands).files
    assert len(shards) == 10
    shares = [share_dirichlet([shards], 3, client, seed=0, alpha=100.0) for client in range(3)]
    dealt = [ImageSource(chips, cfg.bands, [f.path for f in share]) for share in shares]
    assert all(len(source) > 0 for source in dealt)
    assert sum(len(source) for source in dealt) == 20
    assert sorted(c for source in dealt for c in source.chips) == sorted(ImageSource(chips, cfg.bands).chips)


def test_chip_dataset_crops_flips_and_normalises_each_index_as_its_seed_draws(tmp_path):
    root = write_synthetic_store(tmp_path / "store", count=5, bands=["red", "nir"], size=12, seed=4)
    dataset = ChipDataset(root, 8, mean=[0.5, 0.4], std=[0.2, 0.3], seed=1)
    assert len(dataset) == 5
    item = dataset[2]
    assert item["image"].dtype == torch.float32 and item["valid"].dtype == torch.bool
    assert item["image"].shape == item["valid"].shape == (2, 8, 8)
    assert torch.equal(dataset[2]["image"], item["image"]), "an item is a function of its index"
    assert not item["image"][~item["valid"]].any()

    plain = ChipDataset(root, 12, mean=[0.5, 0.4], std=[0.2, 0.3], hflip=False, vflip=False)
    store = ChipStore(root)
    pixels, valid, _, _ = store.read(store.shard_paths()[0], 3)
    want = (pixels.astype(np.float32) * np.float32(1e-4) - np.float32([[[0.5]], [[0.4]]])) / np.float32(
        [[[0.2]], [[0.3]]]
    )
    assert np.allclose(plain[3]["image"].numpy()[valid], want[valid], atol=1e-5)
    assert torch.equal(plain[3]["valid"], torch.from_numpy(np.array(valid)))
    assert torch.equal(plain[3]["image"], plain[8]["image"]), "index 8 is chip 3 again (a later epoch)"

    again = write_synthetic_store(tmp_path / "store", count=5, bands=["red", "nir"], size=12, seed=4)
    assert ChipStore(again).shards == store.shards, "a finished store is left as it is"
    spawned = pickle.loads(pickle.dumps(dataset))
    assert torch.equal(spawned[2]["image"], item["image"])
    assert dataset.store._open and len(pickle.dumps(dataset.store)) < 1000, "a pickled store leaves its maps behind"

    with pytest.raises(DataMismatchError, match=r"index.json: its chips are 12 px, smaller than 16 px"):
        ChipDataset(root, 16, mean=[0.5, 0.4], std=[0.2, 0.3])
    with pytest.raises(DataMismatchError, match=r"holds 2 bands \['red', 'nir'\]; mean and std give 3"):
        ChipDataset(root, 8, mean=[0.5, 0.4, 0.1], std=[0.2, 0.3, 0.1])


def test_chip_sampler_deals_each_epoch_among_ranks_and_resumes():
    shares = [list(ChipSampler(10, seed=2, rank=r, world_size=2)) for r in range(2)]
    assert sorted(shares[0] + shares[1]) == list(range(10))
    later = []
    for rank in range(2):
        sampler = ChipSampler(10, seed=2, rank=rank, world_size=2)
        sampler.set_epoch(3)
        later.append(list(sampler))
    assert sorted(later[0] + later[1]) == list(range(30, 40)), "epoch 3 indexes its own crops of every chip"
    sampler = ChipSampler(10, seed=2, rank=1, world_size=2)
    sampler.set_epoch(3)
    sampler.set_start(2)
    assert list(sampler) == later[1][2:], "a rank resumes mid-epoch"
    assert list(sampler) == later[1], "the start holds for one iteration"


def test_bad_stores_are_named_by_file_and_field(tmp_path, write_tif):
    cfg = _file_source(tmp_path / "tifs", write_tif)
    prepare_store(cfg, tmp_path / "store", size=8, chips_per_shard=8, progress=False)
    chips = _store_source(cfg, tmp_path / "store")

    with pytest.raises(
        DataMismatchError, match=r"index.json: the store holds bands \['blue', 'green', 'red'\]; source"
    ):
        ImageSource(chips.model_copy(update={"bands": ["red", "green", "blue"]}), cfg.bands)

    corrupt = tmp_path / "store" / "00001.pixels.npy"
    corrupt.write_bytes(corrupt.read_bytes()[:200])
    source = ImageSource(chips, cfg.bands)
    with pytest.raises(RasterReadError, match=r"00001.pixels.npy: (is not a readable|holds)"):
        source.load(8)
    source.load(0)  # the other shards read on

    (tmp_path / "store" / "00002.valid.npy").unlink()
    with pytest.raises(DatasetNotFoundError, match=r"00002.valid.npy: shard file of the chip store .* is missing"):
        ImageSource(chips, cfg.bands)
    with pytest.raises(DatasetNotFoundError, match=r"index.json: no chip store index"):
        ImageSource(chips.model_copy(update={"root": tmp_path / "tifs"}), cfg.bands)
    with pytest.raises(ValueError, match=r"layout chips\): nodata, scale were applied when the store was prepared"):
        SourceConfig(**(chips.model_dump() | {"nodata": 0, "scale": 0.5}))


def test_cli_prepare_prints_a_summary_and_errors_in_one_line(tmp_path, write_tif, capsys):
    cfg = _file_source(tmp_path / "tifs", write_tif)
    config = tmp_path / "pile.yaml"
    source = cfg.model_dump(mode="json", exclude_none=True)
    config.write_text(yaml.safe_dump({"data": {"bands": cfg.bands, "sources": [source]}}))
    args = ["data", "prepare", "--config", str(config), "--source", "tifs", "--no-progress"]
    assert main([*args, "--chip-size", "8", "--out", str(tmp_path / "store")]) == 0
    assert json.loads(capsys.readouterr().out)["chips"] == 20

    assert main([*args, "--out", str(tmp_path / "other")]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "geofm: error: source 'tifs' has no chip_size: give the chips' size with --chip-size"


@pytest.mark.slow
def test_the_chip_store_module_imports_no_raster_or_config_stack():
    probe = "import sys, geofm.data.chipstore; print(sorted(m for m in ('rasterio', 'pydantic', 'geofm.config') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_cli_prepare_skips_unreadable_files_as_a_run_would_and_takes_overrides(tmp_path, write_tif, capsys, caplog):
    """A truncated GeoTIFF (its header reads, its pixels do not) is left out, 9 chips of 8 px, one warning."""
    cfg = _file_source(tmp_path / "tifs", write_tif)
    corrupt = write_tif(tmp_path / "tifs" / "d.tif", np.ones((3, 20, 20), dtype=np.uint16), nodata=0)
    corrupt.write_bytes(corrupt.read_bytes()[: corrupt.stat().st_size // 2])
    config = tmp_path / "pile.yaml"
    config.write_text(yaml.safe_dump({"data": {"bands": cfg.bands, "sources": [cfg.model_dump(mode="json")]}}))
    args = ["data", "prepare", "--config", str(config), "--source", "tifs", "--chip-size", "8", "--no-progress"]

    assert main([*args, "--out", str(tmp_path / "failed")]) == 2
    assert capsys.readouterr().err.startswith(f"geofm: error: {tmp_path / 'tifs' / 'd.tif'}")
    assert not (tmp_path / "failed").exists(), "a prepare that wrote nothing leaves no folder"

    assert main([*args, "--out", str(tmp_path / "store"), "data.on_bad_file=skip"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["chips"] == 20 and summary["left_out_unreadable"] == 9
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and warnings[0].startswith(f"source 'tifs': skipping {corrupt}: ")
    assert len(ChipStore(tmp_path / "store").shard_paths()) == 1

    assert main([*args, "--out", str(tmp_path / "x"), "data.on_bad_fil=skip"]) == 2
    assert "override data.on_bad_fil=skip: unknown key (did you mean on_bad_file?)" in capsys.readouterr().err


def test_an_unfinished_store_is_named_unfinished_with_the_prepare_that_finishes_it(tmp_path, write_tif):
    from geofm.errors import ConfigError
    from geofm.training.rundir import InputPath, check_inputs

    cfg = _file_source(tmp_path / "tifs", write_tif)
    store = tmp_path / "store"
    prepare_store(cfg, store, size=8, chips_per_shard=8, progress=False)
    index = json.loads((store / INDEX).read_text())
    (store / INDEX).write_text(json.dumps({**index, "complete": False}))
    with pytest.raises(ConfigError) as info:
        check_inputs([InputPath.of_source("data.sources.0.root", _store_source(cfg, store))], "my.yaml")
    message = str(info.value)
    assert message.startswith("my.yaml: 1 input(s) cannot be read") and "missing" not in message
    assert f"{store}: the chip store is unfinished: its geofm data prepare stopped after 3 shard(s)" in message
    assert f"--source tifs --chip-size 8 --out {store}), which continues after its last shard" in message
