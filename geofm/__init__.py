"""geofm: geospatial foundation models, pretrained centrally or federated, finetuned and published."""

__version__ = "0.1.0"
