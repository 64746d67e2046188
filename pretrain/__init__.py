"""Pretraining programs: central continual pretraining on the DeepSpeed engine."""
