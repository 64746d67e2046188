"""The algorithm interface: what a federated algorithm decides on either side of a round.

An algorithm is a subclass of :class:`Algorithm` registered in
:data:`geofm.fl.algorithms.ALGORITHMS`. It declares (the class-level declarations and the config rules
that follow from them are :mod:`~geofm.fl.algorithms.declaration`):

* ``uplink`` and ``downlink``: the named payloads each way (FedAvg: up ``update``, down ``model``),
  each a vector of the shared parameters' length with its own codec (``algorithm.uplink`` and
  ``algorithm.downlink``, changed per payload by ``uplink_payloads`` and ``downlink_payloads``)
  and, on the uplink, its own error-feedback residual and its own screening and norm history;
  ``model`` (the global model) always travels down;
* ``Options``: a pydantic model of its own settings, read from ``algorithm.options``;
* :meth:`~Algorithm.is_local`: the parameters that stay on each client (default: none); they live
  in the client's state and never travel;
* ``personalised``: whether each client's own model is the algorithm's product (FedBN, pFedLA);
  then every client also evaluates the model it trained on its own validation data each round and
  the server logs their mean and spread.
* ``algorithm.privacy`` (:mod:`~geofm.fl.privacy.client_level`): every algorithm whose only upload is
  ``update`` and whose server steps by the round's combined update takes it: :meth:`~Algorithm.upload`
  clips and noises the update under local privacy, :meth:`~Algorithm.aggregate` clips, averages and
  noises under central privacy.
* ``keeps_local_statistics``: whether each client keeps its own batch-norm running statistics
  (FedBN): the runtime restores them from the client's state after the downlink, and sends every
  client the server model's start statistics instead of the average of the clients'.

The server hands the algorithm its :class:`~geofm.fl.algorithms.context.ServerContext` once
(:meth:`~Algorithm.attach`: its model, the shared layout, the task's public images). A runtime
calls, each round: on the server :meth:`~Algorithm.send`; on each client
:meth:`~Algorithm.receive`, :meth:`~Algorithm.restore_local`, :meth:`~Algorithm.local_hooks`
around its local steps, :meth:`~Algorithm.finish_local` (the end of the local round: what to
upload and the client's metadata), :meth:`~Algorithm.keep_local` and :meth:`~Algorithm.upload`;
on the server again :meth:`~Algorithm.aggregate`, :meth:`~Algorithm.server_update`, and
:meth:`~Algorithm.commit` once it keeps the outcome, then :meth:`~Algorithm.server_local` for the
values of the local parameters its own model validates, checkpoints and exports (the server gives
:meth:`~Algorithm.start_local` its model's start values of them once built).
:meth:`~Algorithm.state_dict` is the server's state (norm histories, downlink copies, which round
each client holds, the algorithm's global and per-client state, its distillation optimiser's) for its
checkpoints, read back by :meth:`~Algorithm.load_checkpoint`. The client's state is a dict of numpy arrays the runtime
keeps between rounds; the algorithm reads and writes it: ``feedback.<payload>.*`` (residuals),
``downlink.<payload>`` and ``reference_round`` (its copies under a compressed downlink), ``local``
(its local parameters), ``local_statistics`` (its batch-norm running statistics, under
``keeps_local_statistics``) and the algorithm's own keys.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from geofm.config.algorithm import AlgorithmConfig, SamConfig, UplinkConfig
from geofm.errors import ConfigError
from geofm.fl.aggregation.robust import Spilling, build_aggregator
from geofm.fl.aggregation.screening import UploadRules
from geofm.fl.aggregation.uploads import ClientUpload, RoundAggregate, aggregate_payloads
from geofm.fl.algorithms import legacy
from geofm.fl.algorithms.context import ServerContext
from geofm.fl.algorithms.declaration import Declaration
from geofm.fl.algorithms.rounds import (
    Arrays,
    LocalHooks,
    LocalRound,
    LocalUpdate,
    ServerRound,
    packet_arrays,
)
from geofm.fl.communication.codec import Codec, Packet, decode
from geofm.fl.communication.feedback import ErrorFeedback, FeedbackState, UplinkReport
from geofm.fl.local.sharpness import SharpnessAscent, asam_scaled
from geofm.fl.parameter_vectors import ParameterLayout
from geofm.fl.privacy.client_level import PrivateMean, noise_generator, privatise

DISTILL_OPTIMIZER = "distill_optimizer"
"""The server's distillation optimiser's state in an algorithm's :meth:`~Algorithm.state_dict`."""


class Algorithm(Declaration, ABC):
    """Base of every federated algorithm (see the module docstring).

    Args:
        cfg: the ``algorithm`` section.
        layout: the model's trainable parameters, or the length of a plain parameter vector.
        declared_examples: institution -> the most examples it may claim.
        num_clients: the number of clients of the federation (known to the server).
        num_rounds: the run's number of rounds (known to the server).
    """

    def __init__(
        self,
        cfg: AlgorithmConfig,
        layout: ParameterLayout | int,
        declared_examples: Mapping[str, int] | None = None,
        num_clients: int | None = None,
        num_rounds: int | None = None,
    ) -> None:
        self.cfg, self.num_clients, self.num_rounds, self.privacy = cfg, num_clients, num_rounds, cfg.privacy
        try:
            self.check_config(cfg)
        except ValueError as err:
            raise ConfigError(f"algorithm.{err}") from None
        self.options = self.options_of(cfg)
        layout = ParameterLayout.vector(layout) if isinstance(layout, int) else layout
        self.shared = layout.select(lambda name: not self.is_local(name))
        self.local = layout.select(self.is_local)
        self.num_values = self.shared.numel
        self.uplink_configs: dict[str, UplinkConfig] = {p: cfg.uplink_for(p) for p in self.uplink}
        self.downlink_codecs = {p: Codec.of(cfg.downlink_for(p)) for p in self.downlink}
        self.feedback = {
            p: ErrorFeedback(
                Codec.of(up),
                alpha=up.feedback_alpha if up.error_feedback else 0.0,
                reset_every=up.feedback_reset_every,
                guard_factor=up.feedback_guard,
            )
            for p, up in self.uplink_configs.items()
        }
        self.rules = {
            p: UploadRules(
                num_values=self.num_values,
                bits=up.bits,
                # Central privacy clips instead of screening norms (see geofm.fl.privacy.client_level).
                norm_factor=math.inf if self.privacy and self.privacy.mode == "central" else cfg.norm_factor,
                examples_factor=cfg.examples_factor,
                declared_examples=declared_examples or {},
            )
            for p, up in self.uplink_configs.items()
        }
        self.aggregator = build_aggregator(cfg.aggregator)
        self.compressed = [p for p, codec in self.downlink_codecs.items() if codec.bits != 32]
        # Server state.
        self.recent_norms: dict[str, list[list[float]]] = {p: [] for p in self.uplink}  # newest last
        self.references: dict[str, Tensor | None] = {p: None for p in self.compressed}  # the clients' copies
        self.synced: dict[str, int] = {}  # client -> round of the copies it holds
        self.state: dict[str, Tensor] = {}
        self.client_state: dict[str, dict[str, Tensor]] = {}
        self.round = 0  # the server's round in progress (begin_round)
        self.context: ServerContext | None = None  # the server's (attach)

    def is_local(self, name: str) -> bool:
        """Whether parameter ``name`` stays on each client instead of being federated (default: never)."""
        return False

    def start_local(self, values: Tensor) -> None:
        """The server model's start values of the local parameters (:attr:`local` order), given once built."""

    def server_local(self) -> Tensor | None:
        """The values of the local parameters the server's own model holds for validation, checkpoints and
        export after the rounds kept so far, or None to leave them at their start (default)."""
        return None

    def evaluated_model(self, model: Tensor) -> Tensor:
        """The shared values the server validates and exports, given the global model that trains on
        (default: that model; server averaging, e.g. SWA, returns its average)."""
        return model

    # ---- server: downlink ---------------------------------------------------------------------
    def attach(self, context: ServerContext) -> None:
        """Take the server's context once, before its first round (server side only; see
        :mod:`~geofm.fl.algorithms.context`). An algorithm with a server-side step of its own
        builds it here (default: keeps the context)."""
        self.context = context

    def begin_round(self, rnd: int) -> None:
        """The server starts round ``rnd`` (before :meth:`send`); :attr:`round` holds it until the next."""
        self.round = rnd

    def downlink_values(self, model: Tensor) -> dict[str, Tensor]:
        """The value of each downlink payload this round (FedAvg: the global model)."""
        return {"model": model}

    def send(
        self, model: Tensor, rnd: int, clients: Sequence[str], generator: torch.Generator
    ) -> dict[str, tuple[Arrays, dict[str, Any]]]:
        """Each selected client's downlink arrays and the scalars that say how to read them.

        A 32-bit payload travels whole. A compressed one travels as the quantised change from the
        clients' copy, which becomes ``copy + deq(change)`` (the dropped part goes with the next
        change); a client that does not hold the previous round's copies (first round, missed
        rounds) receives the new copies whole.
        """
        values = self.downlink_values(model)
        whole = {p: Codec(bits=32).encode(values[p]) for p in self.downlink if p not in self.compressed}
        if not self.compressed:
            return dict.fromkeys(clients, (packet_arrays(whole), {"downlink": "model"}))
        first = self.compressed[0]
        synced = [c for c in clients if self.references[first] is not None and self.synced.get(c) == rnd - 1]
        change = dict(whole)
        for p in self.compressed:
            previous = self.references[p]
            if previous is None:
                change[p], self.references[p] = Codec(bits=32).encode(values[p]), values[p].clone()
            else:
                change[p] = self.downlink_codecs[p].encode(values[p] - previous, generator)
                self.references[p] = previous + decode(change[p])
        if len(synced) < len(clients):
            whole.update({p: Codec(bits=32).encode(self.references[p]) for p in self.compressed})
        sent = {True: (packet_arrays(change), "change"), False: (packet_arrays(whole), "model")}
        return {c: (sent[c in synced][0], {"downlink": sent[c in synced][1], "reference_round": rnd}) for c in clients}

    def note_replies(self, rnd: int, clients: Sequence[str]) -> None:
        """Record which clients answered round ``rnd``: under a compressed downlink they hold its copies."""
        if self.compressed:
            self.synced.update(dict.fromkeys(clients, rnd))

    # ---- client ---------------------------------------------------------------------------
    def receive(
        self, client: str, arrays: Arrays, config: Mapping[str, Any], state: Arrays
    ) -> tuple[dict[str, Tensor], Arrays]:
        """The downlink payloads' values, and the client's state for this round (the copies it now holds).

        Raises:
            ConfigError: a change arrived for copies the client does not hold.
        """
        state = legacy.client_state(state)
        values = {}
        for p in self.downlink:
            packet = Packet.from_arrays(
                {k.removeprefix(f"{p}."): v for k, v in arrays.items() if k.startswith(f"{p}.")}
            )
            if config["downlink"] == "model" or p not in self.compressed:
                values[p] = decode(packet)
                continue
            held = int(state["reference_round"][0]) if "reference_round" in state else None
            if held != int(config["reference_round"]) - 1:
                raise ConfigError(
                    f"client {client}: holds the model of round {held}, the server sent a change to round "
                    f"{int(config['reference_round']) - 1}; it will send the whole model next round"
                )
            values[p] = torch.from_numpy(state[f"downlink.{p}"].copy()) + decode(packet)
        if self.compressed:
            state.update({f"downlink.{p}": values[p].numpy() for p in self.compressed})
            state["reference_round"] = np.array([int(config["reference_round"])], dtype=np.int64)
        return values, state

    def client_vector(self, local: LocalRound, key: str) -> Tensor:
        """The vector ``key`` of the client's state (a control variate, a drift), zero until first kept."""
        saved = local.state.get(key)
        return torch.zeros(self.num_values) if saved is None else torch.from_numpy(saved.copy())

    def restore_local(self, module: nn.Module, state: Arrays) -> None:
        """Put the client's own values of its local parameters into ``module`` (kept from its last round)."""
        if self.local.names and "local" in state:
            self.local.assign(module, torch.from_numpy(state["local"].copy()))

    def keep_local(self, module: nn.Module, state: Arrays) -> None:
        """Keep the module's local parameters in the client's state; they never travel."""
        if self.local.names:
            state["local"] = self.local.flatten_module(module).cpu().numpy()

    def local_round(
        self, client: str, received: dict[str, Tensor], module: nn.Module, state: Arrays, lr: float
    ) -> LocalRound:
        """The local round of ``client`` training ``module`` from the received payloads."""
        params = self.shared.parameters(module)
        anchor = [piece.to(p.device) for piece, p in zip(self.shared.split(received["model"]), params, strict=True)]
        return LocalRound(client, received, params, anchor, state, lr, module)

    def hooks(self, local: LocalRound) -> LocalHooks:
        """What the runtime adds to the local steps: the algorithm's :meth:`local_hooks`, with the
        client-step components every algorithm takes from its config: the SAM ascent of :meth:`local_sam`
        (inside ``around_gradient``: from FedSense's drift-perturbed point, see :mod:`geofm.fl.local.sharpness`)."""
        hooks = self.local_hooks(local)
        sam = self.local_sam()
        if sam is not None:
            eta = sam.eta if sam.adaptive else None
            hooks.ascent = SharpnessAscent(local.params, sam.rho, eta, asam_scaled(self.shared.names))
        return hooks

    def local_sam(self) -> SamConfig | None:
        """The SAM step of this round's local steps (default: :meth:`sharpness` of the config)."""
        return self.sharpness(self.cfg)

    def local_hooks(self, local: LocalRound) -> LocalHooks:
        """The client update rule around the shared local step: plain steps unless overridden."""
        return LocalHooks()

    @abstractmethod
    def finish_local(self, local: LocalRound, trained: Tensor, steps: int) -> LocalUpdate:
        """The end of the local round: the uplink payloads from the trained shared parameters (CPU vector)."""

    def upload(
        self, update: LocalUpdate, state: Arrays, generator: torch.Generator, noise: torch.Generator | None = None
    ) -> tuple[Arrays, dict[str, UplinkReport]]:
        """Encode each uplink payload with its codec and its own error-feedback residual (kept in ``state``);
        under local privacy the update is clipped and noised first, with ``noise`` (None: OS entropy).

        Raises:
            CodecError: a payload holds NaN or Inf, or its stored residual is malformed.
        """
        if set(update.payloads) != set(self.uplink):
            raise ValueError(f"algorithm {self.name} uploads {list(self.uplink)}, got {sorted(update.payloads)}")
        payloads = dict(update.payloads)
        if self.privacy is not None and self.privacy.mode == "local":
            payloads["update"] = privatise(payloads["update"], self.privacy, noise or noise_generator(None))
        packets, reports = {}, {}
        for p in self.uplink:
            prefix = f"feedback.{p}."
            kept = self.uplink_configs[p].error_feedback
            saved = {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)} if kept else {}
            feedback = FeedbackState.from_arrays(saved) if saved else FeedbackState()
            packets[p], reports[p] = self.feedback[p].uplink(payloads[p], feedback, generator)
            if kept:
                state.update({prefix + k: v for k, v in feedback.to_arrays().items()})
        return packet_arrays(packets), reports

    # ---- server: uplink -------------------------------------------------------------------
    def spill_to(self, folder: Path) -> None:
        """Spill the decoded updates of an aggregator that needs them all at once (median, trimmed mean,
        Krum: :class:`~geofm.fl.aggregation.robust.Spilling`) under ``folder`` (the run's), rather than the
        system's temporary folder."""
        if isinstance(self.aggregator, Spilling):
            self.aggregator.spill_dir = folder

    def global_vector(self, key: str) -> Tensor:
        """The vector ``key`` of the algorithm's global server state, zero until first set."""
        return self.state.get(key, torch.zeros(self.num_values))

    def aggregate(self, uploads: Sequence[ClientUpload]) -> dict[str, RoundAggregate]:
        """Decode and screen every payload (its own norm history), combine each over the accepted clients
        with the configured aggregator; under privacy the mean is :class:`~geofm.fl.privacy.client_level.PrivateMean`
        (its noise drawn for :attr:`round` when ``privacy.seed`` is set)."""
        recent = {p: [n for norms in self.recent_norms[p] for n in norms] for p in self.uplink}
        aggregator = self.aggregator
        if self.privacy is not None and self.cfg.aggregator.name == "mean":
            aggregator = PrivateMean(self.privacy, noise_generator(self.privacy.seed, "server", self.round))
        return aggregate_payloads(uploads, self.rules, recent, aggregator)

    @abstractmethod
    def server_update(self, model: Tensor, payloads: Mapping[str, RoundAggregate]) -> ServerRound:
        """The next global model and state from the round's aggregates (at least one client accepted).

        State it changes in place rather than through the outcome is restored by :meth:`discard`.
        """

    def discard(self) -> None:
        """Undo what the last :meth:`server_update` changed in place: the runtime did not keep its outcome."""

    def commit(self, outcome: ServerRound, payloads: Mapping[str, RoundAggregate]) -> None:
        """Keep a round's outcome: its state, and its accepted norms in each payload's history."""
        self.state.update(outcome.state)
        for client, values in outcome.client_state.items():
            self.client_state.setdefault(client, {}).update(values)
        for p in self.uplink:
            history = [*self.recent_norms[p], [a.norm for a in payloads[p].accepted]]
            self.recent_norms[p] = history[-self.cfg.norm_history_rounds :]

    def distillation_optimizer(self) -> torch.optim.Optimizer | None:
        """The optimiser of the server's distillation, whose moments carry across rounds (None: the algorithm
        distils nothing on the server)."""
        return None

    def state_dict(self) -> dict[str, Any]:
        """The server's algorithm state, for its checkpoint."""
        optimizer = self.distillation_optimizer()
        return {
            "recent_norms": self.recent_norms,
            "references": self.references,
            "synced": dict(self.synced),
            "state": self.state,
            "client_state": self.client_state,
            **({DISTILL_OPTIMIZER: optimizer.state_dict()} if optimizer is not None else {}),
        }

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output, or the server state of runs written before named payloads.

        Raises:
            ConfigError: the state is another algorithm's (other payloads).
        """
        saved = legacy.server_state(saved)
        norms, references = dict(saved["recent_norms"]), {k: v for k, v in saved["references"].items() if v is not None}
        if set(norms) != set(self.uplink) or not set(references) <= set(self.compressed):
            raise ConfigError(
                f"the checkpoint holds the state of an algorithm with uplink {sorted(norms)} and compressed "
                f"downlink {sorted(references)}; {self.name} has {list(self.uplink)} and {self.compressed}"
            )
        self.recent_norms = norms
        self.references = {p: references.get(p) for p in self.compressed}
        self.synced = dict(saved["synced"])
        self.state.update(saved.get("state", {}))
        self.client_state = {c: dict(v) for c, v in saved.get("client_state", {}).items()}
        optimizer = self.distillation_optimizer()
        if optimizer is not None and saved.get(DISTILL_OPTIMIZER) is not None:
            optimizer.load_state_dict(saved[DISTILL_OPTIMIZER])

    def load_checkpoint(self, server: Mapping[str, Any]) -> None:
        """Restore the state a server checkpoint holds (its ``server`` entry, :meth:`state_dict` under
        ``algorithm``). Checkpoints written before the algorithm kept its own state hold FedAvg's at the top
        level; those written before it kept its distillation optimiser hold that beside the algorithm's
        state (every run's, empty where nothing was distilled)."""
        state = dict(server.get("algorithm", server))
        if DISTILL_OPTIMIZER in server:
            state[DISTILL_OPTIMIZER] = server[DISTILL_OPTIMIZER]
        self.load_state_dict(state)


__all__ = ["DISTILL_OPTIMIZER", "Algorithm"]
