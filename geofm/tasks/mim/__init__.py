"""Masked image modelling (GFM, SimMIM): the task, the masked image model, GFM's loss and frozen
teacher, the masks and the reconstruction figure."""
