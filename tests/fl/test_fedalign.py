"""FedAlign against the official code's rule worked by hand: the power iteration, the transmitting
matrix, the width-pruned stage and the regulariser's scale and gradient on timm backbones."""

import math

import pytest
import torch
import torch.nn.functional as F
from timm.models.vision_transformer import Block
from torch import nn

from geofm.config.algorithm import AlgorithmConfig
from geofm.errors import ConfigError
from geofm.fl.aggregation.uploads import ClientUpload
from geofm.fl.algorithms import build_algorithm
from geofm.fl.algorithms.fedalign import (
    feature_map,
    lipschitz_estimate,
    pruned_parameters,
    top_eigenvalue,
    transmitting_matrix,
)
from geofm.fl.algorithms.rounds import LocalUpdate, payload_arrays
from geofm.fl.parameter_vectors import ParameterLayout
from geofm.tasks import StepOutput
from geofm.tasks.mim.model import Tap, embed_tokens, run_backbone


def test_the_power_iteration_by_hand_on_a_2x2():
    # K = diag(4, 1), eigenvalues 4 and 1. From v0 = (1, 1):
    # step 1: K v0 = (4, 1), |K v0| = sqrt 17 = 4.1231056; v1 = (4, 1) / sqrt 17.
    # step 2: K v1 = (16, 1) / sqrt 17, |K v1| = sqrt(257 / 17) = 3.8881348.
    # step k: |K v_{k-1}| = sqrt((16^k + 1) / (16^(k-1) + 1)) -> 4; k = 10: 4 (1 - 3.5e-12).
    k = torch.diag(torch.tensor([4.0, 1.0], dtype=torch.float64)).unsqueeze(0)
    assert top_eigenvalue(k, 1).item() == pytest.approx(math.sqrt(17), rel=1e-12)
    assert top_eigenvalue(k, 2).item() == pytest.approx(math.sqrt(257 / 17), rel=1e-12)
    assert top_eigenvalue(k, 10).item() == pytest.approx(4.0, rel=1e-10)


def test_the_power_iteration_finds_the_top_eigenvalue_of_a_symmetric_psd_matrix():
    # A batch of K = M M^T (3 x 3, rank 3): the estimate converges to eigvalsh's largest, M's top singular value squared.
    torch.manual_seed(0)
    m = torch.randn(2, 3, 5, dtype=torch.float64)
    k = m @ m.transpose(1, 2)
    torch.testing.assert_close(top_eigenvalue(k, 200), torch.linalg.eigvalsh(k)[:, -1])
    torch.testing.assert_close(top_eigenvalue(k, 200), torch.linalg.svdvals(m)[:, 0] ** 2)


def test_the_transmitting_matrix_by_hand():
    # Same grid: inputs (C_in = 1) [1, 3] over 2 positions, outputs (C_out = 2) [2, 4] and [1, 0]:
    # T = ([1*2 + 3*4, 1*1 + 3*0]) / 2 = [7, 0.5]; its top singular value sqrt(49 + 0.25) = 7.0178344.
    inputs = torch.tensor([[[[1.0, 3.0]]]])
    outputs = torch.tensor([[[[2.0, 4.0]], [[1.0, 0.0]]]])
    torch.testing.assert_close(transmitting_matrix(inputs, outputs), torch.tensor([[[7.0, 0.5]]]))
    assert lipschitz_estimate(inputs, outputs, 10).item() == pytest.approx(math.sqrt(49.25), rel=1e-6)
    # A larger input grid is pooled to the output's: 2 x 2 channels [[1, 2], [3, 4]] and [[0, 0], [0, 4]]
    # average to 2.5 and 1 on the 1 x 1 output 2: T = [[2.5 * 2], [1 * 2]] / 1 = [[5], [2]].
    inputs = torch.tensor([[[[1.0, 2.0], [3.0, 4.0]], [[0.0, 0.0], [0.0, 4.0]]]])
    torch.testing.assert_close(transmitting_matrix(inputs, torch.tensor([[[[2.0]]]])), torch.tensor([[[5.0], [2.0]]]))


def test_timm_features_become_channels_first():
    swin = torch.arange(24.0).reshape(1, 2, 3, 4)  # (B, H, W, C)
    torch.testing.assert_close(feature_map(swin), swin.permute(0, 3, 1, 2))
    tokens = torch.tensor([[[100.0, 100.0], [1.0, 2.0], [3.0, 4.0]]])  # (B, N, C), a class token first
    assert feature_map(tokens, prefix_tokens=1).tolist() == [[[[1.0], [3.0]], [[2.0], [4.0]]]]


def test_the_pruned_stage_is_the_hand_sliced_mlp():
    """Two ViT blocks of width 8, MLP hidden 32: width 0.25 keeps make_divisible(8) = 8 hidden units each."""
    torch.manual_seed(0)
    stage = nn.Sequential(Block(8, num_heads=2, mlp_ratio=4.0), Block(8, num_heads=2, mlp_ratio=4.0))
    x = torch.randn(2, 5, 8)

    def by_hand(block: Block, x: torch.Tensor) -> torch.Tensor:
        x = x + block.attn(block.norm1(x))
        mlp = block.mlp
        hidden = F.gelu(F.linear(block.norm2(x), mlp.fc1.weight[:8], mlp.fc1.bias[:8]))
        return x + F.linear(hidden, mlp.fc2.weight[:, :8], mlp.fc2.bias)

    pruned = torch.func.functional_call(stage, pruned_parameters(stage, 0.25), (x,))
    torch.testing.assert_close(pruned, by_hand(stage[1], by_hand(stage[0], x)))
    # The gradient reaches the kept slices of the real weights only.
    pruned.sum().backward()
    fc1 = stage[0].mlp.fc1.weight.grad
    assert fc1[:8].abs().sum() > 0 and not fc1[8:].any() and not stage[0].mlp.fc2.weight.grad[:, 8:].any()
    # One block alone is a stage too (a ViT's final one); 0.3 of 32 is 9.6, rounded to 8 then up to 16 (>10% off).
    assert pruned_parameters(stage[0], 0.3)["mlp.fc1.weight"].shape == (16, 8)


def _local(family, tiny_swin, tiny_vit, **options):
    backbone = (tiny_swin if family == "swin" else tiny_vit)(in_chans=3, img_size=64)
    module = nn.Module()
    module.backbone = backbone
    algorithm = build_algorithm(AlgorithmConfig(name="fedalign", options=options), ParameterLayout.of(module))
    local = algorithm.local_round("one", {"model": algorithm.shared.flatten_module(module)}, module, {}, 0.1)
    return algorithm, local, module


@pytest.mark.parametrize("family", ["swin", "vit"])
def test_the_regulariser_weighs_mu_times_the_task_loss_and_trains_the_final_stage_only(family, tiny_swin, tiny_vit):
    algorithm, local, module = _local(family, tiny_swin, tiny_vit, power_iterations=100)
    hooks = algorithm.local_hooks(local)
    images = torch.randn(2, 3, 64, 64)
    # The final stage's first MLP and the hidden units its pruned copy keeps (a quarter of 4 x 128 or 4 x 32).
    stage, mlp, kept = (
        ("backbone.layers.3.blocks.", "0.mlp", 128) if family == "swin" else ("backbone.blocks.3.", "mlp", 32)
    )
    with hooks.around_gradient():
        module.backbone.forward_features(images)
        assert len(local.inputs) == len(local.outputs) == 1
        x, y = local.inputs[0].detach(), local.outputs[0].detach()
        task = torch.tensor(1.5)
        regulariser = hooks.regulariser(None, StepOutput({"loss": task}))
        # mu (L_task / L_reg) L_reg = 0.45 * 1.5 = 0.675 in value; the pruned pass was not captured.
        assert regulariser.item() == pytest.approx(0.675, rel=1e-6) and not local.inputs
        regulariser.backward()
    assert not local.stage._forward_hooks and not local.stage._forward_pre_hooks
    # L_reg against torch's SVD: the mean squared difference of the two runs' top singular values.
    with torch.no_grad():
        pruned = torch.func.functional_call(local.stage, pruned_parameters(local.stage, 0.25), (x,))
        prefix = local.prefix_tokens
        sigma = [
            torch.linalg.svdvals(transmitting_matrix(feature_map(x, prefix), feature_map(z, prefix)))[:, 0]
            for z in (pruned, y)
        ]
    assert local.losses[0].item() == pytest.approx(F.mse_loss(*sigma).item(), rel=1e-4)
    assert local.losses[0].item() > 0
    trained = {n for n, p in module.named_parameters() if p.grad is not None and p.grad.any()}
    assert f"{stage}{mlp}.fc1.weight" in trained and all(n.startswith(stage) for n in trained)
    fc1 = module.get_parameter(f"{stage}{mlp}.fc1.weight").grad
    assert fc1[:kept].any(dim=1).all() and not fc1[kept:].any()


@pytest.mark.parametrize("family", ["swin", "vit"])
def test_every_forward_path_reaches_the_hooks(family, tiny_swin, tiny_vit):
    """timm's forward_intermediates and geofm's stage-by-stage run (a Swin's last stage split at GFM's tap
    after its merging) call the final stage as forward_features does."""
    algorithm, local, module = _local(family, tiny_swin, tiny_vit)
    backbone, images = module.backbone.eval(), torch.randn(1, 3, 64, 64)
    hooks = algorithm.local_hooks(local)
    with torch.no_grad(), hooks.around_gradient():
        backbone.forward_features(images)
        expected = local.outputs[0]
        hooks.regulariser(None, StepOutput({"loss": torch.tensor(1.0)}))
        backbone.forward_intermediates(images, indices=None, intermediates_only=True)
        torch.testing.assert_close(local.outputs[0], expected)
        hooks.regulariser(None, StepOutput({"loss": torch.tensor(1.0)}))
        tap = Tap(3, include_merging=True) if family == "swin" else Tap(1)
        run_backbone(backbone, embed_tokens(backbone, images), tap)
        torch.testing.assert_close(local.outputs[0], expected)
        hooks.regulariser(None, StepOutput({"loss": torch.tensor(1.0)}))
        with pytest.raises(RuntimeError, match="fedalign needs the backbone's final stage run in every forward"):
            hooks.regulariser(None, StepOutput({"loss": torch.tensor(1.0)}))
    assert len(local.losses) == 3 and local.losses[0] == local.losses[1] == local.losses[2]


def test_uploads_and_the_server_are_fedavgs_with_the_lipschitz_loss_logged(tiny_swin, tiny_vit):
    algorithm, local, _ = _local("vit", tiny_swin, tiny_vit)
    local.losses.extend([torch.tensor(1.0), torch.tensor(2.0)])
    start = local.received["model"]
    update = algorithm.finish_local(local, start + 0.5, 2)
    torch.testing.assert_close(update.payloads["update"], torch.full_like(start, 0.5))
    assert update.metadata == {"lipschitz_loss": 1.5}
    other = LocalUpdate({"update": torch.zeros_like(start)}, {"lipschitz_loss": 3.0})
    uploads = [
        ClientUpload(name, payload_arrays(algorithm.upload(u, {}, torch.Generator())[0]), n, u.metadata)
        for name, u, n in (("a", update, 3), ("b", other, 1))
    ]
    outcome = algorithm.server_update(start, algorithm.aggregate(uploads))
    # Weights 3/4 and 1/4: the model moves by 3/4 * 0.5 = 0.375, the logged loss is (3 * 1.5 + 3) / 4 = 1.875.
    torch.testing.assert_close(outcome.model, start + 0.375)
    assert outcome.metrics == {"lipschitz_loss": pytest.approx(1.875)}


def test_bad_settings_and_models_are_refused(tiny_swin, tiny_vit):
    with pytest.raises(ConfigError, match=r"algorithm\.options\.width"):
        build_algorithm(AlgorithmConfig(name="fedalign", options={"width": 1.0}), 2)
    with pytest.raises(ConfigError, match=r"algorithm\.options\.power_iterations"):
        build_algorithm(AlgorithmConfig(name="fedalign", options={"power_iterations": 0}), 2)
    module = nn.Linear(2, 2)
    algorithm = build_algorithm(AlgorithmConfig(name="fedalign"), ParameterLayout.of(module))
    with pytest.raises(ConfigError, match=r"algorithm fedalign .* no module named backbone or encoder"):
        algorithm.local_round("one", {"model": torch.zeros(6)}, module, {}, 0.1)
    _, _, probe = _local("vit", tiny_swin, tiny_vit)
    probe.backbone.requires_grad_(False)  # linear probing: only a head trains
    probe.head = nn.Linear(2, 1)
    algorithm = build_algorithm(AlgorithmConfig(name="fedalign"), ParameterLayout.of(probe))
    with pytest.raises(ConfigError, match="final stage of the model's backbone, which is frozen"):
        algorithm.local_round("one", {"model": torch.zeros(3)}, probe, {}, 0.1)


def test_a_pruned_copy_that_keeps_every_unit_adds_nothing_rather_than_nan():
    # MLP hidden 4: make_divisible(0.25 * 4) = 8, capped at 4, so the copy is the stage itself, L_reg = 0
    # and mu (L_task / L_reg) L_reg is 0 (the official ratio would be 0 / 0).
    module = nn.Module()
    module.backbone = nn.Module()
    module.backbone.blocks = nn.Sequential(Block(4, num_heads=1, mlp_ratio=1.0))
    algorithm = build_algorithm(AlgorithmConfig(name="fedalign"), ParameterLayout.of(module))
    local = algorithm.local_round("one", {"model": algorithm.shared.flatten_module(module)}, module, {}, 0.1)
    hooks = algorithm.local_hooks(local)
    with hooks.around_gradient():
        module.backbone.blocks(torch.randn(2, 3, 4))
        assert hooks.regulariser(None, StepOutput({"loss": torch.tensor(1e3)})).item() == 0.0
    assert local.losses[0].item() == 0.0
