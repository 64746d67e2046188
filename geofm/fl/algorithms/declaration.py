"""What a federated algorithm declares as a class, and the config rules that follow from it.

An algorithm names its payloads each way, its own settings (:attr:`Declaration.Options`), whether it
combines uploads itself, the local optimiser and SAM step its paper assumes; :meth:`Declaration.check_config`
checks an ``algorithm`` section against them when the config is validated, before any model is built.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel

from geofm.config.algorithm import AlgorithmConfig, SamConfig
from geofm.config.federated import LocalOptimizerConfig
from geofm.fl.privacy.client_level import check_private
from geofm.registry import entry_options

# ASAM's offset of T_w = |w| + eta where neither the config nor the algorithm gives one (the ASAM code's default).
ASAM_ETA = 0.01


class Declaration:
    """The class-level declarations of an algorithm (:class:`~geofm.fl.algorithms.base.Algorithm`)."""

    name: ClassVar[str]
    uplink: ClassVar[tuple[str, ...]]
    downlink: ClassVar[tuple[str, ...]]
    Options: ClassVar[type[BaseModel] | None] = None
    own_server_rule: ClassVar[str | None] = None
    """How the algorithm combines uploads itself, where it takes no ``aggregator`` or ``server_optimizer``."""
    personalised: ClassVar[bool] = False
    keeps_local_statistics: ClassVar[bool] = False
    local_optimizer: ClassVar[LocalOptimizerConfig | None] = None
    """The local optimiser the algorithm's analysis assumes (its paper's), which clients use while
    ``train.optimizer`` is null; None: no assumption, AdamW with ``train``'s settings. See
    :mod:`geofm.fl.algorithms.local_optimizer`."""
    local_optimizer_source: ClassVar[str] = ""
    """Where :attr:`local_optimizer` comes from (the paper), named in the warning of an override."""
    default_sam: ClassVar[SamConfig | None] = None
    """The local SAM step the algorithm takes when ``algorithm.sam`` is null, and the defaults of the
    fields that section leaves out (FedSAM: the paper's radius); None: plain steps."""

    @classmethod
    def check_config(cls, cfg: AlgorithmConfig) -> None:
        """Check the parts of ``cfg`` only the algorithm knows; ValueError naming the field otherwise."""
        if "model" not in cls.downlink:
            raise ValueError(f"downlink: {cls.name} sends no 'model' payload; every algorithm must")
        for where, named, payloads in (
            ("uplink_payloads", cfg.uplink_payloads, cls.uplink),
            ("downlink_payloads", cfg.downlink_payloads, cls.downlink),
        ):
            unknown = sorted(set(named) - set(payloads))
            if unknown:
                raise ValueError(f"{where} names {unknown}; {cls.name} sends {list(payloads)}")
        if cls.own_server_rule is not None:
            for section in ("aggregator", "server_optimizer"):
                if getattr(cfg, section) != type(getattr(cfg, section))():
                    raise ValueError(f"{section}: {cls.name} {cls.own_server_rule}; leave {section} at its default")
        sam = cls.sharpness(cfg)
        if sam is not None and sam.rho is None:
            raise ValueError(f"sam.rho: {cls.name} has no default radius; set sam.rho (> 0)")
        if sam is not None and not sam.adaptive and cfg.sam is not None and cfg.sam.eta is not None:
            raise ValueError("sam.eta: eta is ASAM's offset; set sam.adaptive: true to use it")
        check_private(cls.name, cls.uplink, cls.own_server_rule, cfg)
        cls.options_of(cfg)

    @classmethod
    def check_public_images(cls, cfg: AlgorithmConfig, available: bool) -> None:
        """Check that the server holds the public images ``cfg`` needs (``available``: whether the run's
        config gives it some; default: the algorithm needs none); ValueError naming the field otherwise."""
        return

    @classmethod
    def sharpness(cls, cfg: AlgorithmConfig) -> SamConfig | None:
        """The local SAM step: ``cfg.sam``'s fields over :attr:`default_sam`'s, then SAM (``adaptive``
        false, ``eta`` 0.01) for those both leave null; None: plain steps."""
        if cfg.sam is None and cls.default_sam is None:
            return None
        given = [part.model_dump(exclude_none=True) for part in (cls.default_sam, cfg.sam) if part is not None]
        return SamConfig(**{"adaptive": False, "eta": ASAM_ETA, **{k: v for part in given for k, v in part.items()}})

    @classmethod
    def options_of(cls, cfg: AlgorithmConfig) -> BaseModel | None:
        """The algorithm's own settings from ``cfg.options``, validated by :attr:`Options`."""
        return entry_options(cls.name, cls.Options, cfg.options, "options")


__all__ = ["ASAM_ETA", "Declaration"]
