"""The server's context: FedSense builds, runs and checkpoints its similarity distillation on it alone."""

import copy
import itertools

import pytest
import torch
from torch import nn

from federation.programs.resume import comparable_algorithm
from geofm.config.algorithm import AlgorithmConfig
from geofm.errors import ConfigError
from geofm.fl.aggregation.clustering import cluster_clients
from geofm.fl.aggregation.similarity import distill_similarity
from geofm.fl.aggregation.uploads import ClientUpload
from geofm.fl.algorithms import build_algorithm
from geofm.fl.algorithms.base import DISTILL_OPTIMIZER
from geofm.fl.algorithms.context import PublicImages, ServerContext
from geofm.fl.communication.codec import Codec
from geofm.fl.parameter_vectors import ParameterLayout


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(3, 4)
        self.decoder = nn.Linear(4, 3)


def _features(model: nn.Module, images: torch.Tensor) -> torch.Tensor:
    return model.encoder(images)


def _fedsense(model: nn.Module, public: PublicImages | None, steps: int = 2):
    cfg = AlgorithmConfig.model_validate(
        {"name": "fedsense", "options": {"clusters": 2, "distill_steps": steps, "distill_lr": 0.1}}
    )
    layout = ParameterLayout.of(model)
    algorithm = build_algorithm(cfg, layout)
    algorithm.attach(ServerContext(model, layout, public))
    return algorithm, layout


def _public(images: torch.Tensor, asked: list) -> PublicImages:
    def batches(rnd: int, batch_size: int):
        asked.append((rnd, batch_size))
        return itertools.repeat(images)

    return PublicImages(batches, _features, lambda model: model.encoder.parameters())


def test_fedsense_distils_the_average_towards_its_groups_on_the_public_images_the_context_offers():
    torch.manual_seed(0)
    model, images, asked = _Tiny(), torch.randn(6, 3), []
    twin = copy.deepcopy(model)
    algorithm, layout = _fedsense(model, _public(images, asked))
    start = layout.flatten_module(model)
    updates = [torch.randn(layout.numel) * 0.1 + 0.3 * (i % 2) for i in range(4)]
    uploads = [ClientUpload(f"c{i}", {"update": Codec(bits=32).encode(u)}, 10 + i) for i, u in enumerate(updates)]
    algorithm.begin_round(4)
    result = algorithm.server_update(start.clone(), algorithm.aggregate(uploads))
    assert asked == [(4, 16)], "the round's batches, at options.distill_batch_size"
    assert result.metrics["groups"] == 2.0 and result.metrics["loss_similarity"] > 0

    # By hand: the data-weighted mean, then two distillation steps of the encoder towards the K-means groups.
    payloads = build_algorithm(AlgorithmConfig(name="fedavg"), layout).aggregate(uploads)
    aggregate = payloads["update"]
    mean = sum(w * u for w, u in zip(aggregate.weights, updates, strict=True))
    groups = cluster_clients(aggregate.updates, [a.num_examples for a in aggregate.accepted], 2)
    layout.assign(twin, start + mean)
    twin.eval()
    optimizer = torch.optim.AdamW(twin.encoder.parameters(), lr=0.1)
    group_params = [layout.unflatten(start + g) for g in groups.models]
    distill_similarity(twin, group_params, groups.weights, itertools.repeat(images), _features, optimizer, 2)
    torch.testing.assert_close(result.model, layout.flatten_module(twin))
    assert not torch.allclose(result.model, start + mean), "the distillation moved the average"


def test_the_distillation_optimiser_carries_across_a_checkpoint_and_legacy_ones_load():
    torch.manual_seed(0)
    model, images = _Tiny(), torch.randn(6, 3)
    algorithm, layout = _fedsense(model, _public(images, []))
    params = [layout.unflatten(layout.flatten_module(model) + 0.1)]
    distill_similarity(model, params, [1.0], itertools.repeat(images), _features, algorithm.distillation.optimizer, 2)
    saved = algorithm.state_dict()
    assert saved[DISTILL_OPTIMIZER]["state"], "AdamW's moments after two steps"

    resumed, _ = _fedsense(_Tiny(), _public(images, []))
    resumed.load_state_dict(saved)
    assert resumed.distillation.optimizer.state_dict()["state"][0]["step"] == 2

    # A server checkpoint written before FedSense kept it: the optimiser beside the algorithm's state.
    legacy = {"round": 3, "algorithm": {k: v for k, v in saved.items() if k != DISTILL_OPTIMIZER}}
    legacy[DISTILL_OPTIMIZER] = saved[DISTILL_OPTIMIZER]
    again, _ = _fedsense(_Tiny(), _public(images, []))
    again.load_checkpoint(legacy)
    assert again.distillation.optimizer.state_dict()["state"][0]["step"] == 2
    fedavg = build_algorithm(AlgorithmConfig(name="fedavg"), layout)
    fedavg.load_checkpoint(legacy)  # every run's checkpoint held one; FedAvg ignores it


def test_fedsense_refuses_to_distil_without_public_images():
    with pytest.raises(
        ConfigError, match=r"algorithm.options.distill_steps: .*public images.*federation.public_sources"
    ):
        _fedsense(_Tiny(), None)
    algorithm, _ = _fedsense(_Tiny(), None, steps=0)  # nothing to distil: no public images needed
    assert algorithm.distillation is None


def test_a_run_saved_before_options_compares_equal_to_the_same_settings_written_as_options():
    """A resumed run compares the algorithm's settings, not how they were written: flat keys of an old config
    (every field dumped, defaults included) equal the new options; another value does not."""
    old = {
        "name": "fedsense",
        "perturbation_radius": 0.05,
        "proximal_beta": 0.0,
        "clusters": 2,
        "distill_steps": 2,
        "distill_lr": 1e-4,
        "distill_batch_size": 8,
        "server_lr": 1.0,
        "options": {},
        "uplink": {"bits": 1},
    }
    new = {
        "name": "fedsense",
        "options": {
            "perturbation_radius": 0.05,
            "clusters": 2,
            "distill_steps": 2,
            "distill_lr": 1e-4,
            "distill_batch_size": 8,
            "proximal_beta": 0.0,
        },
        "uplink": {"bits": 1},
    }
    assert comparable_algorithm({"algorithm": old}) == comparable_algorithm({"algorithm": new})
    changed = {**new, "options": {**new["options"], "clusters": 3}}
    assert comparable_algorithm({"algorithm": old}) != comparable_algorithm({"algorithm": changed})
    fedavg = {k: v for k, v in old.items() if k != "name"} | {"name": "fedavg", "perturbation_radius": 0.0}
    fedavg.update(clusters=None, distill_steps=0, distill_lr=1e-5, distill_batch_size=16)
    assert comparable_algorithm({"algorithm": fedavg})["algorithm"]["options"] == {}
