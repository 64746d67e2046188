"""Checkpoint loading, layout conversion and backbone export."""
