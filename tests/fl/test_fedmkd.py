"""FedMKD's distillation and alignment against the paper's equations worked by hand and the official attention."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from geofm.config.algorithm import AlgorithmConfig
from geofm.fl.algorithms import build_algorithm
from geofm.fl.algorithms.fedmkd import (
    OWN,
    alignment_loss,
    distill_multi_teacher,
    integrated_target,
    teacher_weights,
)
from geofm.fl.algorithms.moon import representation
from geofm.fl.parameter_vectors import ParameterLayout


def test_each_teacher_weighs_by_the_scaled_dot_product_attention_of_the_student():
    # f_g = [1, 0]; teachers [1, 0] and [0, 1]: scores [1, 0] / sqrt(2), a = softmax = [0.6698, 0.3302]
    student, teachers = torch.tensor([[1.0, 0.0]]), torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]]])
    a = math.exp(2**-0.5) / (math.exp(2**-0.5) + 1.0)
    assert teacher_weights(student, teachers).flatten().tolist() == pytest.approx([a, 1 - a])
    # t = sum_k a_k f_k / ||f_k||: a teacher [0, 3] counts as [0, 1]
    target = integrated_target(student, torch.tensor([[[1.0, 0.0]], [[0.0, 3.0]]]))
    b = math.exp(2**-0.5) / (math.exp(2**-0.5) + math.exp(0.0))  # scores [1, 0] / sqrt(2)
    assert target.flatten().tolist() == pytest.approx([b, 1 - b])


def test_the_weights_agree_with_the_official_self_attention():
    # model.py's SelfAttention: softmax(query [B, 1, K] @ keys^T [B, K, N] / sqrt(K)), squeezed to [B, N]
    torch.manual_seed(0)
    student, teachers = torch.randn(5, 8), torch.randn(3, 5, 8)
    keys = teachers.permute(1, 0, 2)  # [B, N, K]
    official = F.softmax(torch.matmul(student.unsqueeze(1), keys.transpose(-1, -2)) / 8**0.5, dim=-1).squeeze(1)
    assert torch.allclose(teacher_weights(student, teachers), official, atol=1e-6)


def test_the_alignment_is_two_minus_twice_the_cosine():
    assert float(alignment_loss(torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0]]))) == pytest.approx(2.0)
    assert float(alignment_loss(torch.tensor([[1.0, 1.0]]), torch.tensor([[2.0, 2.0]]))) == pytest.approx(0.0, abs=1e-6)
    # a batch: the mean of 2 - 2 cos over the rows, here (2 + 0) / 2
    both = alignment_loss(torch.tensor([[1.0, 0.0], [1.0, 1.0]]), torch.tensor([[0.0, 1.0], [2.0, 2.0]]))
    assert float(both) == pytest.approx(1.0, abs=1e-6)


@pytest.mark.slow
def test_the_distillation_moves_the_student_towards_its_teachers():
    torch.manual_seed(0)
    student = nn.Linear(4, 3, bias=False)
    layout = ParameterLayout.of(student)
    teacher = {"weight": torch.randn(3, 4)}
    images = torch.randn(16, 4)
    optimizer = torch.optim.SGD(student.parameters(), lr=0.5)
    first = distill_multi_teacher(student, [teacher, teacher], [images] * 5, lambda m, x: m(x), optimizer, 1)
    later = distill_multi_teacher(student, [teacher, teacher], [images] * 5, lambda m, x: m(x), optimizer, 5)
    assert later < first
    # a student that is its teachers already has nothing to learn
    same = distill_multi_teacher(
        student,
        [dict(zip(layout.names, layout.parameters(student), strict=True))],
        [images],
        lambda m, x: m(x),
        optimizer,
        1,
    )
    assert same == pytest.approx(0.0, abs=1e-6)


def test_a_client_starts_from_its_own_model_from_its_second_round():
    module = nn.Linear(2, 1, bias=False)
    algorithm = build_algorithm(AlgorithmConfig(name="fedmkd"), ParameterLayout.of(module))
    with torch.no_grad():
        module.weight.copy_(torch.tensor([[1.0, 2.0]]))
    algorithm.restore_local(module, {})
    assert module.weight.tolist() == [[1.0, 2.0]], "its first round starts from the global model"
    algorithm.restore_local(module, {OWN: np.array([4.0, 4.0], dtype=np.float32)})
    assert module.weight.tolist() == [[4.0, 4.0]]


@pytest.mark.slow
def test_the_anchor_is_the_received_global_backbone_and_the_upload_its_change(tiny_swin):
    """A client whose own model is not the global one: L_anchor compares its representation to the frozen global
    one's, is 0 once they agree, and the upload is the trained model minus the global one."""
    module = nn.Module()
    module.encoder = tiny_swin(in_chans=3, img_size=32).eval()
    algorithm = build_algorithm(
        AlgorithmConfig(name="fedmkd", options={"anchor_weight": 2.0}), ParameterLayout.of(module)
    )
    own = algorithm.shared.flatten_module(module)
    received = {"model": own + 0.05 * torch.randn(len(own), generator=torch.Generator().manual_seed(0))}
    state = {}
    local = algorithm.local_round("a", received, module, state, 0.1)
    regulariser = algorithm.local_hooks(local).regulariser
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        module.encoder.forward_features(images)
        z = local.capture.outputs[0].float().mean((1, 2))
        expected = alignment_loss(z, representation(local.global_network, images))
        assert float(regulariser(None, None)) == pytest.approx(2.0 * float(expected), rel=1e-5) and float(expected) > 0
        algorithm.shared.assign(module, received["model"])
        module.encoder.forward_features(images)
        assert float(regulariser(None, None)) == pytest.approx(0.0, abs=1e-5)
    update = algorithm.finish_local(local, own, steps=1)
    assert torch.allclose(update.payloads["update"], own - received["model"]) and state[OWN].tolist() == own.tolist()
    assert not local.capture.handles, "the hooks are removed with the round"


def test_a_run_without_public_images_is_refused():
    from geofm.fl.algorithms.fedmkd import FedMKD

    with pytest.raises(ValueError, match=r"name: FedMKD distils the client models .* on the server's public images"):
        FedMKD.check_public_images(AlgorithmConfig(name="fedmkd"), available=False)
    FedMKD.check_public_images(AlgorithmConfig(name="fedmkd"), available=True)
