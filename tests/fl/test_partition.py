from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from geofm.data.writers import write_geotiff
from geofm.errors import ConfigError
from geofm.fl.partitions.files import (
    PARTITIONERS,
    ClientFile,
    partition_by_region,
    partition_by_source,
    partition_dirichlet,
)


def synthetic_sources(files_per_source: list[int]) -> list[list[str]]:
    return [[f"s{s}/img_{f:03d}.tif" for f in range(count)] for s, count in enumerate(files_per_source)]


def assert_each_private_file_once(clients: list[list[ClientFile]], sources: list[list[str]], public: set[int]) -> None:
    given = [(f.source, f.file) for files in clients for f in files]
    expected = [(s, f) for s, paths in enumerate(sources) if s not in public for f in range(len(paths))]
    assert sorted(given) == sorted(expected), "files lost, duplicated, or public files handed out"
    assert all(Path(sources[f.source][f.file]) == f.path for files in clients for f in files)
    assert all(files for files in clients), "a client is empty"


def test_by_source() -> None:
    sources = synthetic_sources([3, 5, 2, 4])
    clients = partition_by_source(sources, num_clients=3, public={1})
    assert_each_private_file_once(clients, sources, {1})
    assert [{f.source for f in files} for files in clients] == [{0}, {2}, {3}]
    with pytest.raises(ConfigError, match=r"3 private sources .* cannot make 4 clients"):
        partition_by_source(sources, num_clients=4, public={1})
    with pytest.raises(ConfigError, match="sources \\[1\\] have no file"):
        partition_by_source([["a.tif"], []], num_clients=2)
    with pytest.raises(ConfigError, match="out of range"):
        partition_by_source(sources, num_clients=3, public={7})


def test_dirichlet_is_deterministic_and_covers_every_file() -> None:
    sources = synthetic_sources([40, 25, 30, 10])
    first = partition_dirichlet(sources, num_clients=5, alpha=0.5, seed=3, public={2})
    assert_each_private_file_once(first, sources, {2})
    assert first == partition_dirichlet(sources, num_clients=5, alpha=0.5, seed=3, public={2})
    assert first != partition_dirichlet(sources, num_clients=5, alpha=0.5, seed=4, public={2})


def dominant_share(clients: list[list[ClientFile]], sources: list[list[str]]) -> float:
    """Mean over sources of the largest share of the source's files held by one client."""
    shares = []
    for s, paths in enumerate(sources):
        counts = [sum(f.source == s for f in files) for files in clients]
        shares.append(max(counts) / len(paths))
    return float(np.mean(shares))


def test_dirichlet_skew_grows_as_alpha_shrinks() -> None:
    sources = synthetic_sources([60, 60, 60, 60])
    skew = {
        alpha: np.mean([dominant_share(partition_dirichlet(sources, 4, alpha, seed), sources) for seed in range(8)])
        for alpha in (0.1, 1.0, 100.0)
    }
    assert skew[0.1] > skew[1.0] > skew[100.0], f"skew does not grow as alpha shrinks: {skew}"
    assert skew[100.0] < 0.4, f"alpha = 100 should be near IID (1/4 per client), got {skew[100.0]:.2f}"
    assert skew[0.1] > 0.7, f"alpha = 0.1 should give each source a dominant client, got {skew[0.1]:.2f}"


def test_dirichlet_reports_clients_it_cannot_fill() -> None:
    with pytest.raises(ConfigError, match=r"left clients .* empty in 100 draws"):
        partition_dirichlet([["a.tif", "b.tif"]], num_clients=4, alpha=1.0)
    with pytest.raises(ConfigError, match="alpha must be positive"):
        partition_dirichlet([["a.tif"]], num_clients=1, alpha=0.0)


# Three regions far apart, as (lon, lat) of the files' north-west corners in EPSG:4326.
REGIONS = {"alps": (9.0, 46.0), "amazon": (-60.0, -3.0), "tibet": (88.0, 31.0)}


def write_regional_sources(root: Path) -> tuple[list[list[str]], dict[str, str]]:
    """Two private sources and a public one, each with files in every region; one file in UTM."""
    sources: list[list[str]] = [[], [], []]
    region_of: dict[str, str] = {}
    pixels = np.zeros((1, 4, 4), dtype=np.uint8)
    for s in range(3):
        for name, (lon, lat) in REGIONS.items():
            for k in range(2):
                path = root / f"s{s}" / f"{name}_{k}.tif"
                write_geotiff(path, pixels, transform=(0.01, 0, lon + k * 0.3, 0, -0.01, lat - k * 0.2), crs=4326)
                sources[s].append(str(path))
                region_of[str(path)] = name
    utm = root / "s0" / "alps_utm.tif"  # 500000 E, 5100000 N in UTM 32N: 9 E, 46 N
    write_geotiff(utm, pixels, transform=(10.0, 0, 500_000.0, 0, -10.0, 5_100_000.0), crs="EPSG:32632")
    sources[0].append(str(utm))
    region_of[str(utm)] = "alps"
    return sources, region_of


def test_by_region_on_georeferenced_files(tmp_path: Path) -> None:
    sources, region_of = write_regional_sources(tmp_path)
    clients = partition_by_region(sources, num_clients=3, seed=0, public={2})
    assert_each_private_file_once(clients, sources, {2})
    regions = [{region_of[str(f.path)] for f in files} for files in clients]
    assert all(len(r) == 1 for r in regions), f"a client spans several regions: {regions}"
    assert sorted(r.pop() for r in regions) == sorted(REGIONS)
    assert clients == partition_by_region(sources, num_clients=3, seed=0, public={2}), "not deterministic"


def test_by_region_with_given_bounds_and_too_few_locations() -> None:
    sources = [["a.tif", "b.tif", "c.tif"]]
    bounds = [[(179.5, 0.0, -179.5, 1.0), (179.9, 0.0, 180.0, 1.0), (0.0, 0.0, 1.0, 1.0)]]
    clients = partition_by_region(sources, num_clients=2, bounds=bounds)
    assert [[f.file for f in files] for files in clients] == [[0, 1], [2]], "the antimeridian split a region"
    with pytest.raises(ConfigError, match="3 files at 2 distinct locations cannot form 3"):
        partition_by_region([["a", "b", "c"]], num_clients=3, bounds=[[(0, 0, 1, 1), (0, 0, 1, 1), (5, 5, 6, 6)]])


class _Listed(list):
    """Source file lists that record which sources were read."""

    def __init__(self, sources) -> None:
        super().__init__(sources)
        self.read: set[int] = set()

    def __getitem__(self, index):
        self.read.add(index)
        return super().__getitem__(index)


def test_registered_partitioners_give_one_client_its_share_and_by_source_reads_only_its_own() -> None:
    sources = [[f"a{i}.tif" for i in range(3)], [f"p{i}.tif" for i in range(2)], [f"b{i}.tif" for i in range(4)]]
    listed = _Listed(sources)
    share = PARTITIONERS.get("by_source")(listed, 2, 1, seed=0, public=[1], alpha=1.0)
    assert [f.path.name for f in share] == ["b0.tif", "b1.tif", "b2.tif", "b3.tif"] and listed.read == {2}
    with pytest.raises(ConfigError, match="cannot make 3 clients"):
        PARTITIONERS.get("by_source")(sources, 3, 0, public=[1])
    dealt = [PARTITIONERS.get("dirichlet")(sources, 2, c, seed=3, public=[1], alpha=0.5) for c in (0, 1)]
    assert dealt == partition_dirichlet(sources, 2, 0.5, seed=3, public=[1])
    assert PARTITIONERS.names() == ["by_region", "by_source", "dirichlet"]
