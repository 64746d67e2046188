"""Sample partitioners of federated finetuning: each scenario's promise checked on small hand-made tables."""

from __future__ import annotations

import json

import numpy as np
import pytest

from geofm.errors import ConfigError
from geofm.fl.partitions.samples import (
    SAMPLE_PARTITIONERS,
    SampleTable,
    read_metadata,
    read_partition,
    write_partition,
)


def _table(n: int, labels=None, **metadata) -> SampleTable:
    return SampleTable([f"s{i}" for i in range(n)], None if labels is None else np.asarray(labels), metadata)


def _dealt(assignment: dict[str, np.ndarray]) -> list[int]:
    return sorted(i for held in assignment.values() for i in held.tolist())


def test_iid_deals_every_sample_once_evenly_and_reproducibly():
    iid = SAMPLE_PARTITIONERS.get("iid")
    a = iid(_table(10), 3, seed=0)
    assert list(a) == ["client00", "client01", "client02"]
    assert _dealt(a) == list(range(10)) and sorted(len(h) for h in a.values()) == [3, 3, 4]
    assert all(np.array_equal(a[k], iid(_table(10), 3, seed=0)[k]) for k in a), "same seed, same partition"
    assert any(not np.array_equal(a[k], iid(_table(10), 3, seed=1)[k]) for k in a)
    with pytest.raises(ConfigError, match=r"federation\.clients 11 exceeds the 10 samples"):
        iid(_table(10), 11, seed=0)


def test_dirichlet_concentrates_classes_at_small_alpha_and_spreads_them_at_large_alpha():
    labels = np.repeat([0, 1, 2], 30)
    dirichlet = SAMPLE_PARTITIONERS.get("dirichlet")
    skewed = dirichlet(_table(90, labels), 3, seed=0, alpha=0.01)
    assert _dealt(skewed) == list(range(90))
    for c in range(3):  # Dir(0.01) puts nearly all of a class on one client
        shares = sorted(int((labels[held] == c).sum()) for held in skewed.values())
        assert shares[-1] >= 27, shares
    even = dirichlet(_table(90, labels), 3, seed=0, alpha=1e4)
    for held in even.values():  # Dir(10^4) is nearly (1/3, 1/3, 1/3): 10 of each class, give or take one
        assert all(abs(int((labels[held] == c).sum()) - 10) <= 1 for c in range(3))


def test_multi_hot_samples_go_by_their_rarest_positive_class():
    labels = [[1, 1, 0], [1, 0, 0], [1, 0, 1], [0, 0, 0], [1, 1, 0]]  # class counts 4, 2, 1
    assert _table(5, labels).class_of_each("dirichlet").tolist() == [1, 0, 2, -1, 1]
    with pytest.raises(ConfigError, match="labels are not known"):
        _table(5).class_of_each("dirichlet")


def test_dirichlet_deals_by_a_metadata_field_where_samples_have_no_single_label():
    majority = ["water"] * 30 + ["moist"] * 30 + ["dry"] * 30  # a segmentation chip's majority class
    table = _table(90, majority=majority)
    skewed = SAMPLE_PARTITIONERS.get("dirichlet")(table, 3, seed=0, alpha=0.01, field="majority")
    assert _dealt(skewed) == list(range(90))
    for c in ("water", "moist", "dry"):  # Dir(0.01) puts nearly all of a class on one client
        shares = sorted(sum(majority[i] == c for i in held) for held in skewed.values())
        assert shares[-1] >= 27, shares
    with pytest.raises(ConfigError, match="partition_field 'season': no such metadata field"):
        table.class_of_each("dirichlet", "season")


def test_by_field_gives_whole_values_to_clients():
    country = ["AT"] * 5 + ["PT"] * 3 + ["FI"] * 2 + ["RS"] * 1
    by_field = SAMPLE_PARTITIONERS.get("by_field")
    one_each = by_field(_table(11, country=country), 4, field="country")
    held = {name: {country[i] for i in idx} for name, idx in one_each.items()}
    assert held == {"client00": {"AT"}, "client01": {"PT"}, "client02": {"FI"}, "client03": {"RS"}}
    # two clients: AT (5) to client00, PT (3) to client01, FI (2) to client01 (3 < 5), RS (1) to client00 (5 = 5)
    two = by_field(_table(11, country=country), 2, field="country")
    assert {name: sorted({country[i] for i in idx}) for name, idx in two.items()} == {
        "client00": ["AT", "RS"],
        "client01": ["FI", "PT"],
    }
    with pytest.raises(ConfigError, match=r"federation\.clients 5 exceeds the 4 values of 'country'"):
        by_field(_table(11, country=country), 5, field="country")
    with pytest.raises(ConfigError, match=r"needs federation\.partition_field"):
        by_field(_table(11, country=country), 2, field="season")


def test_where_keeps_the_matching_samples_and_their_indices():
    table = _table(6, [0, 1, 2, 0, 1, 2], season=["summer", "winter"] * 3, country=list("AABBCC"))
    summer, kept = table.where({"season": ["summer"]})
    assert kept.tolist() == [0, 2, 4] and summer.ids == ["s0", "s2", "s4"] and summer.labels.tolist() == [0, 2, 1]
    assert summer.metadata["country"] == ["A", "B", "C"]
    with pytest.raises(ConfigError, match=r"federation\.where\.month: no such metadata field"):
        table.where({"month": ["june"]})
    with pytest.raises(ConfigError, match="matches none of the 6 samples"):
        table.where({"season": ["spring"]})


def test_metadata_is_read_by_sample_id_and_a_missing_row_is_named(tmp_path):
    path = tmp_path / "meta.csv"
    path.write_text("sample,country,season\ns1,PT,summer\ns0,AT,winter\nother,FI,summer\n")
    assert read_metadata(path, ["s0", "s1"]) == {"country": ["AT", "PT"], "season": ["winter", "summer"]}
    with pytest.raises(ConfigError, match=r"no row for 1 of the split's 3 samples, e.g. \['s9'\]"):
        read_metadata(path, ["s0", "s1", "s9"])
    (tmp_path / "bad.csv").write_text("id,country\ns0,AT\n")
    with pytest.raises(ConfigError, match="has no 'sample' column"):
        read_metadata(tmp_path / "bad.csv", ["s0"])
    with pytest.raises(ConfigError, match="does not exist"):
        read_metadata(tmp_path / "none.csv", ["s0"])


def test_a_written_partition_names_every_clients_samples_and_label_counts(tmp_path):
    table = _table(4, [0, 1, 1, 2])
    assignment = {"client00": np.array([0, 2]), "client01": np.array([1, 3])}
    path = write_partition(tmp_path / "partition.json", assignment, table, partitioner="iid", seed=3)
    assert read_partition(path) == {"client00": ["s0", "s2"], "client01": ["s1", "s3"]}
    record = json.loads(path.read_text())
    assert record["seed"] == 3 and record["clients"]["client01"]["label_counts"] == {"1": 1, "2": 1}
