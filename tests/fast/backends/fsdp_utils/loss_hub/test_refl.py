"""The refl hooks against hand maths: the prepare replays the recorded x_j at σ_j, the loss is −λ·R(x_j − σ_j·v), its
gradient in v is λ·σ_j·gain·w, the hinge stops it once R ≥ c, and the first-step parity metric is 0 when the trainer's
velocity is the engine's (its Euler step reproduces the recorded x_{j+1})."""

import pytest
import torch

from miles.backends.fsdp_utils.loss_hub import check_loss_hooks, get_loss_hooks
from miles.backends.fsdp_utils.loss_hub.refl import prepare_refl_batch, refl_formula
from miles.plot import infer_loss_type
from tests.fast.backends.fsdp_utils.loss_hub.reward_pairs import call, make_batch, make_ctx, pattern


def test_the_hooks_pass_the_start_up_check():
    ctx = make_ctx()
    check_loss_hooks(get_loss_hooks(ctx.args, "actor"))  # get_loss_hooks checks them against the declaration too


def test_loss_and_gradient_equal_the_hand_computation_and_parity_is_zero_on_the_engines_velocity():
    ctx, batch = make_ctx(reward_grad_scale=0.5), make_batch()
    prepared = prepare_refl_batch(ctx, batch, microbatch_id=0, optim_step_idx=0)
    assert torch.equal(prepared.latents, batch["latents"]) and torch.equal(prepared.sigmas, batch["sigma"])
    v = ((batch["next_latents"] - batch["latents"]) / (0.1 - 0.3)).requires_grad_(True)  # the engine's Euler v
    loss, metrics = call(refl_formula, ctx, batch, prepared, v)
    gains = torch.tensor([1.0, 2.0, 3.0])
    x0 = batch["latents"] - 0.3 * v.detach()
    hand = -0.5 * (gains * (x0 * pattern((2, 4, 4))).flatten(1).sum(1))
    torch.testing.assert_close(loss, hand.sum())
    loss.backward()
    torch.testing.assert_close(v.grad, 0.5 * 0.3 * gains[:, None, None, None] * pattern((2, 4, 4)))
    assert metrics["train/euler_step_abs_diff"] < 1e-6 and metrics["train/refl_sigma_mean"] == pytest.approx(0.3)
    assert infer_loss_type([{**metrics, "role": "actor"}]) == "refl"


def test_the_hinge_gives_no_gradient_once_the_reward_reaches_it():
    ctx, batch = make_ctx(reward_grad_hinge=-100.0), make_batch()
    prepared = prepare_refl_batch(ctx, batch, microbatch_id=0, optim_step_idx=0)
    v = torch.zeros_like(batch["latents"], requires_grad=True)
    loss, _ = call(refl_formula, ctx, batch, prepared, v)
    loss.backward()
    assert float(loss.detach()) == 0.0 and float(v.grad.abs().max()) == 0.0
