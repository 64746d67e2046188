"""Federated pretraining: a runtime contract for federated programs and its Flower adapter."""
