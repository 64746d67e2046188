"""geofm: geospatial foundation models, pretrained centrally or federated, finetuned and published."""

__version__ = "0.1.0"

PROJECT_LOGGERS = ("geofm", "pretrain", "finetune", "benchmarks")
"""Logger names of this project's packages: their INFO lines are a run's log, other libraries' are not."""
