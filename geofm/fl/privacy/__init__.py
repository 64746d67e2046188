"""Differential privacy: client-level of federated rounds (:mod:`.client_level`) and example-level
DP-SGD of a client's one-shot upload (:mod:`.dpsgd`)."""
