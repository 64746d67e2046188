"""The federated programs: the round-based program (server, client, local group) and the one-shot programs."""
