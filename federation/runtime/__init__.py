"""The federated runtime: the program contract and registry, the round loop over any transport,
resume, a program in one process, and finding a run's processes."""
