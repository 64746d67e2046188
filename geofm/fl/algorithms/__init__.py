"""Federated algorithms, found by name: the built-ins and those installed packages register.

:data:`ALGORITHMS` names each algorithm class (a subclass of
:class:`~geofm.fl.algorithms.base.Algorithm`); ``algorithm.name`` in a config picks one.
The built-ins are registered lazily, so that config validation reads the names without importing
torch; ``geofm list algorithms`` prints every registered name with its class's summary. Every
algorithm takes SAM or ASAM local steps from ``algorithm.sam`` and client-level differential privacy
from ``algorithm.privacy``. Another package adds one through the ``geofm.algorithms`` entry-point
group (see :mod:`geofm.registry`), its settings in ``algorithm.options``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from geofm.registry import Registry

if TYPE_CHECKING:
    from geofm.config.algorithm import AlgorithmConfig
    from geofm.fl.algorithms.base import Algorithm
    from geofm.fl.parameter_vectors import ParameterLayout

ALGORITHMS: Registry = Registry("algorithm", "geofm.algorithms")
"""Federated algorithms: client and server update rules and what travels each way (``algorithm.name``)."""
ALGORITHMS.register("fedavg", "geofm.fl.algorithms.fedavg:FedAvg")
ALGORITHMS.register("fedprox", "geofm.fl.algorithms.fedprox:FedProx")
ALGORITHMS.register("fedsense", "geofm.fl.algorithms.fedsense:FedSense")
ALGORITHMS.register("scaffold", "geofm.fl.algorithms.scaffold:Scaffold")
ALGORITHMS.register("pfedla", "geofm.fl.algorithms.pfedla:PFedLA")
ALGORITHMS.register("fedbn", "geofm.fl.algorithms.fedbn:FedBN")
ALGORITHMS.register("fednova", "geofm.fl.algorithms.fednova:FedNova")
ALGORITHMS.register("feddc", "geofm.fl.algorithms.feddc:FedDC")
ALGORITHMS.register("moon", "geofm.fl.algorithms.moon:Moon")
ALGORITHMS.register("swa", "geofm.fl.algorithms.swa:SWA")
ALGORITHMS.register("wima", "geofm.fl.algorithms.swa:WiMA")
ALGORITHMS.register("fedsam", "geofm.fl.algorithms.fedsam:FedSAM")
ALGORITHMS.register("fedasam", "geofm.fl.algorithms.fedsam:FedASAM")
ALGORITHMS.register("fedgloss", "geofm.fl.algorithms.fedgloss:FedGloSS")
ALGORITHMS.register("fedalign", "geofm.fl.algorithms.fedalign:FedAlign")
ALGORITHMS.register("fedema", "geofm.fl.algorithms.fedema:FedEMA")
ALGORITHMS.register("ldawa", "geofm.fl.algorithms.ldawa:LDAWA")
ALGORITHMS.register("fedu2", "geofm.fl.algorithms.fedu2:FedU2")
ALGORITHMS.register("fedmkd", "geofm.fl.algorithms.fedmkd:FedMKD")


def build_algorithm(
    cfg: AlgorithmConfig,
    layout: ParameterLayout | int,
    declared_examples: Mapping[str, int] | None = None,
    num_clients: int | None = None,
    num_rounds: int | None = None,
) -> Algorithm:
    """The algorithm ``cfg.name`` names, for a model of ``layout`` (or a plain vector of that length)."""
    return ALGORITHMS.get(cfg.name)(cfg, layout, declared_examples, num_clients, num_rounds=num_rounds)


__all__ = ["ALGORITHMS", "build_algorithm"]
