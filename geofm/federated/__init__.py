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
* :mod:`~geofm.federated.spill`: a round's uploads stored on disk as they arrive
  (:class:`UploadStore`) and the decoded updates of the rules that need all of them at once
  (:class:`SpilledUpdates`), so that the server's memory stays flat in its clients.
* :mod:`~geofm.federated.server_optimizers`: how the combined update moves the global model (FedAvgM,
  FedAdam, FedYogi), by name.
* :mod:`~geofm.federated.clustering`: :func:`cluster_clients`, K-means of client models on a
  :func:`count_sketch`.
* :mod:`~geofm.federated.similarity`: server similarity distillation on public images
  (:func:`distill_similarity`).
* :mod:`~geofm.federated.partition`: splitting the sources' files among clients by source, by
  region or by Dirichlet proportions.
* :mod:`~geofm.federated.flatness`: :func:`~geofm.federated.flatness.flatness`, a model's mean loss increase
  under random perturbations of a fixed norm.
* :mod:`~geofm.federated.feddiff`: FedDiff's one-shot halves: a client's class-conditional diffusion model
  and statistics (:func:`train_client`), the server's resumable sampling (:func:`generate`) and Fourier
  magnitude filtering (:mod:`~geofm.federated.fmf`), with DP-SGD and its composed budget
  (:mod:`~geofm.federated.dpsgd`).
* :mod:`~geofm.federated.oscar`: OSCAR's one-shot halves: a client's per-class mean encoder embeddings
  (:func:`~geofm.federated.oscar.class_embeddings`), the server's diffusion model guided by them
  (:func:`~geofm.federated.oscar.server_model`, :func:`~geofm.federated.oscar.generate`).
* :mod:`~geofm.federated.synthetic`: the one-shot programs' resumable synthetic classification split.
* :mod:`~geofm.federated.ensemble`: one-shot ensemble distillation: the clients' averaged soft labels on
  public images and the student's KL loss at temperature (:func:`~geofm.federated.ensemble.distill`).
* :mod:`~geofm.federated.algorithms`: the algorithm interface and the registered algorithms
  (``geofm list algorithms``).

The names below are imported on first use, so that reading a registry of this package (as config
validation does) loads no deep-learning package.
"""

from __future__ import annotations

import importlib
from typing import Any

_MODULES = {
    "aggregation": (
        "Accepted",
        "ClientUpload",
        "Decoded",
        "Rejection",
        "RoundAggregate",
        "Upload",
        "UploadRules",
        "aggregate_payloads",
        "aggregate_uploads",
        "screen_uploads",
        "weighted_mean",
    ),
    "clustering": ("Clustering", "cluster_clients", "count_sketch"),
    "codec": ("BITS", "Codec", "Packet", "decode"),
    "feedback": ("ErrorFeedback", "FeedbackState", "UplinkReport"),
    "flat": ("ParameterLayout",),
    "partition": ("ClientFile", "partition_by_region", "partition_by_source", "partition_dirichlet"),
    "perturbation": ("Perturbation", "drift_norm", "perturbed", "proximal_term"),
    "similarity": ("consensus_similarity", "distill_similarity", "similarity_loss", "similarity_matrix"),
    "spill": ("SpilledUpdates", "StoredArrays", "UploadStore", "clear_spill"),
}
_HOME = {name: module for module, names in _MODULES.items() for name in names}


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
    globals()[name] = value
    return value


__all__ = list(_HOME)
