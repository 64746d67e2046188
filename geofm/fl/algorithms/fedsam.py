"""FedSAM and FedASAM: FedAvg whose clients take sharpness-aware local steps.

Caldarola, Caputo, Ciccone, "Improving Generalization in Federated Learning by Seeking Flat Minima",
ECCV 2022. Each client minimises its loss with SAM (Foret et al., ICLR 2021) or ASAM (Kwon et al.,
ICML 2021) instead of plain steps; the server is FedAvg's (``aggregator``, ``server_optimizer``)::

    e = rho g / ||g||                      (SAM)
    e = rho T_w^2 g / ||T_w g||,  T_w = |w| + eta on the weights      (ASAM)
    w <- w - lr * grad L(w + e)            (the client optimiser's step, AdamW here)

The ascent itself is :class:`geofm.fl.local.sharpness.SharpnessAscent`, applied by
:meth:`~geofm.fl.algorithms.base.Algorithm.hooks` from ``algorithm.sam`` to every algorithm;
these two names give FedAvg the paper's radii when ``sam`` leaves them out: SAM ``rho = 0.1``, ASAM
``rho = 0.7, eta = 0.2``, the values of the official code's CIFAR-10 experiments
(debcaldarola/fedsam, ``paper_experiments/cifar10.sh``: 5 of 100 clients a round, one local epoch,
SGD at 0.01). ``sam`` overrides any of them (``sam: {rho: 0.05}`` under ``fedasam`` keeps ASAM
with ``eta = 0.2``). The paper's server-side SWA is a separate component.

Deviation: the local optimiser is the run's (AdamW with its clipping and schedule), not the paper's
SGD; SAM's ascent is independent of the optimiser, which applies the gradient at ``w + e`` as its own.
"""

from __future__ import annotations

from typing import ClassVar

from geofm.config.algorithm import AlgorithmConfig, SamConfig
from geofm.fl.algorithms.fedavg import FedAvg


class FedSAM(FedAvg):
    """FedAvg with SAM local steps (``sam.rho`` 0.1 by default)."""

    name = "fedsam"
    default_sam: ClassVar[SamConfig] = SamConfig(rho=0.1, adaptive=False)

    @classmethod
    def check_config(cls, cfg: AlgorithmConfig) -> None:
        super().check_config(cfg)
        adaptive = cls.sharpness(cfg).adaptive
        if adaptive != cls.default_sam.adaptive:
            steps, other = ("ASAM", "fedasam") if adaptive else ("SAM", "fedsam")
            raise ValueError(f"sam.adaptive: {adaptive} asks for {steps} steps; name {other} for them")


class FedASAM(FedSAM):
    """FedAvg with ASAM local steps (``sam.rho`` 0.7, ``sam.eta`` 0.2 by default)."""

    name = "fedasam"
    default_sam: ClassVar[SamConfig] = SamConfig(rho=0.7, adaptive=True, eta=0.2)


__all__ = ["FedASAM", "FedSAM"]
