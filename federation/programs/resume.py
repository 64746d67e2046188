"""What a resumed federated server compares and notes: its saved config read as today's settings, and how
its logged rounds weighted the clients."""

from __future__ import annotations

import logging

from geofm.config.algorithm import MOVED_TO_OPTIONS, AlgorithmConfig
from geofm.config.federated import FederatedConfig
from geofm.fl.algorithms import ALGORITHMS

log = logging.getLogger("geofm.fl")


def comparable_algorithm(tree: dict | None) -> dict | None:
    """``tree`` with its algorithm's options as the algorithm reads them (defaults left out), so that a
    resumed run compares settings, not how they were written; a config saved before each algorithm
    kept its settings in ``options`` has them moved there (the algorithm's own; the others' dropped)."""
    if tree is None or not isinstance(tree.get("algorithm"), dict):
        return tree
    algorithm = dict(tree["algorithm"])
    moved = {key: algorithm.pop(key) for key in MOVED_TO_OPTIONS if key in algorithm}
    options = dict(algorithm.get("options") or {})
    rule = ALGORITHMS.get(algorithm.get("name", AlgorithmConfig.model_fields["name"].default))
    if rule.Options is not None:
        own = {key: value for key, value in moved.items() if key in rule.Options.model_fields}
        options = rule.Options.model_validate({**own, **options}).model_dump(exclude_defaults=True)
    return {**tree, "algorithm": {**algorithm, "options": options}}


def saved_config(tree: dict | None) -> dict | None:
    """A checkpoint's saved config, with the ``task`` of runs written before configs named one (they all pretrained)."""
    if tree is None or "task" in tree:
        return tree
    return {**tree, "task": FederatedConfig.model_fields["task"].default}


def note_file_weights(last_round: dict | None, task_kind: str | None, rounds_log: str) -> bool:
    """Warn, when a pretraining run resumes from rounds written before each round recorded its clients'
    ``examples``, that those rounds weighted a client by its files and the rounds from here on weigh it
    by its samples. Returns whether it warned."""
    if last_round is None or "examples" in last_round or task_kind != "pretraining":
        return False
    rnd = last_round.get("round", "?")
    log.warning(
        "%s: rounds up to %s weighted each client by its number of files; from round %s on a client is weighted "
        "by its training samples (a scene with chip_size counts its chips, a chip store its chips, any other file "
        "one), and train.local_epochs counts those samples. Where a client has chip_size scenes or a chip store its "
        "weight and local steps change; otherwise nothing does. Start a new run.output_dir to train with one "
        "weighting throughout",
        rounds_log,
        rnd,
        rnd + 1 if isinstance(rnd, int) else "the next",
    )
    return True


__all__ = ["comparable_algorithm", "note_file_weights", "saved_config"]
