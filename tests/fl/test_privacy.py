"""Client-level differential privacy: clipping and noise by hand, the accountant against Opacus, config errors."""

from __future__ import annotations

import math

import pytest
import torch
from opacus.accountants import RDPAccountant

from geofm.config.algorithm import AlgorithmConfig
from geofm.errors import ConfigError
from geofm.fl.aggregation.uploads import ClientUpload
from geofm.fl.algorithms import build_algorithm
from geofm.fl.algorithms.rounds import LocalUpdate, payload_arrays
from geofm.fl.communication.codec import Packet, decode
from geofm.fl.privacy.client_level import (
    PrivacyAccountant,
    PrivateMean,
    check_statistics,
    clip_update,
    noise_generator,
    privatise,
)

N = 200_000  # coordinates for the statistical checks: the sample std is within 0.5% of the true one (> 3 sigma)


def _privacy(mode: str, clip: float = 1.0, z: float = 0.0, **more) -> dict:
    return {"mode": mode, "clip": clip, "noise_multiplier": z, "seed": 7, **more}


def _cfg(name: str = "fedavg", **fields) -> AlgorithmConfig:
    return AlgorithmConfig(name=name, **fields)


def test_clipping_scales_an_update_above_the_norm_down_to_it_by_hand():
    # ||(3, 0, 4)|| = 5; S = 1 scales by 1/5: (0.6, 0, 0.8); S = 10 leaves it as it is.
    update = torch.tensor([3.0, 0.0, 4.0])
    assert torch.allclose(clip_update(update, 1.0), torch.tensor([0.6, 0.0, 0.8]))
    assert torch.equal(clip_update(update, 10.0), update)


def test_local_noise_has_std_z_times_s_around_the_clipped_update():
    # (3, 0, 4) clipped to S = 2 is (1.2, 0, 1.6); with z = 1.5 each coordinate gets N(0, (1.5 * 2)^2 = 9).
    privacy = AlgorithmConfig(name="fedavg", privacy=_privacy("local", clip=2.0, z=1.5)).privacy
    update = torch.zeros(N)
    update[:3] = torch.tensor([3.0, 0.0, 4.0])
    noisy = privatise(update, privacy, noise_generator(7, "client", "a", 1))
    noise = noisy - clip_update(update, 2.0)
    assert float(noise.std()) == pytest.approx(3.0, rel=5e-3) and abs(float(noise.mean())) < 0.03
    assert torch.equal(noisy, privatise(update, privacy, noise_generator(7, "client", "a", 1))), "seeded"
    assert not torch.equal(noisy, privatise(update, privacy, noise_generator(7, "client", "a", 2))), "per round"
    assert not torch.equal(noisy, privatise(update, privacy, noise_generator(None))), "OS entropy"


def test_central_mean_clips_each_update_weighs_them_equally_and_adds_noise_z_s_over_m():
    # Clipped to S = 1: (3, 0, 4) -> (0.6, 0, 0.8); (0, 0.5, 0) stays. Equal weights, whatever the examples:
    # mean (0.3, 0.25, 0.4). Noise std z S / m = 2 * 1 / 2 = 1.
    updates = [torch.zeros(N), torch.zeros(N)]
    updates[0][:3], updates[1][:3] = torch.tensor([3.0, 0.0, 4.0]), torch.tensor([0.0, 0.5, 0.0])
    exact = PrivateMean(_cfg(privacy=_privacy("central")).privacy, noise_generator(None))
    assert torch.allclose(exact.combine(updates, [0.9, 0.1])[:3], torch.tensor([0.3, 0.25, 0.4]))
    noisy = PrivateMean(_cfg(privacy=_privacy("central", z=2.0)).privacy, noise_generator(7, "server", 1))
    noise = noisy.combine(updates, [0.9, 0.1]) - exact.combine(updates, [0.9, 0.1])
    assert float(noise.std()) == pytest.approx(1.0, rel=5e-3)


def test_local_privacy_noises_before_the_1bit_codec_and_its_error_feedback():
    """The residual is that of the noisy update: e = (clip(u) + noise) - deq(Q(clip(u) + noise))."""
    up = {"bits": 1, "bucket_size": 4, "error_feedback": True}
    algorithm = build_algorithm(_cfg(privacy=_privacy("local", clip=1.0, z=0.5), uplink=up), 8)
    update = torch.arange(8.0) - 3.5
    state = {}
    arrays, reports = algorithm.upload(LocalUpdate({"update": update}), state, torch.Generator(), noise_generator(1))
    noisy = privatise(update, algorithm.privacy, noise_generator(1))
    sent = decode(Packet.from_arrays(payload_arrays(arrays)["update"]))
    assert torch.allclose(torch.from_numpy(state["feedback.update.error"]), noisy - sent, atol=1e-6)
    assert reports["update"].update_norm == pytest.approx(float(noisy.norm()), rel=1e-5)


def test_central_privacy_clips_what_the_server_decodes_from_1bit_uploads():
    """A 1-bit packet decodes to a vector of another norm than the update: the server clips the decoded one."""
    up = {"bits": 1, "bucket_size": 4, "error_feedback": True}
    algorithm = build_algorithm(_cfg(privacy=_privacy("central", clip=0.5), uplink=up), 8)
    uploads, decoded = [], []
    for i, client in enumerate(("a", "b", "c")):
        update = torch.linspace(-1.0, 1.0 + i, 8)
        arrays, _ = algorithm.upload(LocalUpdate({"update": update}), {}, torch.Generator())
        packets = payload_arrays(arrays)
        decoded.append(decode(Packet.from_arrays(packets["update"])))
        uploads.append(ClientUpload(client, packets, num_examples=10**i))
    algorithm.begin_round(1)
    combined = algorithm.aggregate(uploads)["update"].update
    expected = sum(clip_update(d, 0.5) for d in decoded) / 3
    assert all(float(d.norm()) > 0.5 for d in decoded)
    assert torch.allclose(combined, expected, atol=1e-6) and float(combined.norm()) <= 0.5 + 1e-6


def test_the_seeded_server_noise_is_the_rounds():
    algorithm = build_algorithm(_cfg(privacy=_privacy("central", z=1.0)), 4)
    uploads = [
        ClientUpload(
            "a", payload_arrays(algorithm.upload(LocalUpdate({"update": torch.ones(4)}), {}, torch.Generator())[0]), 1
        )
    ]
    draws = []
    for rnd in (1, 1, 2):
        algorithm.begin_round(rnd)
        draws.append(algorithm.aggregate(uploads)["update"].update)
    assert torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], draws[2])


def test_epsilon_after_k_rounds_is_opacus_rdp_accountant_value():
    # Printed once from Opacus 1.6.0: z = 1, q = 1, 10 steps, delta 1e-5 -> epsilon 19.0536.
    reference = RDPAccountant()
    for _ in range(10):
        reference.step(noise_multiplier=1.0, sample_rate=1.0)
    assert reference.get_epsilon(1e-5) == pytest.approx(19.0536, rel=1e-4)
    central = PrivacyAccountant(_cfg(privacy=_privacy("central", z=1.1)).privacy, sample_rate=0.25)
    direct = RDPAccountant()
    assert central.epsilon() == 0.0
    for _ in range(4):
        central.step(["a", "b"])
        direct.step(noise_multiplier=1.1, sample_rate=0.25)
    assert central.report() == {"epsilon": pytest.approx(direct.get_epsilon(1e-5), rel=1e-9), "delta": 1e-5}
    # Local: each client composes over its own uploads at sample rate 1; the log holds the largest.
    local = PrivacyAccountant(_cfg(privacy=_privacy("local", z=1.0)).privacy, sample_rate=0.25)
    for clients in (["a", "b"], ["a"], ["a", "c"]):
        local.step(clients)
    three = RDPAccountant()
    for _ in range(3):
        three.step(noise_multiplier=1.0, sample_rate=1.0)
    assert local.epsilon() == pytest.approx(three.get_epsilon(1e-5), rel=1e-9)
    resumed = PrivacyAccountant(local.privacy, sample_rate=0.25)
    resumed.load_state_dict(local.state_dict())
    assert resumed.epsilon() == local.epsilon()
    clipping_only = PrivacyAccountant(_cfg(privacy=_privacy("local", z=0.0)).privacy, 1.0)
    clipping_only.step(["a"])
    assert math.isinf(clipping_only.epsilon())


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"name": "scaffold"}, "privacy: scaffold uploads ['delta_y', 'delta_c']"),
        ({"name": "fedbn"}, "privacy: fedbn uploads ['update', 'norms']"),
        ({"name": "fednova"}, "privacy: fednova normalises"),
        ({"name": "pfedla"}, "privacy: pfedla mixes"),
        ({"aggregator": {"name": "median"}}, "aggregator: central privacy calibrates its noise to the mean"),
        ({"norm_factor": 3.0}, "norm_factor: central privacy clips every update"),
        ({"name": "fedsense", "options": {"distill_steps": 2}}, "options.distill_steps: central privacy noises only"),
    ],
)
def test_privacy_refuses_what_it_cannot_cover_naming_the_field(fields, message):
    with pytest.raises(ConfigError, match=rf"^algorithm\.{message}".replace("[", r"\[").replace("]", r"\]")):
        build_algorithm(_cfg(**{**fields, "privacy": _privacy("central", z=1.0)}), 4)


def test_local_privacy_takes_a_robust_aggregator_and_fedsense_distillation():
    for fields in ({"aggregator": {"name": "median"}}, {"name": "fedsense", "options": {"distill_steps": 2}}):
        build_algorithm(_cfg(**fields, privacy=_privacy("local", z=1.0)), 4)


@pytest.mark.parametrize(
    ("privacy", "message"),
    [
        ({"mode": "central", "clip": 0.0, "noise_multiplier": 1.0}, "privacy.clip"),
        ({"mode": "local", "clip": 1.0, "noise_multiplier": -1.0}, "privacy.noise_multiplier"),
        ({"mode": "both", "clip": 1.0, "noise_multiplier": 1.0}, "privacy.mode"),
        ({"mode": "local", "clip": 1.0, "noise_multiplier": 1.0, "delta": 1.0}, "privacy.delta"),
    ],
)
def test_bad_privacy_settings_name_the_key(privacy, message):
    with pytest.raises(ValueError, match=message):
        AlgorithmConfig(name="fedavg", privacy=privacy)


def test_a_model_with_batch_norm_statistics_is_refused_under_privacy():
    privacy = _cfg(privacy=_privacy("local")).privacy
    check_statistics(privacy, None)
    check_statistics(None, torch.ones(3).numpy())
    with pytest.raises(ConfigError, match="batch-norm layers"):
        check_statistics(privacy, torch.ones(3).numpy())


@pytest.mark.parametrize("name", ["fedsam", "fedasam", "swa", "wima", "fedalign", "fedgloss"])
def test_the_flatness_algorithms_take_privacy_local_and_all_but_fedgloss_central(name):
    """Each uploads one averaged ``update``: both modes compose, except FedGloSS's dual under central privacy."""
    for mode in ("local", "central"):
        cfg = AlgorithmConfig.model_validate(
            {"name": name, "privacy": {"mode": mode, "clip": 1.0, "noise_multiplier": 1.0, "seed": 0}}
        )
        if name == "fedgloss" and mode == "central":
            with pytest.raises(ConfigError, match="privacy: fedgloss"):
                build_algorithm(cfg, 4, num_clients=2)
        else:
            assert build_algorithm(cfg, 4, num_clients=2).privacy.mode == mode
