"""AWM's maths against hand-written computations (ALGORITHMS.md, AWM): logp 0 for a perfect prediction, p = 1 gives
σℓ, each weighting's value, A' = clamp(A, ±5)/5, the strata of the grid indices [1, int(0.9·N)) and the draws landing
one per stratum."""

import math

import numpy as np
import pytest
import torch

from miles.algorithms.awm import WEIGHTINGS
from miles.diffusion.awm import (
    AWM_WEIGHTINGS,
    awm_log_prob,
    matching_error,
    scaled_advantage,
    stratified_indices,
    stratum_bounds,
)

B, SHAPE = 4, (2, 3, 3)


def tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    # multiples of 1/64: ε − x₀ is exact in float32, so a perfect prediction has ℓ = 0 exactly
    v, x0, eps = (torch.round(torch.randn(B, *SHAPE, generator=g) * 64) / 64 for _ in range(3))
    sigma = torch.tensor([0.95, 0.6, 0.3, 0.05])
    return v, x0, eps, sigma


def hand_error(v, x0, eps):
    """ℓ_b = (1/D)·Σ_d (v − (ε − x₀))², one loop per sample."""
    out = []
    for b in range(v.shape[0]):
        diff = (v[b].double() - (eps[b].double() - x0[b].double())).flatten().tolist()
        out.append(sum(d * d for d in diff) / len(diff))
    return torch.tensor(out, dtype=torch.float64)


def test_declaration_lists_the_weightings_the_maths_knows():
    assert WEIGHTINGS == AWM_WEIGHTINGS


@pytest.mark.parametrize("weighting", AWM_WEIGHTINGS)
def test_log_prob_is_zero_for_a_perfect_prediction(weighting):
    _, x0, eps, sigma = tensors()
    logp = awm_log_prob(eps - x0, x0, eps, sigma, weighting=weighting)
    assert torch.equal(logp, torch.zeros(B, dtype=torch.float64))


def test_ghuber_with_power_one_is_sigma_times_the_error():
    v, x0, eps, sigma = tensors()
    logp = awm_log_prob(v, x0, eps, sigma, weighting="ghuber", power=1.0)
    torch.testing.assert_close(logp, -sigma.double() * hand_error(v, x0, eps), rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize(
    ("weighting", "power", "expected"),
    [  # ℓ = 16, σ = 0.5 worked by hand: (16 + 1e-10)^¼ = 2, (1e-10)^¼ = 10^-2.5
        ("ghuber", 0.25, (0.5 / 0.25) * (2.0 - 10**-2.5)),
        ("ghuber", 0.5, (0.5 / 0.5) * (4.0 - 1e-5)),
        ("l", 0.25, 16.0),
        ("sigma", 0.25, 8.0),
        ("sigma2", 0.25, 4.0),
    ],
)
def test_each_weighting_at_a_hand_worked_point(weighting, power, expected):
    x0 = torch.zeros(1, 4)
    eps = torch.zeros(1, 4)
    v = torch.full((1, 4), 4.0)  # (v − (ε − x₀))² = 16 everywhere
    logp = awm_log_prob(v, x0, eps, torch.tensor([0.5]), weighting=weighting, power=power)
    assert math.isclose(-logp.item(), expected, rel_tol=1e-9)


def test_matching_error_is_the_per_sample_mean_squared_error():
    v, x0, eps, _ = tensors(seed=3)
    torch.testing.assert_close(matching_error(v, x0, eps), hand_error(v, x0, eps), rtol=1e-12, atol=0)


def test_unknown_weighting_names_the_flag():
    v, x0, eps, sigma = tensors()
    with pytest.raises(ValueError, match="--awm-weighting"):
        awm_log_prob(v, x0, eps, sigma, weighting="huber")


def test_scaled_advantage_clamps_to_five_then_divides():
    a = torch.tensor([-12.0, -5.0, -1.25, 0.0, 2.5, 5.0, 7.0])
    assert scaled_advantage(a, 5.0).tolist() == [-1.0, -1.0, -0.25, 0.0, 0.5, 1.0, 1.0]


@pytest.mark.parametrize(
    ("num_steps", "count", "edges"),
    [  # floor(linspace(1, int(0.9·N), K + 1)) worked by hand
        (14, 6, [1, 2, 4, 6, 8, 10, 12]),  # int(12.6) = 12: the authors' SD3.5-M grid
        (10, 6, [1, 2, 3, 5, 6, 7, 9]),  # int(9.0) = 9: linspace 1, 2.33, 3.67, 5, 6.33, 7.67, 9
        (10, 8, [1, 2, 3, 4, 5, 6, 7, 8, 9]),  # every index of [1, 9) once
        (6, 2, [1, 3, 5]),  # int(5.4) = 5
    ],
)
def test_strata_split_the_indices_from_one_to_ninety_percent(num_steps, count, edges):
    lower, upper = stratum_bounds(num_steps, count, 0.9)
    assert lower.tolist() == edges[:-1] and upper.tolist() == edges[1:]
    # u = 0 takes each stratum's first index, u → 1 its last
    assert stratified_indices(num_steps, count, 0.9, np.zeros(count)).tolist() == edges[:-1]
    almost_one = np.full(count, np.nextafter(1.0, 0.0))
    assert stratified_indices(num_steps, count, 0.9, almost_one).tolist() == [e - 1 for e in edges[1:]]


def test_strata_are_the_authors_float32_linspace_over_a_sweep_of_layouts():
    # the authors cut [1, top) with torch.linspace(1, top, K + 1) in float32 then .long(); an exact or float64 floor
    # differs from it in some layouts (one index lower at an edge that should be whole): 18 of these 2 689 layouts
    differ = 0
    for fraction, step_counts in ((0.9, range(2, 61)), (1.0, range(2, 49))):
        for num_steps in step_counts:
            top = int(fraction * num_steps)
            for count in range(1, top):
                reference = torch.linspace(1, top, count + 1, dtype=torch.float32).long().numpy()
                lower, upper = stratum_bounds(num_steps, count, fraction)
                assert lower.tolist() == reference[:-1].tolist() and upper.tolist() == reference[1:].tolist()
                assert (upper > lower).all()
                differ += not np.array_equal(np.floor(np.linspace(1.0, float(top), count + 1)), reference)
    assert differ == 18


def test_strata_are_numbers_under_the_planners_fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():  # the planner converts its fake rollouts with the rollout side's own code
        lower, upper = stratum_bounds(14, 6, 0.9)
    assert lower.tolist() == [1, 2, 4, 6, 8, 10] and upper.tolist() == [2, 4, 6, 8, 10, 12]


def test_draws_land_one_per_stratum_and_reach_every_index():
    rng = np.random.default_rng(0)
    lower, upper = [1, 2, 4, 6, 8, 10], [2, 4, 6, 8, 10, 12]
    seen = set()
    for _ in range(400):
        index = stratified_indices(14, 6, 0.9, rng.random(6))
        assert all(lo <= i < hi for i, lo, hi in zip(index.tolist(), lower, upper))
        seen.update(index.tolist())
    assert seen == set(range(1, 12))  # [1, int(0.9·14)): never index 0 (pure noise) nor the last steps


def test_too_many_strata_for_the_grid_name_the_flags():
    with pytest.raises(ValueError, match="--awm-train-timesteps 6.*--diffusion-num-steps 6"):
        stratum_bounds(6, 6, 0.9)
