"""Names of the files a finetuning run directory holds that the command line names before it loads torch."""

from __future__ import annotations

ONNX_FILE = "model.onnx"
"""Where ``geofm export onnx --model RUN`` writes by default, and ``geofm predict --engine onnx`` reads: ``RUN/model.onnx``."""

__all__ = ["ONNX_FILE"]
