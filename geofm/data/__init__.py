"""Imagery readers, band and normalisation specs, the multi-source pretraining pile."""
