"""Splitting the imagery files of the configured sources among federated clients.

Every strategy gives each file of a private source to exactly one client, never hands out the
files of the server's public sources, and is deterministic given its inputs and seed:

* :func:`partition_by_source`: each private source (a sensor's or an institution's archive) is
  one client. The number of clients must equal the number of private sources; anything else is
  an error, since splitting or merging archives is what the other strategies are for.
* :func:`partition_by_region`: files are grouped into spatially coherent regions by K-means
  (scikit-learn, seeded) on their footprint centres, taken as points on the unit sphere so
  that distances do not break at the antimeridian or shrink towards the poles.
* :func:`partition_dirichlet`: each source's files are dealt to clients in proportions drawn from
  ``Dirichlet(alpha)``; a small ``alpha`` gives each client a few dominant sources (non-IID).

The strategies are registered in :data:`PARTITIONERS` (a config's ``federation.partition`` names
one) as functions of one signature, :data:`Partitioner`, giving one client its share; a
plug-in adds another through the ``geofm.partitioners`` entry-point group.

A client left without any file cannot train: every strategy raises
:class:`~geofm.errors.ConfigError` naming the empty clients rather than returning them. The
Dirichlet split first redraws its proportions (up to ``max_draws`` times, as is usual for this
benchmark protocol) before giving up.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np

from geofm.errors import ConfigError
from geofm.registry import Registry

Bounds = tuple[float, float, float, float]
"""A footprint ``(west, south, east, north)`` in degrees (EPSG:4326)."""


class ClientFile(NamedTuple):
    """One file given to a client: its source's index, its index in that source, and its path."""

    source: int
    file: int
    path: Path


def _private(sources: Sequence[Sequence[str | Path]], public: Collection[int]) -> list[int]:
    """Indices of the sources that may be given to clients."""
    unknown = sorted(i for i in public if not 0 <= i < len(sources))
    if unknown:
        raise ConfigError(f"public source indices {unknown} are out of range for {len(sources)} sources")
    private = [i for i in range(len(sources)) if i not in public]
    if not private:
        raise ConfigError("every source is public: no imagery is left for the clients")
    return private


def _check_clients(num_clients: int) -> None:
    if num_clients < 1:
        raise ConfigError(f"num_clients must be positive, got {num_clients}")


def _empty(clients: list[list[ClientFile]]) -> list[int]:
    return [i for i, files in enumerate(clients) if not files]


def _files(sources: Sequence[Sequence[str | Path]], private: list[int]) -> list[ClientFile]:
    return [ClientFile(s, f, Path(path)) for s in private for f, path in enumerate(sources[s])]


def _one_client_per_source(
    sources: Sequence[Sequence[str | Path]], num_clients: int, public: Collection[int]
) -> list[int]:
    """The private sources, one per client; ConfigError if their count is not ``num_clients``."""
    _check_clients(num_clients)
    private = _private(sources, public)
    if num_clients != len(private):
        raise ConfigError(
            f"partition by source makes one client per private source: {len(private)} private sources "
            f"(of {len(sources)}, public {sorted(public)}) cannot make {num_clients} clients; "
            "use the region or Dirichlet partition to split or merge sources"
        )
    return private


def partition_by_source(
    sources: Sequence[Sequence[str | Path]], num_clients: int, public: Collection[int] = ()
) -> list[list[ClientFile]]:
    """One client per private source, in source order.

    Args:
        sources: each source's file paths.
        num_clients: must equal the number of private sources.
        public: indices of the server's public sources, given to no client.

    Returns:
        Each client's files.

    Raises:
        ConfigError: if ``num_clients`` differs from the number of private sources, a public index
            is out of range, or a private source has no file.
    """
    private = _one_client_per_source(sources, num_clients, public)
    clients = [_files(sources, [s]) for s in private]
    if empty := _empty(clients):
        raise ConfigError(f"sources {[private[i] for i in empty]} have no file, so their clients would be empty")
    return clients


def _centre_on_sphere(bounds: Bounds) -> tuple[float, float, float]:
    """Unit vector of a footprint's centre; a footprint with west > east crosses the antimeridian."""
    west, south, east, north = bounds
    if west > east:
        east += 360.0
    lon, lat = math.radians((west + east) / 2), math.radians((south + north) / 2)
    return math.cos(lat) * math.cos(lon), math.cos(lat) * math.sin(lon), math.sin(lat)


def partition_by_region(
    sources: Sequence[Sequence[str | Path]],
    num_clients: int,
    seed: int = 0,
    public: Collection[int] = (),
    bounds: Sequence[Sequence[Bounds]] | None = None,
) -> list[list[ClientFile]]:
    """Spatially coherent clients: K-means of the files' footprint centres into ``num_clients`` regions.

    Args:
        sources: each source's file paths.
        num_clients: number of regions (clients).
        seed: seed of K-means.
        public: indices of the server's public sources, given to no client.
        bounds: each file's footprint in EPSG:4326, parallel to ``sources`` (public sources may be
            empty lists); None reads them from the files' georeferencing.

    Returns:
        Each client's files; clients are numbered in the order their first file appears.

    Raises:
        ConfigError: if there are fewer distinct file locations than clients, so a region would
            be empty, or a public index is out of range.
        RasterReadError: if ``bounds`` is None and a file cannot be read or is not georeferenced.
    """
    from sklearn.cluster import KMeans  # config validation reads the registry here without scikit-learn

    from geofm.data.readers import read_bounds_lonlat

    _check_clients(num_clients)
    private = _private(sources, public)
    files = _files(sources, private)
    if bounds is None:
        footprints = [read_bounds_lonlat(f.path) for f in files]
    else:
        footprints = [bounds[f.source][f.file] for f in files]
    points = np.array([_centre_on_sphere(b) for b in footprints], dtype=np.float64).reshape(-1, 3)
    distinct = len(np.unique(points.round(12), axis=0))
    if distinct < num_clients:
        raise ConfigError(
            f"{len(files)} files at {distinct} distinct locations cannot form {num_clients} non-empty regions"
        )
    labels = KMeans(n_clusters=num_clients, n_init=10, random_state=seed).fit_predict(points)
    renumber: dict[int, int] = {}
    clients: list[list[ClientFile]] = [[] for _ in range(num_clients)]
    for f, label in zip(files, labels.tolist(), strict=True):
        clients[renumber.setdefault(label, len(renumber))].append(f)
    if empty := _empty(clients):
        raise ConfigError(f"regions {empty} of {num_clients} received no file; try fewer clients or another seed")
    return clients


def partition_dirichlet(
    sources: Sequence[Sequence[str | Path]],
    num_clients: int,
    alpha: float,
    seed: int = 0,
    public: Collection[int] = (),
    max_draws: int = 100,
) -> list[list[ClientFile]]:
    """Deal each private source's files among clients in ``Dirichlet(alpha)`` proportions.

    For each source (in order) the proportions are drawn from a symmetric Dirichlet over the
    clients and its shuffled files are cut accordingly (rounded to whole files). If a client ends
    up with no file, all proportions are redrawn from the same random stream.

    Args:
        sources: each source's file paths.
        num_clients: number of clients.
        alpha: concentration; small values (0.1) are highly non-IID, large ones (100) near IID.
        seed: seed of the draws and shuffles.
        public: indices of the server's public sources, given to no client.
        max_draws: how many times to draw before giving up on leaving no client empty.

    Returns:
        Each client's files, sorted by source and file index.

    Raises:
        ConfigError: if ``alpha`` is not positive, a public index is out of range, or some client
            is still empty after ``max_draws`` draws.
    """
    _check_clients(num_clients)
    if alpha <= 0:
        raise ConfigError(f"Dirichlet alpha must be positive, got {alpha}")
    private = _private(sources, public)
    rng = np.random.default_rng(seed)
    for _ in range(max_draws):
        clients: list[list[ClientFile]] = [[] for _ in range(num_clients)]
        for s in private:
            order = rng.permutation(len(sources[s]))
            cuts = np.floor(np.cumsum(rng.dirichlet([alpha] * num_clients))[:-1] * len(order) + 0.5).astype(int)
            for client, part in enumerate(np.split(order, cuts)):
                clients[client] += [ClientFile(s, int(f), Path(sources[s][f])) for f in part]
        empty = _empty(clients)
        if not empty:
            return [sorted(files) for files in clients]
    raise ConfigError(
        f"Dirichlet(alpha={alpha}) partition of {sum(len(sources[s]) for s in private)} files among "
        f"{num_clients} clients left clients {empty} empty in {max_draws} draws; "
        "raise alpha, add files or use fewer clients"
    )


Partitioner = Callable[..., list[ClientFile]]
"""``partitioner(sources, num_clients, client, *, seed, public, alpha) -> client's files``.

``sources`` holds each source's file paths and may list a source only when it is indexed, so a
strategy that needs one client's own source (``by_source``) reads no other institution's folder.
"""


def share_by_source(
    sources: Sequence[Sequence[str | Path]],
    num_clients: int,
    client: int,
    *,
    seed: int = 0,
    public: Collection[int] = (),
    alpha: float = 1.0,
) -> list[ClientFile]:
    """One client per private source (:func:`partition_by_source`): client ``client``'s share, reading only its source."""
    private = _one_client_per_source(sources, num_clients, public)
    files = _files(sources, [private[client]])
    if not files:
        raise ConfigError(f"source {private[client]} has no file, so its client would be empty")
    return files


def share_by_region(
    sources: Sequence[Sequence[str | Path]],
    num_clients: int,
    client: int,
    *,
    seed: int = 0,
    public: Collection[int] = (),
    alpha: float = 1.0,
) -> list[ClientFile]:
    """Spatially coherent clients, regions of the files' footprints (:func:`partition_by_region`): client ``client``'s share."""
    return partition_by_region(sources, num_clients, seed=seed, public=public)[client]


def share_dirichlet(
    sources: Sequence[Sequence[str | Path]],
    num_clients: int,
    client: int,
    *,
    seed: int = 0,
    public: Collection[int] = (),
    alpha: float = 1.0,
) -> list[ClientFile]:
    """Each private source's files dealt in ``Dirichlet(alpha)`` proportions (:func:`partition_dirichlet`): client ``client``'s share."""
    return partition_dirichlet(sources, num_clients, alpha, seed=seed, public=public)[client]


PARTITIONERS: Registry[Partitioner] = Registry("partitioner", "geofm.partitioners")
"""How federated pretraining splits the sources' files among clients (``federation.partition``)."""
PARTITIONERS.register("by_source", share_by_source)
PARTITIONERS.register("by_region", share_by_region)
PARTITIONERS.register("dirichlet", share_dirichlet)
