"""The direct_align hooks: the prepare injects the rollout's initial noise into its clean sample at a σ_hi drawn per
pair row in the configured range; at v = ε − x₀ the recovered x̂₀ is x₀ exactly (both branches), so the reward is
R(x₀); the relative reward with control words is (1 + k)·R(c⁺) − R(c⁻)."""

import pytest
import torch

from miles.backends.fsdp_utils.loss_hub import check_loss_hooks, get_loss_hooks
from miles.backends.fsdp_utils.loss_hub.direct_align import direct_align_formula, prepare_direct_align_batch
from tests.fast.backends.fsdp_utils.loss_hub.reward_pairs import call, make_batch, make_ctx, pattern

GAINS = torch.tensor([1.0, 2.0, 3.0])


def test_the_hooks_pass_the_start_up_check():
    ctx = make_ctx("direct_align")
    check_loss_hooks(get_loss_hooks(ctx.args, "actor"))  # get_loss_hooks checks them against the declaration too


@pytest.mark.parametrize("branch", ["denoise", "inversion"])
def test_recovery_is_exact_at_the_injected_noise(branch):
    ctx = make_ctx("direct_align", direct_align_branch=branch, direct_align_delta_sigma=0.05)
    batch = make_batch()
    prepared = prepare_direct_align_batch(ctx, batch, microbatch_id=0, optim_step_idx=0)
    hi = prepared.extras["sigma_hi"]
    assert bool(((hi >= 0.75) & (hi <= 0.96)).all()) and len(set(hi.tolist())) == 3
    torch.testing.assert_close(prepared.sigmas, hi if branch == "denoise" else hi - 0.05)
    x0, noise = batch["final_latents"], batch["latents"]
    v = (noise - x0).requires_grad_(True)
    loss, metrics = call(direct_align_formula, ctx, batch, prepared, v)
    torch.testing.assert_close(loss, -(GAINS * (x0 * pattern((2, 4, 4))).flatten(1).sum(1)).sum(), atol=1e-5, rtol=0)
    assert metrics["train/direct_align_x0_abs_diff"] < 1e-5


def test_the_relative_reward_with_control_words():
    ctx = make_ctx("direct_align", direct_align_control_words=["pos", "neg"], direct_align_k=0.25)
    batch = make_batch()
    prepared = prepare_direct_align_batch(ctx, batch, microbatch_id=0, optim_step_idx=0)
    v = batch["latents"] - batch["final_latents"]
    loss, _ = call(direct_align_formula, ctx, batch, prepared, v)
    plain = GAINS * (batch["final_latents"] * pattern((2, 4, 4))).flatten(1).sum(1)
    torch.testing.assert_close(loss, -((1.25 * 2.0 - 1.0) * plain).sum(), atol=1e-5, rtol=0)
