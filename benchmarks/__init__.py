"""The geofm benchmark suite: ``geofm bench NAME`` (see :mod:`benchmarks.cli`)."""
