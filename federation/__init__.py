"""The federated layer: a runtime contract, its Flower adapter, and the program that runs a registered task.

It imports ``geofm`` only, never ``pretrain`` or ``finetune``: tasks and programs are found by name.
"""
