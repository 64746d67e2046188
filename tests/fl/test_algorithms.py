import numpy as np
import pytest
import torch

from geofm.config.algorithm import AlgorithmConfig
from geofm.errors import ConfigError
from geofm.fl.aggregation.uploads import ClientUpload
from geofm.fl.algorithms import build_algorithm
from geofm.fl.algorithms.fedavg import FedAvg
from geofm.fl.algorithms.fedprox import FedProx
from geofm.fl.algorithms.fedsense import FedSense
from geofm.fl.algorithms.rounds import LocalRound, LocalUpdate, payload_arrays
from geofm.fl.communication.codec import Codec, Packet, decode


def _config(**fields) -> AlgorithmConfig:
    return AlgorithmConfig.model_validate(fields)


def _local(params, anchor, state=None) -> LocalRound:
    return LocalRound("c0", {"model": torch.cat([a.flatten() for a in anchor])}, params, anchor, state or {}, 0.1)


def _packet(arrays: dict, payload: str) -> Packet:
    return Packet.from_arrays(payload_arrays(arrays)[payload])


def test_build_algorithm_picks_the_named_member():
    assert type(build_algorithm(_config(name="fedavg"), 4)) is FedAvg
    assert type(build_algorithm(_config(name="fedprox", options={"proximal_beta": 0.1}), 4)) is FedProx
    assert type(build_algorithm(_config(name="fedsense"), 4)) is FedSense


def test_fedprox_adds_the_proximal_term_and_fedavg_nothing():
    params, anchor = [torch.tensor([1.0, 2.0], requires_grad=True)], [torch.tensor([0.0, 0.0])]
    assert build_algorithm(_config(name="fedavg"), 2).local_hooks(_local(params, anchor)).regulariser is None
    hooks = build_algorithm(_config(name="fedprox", options={"proximal_beta": 0.5}), 2).local_hooks(
        _local(params, anchor)
    )
    assert float(hooks.regulariser(None, None).detach()) == pytest.approx(0.5 / 2 * (1 + 4))


def test_fedsense_takes_gradients_at_the_perturbed_point_and_restores_theta():
    param = torch.tensor([3.0, 4.0], requires_grad=True)
    anchor = [torch.zeros(2)]
    algorithm = build_algorithm(_config(name="fedsense", options={"perturbation_radius": 0.5}), 2)
    hooks = algorithm.local_hooks(_local([param], anchor))
    with hooks.around_gradient():
        seen = param.detach().clone()
        (param**2).sum().backward()
    assert torch.allclose(seen, torch.tensor([3.3, 4.4])), "theta + 0.5 * d / ||d||, d = (3, 4), ||d|| = 5"
    assert torch.equal(param.detach(), torch.tensor([3.0, 4.0])) and torch.allclose(param.grad, 2 * seen)


def test_uploads_carry_error_feedback_state_only_when_configured():
    update = LocalUpdate({"update": torch.linspace(-1, 1, 1000)})
    plain, state = build_algorithm(_config(name="fedavg", uplink={"bits": 1}), 1000), {}
    arrays, _ = plain.upload(update, state, torch.Generator().manual_seed(0))
    assert _packet(arrays, "update").bits == 1 and state == {}
    feedback = build_algorithm(_config(name="fedavg", uplink={"bits": 1, "error_feedback": True}), 1000)
    arrays, _ = feedback.upload(update, state, torch.Generator().manual_seed(0))
    residual = (update.payloads["update"] - decode(_packet(arrays, "update"))).numpy()
    assert np.allclose(state["feedback.update.error"], residual) and state["feedback.update.rounds"][0] == 1
    feedback.upload(update, state, torch.Generator().manual_seed(0))
    assert state["feedback.update.rounds"][0] == 2


def test_a_compressed_downlink_sends_the_change_and_tracks_the_clients_copy():
    model = torch.randn(2048)
    algorithm = build_algorithm(_config(name="fedavg", downlink={"bits": 8}), 2048)
    client = build_algorithm(_config(name="fedavg", downlink={"bits": 8}), 2048)
    arrays, config = algorithm.send(model, 1, ["a"], torch.Generator().manual_seed(0))["a"]
    first = _packet(arrays, "model")
    assert first.bits == 32 and config == {"downlink": "model", "reference_round": 1}, "no copy yet: the model"
    received, state = client.receive("a", arrays, config, {})
    assert torch.equal(received["model"], model) and state["reference_round"][0] == 1
    algorithm.note_replies(1, ["a"])
    moved = model + 0.01 * torch.randn(2048)
    sent = algorithm.send(moved, 2, ["a", "b"], torch.Generator().manual_seed(1))
    (arrays, config), (whole, _) = sent["a"], sent["b"]
    change = _packet(arrays, "model")
    assert change.bits == 8 and change.nbytes < first.nbytes / 3 and config["downlink"] == "change"
    step = (moved - model).abs().max() / 127  # one 8-bit level of the largest bucket scale
    copy = algorithm.references["model"]
    assert torch.allclose(copy, model + decode(change)) and (copy - moved).abs().max() <= step
    assert torch.equal(decode(_packet(whole, "model")), copy), "a client without the last copy gets the new one whole"
    received, state = client.receive("a", arrays, config, state)
    assert torch.equal(received["model"], copy) and np.array_equal(state["downlink.model"], copy.numpy())
    with pytest.raises(ConfigError, match="client a: holds the model of round 2, the server sent a change to round 1"):
        client.receive("a", arrays, config, state)


def test_fedsense_refines_the_average_with_its_groups():
    cfg = _config(name="fedsense", options={"clusters": 2, "distill_steps": 1})
    algorithm = build_algorithm(cfg, 4)
    updates = [torch.tensor([1.0, 0, 0, 0]), torch.tensor([1.1, 0, 0, 0]), torch.tensor([0, 0, 0, 5.0])]
    uploads = [ClientUpload(f"c{i}", {"update": Codec(bits=32).encode(u)}, 10) for i, u in enumerate(updates)]
    payloads = algorithm.aggregate(uploads)
    seen = {}

    def distillation(rnd, model, groups, weights):
        seen.update(rnd=rnd, groups=groups, weights=weights)
        return model * 0, 0.25

    algorithm.distillation = distillation
    algorithm.begin_round(3)
    result = algorithm.server_update(torch.ones(4), payloads)
    assert seen["rnd"] == 3 and len(seen["groups"]) == 2 and sorted(seen["weights"]) == pytest.approx([1 / 3, 2 / 3])
    assert torch.equal(result.model, torch.zeros(4)) and result.metrics == {"loss_similarity": 0.25, "groups": 2.0}
    plain = build_algorithm(_config(name="fedavg"), 4).server_update(torch.ones(4), payloads)
    assert torch.allclose(plain.model, torch.ones(4) + torch.stack(updates).mean(0))
