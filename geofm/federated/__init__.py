"""FedSense mathematics in plain PyTorch, for any federated runtime to call.

* :mod:`~geofm.federated.flat`: :class:`ParameterLayout`, a module's trainable parameters as one
  float32 vector and back.
* :mod:`~geofm.federated.codec`: :class:`Codec` quantises an update to 1-8 bits (or 32, raw) and
  packs it into a :class:`Packet`, the wire format; :func:`decode` reverses it.
* :mod:`~geofm.federated.feedback`: :class:`ErrorFeedback` does the client's whole uplink
  (residual, quantisation, residual update, resets) on a serialisable :class:`FeedbackState`.
* :mod:`~geofm.federated.perturbation`: :func:`perturbed` local steps of server-to-client
  guidance, and FedProx's :func:`proximal_term`.
* :mod:`~geofm.federated.aggregation`: screening of uploads (:class:`UploadRules`) and
  data-weighted averaging (:func:`aggregate_uploads`).
* :mod:`~geofm.federated.robust`: aggregators beyond the mean (median, trimmed mean, Krum), by name.
* :mod:`~geofm.federated.server_optimizers`: how the combined update moves the global model (FedAvgM,
  FedAdam, FedYogi), by name.
* :mod:`~geofm.federated.clustering`: :func:`cluster_clients`, K-means of client models on a
  :func:`count_sketch`.
* :mod:`~geofm.federated.similarity`: server similarity distillation on public images
  (:func:`distill_similarity`).
* :mod:`~geofm.federated.partition`: splitting the sources' files among clients by source, by
  region or by Dirichlet proportions.
"""

from geofm.federated.aggregation import (
    Accepted,
    Rejection,
    RoundAggregate,
    Upload,
    UploadRules,
    aggregate_uploads,
    screen_uploads,
    weighted_mean,
)
from geofm.federated.clustering import Clustering, cluster_clients, count_sketch
from geofm.federated.codec import BITS, Codec, Packet, decode
from geofm.federated.feedback import ErrorFeedback, FeedbackState, UplinkReport
from geofm.federated.flat import ParameterLayout
from geofm.federated.partition import ClientFile, partition_by_region, partition_by_source, partition_dirichlet
from geofm.federated.perturbation import Perturbation, drift_norm, perturbed, proximal_term
from geofm.federated.similarity import (
    consensus_similarity,
    distill_similarity,
    similarity_loss,
    similarity_matrix,
)

__all__ = [
    "BITS",
    "Accepted",
    "ClientFile",
    "Clustering",
    "Codec",
    "ErrorFeedback",
    "FeedbackState",
    "Packet",
    "ParameterLayout",
    "Perturbation",
    "Rejection",
    "RoundAggregate",
    "UplinkReport",
    "Upload",
    "UploadRules",
    "aggregate_uploads",
    "cluster_clients",
    "consensus_similarity",
    "count_sketch",
    "decode",
    "distill_similarity",
    "drift_norm",
    "partition_by_region",
    "partition_by_source",
    "partition_dirichlet",
    "perturbed",
    "proximal_term",
    "screen_uploads",
    "similarity_loss",
    "similarity_matrix",
    "weighted_mean",
]
