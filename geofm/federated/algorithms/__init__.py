"""Federated algorithms, found by name: the built-ins and those installed packages register.

:data:`ALGORITHMS` names each algorithm class (a subclass of
:class:`~geofm.federated.algorithms.base.Algorithm`); ``algorithm.name`` in a config picks one.
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
    from geofm.federated.algorithms.base import Algorithm
    from geofm.federated.parameter_vectors import ParameterLayout

ALGORITHMS: Registry = Registry("algorithm", "geofm.algorithms")
"""Federated algorithms: client and server update rules and what travels each way (``algorithm.name``)."""
ALGORITHMS.register("fedavg", "geofm.federated.algorithms.fedavg:FedAvg")
ALGORITHMS.register("fedprox", "geofm.federated.algorithms.fedprox:FedProx")
ALGORITHMS.register("fedsense", "geofm.federated.algorithms.fedsense:FedSense")
ALGORITHMS.register("scaffold", "geofm.federated.algorithms.scaffold:Scaffold")
ALGORITHMS.register("pfedla", "geofm.federated.algorithms.pfedla:PFedLA")
ALGORITHMS.register("fedbn", "geofm.federated.algorithms.fedbn:FedBN")
ALGORITHMS.register("fednova", "geofm.federated.algorithms.fednova:FedNova")
ALGORITHMS.register("feddc", "geofm.federated.algorithms.feddc:FedDC")
ALGORITHMS.register("moon", "geofm.federated.algorithms.moon:Moon")
ALGORITHMS.register("swa", "geofm.federated.algorithms.swa:SWA")
ALGORITHMS.register("wima", "geofm.federated.algorithms.swa:WiMA")
ALGORITHMS.register("fedsam", "geofm.federated.algorithms.fedsam:FedSAM")
ALGORITHMS.register("fedasam", "geofm.federated.algorithms.fedsam:FedASAM")
ALGORITHMS.register("fedgloss", "geofm.federated.algorithms.fedgloss:FedGloSS")
ALGORITHMS.register("fedalign", "geofm.federated.algorithms.fedalign:FedAlign")
ALGORITHMS.register("fedema", "geofm.federated.algorithms.fedema:FedEMA")
ALGORITHMS.register("ldawa", "geofm.federated.algorithms.ldawa:LDAWA")
ALGORITHMS.register("fedu2", "geofm.federated.algorithms.fedu2:FedU2")
ALGORITHMS.register("fedmkd", "geofm.federated.algorithms.fedmkd:FedMKD")


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
