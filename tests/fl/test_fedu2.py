"""FedU²'s regulariser and aggregator against the paper's equations worked by hand and against the official code."""

import itertools
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from geofm.config.algorithm import AlgorithmConfig
from geofm.fl.aggregation.uploads import ClientUpload
from geofm.fl.algorithms import build_algorithm
from geofm.fl.algorithms.fedu2 import (
    fur_draws,
    min_norm_weights,
    simplex_projection,
    sliced_wasserstein,
    sphere_log,
    unified_update,
    uniformity_loss,
)
from geofm.fl.communication.codec import Codec


def test_the_spheres_log_map_is_the_angle_along_the_geodesic():
    # at t = e1, x = e2 lies a quarter circle away along e2: log = (pi / 2) e2; t itself maps to 0
    tangent = sphere_log(torch.tensor([1.0, 0.0]), torch.tensor([[0.0, 1.0], [1.0, 0.0]]))
    assert tangent.flatten().tolist() == pytest.approx([0.0, math.pi / 2, 0.0, 0.0], abs=1e-6)


def test_the_sliced_wasserstein_distance_pairs_the_sorted_projections():
    a, b = torch.tensor([[1.0], [0.0]]), torch.tensor([[3.0], [1.0]])
    # sorted: [0, 1] against [1, 3]: ((0 - 1)^2 + (1 - 3)^2) / 2 = 2.5; a direction of length 2 scales it by 4
    assert float(sliced_wasserstein(a, b, torch.tensor([[1.0]]))) == pytest.approx(2.5)
    assert float(sliced_wasserstein(a, b, torch.tensor([[1.0], [2.0]]))) == pytest.approx((2.5 + 10.0) / 2)


def test_representations_spread_like_the_references_cost_nothing_and_collapsed_ones_do():
    points, references, directions = fur_draws(64, 8, 3, 4, torch.device("cpu"))
    assert float(uniformity_loss(references * 3.0, points, references, directions)) == pytest.approx(0.0, abs=1e-10)
    collapsed = references[:1].expand(64, 8)
    assert float(uniformity_loss(collapsed, points, references, directions)) > 0.1


def test_the_regulariser_agrees_with_the_official_tangent_space_sliced_wasserstein():
    def official(z, tangent_points, references, projections):
        # sw_loss.py's RepresentationTagentCollapse re-expressed: geoopt's Sphere.logmap at each tangent point,
        # then sliced_wasserstein_distance(log_random, log_sample) with the given projections, over the points
        def logmap(x, y):
            u = y - (y * x).sum(-1, keepdim=True) * x
            dist = torch.arccos((y * x).sum(-1, keepdim=True).clamp(-1, 1))
            return u * dist / u.norm(dim=-1, keepdim=True).clamp_min(1e-12)

        total = 0.0
        for t, theta in zip(tangent_points, projections, strict=True):
            a, b = references, z
            gap = torch.sort((logmap(t, a) @ theta.T).T, dim=1)[0] - torch.sort((logmap(t, b) @ theta.T).T, dim=1)[0]
            total = total + gap.pow(2).mean()
        return total / len(tangent_points)

    torch.manual_seed(0)
    z = F.normalize(torch.randn(32, 16) + 2.0, dim=1)
    draws = fur_draws(32, 16, 6, 6, torch.device("cpu"))
    assert float(uniformity_loss(z, *draws)) == pytest.approx(float(official(z, *draws)), rel=1e-5)


def test_the_min_norm_weights_of_two_vectors_are_the_official_closed_form():
    # MinNormSolver._min_norm_element_from2: gamma = (v2v2 - v1v2) / (v1v1 + v2v2 - 2 v1v2) on the first vector
    v1, v2 = torch.tensor([1.0, 0.0]), torch.tensor([-0.5, 1.0])
    v1v1, v1v2, v2v2 = float(v1 @ v1), float(v1 @ v2), float(v2 @ v2)
    gamma = (v2v2 - v1v2) / (v1v1 + v2v2 - 2 * v1v2)
    gram = torch.stack((v1, v2)) @ torch.stack((v1, v2)).T
    assert min_norm_weights(gram).tolist() == pytest.approx([gamma, 1 - gamma], abs=1e-6)
    # orthogonal unit vectors: equal weights, the smallest combination [0.5, 0.5]
    assert min_norm_weights(torch.eye(2)).tolist() == pytest.approx([0.5, 0.5])


def test_the_min_norm_weights_of_three_vectors_are_the_smallest_point_of_their_hull():
    vectors = torch.tensor([[1.0, 0.2, 0.0], [0.1, 1.0, 0.3], [0.4, -0.2, 1.0]])
    gram = vectors @ vectors.T
    alpha = min_norm_weights(gram)
    grid = [
        torch.tensor([a, b, 1 - a - b]) for a, b in itertools.product(np.linspace(0, 1, 101), repeat=2) if a + b <= 1
    ]
    best = min(float(w.double() @ gram.double() @ w.double()) for w in grid)
    assert float(alpha.sum()) == pytest.approx(1.0) and float(alpha.min()) >= 0.0
    assert float(alpha @ gram.double() @ alpha) <= best + 1e-9


def test_the_simplex_projection_keeps_a_point_of_the_simplex_and_clips_others():
    assert simplex_projection(torch.tensor([0.2, 0.8], dtype=torch.float64)).tolist() == pytest.approx([0.2, 0.8])
    assert simplex_projection(torch.tensor([2.0, 0.0], dtype=torch.float64)).tolist() == pytest.approx([1.0, 0.0])


def test_one_server_round_gives_the_papers_numbers():
    # Delta = [2, 0] and [0, 3]: unit [1, 0] and [0, 1], alpha = [0.5, 0.5], direction [0.5, 0.5];
    # m = (2 + 3) / 2 with equal examples: Theta' = Theta + 2.5 [0.5, 0.5]
    direction, alpha = unified_update([torch.tensor([2.0, 0.0]), torch.tensor([0.0, 3.0])], [2.0, 3.0])
    assert direction.tolist() == pytest.approx([0.5, 0.5]) and alpha.tolist() == pytest.approx([0.5, 0.5])
    server = build_algorithm(AlgorithmConfig(name="fedu2"), 2, num_clients=2)
    encode = Codec(bits=32).encode
    uploads = [
        ClientUpload("a", {"update": encode(torch.tensor([2.0, 0.0]))}, 4, {"uniformity_loss": 1.0}),
        ClientUpload("b", {"update": encode(torch.tensor([0.0, 3.0]))}, 4, {"uniformity_loss": 3.0}),
    ]
    outcome = server.server_update(torch.ones(2), server.aggregate(uploads))
    assert outcome.model.tolist() == pytest.approx([2.25, 2.25])
    assert outcome.metrics == pytest.approx({"unified_norm": 0.5**0.5, "uniformity_loss": 2.0})


def test_clients_that_agree_give_fedavgs_step():
    server = build_algorithm(AlgorithmConfig(name="fedu2"), 2, num_clients=2)
    encode = Codec(bits=32).encode
    uploads = [ClientUpload(c, {"update": encode(torch.tensor([3.0, 4.0]))}, 1) for c in "ab"]
    assert server.server_update(torch.zeros(2), server.aggregate(uploads)).model.tolist() == pytest.approx([3.0, 4.0])
