import numpy as np
import pytest
import torch

from geofm.config.federated import AlgorithmConfig
from geofm.federated.aggregation import Upload
from geofm.federated.algorithms import FedAvg, FedProx, FedSense, build_algorithm
from geofm.federated.codec import Codec, decode


def _config(**fields) -> AlgorithmConfig:
    return AlgorithmConfig.model_validate(fields)


def test_build_algorithm_picks_the_named_member():
    assert type(build_algorithm(_config(name="fedavg"), 4)) is FedAvg
    assert type(build_algorithm(_config(name="fedprox", proximal_beta=0.1), 4)) is FedProx
    assert type(build_algorithm(_config(name="fedsense"), 4)) is FedSense


def test_fedprox_adds_the_proximal_term_and_fedavg_nothing():
    params, anchor = [torch.tensor([1.0, 2.0], requires_grad=True)], [torch.tensor([0.0, 0.0])]
    assert build_algorithm(_config(name="fedavg"), 2).local_hooks(params, anchor).regulariser is None
    hooks = build_algorithm(_config(name="fedprox", proximal_beta=0.5), 2).local_hooks(params, anchor)
    assert float(hooks.regulariser().detach()) == pytest.approx(0.5 / 2 * (1 + 4))


def test_fedsense_takes_gradients_at_the_perturbed_point_and_restores_theta():
    param = torch.tensor([3.0, 4.0], requires_grad=True)
    anchor = [torch.zeros(2)]
    hooks = build_algorithm(_config(name="fedsense", perturbation_radius=0.5), 2).local_hooks([param], anchor)
    with hooks.around_gradient():
        seen = param.detach().clone()
        (param**2).sum().backward()
    assert torch.allclose(seen, torch.tensor([3.3, 4.4])), "theta + 0.5 * d / ||d||, d = (3, 4), ||d|| = 5"
    assert torch.equal(param.detach(), torch.tensor([3.0, 4.0])) and torch.allclose(param.grad, 2 * seen)


def test_uploads_carry_error_feedback_state_only_when_configured():
    delta = torch.linspace(-1, 1, 1000)
    plain = build_algorithm(_config(name="fedavg", uplink={"bits": 1}), 1000)
    packet, _, state = plain.upload(delta, {}, torch.Generator().manual_seed(0))
    assert packet.bits == 1 and state == {}
    feedback = build_algorithm(_config(name="fedavg", uplink={"bits": 1, "error_feedback": True}), 1000)
    packet, _, state = feedback.upload(delta, {}, torch.Generator().manual_seed(0))
    assert np.allclose(state["error"], (delta - decode(packet)).numpy()) and state["rounds"][0] == 1
    _, _, later = feedback.upload(delta, state, torch.Generator().manual_seed(0))
    assert later["rounds"][0] == 2


def test_a_compressed_downlink_sends_the_change_and_tracks_the_clients_copy():
    model = torch.randn(2048)
    algorithm = build_algorithm(_config(name="fedavg", downlink={"bits": 8}), 2048)
    first, copy = algorithm.downlink(model, None, torch.Generator().manual_seed(0))
    assert first.bits == 32 and torch.equal(copy, model), "a client without a copy gets the model itself"
    moved = model + 0.01 * torch.randn(2048)
    change, copy = algorithm.downlink(moved, model, torch.Generator().manual_seed(1))
    assert change.bits == 8 and change.nbytes < first.nbytes / 3
    step = (moved - model).abs().max() / 127  # one 8-bit level of the largest bucket scale
    assert torch.allclose(copy, model + decode(change)) and (copy - moved).abs().max() <= step


def test_fedsense_refines_the_average_with_its_groups():
    cfg = _config(name="fedsense", clusters=2, distill_steps=1)
    algorithm = build_algorithm(cfg, 4)
    updates = [torch.tensor([1.0, 0, 0, 0]), torch.tensor([1.1, 0, 0, 0]), torch.tensor([0, 0, 0, 5.0])]
    aggregate = algorithm.screen([Upload(f"c{i}", Codec(bits=32).encode(u), 10) for i, u in enumerate(updates)])
    seen = {}

    def refine(model, groups, weights):
        seen.update(groups=groups, weights=weights)
        return model * 0, 0.25

    result = algorithm.server_update(torch.ones(4), aggregate, refine)
    assert len(seen["groups"]) == 2 and sorted(seen["weights"]) == pytest.approx([1 / 3, 2 / 3])
    assert torch.equal(result.model, torch.zeros(4)) and result.metrics == {"loss_similarity": 0.25, "groups": 2.0}
    plain = build_algorithm(_config(name="fedavg"), 4).server_update(torch.ones(4), aggregate, refine)
    assert torch.allclose(plain.model, torch.ones(4) + torch.stack(updates).mean(0))
