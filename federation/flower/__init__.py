"""Flower: the adapter (ServerApp and ClientApp of any registered program), its Flower App, and the simulation engine."""
