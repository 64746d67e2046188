"""A federated program's client: one institution's local rounds of the run's task.

The client's state (error residual, its copy of a compressed downlink) travels in Flower's client
state and is also kept in its state folder, from which a restarted run recovers it.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import torch

from federation.program import STATE_DIR, build_task, client_shares, local_config, stable_id
from federation.runtime import INSTITUTION, Arrays, Scalars
from geofm import engine as ds
from geofm.config.federated import FederatedConfig
from geofm.errors import ConfigError
from geofm.federated.algorithms import build_algorithm
from geofm.federated.codec import Packet, decode
from geofm.federated.flat import ParameterLayout
from geofm.training import IntervalMeans, check_inputs


def local_steps(
    engine, task, batches: Iterable[list[dict]], hooks, step_seed: Callable[[int], int]
) -> tuple[dict, int]:
    """Train the local steps: each step's micro-batches forward and backward, the algorithm's hooks around them.

    ``hooks.around_gradient`` wraps each forward/backward (FedSense's perturbation),
    ``hooks.regulariser`` is added to the loss (FedProx's proximal term); the engine steps the
    optimizer at accumulation boundaries. Each step reseeds torch from ``step_seed(step)``.
    Returns the mean of the task's logged losses and the number of steps.
    """
    sums, steps = IntervalMeans(task.log_keys), 0
    for step, micro_batches in enumerate(batches):
        torch.manual_seed(step_seed(step))
        for batch in micro_batches:
            with hooks.around_gradient():
                losses = task.forward(engine, batch).losses
                loss = losses["loss"] if hooks.regulariser is None else losses["loss"] + hooks.regulariser()
                engine.backward(loss)
            engine.step()
            sums.add(losses)
        steps += 1
    return sums.means(), steps


class FederatedClient:
    """One institution: trains the run's task on its own share only, uploads compressed updates.

    Args:
        cfg: the run's config.
        node_config: the node's config (``institution``, optionally ``data-root``, ``teacher``,
            ``state-dir``).
    """

    def __init__(self, cfg: FederatedConfig, node_config: dict) -> None:
        self.name = str(node_config[INSTITUTION])
        self.cfg = local_config(cfg, node_config)
        self.shares = client_shares(self.cfg, self.name)
        self.num_examples = sum(len(files) for files in self.shares)
        self.task = build_task(self.cfg)
        check_inputs(self.task.inputs(), f"client {self.name}")
        self.state_dir = Path(node_config.get(STATE_DIR) or self.cfg.run.output_dir / "clients" / self.name)

    def identity(self) -> Scalars:
        return {"client": self.name, "num_examples": self.num_examples}

    def train(self, arrays: Arrays, config: Scalars, state: Arrays) -> tuple[Arrays, Scalars, Arrays]:
        """One round: receive the model, train the local steps, upload the update."""
        started = time.perf_counter()
        cfg, rnd = self.cfg, int(config["round"])
        state = state or self._recover(rnd)
        reference = self._receive(arrays, config, state)
        algorithm = build_algorithm(cfg.algorithm, reference.numel())
        # Each round's model is built fresh and overwritten by the global model: no initial weights to read.
        model = self.task.build_model(initial_weights=False)
        layout = ParameterLayout.of(model)
        layout.assign(model, reference)
        self.task.prepare(model)
        engine = ds.initialize(model, cfg.train, 1, None, float(config["lr"]))
        params = layout.parameters(engine.module)
        anchor = [t.to(self.task.device) for t in layout.split(reference)]
        hooks = algorithm.local_hooks(params, anchor)
        batches = self.task.local_batches(self.shares, self._num_steps(), rnd, stable_id(cfg.run.seed, self.name))
        means, steps = local_steps(
            engine, self.task, batches, hooks, lambda step: stable_id(cfg.run.seed, self.name, rnd, step)
        )

        delta = layout.flatten_module(engine.module).cpu() - reference
        generator = torch.Generator().manual_seed(stable_id(cfg.run.seed, self.name, rnd, "uplink"))
        feedback = {k.removeprefix("feedback."): v for k, v in state.items() if k.startswith("feedback.")}
        packet, report, feedback = algorithm.upload(delta, feedback, generator)
        new_state = {f"feedback.{k}": v for k, v in feedback.items()}
        new_state["round"] = np.array([rnd], dtype=np.int64)
        if cfg.algorithm.downlink.bits != 32:
            new_state["reference"] = reference.numpy()
            new_state["reference_round"] = np.array([int(config["reference_round"])], dtype=np.int64)
        self._persist(rnd, new_state)
        metrics = {
            "client": self.name,
            "num_examples": self.num_examples,
            "steps": steps,
            **means,
            "update_norm": report.update_norm,
            "error_norm": report.error_norm,
            "feedback_reset": "guard" if report.guard_reset else "periodic" if report.periodic_reset else "",
            "seconds": time.perf_counter() - started,
        }
        return packet.to_arrays(), metrics, new_state

    def _receive(self, arrays: Arrays, config: Scalars, state: Arrays) -> torch.Tensor:
        """The model this round starts from: sent whole, or as a change to the client's copy."""
        packet = Packet.from_arrays(arrays)
        if config["downlink"] == "model":
            return decode(packet)
        held = int(state["reference_round"][0]) if "reference_round" in state else None
        if held != int(config["reference_round"]) - 1:
            raise ConfigError(
                f"client {self.name}: holds the model of round {held}, the server sent a change to round "
                f"{int(config['reference_round']) - 1}; it will send the whole model next round"
            )
        return torch.from_numpy(state["reference"].copy()) + decode(packet)

    def _num_steps(self) -> int:
        """Local steps per round: ``train.local_steps``, or ``train.local_epochs`` of this client's share."""
        train = self.cfg.train
        if train.local_steps is not None:
            return train.local_steps
        return max(1, int(train.local_epochs * self.num_examples) // (train.micro_batch_size * train.grad_accum_steps))

    def _persist(self, rnd: int, state: Arrays) -> None:
        """Keep the state on this institution's disk too; a restarted run (new Flower context) reads it back."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        path = self.state_dir / f"state_round_{rnd:06d}.npz"
        partial = path.with_name(path.name + ".partial")  # not a state_round_*.npz until complete
        with partial.open("wb") as f:
            np.savez(f, **state)
        partial.replace(path)
        for _, old in self._saved()[:-2]:
            old.unlink()

    def _saved(self) -> list[tuple[int, Path]]:
        """The complete states on disk, oldest first, as (round, path); anything else there is ignored."""
        found = (re.fullmatch(r"state_round_(\d+)\.npz", p.name) for p in self.state_dir.glob("state_round_*"))
        return sorted((int(m.group(1)), self.state_dir / m.group(0)) for m in found if m)

    def _recover(self, rnd: int) -> Arrays:
        """The newest state saved before round ``rnd`` (empty: a first round, or none kept)."""
        earlier = [path for saved, path in self._saved() if saved < rnd]
        if not earlier:
            return {}
        with np.load(earlier[-1]) as data:
            return {key: data[key] for key in data.files}


__all__ = ["FederatedClient", "local_steps"]
