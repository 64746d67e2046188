"""Finetuning heads and programs (classification, segmentation, change detection, super-resolution)."""
