"""Federated learning in plain PyTorch, for any federated runtime to call, in subpackages by job.

* :mod:`~geofm.fl.parameter_vectors`: :class:`~geofm.fl.parameter_vectors.ParameterLayout`,
  a module's trainable parameters as one float32 vector and back.
* :mod:`~geofm.fl.communication`: what travels and how: the update codecs and their wire
  format, the client's error-feedback uplink, the server's uploads spilled to disk.
* :mod:`~geofm.fl.aggregation`: the server's side of a round: screening and averaging of
  uploads, robust aggregators, server optimisers, client clustering and similarity distillation.
* :mod:`~geofm.fl.privacy`: client-level differential privacy of rounds and DP-SGD of
  one-shot uploads.
* :mod:`~geofm.fl.local`: the client's perturbed local steps (server-to-client guidance,
  FedProx's term, SAM and ASAM).
* :mod:`~geofm.fl.partitions`: which client holds which pretraining file or finetuning sample.
* :mod:`~geofm.fl.oneshot`: the one-shot programs' halves (FedDiff, OSCAR, ensemble
  distillation) and their synthetic split.
* :mod:`~geofm.fl.algorithms`: the algorithm interface and the registered algorithms
  (``geofm list algorithms``), with the local optimiser each one assumes.
* :mod:`~geofm.fl.landscape`: a model's flatness, its mean loss increase under random
  perturbations of a fixed norm.
* :mod:`~geofm.fl.comparison`: federated runs side by side, scores and costs.

Each imports only those listed before it, and they form no import cycle (``tests/test_layering.py``);
reading a registry (as config validation does) loads no deep-learning package.
"""
