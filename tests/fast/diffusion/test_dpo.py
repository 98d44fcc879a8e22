"""DPO in flow form against hand-written maths (ALGORITHMS.md, "DPO in flow form"): log 2 at θ = θ_ref, the gradient
β·(v_ref − u)/(2·D·P) for the chosen sample and its negative for the rejected one, z negated by swapping w and l, the
loss at arbitrary errors, and the best-vs-worst pairing rule with its ties and zero-spread groups."""

import math

import pytest
import torch

from miles.diffusion.dpo import best_worst_pair, dpo_logits, dpo_loss, flow_error

P, SHAPE = 5, (2, 3, 3)
D = 2 * 3 * 3


def pairs(seed=0):
    g = torch.Generator().manual_seed(seed)
    x0_w, x0_l, eps = (torch.randn(P, *SHAPE, generator=g, dtype=torch.float64) for _ in range(3))
    v_ref_w, v_ref_l = (torch.randn(P, *SHAPE, generator=g, dtype=torch.float64) for _ in range(2))
    return x0_w, x0_l, eps, v_ref_w, v_ref_l


def mean_loss(v_w, v_l, v_ref_w, v_ref_l, x0_w, x0_l, eps, beta):
    z = dpo_logits(
        flow_error(v_w, x0_w, eps),
        flow_error(v_l, x0_l, eps),
        flow_error(v_ref_w, x0_w, eps),
        flow_error(v_ref_l, x0_l, eps),
        beta=beta,
    )
    return dpo_loss(z).mean(), z


def test_flow_error_is_the_per_sample_mean_squared_error_to_eps_minus_x0():
    x0_w, _, eps, v, _ = pairs()
    expected = [((v[i] - (eps[i] - x0_w[i])) ** 2).sum().item() / D for i in range(P)]
    assert flow_error(v, x0_w, eps).tolist() == pytest.approx(expected, rel=1e-6)


def test_the_loss_is_log_2_at_theta_equal_theta_ref():
    x0_w, x0_l, eps, v_ref_w, v_ref_l = pairs()
    loss, z = mean_loss(v_ref_w, v_ref_l, v_ref_w, v_ref_l, x0_w, x0_l, eps, beta=100.0)
    assert torch.equal(z, torch.zeros(P, dtype=z.dtype))
    assert loss.item() == pytest.approx(math.log(2), abs=1e-7)


def test_the_gradient_at_theta_ref_is_beta_times_v_ref_minus_u_over_2dp_and_opposite_for_the_rejected():
    x0_w, x0_l, eps, v_ref_w, v_ref_l = pairs(1)
    beta = 100.0
    v_w, v_l = v_ref_w.clone().requires_grad_(True), v_ref_l.clone().requires_grad_(True)
    loss, _ = mean_loss(v_w, v_l, v_ref_w, v_ref_l, x0_w, x0_l, eps, beta)
    loss.backward()
    u_w, u_l = eps - x0_w, eps - x0_l  # the flow-matching targets
    torch.testing.assert_close(v_w.grad, beta * (v_ref_w - u_w) / (2 * D * P), rtol=1e-4, atol=1e-6)  # fp32 errors
    torch.testing.assert_close(v_l.grad, -beta * (v_ref_l - u_l) / (2 * D * P), rtol=1e-4, atol=1e-6)  # fp32 errors


def test_swapping_chosen_and_rejected_negates_z():
    x0_w, x0_l, eps, v_ref_w, v_ref_l = pairs(2)
    g = torch.Generator().manual_seed(9)
    v_w, v_l = v_ref_w + 0.1 * torch.randn(v_ref_w.shape, generator=g, dtype=torch.float64), v_ref_l * 0.9
    _, z = mean_loss(v_w, v_l, v_ref_w, v_ref_l, x0_w, x0_l, eps, beta=7.0)
    _, swapped = mean_loss(v_l, v_w, v_ref_l, v_ref_w, x0_l, x0_w, eps, beta=7.0)
    assert z.abs().min() > 0
    torch.testing.assert_close(swapped, -z)


def test_the_loss_at_arbitrary_errors_matches_the_written_out_formula():
    err_w, err_l, ref_w, ref_l = torch.tensor([0.3, 1.2]), torch.tensor([0.5, 0.1]), torch.tensor([0.4, 1.0]), 0.2
    beta = 3.0
    z = dpo_logits(err_w, err_l, ref_w, torch.tensor([ref_l, ref_l]), beta=beta)
    for i in range(2):
        expected_z = -(beta / 2) * ((err_w[i].item() - ref_w[i].item()) - (err_l[i].item() - ref_l))
        assert z[i].item() == pytest.approx(expected_z, rel=1e-6)
        assert dpo_loss(z)[i].item() == pytest.approx(math.log(1 + math.exp(-expected_z)), rel=1e-6)
    assert dpo_loss(torch.tensor([-200.0, 200.0])).tolist() == pytest.approx([200.0, 0.0], abs=1e-6)  # stable


@pytest.mark.parametrize(
    ("rewards", "keep", "expected"),
    [
        ([0.1, 0.9, 0.4, 0.2], False, (1, 0, True)),  # highest vs lowest
        ([0.5, 0.9, 0.9, 0.1, 0.1], False, (1, 4, True)),  # ties: the first highest, the last lowest
        ([0.3, 0.3, 0.3], False, (0, 2, False)),  # zero spread: first vs last, dropped by default
        ([0.3, 0.3, 0.3], True, (0, 2, True)),  # ... kept with the option
        ([0.7], True, (0, 0, False)),  # one sample: no pair
    ],
)
def test_best_worst_pairing(rewards, keep, expected):
    assert best_worst_pair(rewards, keep_zero_spread=keep) == expected
