"""The dpo hooks against hand-written maths: a pair's two rows share one ε and one σ from the scheduler's table,
seeded by ids; the loss is log 2 per pair at θ = θ_ref and its gradient through the hooks is β·(v_ref − u)/(2·D·P)
for w and the opposite for l; a weight-0 pair adds nothing; the reference refresh every K optimizer steps."""

import argparse
import math
from types import MappingProxyType

import pytest
import torch

from miles.backends.fsdp_utils.loss_hub import LossHooks, check_loss_hooks
from miles.backends.fsdp_utils.loss_hub.dpo import (
    dpo_formula,
    prepare_dpo_batch,
    refresh_due,
    refresh_reference,
)
from miles.backends.fsdp_utils.loss_hub.types import DiffusionLossContext, WindowMetrics
from miles.backends.fsdp_utils.microbatch import (
    build_microbatch_schedule,
    pairs_in_window,
    weighted_denominator,
    window_weight_totals,
)
from miles.diffusion.schedule import training_sigmas

P, C, H, W, L, E = 4, 2, 3, 3, 5, 6
D = C * H * W
BETA = 100.0


class FakeFamily:
    scheduler_shift = 3.0


def make_ctx(**overrides):
    args = dict(seed=7, dpo_beta=BETA, dpo_ref_update_interval=40, num_steps_per_rollout=4)
    args.update(overrides)
    return DiffusionLossContext(
        args=argparse.Namespace(**args),
        role="actor",
        rollout_id=0,
        dp_rank=0,
        dp_size=1,
        device=torch.device("cpu"),
        forward_dtype=torch.float32,
        family=FakeFamily(),
        networks=MappingProxyType({}),
    )


def make_batch(weight=None):
    g = torch.Generator().manual_seed(0)
    return {
        "x0_w": torch.randn(P, C, H, W, generator=g),
        "x0_l": torch.randn(P, C, H, W, generator=g),
        "weight": torch.ones(P) if weight is None else torch.tensor(weight, dtype=torch.float32),
        "cond/prompt_embeds": torch.randn(P, L, E, generator=g),
        "cond/pooled_prompt_embeds": torch.randn(P, E, generator=g),
        "pair_index": torch.arange(P),
    }


def run_formula(ctx, batch, prepared, new_pred, v_ref, metrics=None):
    return dpo_formula(
        ctx,
        batch,
        prepared,
        new_pred=new_pred,
        frozen_preds=MappingProxyType({"dpo_ref": v_ref}),
        metrics=metrics if metrics is not None else WindowMetrics(),
        optim_step_idx=0,
        train_output_inputs=[],
    )


def test_dpo_hooks_pass_the_signature_check():
    check_loss_hooks(LossHooks(prepare=prepare_dpo_batch, formula=dpo_formula, after_train=refresh_reference))


def test_a_pair_shares_one_eps_and_one_sigma_from_the_table_seeded_per_pair_and_window():
    ctx, batch = make_ctx(), make_batch()
    prepared = prepare_dpo_batch(ctx, batch, microbatch_id=3, optim_step_idx=0)
    again = prepare_dpo_batch(ctx, batch, microbatch_id=4, optim_step_idx=0)  # another rank's micro-batch
    other = prepare_dpo_batch(ctx, batch, microbatch_id=3, optim_step_idx=1)
    assert torch.equal(prepared.latents, again.latents) and not torch.equal(prepared.latents, other.latents)
    eps, sigma = prepared.extras["noise"], prepared.sigmas
    assert prepared.latents.shape == (2 * P, C, H, W) and prepared.frozen_networks == ("dpo_ref",)
    assert torch.equal(eps[0::2], eps[1::2]) and torch.equal(sigma[0::2], sigma[1::2])
    assert not torch.equal(eps[0], eps[2]) and len(set(sigma[0::2].tolist())) == P
    table = training_sigmas(shift=3.0)
    assert all(bool((table == s).any()) for s in sigma)
    for i in range(P):  # x_σ = (1 − σ)·x₀ + σ·ε, w rows even, l rows odd
        s = sigma[2 * i]
        torch.testing.assert_close(prepared.latents[2 * i], (1 - s) * batch["x0_w"][i] + s * eps[2 * i])
        torch.testing.assert_close(prepared.latents[2 * i + 1], (1 - s) * batch["x0_l"][i] + s * eps[2 * i])
    assert torch.equal(prepared.embeds["pooled_prompt_embeds"][0::2], batch["cond/pooled_prompt_embeds"])
    assert torch.equal(prepared.embeds["pooled_prompt_embeds"][1::2], batch["cond/pooled_prompt_embeds"])


def test_log_2_per_pair_and_the_gradient_identity_at_theta_ref_through_the_hooks():
    ctx, batch = make_ctx(), make_batch()
    prepared = prepare_dpo_batch(ctx, batch, microbatch_id=0, optim_step_idx=0)
    v_ref = torch.randn(2 * P, C, H, W, generator=torch.Generator().manual_seed(5))
    new_pred = v_ref.clone().requires_grad_(True)
    metrics = WindowMetrics()
    loss_sum = run_formula(ctx, batch, prepared, new_pred, v_ref, metrics)
    assert loss_sum.item() == pytest.approx(P * math.log(2), rel=1e-6)
    (loss_sum / P).backward()  # the trunk divides by the window's pair count
    eps = prepared.extras["noise"][0::2]
    u_w, u_l = eps - batch["x0_w"], eps - batch["x0_l"]
    torch.testing.assert_close(new_pred.grad[0::2], BETA * (v_ref[0::2] - u_w) / (2 * D * P), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(new_pred.grad[1::2], -BETA * (v_ref[1::2] - u_l) / (2 * D * P), rtol=1e-4, atol=1e-6)
    means = metrics.means()
    assert means["train/loss"] == pytest.approx(math.log(2), rel=1e-6) and means["train/dpo_implicit_acc"] == 0.0


def test_a_weight_0_pair_adds_no_loss_and_no_gradient():
    ctx, batch = make_ctx(), make_batch(weight=[1.0, 0.0, 1.0, 0.0])
    prepared = prepare_dpo_batch(ctx, batch, microbatch_id=0, optim_step_idx=0)
    v_ref = torch.randn(2 * P, C, H, W, generator=torch.Generator().manual_seed(5))
    new_pred = (v_ref + 0.05).requires_grad_(True)
    metrics = WindowMetrics()
    run_formula(ctx, batch, prepared, new_pred, v_ref, metrics).backward()
    dropped = [2, 3, 6, 7]  # the rows of pairs 1 and 3
    assert torch.equal(new_pred.grad[dropped], torch.zeros_like(new_pred.grad[dropped]))
    assert new_pred.grad[[0, 1, 4, 5]].abs().min() > 0
    assert metrics.means()["train/dpo_pair_weight"] == 0.5 and metrics.counts["train/dpo_z"] == 2


def window_step(batch, weighted):
    """The trunk's step on one window of `batch` (one rank, one micro-batch) through a tiny policy v = v_ref + θ·x:
    (the loss it backpropagates, ∂/∂θ, the metrics), divided as the trunk divides (`weighted`: by the pairs that
    train, the dpo entry's pair weight; else by the pair count)."""
    ctx = make_ctx()
    prepared = prepare_dpo_batch(ctx, batch, microbatch_id=0, optim_step_idx=0)
    v_ref = torch.randn(C, H, W, generator=torch.Generator().manual_seed(5)).expand_as(prepared.latents)
    theta = torch.full((C, H, W), 0.02, requires_grad=True)
    metrics = WindowMetrics()
    loss_sum = run_formula(ctx, batch, prepared, v_ref + theta * prepared.latents, v_ref, metrics)
    schedule = build_microbatch_schedule(len(batch["weight"]), 1, 8)
    totals = window_weight_totals(batch["weight"], schedule)[0].tolist()
    denominator = weighted_denominator(schedule[0], *totals) if weighted else pairs_in_window(schedule[0])
    loss = loss_sum / denominator
    loss.backward()
    return loss.detach(), theta.grad, metrics.means()


def test_dropped_groups_change_neither_the_loss_nor_the_gradient_of_a_window():
    # pairs 1 and 3 belong to dropped (zero-spread) groups: weight 0; the same window without them
    batch = make_batch(weight=[1.0, 0.0, 1.0, 0.0])
    kept = {key: value[[0, 2]] for key, value in batch.items()}  # pair_index 0 and 2: the same ε and σ
    loss, grad, metrics = window_step(batch, weighted=True)
    kept_loss, kept_grad, kept_metrics = window_step(kept, weighted=True)
    torch.testing.assert_close(loss, kept_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(grad, kept_grad, rtol=1e-5, atol=1e-6)  # float32 sums over other rows
    assert metrics["train/loss"] == pytest.approx(kept_metrics["train/loss"], rel=1e-6)
    assert metrics["train/loss"] == pytest.approx(loss.item(), rel=1e-6)  # the metric is the mean the step follows
    # dividing by every pair, dropped ones included, shrank the step by the kept share (here 1/2)
    diluted_loss, diluted_grad, _ = window_step(batch, weighted=False)
    torch.testing.assert_close(diluted_grad, grad / 2, rtol=1e-5, atol=1e-6)
    assert diluted_loss.item() == pytest.approx(loss.item() / 2, rel=1e-6)


@pytest.mark.parametrize(
    ("global_step", "interval", "steps", "due"),
    [(40, 40, 4, True), (44, 40, 4, False), (42, 40, 4, True), (4, 4, 4, True), (80, 40, 40, True), (3, 0, 1, False)],
)
def test_the_reference_refreshes_when_the_step_count_crosses_a_multiple_of_k(global_step, interval, steps, due):
    assert refresh_due(global_step, interval=interval, steps_per_rollout=steps) is due
    ctx = make_ctx(dpo_ref_update_interval=interval, num_steps_per_rollout=steps)
    assert refresh_reference(ctx, global_step=global_step) == ({"dpo_ref": 0.0} if due else {})
