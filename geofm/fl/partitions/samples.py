"""Decentralisation scenarios: which client holds which sample of a labelled dataset (federated finetuning).

:mod:`geofm.fl.partitions.files` deals pretraining *files* of sources among clients; here the
*samples* of a finetuning split are dealt, from their labels. A partitioner of
:data:`SAMPLE_PARTITIONERS` takes a :class:`SampleTable` and returns each client's sample indices;
the same table, client count and seed give the same partition in every process, so every
simulated client computes its own share alike.

Built in: ``iid`` (shuffled, dealt evenly), ``dirichlet`` (per class, client proportions drawn
from Dir(alpha): Hsu, Qi and Brown, "Measuring the effects of non-identical data distribution for
federated visual classification", 2019) and ``by_field`` (whole values of a metadata field per
client: a country, a season, a sensor). Per-sample metadata comes from a CSV file
(:func:`read_metadata`); :meth:`SampleTable.where` keeps the samples whose fields match before any
partitioner deals them (BigEarthNet's DS1 is ``where: {season: [summer]}`` dealt ``iid``, DS2 the
same dealt ``by_field`` country, DS3 all seasons ``by_field`` country).
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from geofm.config.fedfinetune import client_names
from geofm.errors import ConfigError
from geofm.registry import Registry

PARTITION_FILE = "partition.json"
SamplePartitioner = Callable[..., dict[str, np.ndarray]]
SAMPLE_PARTITIONERS: Registry[SamplePartitioner] = Registry("sample partitioner", "geofm.sample_partitioners")
"""How federated finetuning splits a dataset's samples among clients (``federation.partition``)."""


@dataclass(frozen=True)
class SampleTable:
    """The samples of a split as partitioners see them.

    Attributes:
        ids: a stable name per sample (its file), for the written partition.
        labels: class ids (N,), a multi-hot array (N, C), or None where labels are not cheaply known.
        metadata: per-sample fields (country, season, sensor, ...), each a list of N strings.
    """

    ids: list[str]
    labels: np.ndarray | None = None
    metadata: dict[str, list[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.ids)
        if self.labels is not None and len(self.labels) != n:
            raise ValueError(f"{len(self.labels)} labels for {n} samples")
        for name, values in self.metadata.items():
            if len(values) != n:
                raise ValueError(f"metadata field {name!r}: {len(values)} values for {n} samples")

    def __len__(self) -> int:
        return len(self.ids)

    def where(self, accepted: Mapping[str, list[str]]) -> tuple[SampleTable, np.ndarray]:
        """The samples whose every field in ``accepted`` has one of its listed values, and their
        indices in this table.

        Raises:
            ConfigError: a field the metadata lacks, or no sample left.
        """
        keep = np.ones(len(self), dtype=bool)
        for name, values in accepted.items():
            if name not in self.metadata:
                raise ConfigError(f"federation.where.{name}: no such metadata field; fields: {sorted(self.metadata)}")
            keep &= np.isin(np.asarray(self.metadata[name], dtype=object), list(map(str, values)))
        kept = np.flatnonzero(keep)
        if not len(kept):
            raise ConfigError(f"federation.where {dict(accepted)} matches none of the {len(self)} samples")
        labels = None if self.labels is None else np.asarray(self.labels)[kept]
        metadata = {name: [values[i] for i in kept] for name, values in self.metadata.items()}
        return SampleTable([self.ids[i] for i in kept], labels, metadata), kept

    def class_of_each(self, partitioner: str, field: str | None = None) -> np.ndarray:
        """One class id per sample: the index of its value of the metadata ``field`` when one is
        named (a segmentation chip's majority class, say), else its label, or for multi-hot labels
        its rarest positive class (the class that decides which client a sample can go to under
        label skew; a sample without any positive class counts as its own class -1).

        Raises:
            ConfigError: a ``field`` the metadata lacks, or no field and no labels.
        """
        if field is not None:
            if field not in self.metadata:
                raise ConfigError(
                    f"federation.partition_field {field!r}: no such metadata field; fields: {sorted(self.metadata)}"
                )
            return np.unique(np.asarray(self.metadata[field], dtype=str), return_inverse=True)[1].astype(np.int64)
        if self.labels is None:
            raise ConfigError(
                f"federation.partition {partitioner!r} deals samples by label, but this dataset's "
                "labels are not known without reading every sample (use iid, or name a metadata field "
                "holding each sample's class as federation.partition_field)"
            )
        labels = np.asarray(self.labels)
        if labels.ndim == 1:
            return labels.astype(np.int64)
        counts = labels.sum(axis=0)
        rarity = np.where(labels > 0, counts[None, :], np.inf)
        return np.where(labels.any(axis=1), rarity.argmin(axis=1), -1).astype(np.int64)


def _checked(partitioner: str, assignment: dict[str, list[int] | np.ndarray]) -> dict[str, np.ndarray]:
    empty = [name for name, indices in assignment.items() if not len(indices)]
    if empty:
        raise ConfigError(
            f"federation.partition {partitioner!r} left clients {empty} without a sample; use fewer clients, "
            "a larger alpha or another seed"
        )
    return {name: np.sort(np.asarray(indices, dtype=np.int64)) for name, indices in assignment.items()}


def _count(partitioner: str, table: SampleTable, clients: int | None) -> int:
    if clients is None or clients < 1:
        raise ConfigError(f"federation.partition {partitioner!r} needs federation.clients (a positive count)")
    if clients > len(table):
        raise ConfigError(f"federation.clients {clients} exceeds the {len(table)} samples of the split")
    return clients


@SAMPLE_PARTITIONERS.register("iid")
def partition_iid(table: SampleTable, clients: int | None, *, seed: int, **_: Any) -> dict[str, np.ndarray]:
    """The samples shuffled and dealt evenly (sizes differ by at most one)."""
    count = _count("iid", table, clients)
    order = np.random.default_rng(seed).permutation(len(table))
    return _checked("iid", dict(zip(client_names(count), np.array_split(order, count), strict=True)))


@SAMPLE_PARTITIONERS.register("dirichlet")
def partition_dirichlet_labels(
    table: SampleTable,
    clients: int | None,
    *,
    seed: int,
    alpha: float = 0.5,
    field: str | None = None,
    max_draws: int = 100,
    **_: Any,
) -> dict[str, np.ndarray]:
    """Label skew: each class's samples dealt to clients in proportions p ~ Dir(alpha) (Hsu et al. 2019).

    A sample's class is its label, or its value of the metadata ``field`` where one is named (for
    tasks whose samples have no single label, such as a segmentation chip's majority class). Small
    ``alpha`` gives each client few classes; large ``alpha`` approaches ``iid``. Draws are
    repeated (up to ``max_draws``, from the same seeded stream) until every client holds a sample.
    """
    count = _count("dirichlet", table, clients)
    classes = table.class_of_each("dirichlet", field)
    rng = np.random.default_rng(seed)
    for _draw in range(max_draws):
        assignment: list[list[int]] = [[] for _ in range(count)]
        for label in np.unique(classes):
            members = rng.permutation(np.flatnonzero(classes == label))
            shares = rng.dirichlet(np.full(count, alpha))
            cuts = (np.cumsum(shares)[:-1] * len(members)).round().astype(int)
            for client, part in enumerate(np.split(members, cuts)):
                assignment[client] += part.tolist()
        if all(assignment):
            return _checked("dirichlet", dict(zip(client_names(count), assignment, strict=True)))
    raise ConfigError(
        f"federation.partition 'dirichlet' (alpha {alpha}) left a client without samples in {max_draws} draws; "
        "use fewer clients or a larger federation.dirichlet_alpha"
    )


@SAMPLE_PARTITIONERS.register("by_field")
def partition_by_field(
    table: SampleTable, clients: int | None, *, field: str | None = None, **_: Any
) -> dict[str, np.ndarray]:
    """Whole values of the metadata ``field`` per client: one value each when ``clients`` equals the
    number of values, else the values from the most to the fewest samples, each to the client that
    holds the fewest samples so far (so a client may hold several values, never part of one).

    Raises:
        ConfigError: no ``field``, a field the metadata lacks, or more clients than values.
    """
    count = _count("by_field", table, clients)
    if not field or field not in table.metadata:
        raise ConfigError(
            f"federation.partition 'by_field' needs federation.partition_field, one of the metadata fields "
            f"{sorted(table.metadata)} (from federation.metadata)"
        )
    values = np.asarray(table.metadata[field], dtype=object)
    names, sizes = np.unique(values, return_counts=True)
    if count > len(names):
        raise ConfigError(
            f"federation.clients {count} exceeds the {len(names)} values of {field!r} ({', '.join(map(str, names))}); "
            "by_field gives each value to one client"
        )
    assignment: list[list[int]] = [[] for _ in range(count)]
    for name in names[np.argsort(-sizes, kind="stable")]:
        smallest = min(range(count), key=lambda c: (len(assignment[c]), c))
        assignment[smallest] += np.flatnonzero(values == name).tolist()
    return _checked("by_field", dict(zip(client_names(count), assignment, strict=True)))


def read_metadata(path: Path, ids: list[str]) -> dict[str, list[str]]:
    """Per-sample fields from a CSV file with a ``sample`` column naming each sample as its table id
    (a folder dataset's first file relative to its split folder, e.g. ``forest/3.tif``; a torchgeo
    dataset's index in its split) and one column per field; rows of other samples are ignored.

    Raises:
        ConfigError: the file is missing or has no ``sample`` column, or a sample has no row (named).
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"federation.metadata: {path} does not exist (expected a CSV file with a 'sample' column)")
    with path.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    fields = [name for name in (rows[0] if rows else {}) if name != "sample"]
    if not rows or "sample" not in rows[0]:
        raise ConfigError(f"federation.metadata: {path} has no 'sample' column (its header names the fields)")
    by_sample = {row["sample"]: row for row in rows}
    missing = [i for i in ids if i not in by_sample]
    if missing:
        raise ConfigError(
            f"federation.metadata: {path} has no row for {len(missing)} of the split's {len(ids)} samples, "
            f"e.g. {missing[:3]}"
        )
    return {name: [str(by_sample[i][name]) for i in ids] for name in fields}


def label_counts(table: SampleTable, indices: np.ndarray) -> dict[str, int]:
    """How many of ``indices`` carry each class (multi-hot: each positive class counts)."""
    if table.labels is None:
        return {}
    labels = np.asarray(table.labels)[indices]
    if labels.ndim == 1:
        values, counts = np.unique(labels, return_counts=True)
        return {str(v): int(c) for v, c in zip(values, counts, strict=True)}
    return {str(c): int(n) for c, n in enumerate(labels.sum(axis=0)) if n}


def write_partition(
    path: Path, assignment: Mapping[str, np.ndarray], table: SampleTable, *, partitioner: str, seed: int, **options
) -> Path:
    """Write which client holds which sample (with the partitioner, its options, the seed and each
    client's label counts) to ``path`` as JSON, atomically."""
    record = {
        "partitioner": partitioner,
        "options": options,
        "seed": seed,
        "clients": {
            name: {"samples": [table.ids[i] for i in indices], "label_counts": label_counts(table, indices)}
            for name, indices in assignment.items()
        },
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(partial, path)
    return path


def read_partition(path: Path) -> dict[str, list[str]]:
    """Client -> sample ids of a written partition."""
    return {name: client["samples"] for name, client in json.loads(Path(path).read_text())["clients"].items()}


__all__ = [
    "PARTITION_FILE",
    "SAMPLE_PARTITIONERS",
    "SampleTable",
    "label_counts",
    "partition_by_field",
    "partition_dirichlet_labels",
    "partition_iid",
    "read_metadata",
    "read_partition",
    "write_partition",
]
