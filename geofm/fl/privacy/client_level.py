"""Client-level differential privacy of federated rounds: clipping, Gaussian noise, the accountant.

``algorithm.privacy`` (default null: off) makes every round a Gaussian mechanism on the clients'
model updates ``Delta_i`` (the ``update`` payload), with clipping norm ``S`` (``clip``) and noise
multiplier ``z`` (``noise_multiplier``); a neighbouring federation has one client more or fewer.

Central (DP-FedAvg: McMahan, Ramage, Talwar and Zhang, "Learning Differentially Private Recurrent
Language Models", ICLR 2018; Flower's ``DifferentialPrivacyServerSideFixedClipping`` does the same).
A trusted server clips each decoded, accepted update and averages them with equal weights::

    clip(Delta, S) = Delta * min(1, S / ||Delta||_2)
    Delta_bar = (1 / m) sum_i clip(Delta_i, S) + N(0, (z S / m)^2 I)      (m accepted clients)

One client moves the sum by at most ``S``: the noise on the sum has std ``z S``. Clipping happens
after decoding because quantisation and error feedback change a vector's norm (the decoded upload
carries the client's residual of earlier rounds and the codec's rounding): the bound must hold on
what the server averages. The paper weights clients by their capped example counts and divides
by the expected total weight; geofm weights them equally and divides by the number it averages, as
Flower does, so that no data-dependent weight enters the sensitivity.

Local: each client clips its update and adds ``N(0, (z S)^2 I)`` itself, before error feedback and
the codec: the residual and the quantisation are then post-processing of the noisy update, so the
guarantee holds whatever ``algorithm.uplink`` says, and the server need not be trusted. The server
averages the noisy updates with equal weights too: that is the weighting with the least noise in
the mean (``(z S)^2 sum_i w_i^2``, smallest at ``w_i = 1 / m``), and no example count is trusted.

Order of operations on a quantised uplink (1-bit with error feedback, say)::

    central:  client  Delta -> + residual -> quantise -> send;   server  decode -> clip -> mean -> + noise
    local:    client  Delta -> clip -> + noise -> + residual -> quantise -> send;   server  decode -> mean

What the server does after aggregation (its optimiser, FedSense's steps) is post-processing.

Server screening: under central privacy the norm rule (``norm_factor``) is off, since clipping
bounds every update, and a rule comparing a client with the others' median would make who counts
depend on the others' data, outside the accountant; a robust aggregator is refused (the noise is
calibrated to the mean). Under local privacy both apply to the noisy uploads (post-processing).

Accountant: Opacus's RDP accountant (Mironov, "Renyi Differential Privacy", CSF 2017; the sampled
Gaussian mechanism of Mironov, Talwar and Zhang 2019). Central: one step per aggregated round with
sample rate ``q`` = clients selected per round / clients of the federation; the logged ``epsilon``
is the model's guarantee for ``delta``. geofm selects a fixed number of clients without
replacement, while the analysis assumes Poisson sampling with rate ``q``: below ``q = 1`` the epsilon
is that of Poisson sampling, not a proven bound for the fixed-size sampling that ran (at ``q = 1``
the two agree). Local: each client's own guarantee, composed over the rounds it uploaded in (sample
rate 1, as its upload is released every time); the log holds the largest over the clients.

Not covered: the clients' reported metrics (losses, example counts, timings) and batch-norm running
statistics travel beside the update unnoised, so a model with batch-norm layers is refused; the
replies of a round attempt below ``federation.min_clients`` are dropped unaccounted. Noise is drawn
with torch's generator in floating point (no defence against floating-point attacks on the
Gaussian's low bits). ``seed`` null draws it from OS entropy, the only private choice; a seed makes
it reproducible and gives no privacy against anyone who knows the seed.

Flower's own helpers (``flwr.supercore.differential_privacy``) work on numpy lists with numpy's
global random state, and only ``federation/flower/adapter.py`` and ``simulation.py`` may import Flower: the two operations are a
few lines of torch here.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from geofm.config.algorithm import AlgorithmConfig, PrivacyConfig
from geofm.errors import ConfigError
from geofm.fl.aggregation.uploads import weighted_mean


def clip_update(update: Tensor, clip: float) -> Tensor:
    """``update * min(1, clip / ||update||_2)``: the update scaled down to L2 norm ``clip`` if above it."""
    norm = float(torch.linalg.vector_norm(update.float()))
    return update * (clip / norm) if norm > clip else update


def gaussian_noise(like: Tensor, std: float, generator: torch.Generator) -> Tensor:
    """``N(0, std^2)`` per coordinate, shaped like ``like`` (float32, CPU)."""
    return torch.normal(0.0, std, like.shape, generator=generator)


def noise_generator(seed: int | None, *parts: object) -> torch.Generator:
    """The generator of a noise draw: from OS entropy (``seed`` None), else from ``seed`` and ``parts``
    (the round, the client), the same in every process."""
    words = None if seed is None else [seed, *(zlib.crc32(repr(p).encode()) for p in parts)]
    return torch.Generator().manual_seed(int(np.random.SeedSequence(words).generate_state(1, np.uint64)[0]))


def privatise(update: Tensor, privacy: PrivacyConfig, generator: torch.Generator) -> Tensor:
    """Local privacy on a client: ``clip(update, S) + N(0, (z S)^2)``."""
    clipped = clip_update(update, privacy.clip)
    if not privacy.noise_multiplier:
        return clipped
    return clipped + gaussian_noise(update, privacy.noise_multiplier * privacy.clip, generator)


class PrivateMean:
    """The server's combination under privacy: the equal-weight mean of the updates; under central
    privacy of the updates clipped to ``S``, plus ``N(0, (z S / m)^2)``."""

    def __init__(self, privacy: PrivacyConfig, generator: torch.Generator) -> None:
        self.privacy, self.generator = privacy, generator

    def combine(self, updates: Sequence[Tensor], weights: Sequence[float]) -> Tensor:
        p = self.privacy
        if p.mode == "local":
            return weighted_mean(updates, [1.0] * len(updates))
        mean = weighted_mean((clip_update(u, p.clip) for u in updates), [1.0] * len(updates))
        if not p.noise_multiplier:
            return mean
        return mean + gaussian_noise(mean, p.noise_multiplier * p.clip / len(updates), self.generator)


def check_private(name: str, uplink: Sequence[str], own_server_rule: str | None, cfg: AlgorithmConfig) -> None:
    """Whether algorithm ``name`` composes with ``cfg.privacy``; ValueError naming the field otherwise."""
    privacy = cfg.privacy
    if privacy is None:
        return
    if tuple(uplink) != ("update",):
        raise ValueError(
            f"privacy: {name} uploads {list(uplink)}; privacy clips and noises a single model update "
            "payload 'update' (fedavg, fedprox, fedsense, moon and their kind)"
        )
    if own_server_rule is not None:
        raise ValueError(
            f"privacy: {name} {own_server_rule}; privacy needs the mean of the clipped updates as the round's update"
        )
    if privacy.mode == "central":
        if cfg.aggregator.name != "mean":
            raise ValueError(
                f"aggregator: central privacy calibrates its noise to the mean of clipped updates; "
                f"got {cfg.aggregator.name!r}, expected 'mean' (local privacy takes any aggregator)"
            )
        if cfg.norm_factor != AlgorithmConfig.model_fields["norm_factor"].default:
            raise ValueError(
                "norm_factor: central privacy clips every update to privacy.clip instead of screening norms "
                "against the round's median (data-dependent, outside the accountant); leave norm_factor at its default"
            )


def check_statistics(privacy: PrivacyConfig | None, statistics: np.ndarray | None) -> None:
    """Refuse privacy for a model whose batch-norm running statistics would travel beside the update.

    Raises:
        ConfigError: ``privacy`` is set and the model has batch-norm layers.
    """
    if privacy is not None and statistics is not None:
        raise ConfigError(
            "algorithm.privacy: the model has batch-norm layers (an UperNet head?), whose running statistics "
            "travel beside the update unclipped and unnoised; choose a head without batch norm or no privacy"
        )


class PrivacyAccountant:
    """The epsilon spent so far for ``privacy.delta`` (see the module docstring), with Opacus's RDP
    accountants: one for the model (central) or one per client (local).

    Args:
        privacy: the ``algorithm.privacy`` section.
        sample_rate: central privacy's ``q``, the share of the federation's clients selected per round.
    """

    def __init__(self, privacy: PrivacyConfig, sample_rate: float) -> None:
        from opacus.accountants import RDPAccountant  # a second to import: only runs with privacy do

        self.privacy, self._new = privacy, RDPAccountant
        self.sample_rate = sample_rate if privacy.mode == "central" else 1.0
        self.accountants: dict[str, RDPAccountant] = {}

    def step(self, clients: Sequence[str]) -> None:
        """Account for one aggregated round whose uploads came from ``clients``."""
        for key in ["model"] if self.privacy.mode == "central" else clients:
            accountant = self.accountants.setdefault(key, self._new())
            accountant.step(noise_multiplier=self.privacy.noise_multiplier, sample_rate=self.sample_rate)

    def epsilon(self) -> float:
        """The epsilon for ``delta`` after the rounds so far (local: the largest client's); 0 before any
        round, infinite with ``noise_multiplier`` 0."""
        if not self.accountants:
            return 0.0
        if not self.privacy.noise_multiplier:
            return math.inf
        return max(float(a.get_epsilon(self.privacy.delta)) for a in self.accountants.values())

    def report(self) -> dict[str, float]:
        """``epsilon`` and ``delta`` for the round's log (an infinite epsilon is logged as null)."""
        return {"epsilon": self.epsilon(), "delta": self.privacy.delta}

    def state_dict(self) -> dict[str, Any]:
        return {key: a.state_dict() for key, a in self.accountants.items()}

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        self.accountants = {}
        for key, state in saved.items():
            self.accountants[key] = self._new()
            self.accountants[key].load_state_dict(state)


__all__ = [
    "PrivacyAccountant",
    "PrivateMean",
    "check_private",
    "check_statistics",
    "clip_update",
    "gaussian_noise",
    "noise_generator",
    "privatise",
]
