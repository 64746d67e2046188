"""MOON against the paper's equations worked by hand, its hooks on timm backbones, and a 1-bit uplink."""

import math

import numpy as np
import pytest
import torch
from torch import nn

from geofm.config.algorithm import AlgorithmConfig
from geofm.errors import ConfigError
from geofm.fl.aggregation.uploads import ClientUpload
from geofm.fl.algorithms import build_algorithm
from geofm.fl.algorithms.moon import PREVIOUS, model_contrastive_loss, pooled, representation
from geofm.fl.algorithms.rounds import payload_arrays
from geofm.fl.communication.codec import Codec, Packet, decode
from geofm.fl.parameter_vectors import ParameterLayout
from geofm.tasks import StepOutput
from geofm.tasks.mim.model import Tap, embed_tokens, run_backbone


class PatchEmbed(nn.Module):
    """(B, 2, H, W) -> (B, H, W, 2) tokens, band 0 scaled by ``a``."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.tensor(1.0))

    def forward(self, images):
        return images.permute(0, 2, 3, 1) * torch.stack((self.a, torch.ones_like(self.a)))


class Block(nn.Module):
    """Channel 1 of (B, H, W, 2) tokens scaled by ``b``."""

    def __init__(self) -> None:
        super().__init__()
        self.b = nn.Parameter(torch.tensor(1.0))

    def forward(self, tokens):
        return tokens * torch.stack((torch.ones_like(self.b), self.b))


class Stage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(Block())

    def forward(self, tokens):
        return self.blocks(tokens)


class TinyBackbone(nn.Module):
    """A Swin-shaped backbone of two parameters: z = pooled (a x_0, b x_1)."""

    def __init__(self) -> None:
        super().__init__()
        self.patch_embed = PatchEmbed()
        self.layers = nn.Sequential(Stage())

    def forward_features(self, images):
        return self.layers(self.patch_embed(images))

    def forward_intermediates(self, images, indices, norm, intermediates_only):
        assert (indices, norm, intermediates_only) == (1, False, True)
        return [self.forward_features(images).permute(0, 3, 1, 2)]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = TinyBackbone()

    def forward(self, images):
        return self.backbone.forward_features(images)


# One image of two pixels, (band 0, band 1) = (1, 0) and (1, 2): the pooled input is (1, 1), so
# z = (a * 1, b * 1) = (a, b), dz/da = (1, 0), dz/db = (0, 1).
IMAGE = torch.tensor([[[[1.0, 1.0]], [[0.0, 2.0]]]])


def _round(algorithm, state, model_vector, lr=0.5):
    """One local SGD step on mu * l_con alone (l_sup = 0); returns the model, the loss and the update."""
    model = Net()
    algorithm.shared.assign(model, model_vector)
    received = {"model": model_vector}
    local = algorithm.local_round("one", received, model, state, lr)
    hooks = algorithm.local_hooks(local)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    features = model(IMAGE)
    loss = hooks.regulariser({"image": IMAGE}, StepOutput({"loss": features.sum() * 0}))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    update = algorithm.finish_local(local, algorithm.shared.flatten_module(model), 1)
    return model, local, loss, update


def test_one_step_gives_the_papers_numbers():
    # Global (a, b) = (1, 1): z_glob = (1, 1). Previous local model (a, b) = (2, 1): z_prev = (2, 1).
    # The trained model starts at the global one: z = (1, 1).
    # sim(z, z_glob) = 1; sim(z, z_prev) = (2 + 1) / (sqrt 2 sqrt 5) = 3 / sqrt 10 = 0.9486833.
    # tau = 0.5: logits (2, 1.8973666); l_con = log(1 + exp(1.8973666 - 2)) = log(1 + 0.9024578) = 0.6431466.
    # mu = 2: the regulariser is 1.2862932.
    cfg = AlgorithmConfig(name="moon", options={"mu": 2.0, "temperature": 0.5})
    algorithm = build_algorithm(cfg, ParameterLayout.of(Net()))
    state = {PREVIOUS: np.array([2.0, 1.0], np.float32)}
    model, local, loss, update = _round(algorithm, state, torch.tensor([1.0, 1.0]))
    assert loss.item() == pytest.approx(2 * math.log(1 + math.exp(6 / math.sqrt(10) - 2)), rel=1e-6)
    assert loss.item() == pytest.approx(1.2862932, rel=1e-6)

    # Gradient: l_con = log(1 + exp((s_p - s_g) / tau)), so dl/dz = sigma((s_p - s_g) / tau) / tau (ds_p/dz - ds_g/dz),
    # with ds/dz = (w/|w| - s z/|z|) / |z| for s = sim(z, w). ds_g/dz = 0 (z parallel to z_glob);
    # ds_p/dz = ((2, 1)/sqrt 5 - (3/sqrt 10)(1, 1)/sqrt 2) / sqrt 2 = (0.5, -0.5) / sqrt 10 = (0.1581139, -0.1581139).
    # sigma(-0.1026334) = 1 / (1 + 1.1080851) = 0.4743641; dl/dz = 0.4743641 * 2 * (0.1581139, -0.1581139)
    # = (0.1500071, -0.1500071). mu = 2: dL/da = 0.3000142, dL/db = -0.3000142.
    # SGD at lr 0.5: a = 1 - 0.1500071 = 0.8499929, b = 1 + 0.1500071 = 1.1500071.
    trained = algorithm.shared.flatten_module(model)
    np.testing.assert_allclose(trained.numpy(), [0.8499929, 1.1500071], rtol=1e-6)
    # The trained backbone is the client's next previous model; the upload is FedAvg's theta - Theta.
    np.testing.assert_allclose(state[PREVIOUS], [0.8499929, 1.1500071], rtol=1e-6)
    np.testing.assert_allclose(update.payloads["update"].numpy(), [-0.1500071, 0.1500071], rtol=1e-5)
    assert update.metadata["contrastive_loss"] == pytest.approx(0.6431466, rel=1e-6)  # l_con, without mu

    # The hooks are gone with the round: a forward captures nothing.
    model(IMAGE)
    assert not local.inputs and not local.outputs
    assert not model.backbone.patch_embed._forward_pre_hooks and not model.backbone.layers[0].blocks._forward_hooks


def test_a_first_round_takes_the_global_model_as_the_previous_one():
    # No previous model: z_glob = z_prev, so sim(z, z_glob) = sim(z, z_prev) whatever z:
    # l_con = -log(e^s / (2 e^s)) = log 2 (mu = 1) and its gradient is 0; the step leaves (a, b) where it was.
    algorithm = build_algorithm(AlgorithmConfig(name="moon"), ParameterLayout.of(Net()))
    state = {}
    model, _, loss, _ = _round(algorithm, state, torch.tensor([1.5, -0.5]))
    assert loss.item() == pytest.approx(math.log(2), rel=1e-6)
    assert algorithm.shared.flatten_module(model).tolist() == [1.5, -0.5]
    np.testing.assert_array_equal(state[PREVIOUS], [1.5, -0.5])


def test_the_loss_is_the_mean_over_samples_of_the_papers_term():
    # Sample 1: z = (1, 0), z_glob = (1, 0), z_prev = (0, 1): s_g = 1, s_p = 0, tau = 0.5:
    # l = log(1 + e^(0 - 2)) = log(1.1353353) = 0.1269280.
    # Sample 2: z = (0, 1), z_glob = (1, 0), z_prev = (0, 1): s_g = 0, s_p = 1: l = log(1 + e^2) = 2.1269280.
    # Mean: 1.1269280.
    z = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    z_glob = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    z_prev = torch.tensor([[0.0, 1.0], [0.0, 1.0]])
    assert model_contrastive_loss(z, z_glob, z_prev, 0.5).item() == pytest.approx(1.1269280, rel=1e-6)


def test_vit_tokens_pool_without_the_class_token():
    tokens = torch.tensor([[[100.0, 100.0], [1.0, 2.0], [3.0, 4.0]]])
    assert pooled(tokens, prefix_tokens=1).tolist() == [[2.0, 3.0]]
    assert pooled(torch.ones(2, 3, 3, 5)).shape == (2, 5)


@pytest.mark.parametrize("family", ["swin", "vit"])
def test_the_hooked_representation_of_a_timm_backbone_is_its_frozen_copys(family, tiny_swin, tiny_vit):
    """At the start of a first round the trained backbone is the global one: z = z_glob = z_prev, l_con = log 2,
    whichever path (timm's forward_features or forward_intermediates, geofm's run_backbone) the model takes."""
    backbone = (tiny_swin if family == "swin" else tiny_vit)(in_chans=3, img_size=64).eval()
    module = nn.Module()
    module.backbone = backbone
    algorithm = build_algorithm(AlgorithmConfig(name="moon"), ParameterLayout.of(module))
    local = algorithm.local_round("one", {"model": algorithm.shared.flatten_module(module)}, module, {}, 0.1)
    regulariser = algorithm.local_hooks(local).regulariser
    images = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        expected = representation(local.global_copy, images)
        backbone.forward_features(images)
        z = pooled(local.outputs[0], local.prefix_tokens)
        torch.testing.assert_close(z, expected)
        assert regulariser(None, None).item() == pytest.approx(math.log(2), rel=1e-5)
        backbone.forward_intermediates(images, indices=None, intermediates_only=True)
        assert regulariser(None, None).item() == pytest.approx(math.log(2), rel=1e-5)
        # Masked image modelling runs it stage by stage, a Swin's last stage split at GFM's tap after its merging.
        tap = Tap(3, include_merging=True) if family == "swin" else Tap(1)
        run_backbone(backbone, embed_tokens(backbone, images), tap)
        torch.testing.assert_close(pooled(local.outputs[0], local.prefix_tokens), expected)
        assert regulariser(None, None).item() == pytest.approx(math.log(2), rel=1e-5)


def test_a_model_without_a_trainable_backbone_or_encoder_is_refused():
    module = nn.Linear(2, 2)
    algorithm = build_algorithm(AlgorithmConfig(name="moon"), ParameterLayout.of(module))
    with pytest.raises(ConfigError, match="no module named backbone or encoder"):
        algorithm.local_round("one", {"model": torch.zeros(6)}, module, {}, 0.1)
    probe = Net()
    probe.backbone.requires_grad_(False)  # linear probing: only a head trains
    probe.head = nn.Linear(2, 1)
    algorithm = build_algorithm(AlgorithmConfig(name="moon"), ParameterLayout.of(probe))
    with pytest.raises(ConfigError, match="the model's backbone, which is frozen"):
        algorithm.local_round("one", {"model": torch.zeros(3)}, probe, {}, 0.1)
    with pytest.raises(ConfigError, match=r"algorithm\.options\.temperature"):
        build_algorithm(AlgorithmConfig(name="moon", options={"temperature": 0}), 2)


def test_moon_composes_with_a_1bit_uplink_with_error_feedback():
    # The same local round twice (global (1, 3), previous (2, 1)): the second upload differs from the first
    # by the residual the first left, and the previous model is kept beside the residual in the state.
    cfg = AlgorithmConfig(name="moon", uplink={"bits": 1, "error_feedback": True})
    layout = ParameterLayout.of(Net())
    client, server = build_algorithm(cfg, layout), build_algorithm(cfg, layout, num_clients=1)
    state = {}
    generator = torch.Generator().manual_seed(0)
    global_model = torch.tensor([1.0, 3.0])
    residual = torch.zeros(2)
    for _ in range(2):
        state[PREVIOUS] = np.array([2.0, 1.0], np.float32)
        _, _, _, update = _round(client, state, global_model)
        np.testing.assert_allclose(state[PREVIOUS], (global_model + update.payloads["update"]).numpy())
        change = update.payloads["update"] + residual
        up, _ = client.upload(update, state, generator)
        packet = Packet.from_arrays(payload_arrays(up)["update"])
        # 1 bit: the sign of each value times the bucket's mean absolute value; the rest is the residual.
        expected = Codec(bits=1, bucket_size=packet.bucket_size).encode(change)
        assert packet.bits == 1 and torch.equal(decode(packet), decode(expected))
        residual = torch.from_numpy(state["feedback.update.error"].copy())
        torch.testing.assert_close(residual, change - decode(packet))
        assert residual.abs().sum() > 0
        upload = ClientUpload("one", payload_arrays(up), 5, update.metadata)
        payloads = server.aggregate([upload])
        outcome = server.server_update(global_model, payloads)
        torch.testing.assert_close(outcome.model, global_model + decode(packet))  # FedAvg's Theta + Delta
        assert outcome.metrics["contrastive_loss"] == update.metadata["contrastive_loss"]
        server.commit(outcome, payloads)
