"""Backbones, masked image modelling and the frozen teacher."""
