"""K-means of client models into groups, on a count sketch of their parameters.

Clustering tens of millions of dimensions directly is too heavy, so each client vector ``x`` is
first mapped to a ``sketch_dim``-dimensional count sketch ``Sx``: every coordinate ``i`` is added
with a random sign ``s(i)`` to a random bucket ``h(i)`` (feature hashing; the sparse
Johnson-Lindenstrauss transform with one non-zero per column). The map is linear, so
``||Sx - Sy|| = ||S(x - y)||``, and ``E ||Sz||^2 = ||z||^2`` with a relative standard deviation of
at most ``sqrt(2 / sketch_dim)`` (about 2 % at the default 4096): pairwise distances, which are
all K-means looks at, are preserved closely enough to separate client groups. It costs one pass
over each vector and ``O(sketch_dim)`` memory, where a dense Gaussian projection would need a
``n x sketch_dim`` matrix. The hash and signs are drawn from a seeded generator chunk by chunk,
so the same seed sketches every vector the same way.

Because the map is linear and K-means only sees distances, clustering client models
``Theta + delta`` or their updates ``delta`` of one round gives the same groups.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from sklearn.cluster import KMeans
from torch import Tensor

from geofm.errors import ConfigError, LayoutMismatchError
from geofm.fl.aggregation.uploads import weighted_mean

_CHUNK = 1 << 20


def count_sketch(vectors: Sequence[Tensor], sketch_dim: int = 4096, seed: int = 0) -> Tensor:
    """Count sketches of equally long vectors (see the module docstring).

    Each vector is sketched on its own, with the same hash and signs, so the vectors may be decoded
    one at a time as they are taken (:class:`~geofm.fl.aggregation.uploads.Decoded`).

    Args:
        vectors: 1-D float tensors of one length, on one device.
        sketch_dim: number of buckets of the sketch.
        seed: seed of the hash and the signs; the same seed gives the same map.

    Returns:
        A float64 CPU tensor of shape (len(vectors), sketch_dim).

    Raises:
        LayoutMismatchError: if the vectors differ in shape or are not 1-D.
    """
    if sketch_dim < 1:
        raise ConfigError(f"sketch_dim must be positive, got {sketch_dim}")
    sketches: list[Tensor] = []
    first: tuple[int, ...] | None = None
    for vector in vectors:  # each taken once: a lazily decoded sequence holds one at a time
        first = first or (vector.numel(),)
        if tuple(vector.shape) != first:
            raise LayoutMismatchError(
                f"expected 1-D vectors of one length to sketch, got shapes {first} and {tuple(vector.shape)}"
            )
        sketches.append(_sketch(vector, sketch_dim, seed))
    if not sketches:
        raise LayoutMismatchError("expected 1-D vectors of one length to sketch, got none")
    return torch.stack(sketches)


def _sketch(vector: Tensor, sketch_dim: int, seed: int) -> Tensor:
    """One vector's count sketch."""
    n, device = vector.numel(), vector.device
    generator = torch.Generator().manual_seed(seed)
    # Bucket b < sketch_dim adds with sign +1, bucket sketch_dim + b with sign -1. Each chunk is
    # summed in float32 (a bucket gets about chunk / sketch_dim values from it) and the chunks'
    # sums in float64: a tenth of the time of summing in float64 throughout, just as exact.
    signed = torch.zeros(2 * sketch_dim, dtype=torch.float64, device=device)
    part = torch.empty(2 * sketch_dim, dtype=torch.float32, device=device)
    for start in range(0, n, _CHUNK):
        stop = min(start + _CHUNK, n)
        index = torch.randint(0, 2 * sketch_dim, (stop - start,), generator=generator).to(device)
        part.zero_().index_add_(0, index, vector[start:stop].to(torch.float32))
        signed += part
    return (signed[:sketch_dim] - signed[sketch_dim:]).cpu()


@dataclass(frozen=True, eq=False)
class Clustering:
    """Groups of clients and their models.

    Attributes:
        assignment: the group of each client, in client order; groups are numbered by their
            first client, so client 0 is in group 0.
        members: the clients of each group.
        models: each group's data-weighted mean of its members' vectors (float32).
        weights: each group's share of all clients' examples (sums to 1).
    """

    assignment: list[int]
    members: list[list[int]]
    models: list[Tensor]
    weights: list[float]


def cluster_clients(
    vectors: Sequence[Tensor],
    num_examples: Sequence[int],
    num_groups: int,
    *,
    sketch_dim: int = 4096,
    seed: int = 0,
) -> Clustering:
    """Group clients by K-means (scikit-learn, seeded) on count sketches of their vectors.

    The vectors are taken one at a time: once for the sketches and once more for the group means,
    which are running sums, so a lazily decoded sequence (:class:`~geofm.fl.aggregation.uploads.Decoded`)
    keeps the memory at the ``num_groups`` group models whatever the number of clients. With
    ``num_groups`` at least the number of clients there is no clustering: each client is
    its own group (and its vector a group model). K-means may find fewer groups than asked when clients coincide; empty groups
    are dropped.

    Args:
        vectors: each client's model (or update) as a 1-D float tensor.
        num_examples: each client's number of training examples (its weight).
        num_groups: K, the number of groups asked for.
        sketch_dim: dimension of the sketch clustered.
        seed: seed of the sketch and of K-means.

    Returns:
        The assignment, members, group models and group weights.

    Raises:
        ConfigError: if ``num_groups`` is not positive.
        ValueError: if there are no clients, the counts differ, or an example count is not positive.
    """
    if num_groups < 1:
        raise ConfigError(f"num_groups must be positive, got {num_groups}")
    if not vectors or len(vectors) != len(num_examples):
        raise ValueError(f"expected one example count per client vector, got {len(vectors)} and {len(num_examples)}")
    if any(count <= 0 for count in num_examples):
        raise ValueError(f"every client needs a positive example count, got {list(num_examples)}")
    if num_groups >= len(vectors):
        labels = list(range(len(vectors)))
    else:
        sketch = count_sketch(vectors, sketch_dim, seed).numpy()
        labels = KMeans(n_clusters=num_groups, n_init=10, random_state=seed).fit_predict(sketch).tolist()
    renumber: dict[int, int] = {}
    assignment = [renumber.setdefault(label, len(renumber)) for label in labels]
    members = [[client for client, group in enumerate(assignment) if group == g] for g in range(len(renumber))]
    total = float(sum(num_examples))
    return Clustering(
        assignment=assignment,
        members=members,
        models=[weighted_mean((vectors[c] for c in group), [num_examples[c] for c in group]) for group in members],
        weights=[sum(num_examples[c] for c in group) / total for group in members],
    )
