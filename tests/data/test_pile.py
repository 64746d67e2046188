from __future__ import annotations

import itertools
import logging
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, default_collate

from geofm.config import DataConfig
from geofm.data.pile import PileIndex, PileSampler, PretrainPile, SkippedFiles, shown_samples
from geofm.errors import DatasetNotFoundError, RasterReadError

BANDS = ["blue", "green", "red", "nir"]


@pytest.fixture
def data_cfg(make_source) -> DataConfig:
    rgb = make_source("rgb", ["red", "green", "blue"], files=5, size=20, dtype="uint8", weight=2.0, seed=1)
    ms = make_source("ms", BANDS, files=3, size=24, nodata=0, seed=2)
    return DataConfig(bands=BANDS, sources=[rgb, ms], num_workers=0)


def _mask_fn(generator: torch.Generator) -> torch.Tensor:
    return torch.rand(4, 4, generator=generator) < 0.5


# PileSampler


def test_sampler_deterministic_per_seed_and_epoch() -> None:
    def order(seed: int, epoch: int) -> list[PileIndex]:
        sampler = PileSampler([7, 3], [1.0, 1.0], 50, seed=seed)
        sampler.set_epoch(epoch)
        return list(sampler)

    first = order(0, 0)
    assert len(first) == 50
    assert all(isinstance(i, PileIndex) for i in first)
    assert first == order(0, 0)
    assert first != order(0, 1)
    assert first != order(1, 0)
    assert all(0 <= i.sample_seed < 2**63 for i in first)
    assert len({i.sample_seed for i in first}) == 50


def test_shown_samples_take_the_sources_in_turn_with_seeds_of_their_own() -> None:
    shown = shown_samples([3, 5], 8, seed=0)
    assert shown == shown_samples([3, 5], 8, seed=0) and shown != shown_samples([3, 5], 8, seed=1)
    assert [i.source for i in shown] == [0, 1] * 4
    assert sorted(i.file for i in shown[0::2][:3]) == [0, 1, 2], "a source's files before any repeats"
    assert len({i.file for i in shown[1::2]}) == 4
    sampler = PileSampler([3, 5], [1.0, 1.0], 8, seed=0)
    trained = set()
    for epoch in range(3):
        sampler.set_epoch(epoch)
        trained |= {i.sample_seed for i in sampler}
    assert not trained & {i.sample_seed for i in shown}, "no training step sees these crops and masks"


def test_sampler_respects_weights() -> None:
    sampler = PileSampler([10, 10, 10], [3.0, 1.0, 0.5], 9000, seed=4)
    counts = Counter(i.source for i in sampler)
    assert counts[0] / 9000 == pytest.approx(3.0 / 4.5, abs=0.03)
    assert counts[1] / 9000 == pytest.approx(1.0 / 4.5, abs=0.03)
    assert counts[2] / 9000 == pytest.approx(0.5 / 4.5, abs=0.03)


def test_sampler_walks_each_source_without_replacement() -> None:
    sizes = [7, 4, 50]
    sampler = PileSampler(sizes, [1.0, 1.0, 1.0], 200, seed=3)
    indices = list(sampler)
    for source, size in enumerate(sizes):
        files = [i.file for i in indices if i.source == source]
        assert files, f"source {source} never drawn"
        for start in range(0, len(files), size):
            chunk = files[start : start + size]
            assert len(set(chunk)) == len(chunk), f"source {source} repeats a file before exhaustion"
            assert all(0 <= f < size for f in chunk)
        full_rounds = len(files) // size
        if full_rounds >= 2:
            rounds = [files[r * size : (r + 1) * size] for r in range(full_rounds)]
            assert any(a != b for a, b in itertools.pairwise(rounds)), "no reshuffle between rounds"


def test_sampler_set_start_resumes_same_order() -> None:
    sampler = PileSampler([5, 6], [1.0, 2.0], 40, seed=9, rank=1, world_size=2)
    sampler.set_epoch(3)
    full = list(sampler)
    assert len(full) == len(sampler) == 20
    sampler.set_start(7)
    assert list(sampler) == full[7:]
    assert list(sampler) == full, "set_start applies to the next iteration only"
    resumed = PileSampler([5, 6], [1.0, 2.0], 40, seed=9, rank=1, world_size=2)
    resumed.set_start(20)
    resumed.set_epoch(3)
    assert list(resumed) == []
    with pytest.raises(ValueError, match="start position"):
        resumed.set_start(21)


def test_resuming_on_more_processes_continues_with_the_same_samples() -> None:
    """8 images per step: 3 steps on one process, then the rest split over two processes of 4 each."""
    single = PileSampler([8, 5], [1.0, 1.0], 40, seed=4)
    single.set_epoch(2)
    plan = list(single)
    shares = []
    for rank in range(2):
        sampler = PileSampler([8, 5], [1.0, 1.0], 40, seed=4, rank=rank, world_size=2)
        sampler.set_epoch(2)
        sampler.set_start(3 * 8 // 2)  # done steps x micro-batch x accumulation of the new split
        shares.append(list(sampler))
    steps = [shares[0][i : i + 4] + shares[1][i : i + 4] for i in range(0, len(shares[0]), 4)]
    assert [sorted(step) for step in steps] == [sorted(plan[i : i + 8]) for i in range(24, 40, 8)]


def test_sampler_ranks_are_disjoint_and_cover_the_epoch() -> None:
    world = 3
    single = PileSampler([8, 5], [1.0, 1.0], 100, seed=2)
    single.set_epoch(1)
    everything = list(single)
    shares = []
    for rank in range(world):
        sampler = PileSampler([8, 5], [1.0, 1.0], 100, seed=2, rank=rank, world_size=world)
        sampler.set_epoch(1)
        shares.append(list(sampler))
        assert len(shares[-1]) == len(sampler) == 33
    seeds = [{i.sample_seed for i in share} for share in shares]
    assert not (seeds[0] & seeds[1]) and not (seeds[0] & seeds[2]) and not (seeds[1] & seeds[2])
    for rank, share in enumerate(shares):
        assert share == everything[rank:99:world]


def test_sampler_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="one weight per source"):
        PileSampler([3, 3], [1.0], 10, seed=0)
    with pytest.raises(ValueError, match="positive"):
        PileSampler([3], [0.0], 10, seed=0)
    with pytest.raises(ValueError, match="rank"):
        PileSampler([3], [1.0], 10, seed=0, rank=2, world_size=2)
    with pytest.raises(ValueError, match="world_size"):
        PileSampler([3], [1.0], 2, seed=0, rank=0, world_size=4)


# PretrainPile


def test_pile_sample(data_cfg: DataConfig) -> None:
    pile = PretrainPile(data_cfg, img_size=16, mask_fn=_mask_fn)
    assert pile.source_sizes == [5, 3]
    assert pile.weights == [2.0, 1.0]
    assert [s.name for s in pile.sources] == ["rgb", "ms"]
    sample = pile[PileIndex(0, 2, 12345)]
    assert set(sample) == {"image", "valid", "mask", "source", "file", "skipped", "skip_reasons", "skip_notes"}
    assert sample["image"].shape == sample["valid"].shape == (4, 16, 16)
    assert sample["image"].dtype == torch.float32 and sample["valid"].dtype == torch.bool
    assert sample["source"] == 0 and sample["file"] == 2 and sample["skipped"] == 0 and sample["skip_reasons"] == ""
    assert not sample["valid"][3].any(), "the RGB source has no nir band"
    assert sample["valid"][:3].all()
    assert torch.equal(sample["mask"], _mask_fn(torch.Generator().manual_seed(12345)))


def test_pile_sample_is_pure_function_of_index(data_cfg: DataConfig) -> None:
    pile = PretrainPile(data_cfg, img_size=16)
    torch.manual_seed(0)
    state = torch.get_rng_state()
    a = pile[PileIndex(1, 1, 77)]
    assert torch.equal(torch.get_rng_state(), state), "the global RNG must not be consumed"
    torch.manual_seed(123)
    b = pile[PileIndex(1, 1, 77)]
    c = pile[PileIndex(1, 1, 78)]
    assert "mask" not in a
    assert torch.equal(a["image"], b["image"]) and torch.equal(a["valid"], b["valid"])
    assert not torch.equal(a["image"], c["image"])


def test_pile_same_batches_with_0_and_2_workers(data_cfg: DataConfig) -> None:
    pile = PretrainPile(data_cfg, img_size=16, mask_fn=_mask_fn)

    def batches(workers: int) -> list[dict]:
        sampler = PileSampler(pile.source_sizes, pile.weights, 12, seed=5)
        sampler.set_epoch(2)
        loader = DataLoader(pile, batch_size=4, sampler=sampler, num_workers=workers)
        return list(loader)

    serial, parallel = batches(0), batches(2)
    assert len(serial) == len(parallel) == 3
    for a, b in zip(serial, parallel, strict=False):
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]) if torch.is_tensor(a[key]) else a[key] == b[key], key


def test_samples_per_epoch(data_cfg: DataConfig) -> None:
    assert PretrainPile(data_cfg, 16).samples_per_epoch == 8
    assert PretrainPile(data_cfg.model_copy(update={"samples_per_epoch": 3}), 16).samples_per_epoch == 3


def _corrupt(cfg: DataConfig, source: int, *files: int) -> list[Path]:
    paths = sorted(Path(cfg.sources[source].root).glob("*.tif"))
    for f in files:
        paths[f].write_bytes(b"not a tiff" * 50)
    return [paths[f] for f in files]


def test_skip_mode_substitutes_next_file_and_warns_once_per_file(
    data_cfg: DataConfig, caplog: pytest.LogCaptureFixture
) -> None:
    bad = _corrupt(data_cfg, 0, 1, 2)
    pile = PretrainPile(data_cfg.model_copy(update={"on_bad_file": "skip"}), img_size=16)
    reference = PretrainPile(data_cfg, img_size=16)
    sample = pile[PileIndex(0, 1, 5)]
    assert sample["skipped"] == 2 and sample["skip_reasons"] == "uu"
    expected = reference[PileIndex(0, 3, 5)]
    assert torch.equal(sample["image"], expected["image"])
    assert pile[PileIndex(0, 0, 5)]["skipped"] == 0

    skipped = SkippedFiles(pile.source_sizes)
    with caplog.at_level(logging.WARNING, logger="geofm.data"):
        # the bad files met twice in one batch, then again (another epoch), then readable files only
        for files in ([1, 2], [2, 0], [0, 3]):
            skipped.add_batch(default_collate([pile[PileIndex(0, file, 5)] for file in files]))
    assert skipped.files == {(0, 1), (0, 2)}
    assert [r.name for r in caplog.records] == ["geofm.data", "geofm.data"], "each bad file warned of once"
    assert caplog.records[0].getMessage().startswith(f"source 'rgb': skipping {bad[0]}: ")
    assert caplog.records[1].getMessage().startswith(f"source 'rgb': skipping {bad[1]}: ")


def test_skip_mode_wraps_around_and_fails_when_all_bad(data_cfg: DataConfig) -> None:
    _corrupt(data_cfg, 1, 2)
    pile = PretrainPile(data_cfg.model_copy(update={"on_bad_file": "skip"}), img_size=16)
    assert pile[PileIndex(1, 2, 0)]["skipped"] == 1
    _corrupt(data_cfg, 1, 0, 1)
    with pytest.raises(DatasetNotFoundError, match="none of the 3 files"):
        pile[PileIndex(1, 0, 0)]


def test_error_mode_raises_naming_file(data_cfg: DataConfig) -> None:
    (bad,) = _corrupt(data_cfg, 0, 4)
    pile = PretrainPile(data_cfg, img_size=16)
    with pytest.raises(RasterReadError) as info:
        pile[PileIndex(0, 4, 0)]
    assert info.value.path == str(bad)
