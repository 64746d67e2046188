"""The federated layer, by layer: the runtime contract and round loop (``runtime/``), deployment
(``deploy/``), Flower's adapter and simulation (``flower/``), and the programs (``programs/``: the
round-based program and the one-shot ones).

It imports ``geofm`` only, never ``pretrain`` or ``finetune``: tasks and programs are found by name.
"""
