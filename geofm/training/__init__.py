"""The run framework every program stands on: the engine and its step arithmetic, the training loop,
step boundaries, the central programs' template, run folders, optimiser groups."""
