"""The awm hooks against hand-written maths (ALGORITHMS.md, AWM): on-policy loss −mean(A'), the gradient of every
weighting equal to the analytic one of −mean(A'·logp) and flipping with A, zero gradient where the ratio is clipped,
loss and gradient 0 for A' = 0 and v = v_ref = v_ema, the KL terms, the recompute pass, the EMA anchor's schedule."""

import argparse
from types import MappingProxyType

import pytest
import torch

from miles.algorithms.awm import EMA_ANCHOR
from miles.backends.fsdp_utils.loss_hub import LossHooks, check_loss_hooks
from miles.backends.fsdp_utils.loss_hub.awm import awm_formula, decay_ema_anchor, prepare_awm_batch
from miles.backends.fsdp_utils.loss_hub.types import DiffusionLossContext, WindowMetrics
from miles.plot import infer_loss_type
from miles.utils.types import slice_pairs

B, C, H, W, L, D, P = 4, 2, 3, 3, 5, 6, 7
CLIP = 5.0
DIMS = C * H * W
SIGMA = [0.9, 0.6, 0.35, 0.1]


def make_args(**overrides):
    values = dict(
        seed=7,
        diffusion_adv_clip_max=CLIP,
        diffusion_guidance_scale=1.0,
        awm_weighting="ghuber",
        awm_ghuber_power=0.25,
        awm_clip_range=1.0,
        awm_kl_beta=0.0,
        awm_ema_kl_beta=0.0,
        awm_ema_decay_rate=0.001,
        awm_ema_decay_max=0.3,
    )
    values.update(overrides)
    return argparse.Namespace(**values)


def make_ctx(**overrides):
    return DiffusionLossContext(
        args=make_args(**overrides),
        role="actor",
        rollout_id=2,
        dp_rank=0,
        dp_size=1,
        device=torch.device("cpu"),
        forward_dtype=torch.float32,
        family=None,
        networks=MappingProxyType({}),
    )


def make_batch(advantage=(6.0, -2.0, 1.0, -0.5), seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "x0": torch.randn(B, C, H, W, generator=g),
        "t": torch.tensor(SIGMA),
        "advantage": torch.as_tensor(advantage, dtype=torch.float32),
        "old_log_prob": torch.full((B,), float("nan")),
        "cond/prompt_embeds": torch.randn(B, L, D, generator=g),
        "cond/pooled_prompt_embeds": torch.randn(B, P, generator=g),
        "pair_index": torch.arange(B),
    }


def run(ctx, batch, prepared, new_pred, frozen=None, **kwargs):
    kwargs.setdefault("old_log_prob_from_new", True)
    return awm_formula(
        ctx,
        batch,
        prepared,
        new_pred=new_pred,
        frozen_preds=MappingProxyType(frozen or {}),
        metrics=kwargs.pop("metrics", WindowMetrics()),
        optim_step_idx=0,
        train_output_inputs=[],
        **kwargs,
    )


def velocity(prepared, seed=1):
    g = torch.Generator().manual_seed(seed)
    target = prepared.extras["noise"] - prepared.extras["x0"]
    return (target + 0.7 * torch.randn(target.shape, generator=g)).requires_grad_(True)


def hand_weight_derivative(err, sigma, weighting, p):
    """dw/dℓ per sample: ghuber σ·(ℓ + 1e-10)^(p − 1), l 1, sigma σ, sigma2 σ²."""
    return {
        "ghuber": sigma * (err + 1e-10) ** (p - 1),
        "l": torch.ones_like(err),
        "sigma": sigma,
        "sigma2": sigma**2,
    }[weighting]


def test_awm_hooks_pass_the_signature_check_with_the_ratio_keywords():
    check_loss_hooks(
        LossHooks(prepare=prepare_awm_batch, formula=awm_formula, after_train=decay_ema_anchor), log_prob_ratio=True
    )


def test_prepare_renoises_x0_with_noise_seeded_per_pair_and_window():
    ctx, batch = make_ctx(), make_batch()
    first = prepare_awm_batch(ctx, batch, microbatch_id=3, optim_step_idx=1)
    again = prepare_awm_batch(ctx, batch, microbatch_id=9, optim_step_idx=1)  # another pass, rank or micro-batch
    other = prepare_awm_batch(ctx, batch, microbatch_id=3, optim_step_idx=2)
    assert torch.equal(first.extras["noise"], again.extras["noise"])  # recompute and training pass agree
    assert not torch.equal(first.extras["noise"], other.extras["noise"])
    alone = prepare_awm_batch(ctx, slice_pairs(batch, 2, 3), microbatch_id=0, optim_step_idx=1)
    assert torch.equal(alone.extras["noise"][0], first.extras["noise"][2])
    s = torch.tensor(SIGMA).view(-1, 1, 1, 1)
    torch.testing.assert_close(first.latents, (1 - s) * batch["x0"] + s * first.extras["noise"], rtol=0, atol=1e-6)
    assert torch.equal(first.sigmas, batch["t"])
    assert first.frozen_networks == ()


def test_prepare_names_the_networks_each_kl_term_reads():
    batch = make_batch()
    prepared = prepare_awm_batch(
        make_ctx(awm_kl_beta=1e-3, awm_ema_kl_beta=1.0), batch, microbatch_id=0, optim_step_idx=0
    )
    assert prepared.frozen_networks == ("ref", EMA_ANCHOR.name)
    prepared = prepare_awm_batch(make_ctx(awm_ema_kl_beta=1.0), batch, microbatch_id=0, optim_step_idx=0)
    assert prepared.frozen_networks == (EMA_ANCHOR.name,)


def test_on_policy_loss_is_minus_the_mean_scaled_advantage():
    ctx, batch = make_ctx(), make_batch()
    prepared = prepare_awm_batch(ctx, batch, microbatch_id=0, optim_step_idx=0)
    metrics = WindowMetrics()
    loss_sum = run(ctx, batch, prepared, velocity(prepared), metrics=metrics)
    a_scaled = [1.0, -0.4, 0.2, -0.1]  # clamp(A, ±5)/5 of (6, −2, 1, −0.5)
    assert loss_sum.item() / B == pytest.approx(-sum(a_scaled) / B, abs=1e-7)
    assert metrics.means()["train/awm_ratio_mean"] == 1.0
    assert metrics.means()["train/awm_clipfrac"] == 0.0


@pytest.mark.parametrize("weighting", ["ghuber", "l", "sigma", "sigma2"])
@pytest.mark.parametrize("power", [0.25, 0.5])
def test_gradient_is_that_of_minus_mean_scaled_advantage_times_log_prob_and_flips_with_a(weighting, power):
    ctx = make_ctx(awm_weighting=weighting, awm_ghuber_power=power)
    advantage = torch.tensor([6.0, -2.0, 1.0, -0.5])
    grads = []
    for sign in (1.0, -1.0):
        batch = make_batch(advantage=sign * advantage)
        prepared = prepare_awm_batch(ctx, batch, microbatch_id=0, optim_step_idx=0)
        v = velocity(prepared)
        (run(ctx, batch, prepared, v) / B).backward()  # the trunk divides by the pairs in the window
        grads.append(v.grad)
    # analytic: ∂/∂v_b of −(1/B)·Σ A'_b·logp_b = (A'_b/B)·w'(ℓ_b)·2(v_b − u_b)/D, u = ε − x₀
    u = (prepared.extras["noise"] - prepared.extras["x0"]).double()
    diff = v.detach().double() - u
    err = (diff**2).reshape(B, -1).mean(dim=1)
    a_scaled = advantage.double().clamp(-CLIP, CLIP) / CLIP
    coef = a_scaled / B * hand_weight_derivative(err, torch.tensor(SIGMA, dtype=torch.float64), weighting, power)
    expected = coef.view(-1, 1, 1, 1) * 2 * diff / DIMS
    torch.testing.assert_close(grads[0].double(), expected, rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(grads[1], -grads[0], rtol=0, atol=0)


def test_gradient_is_zero_where_the_ratio_is_clipped():
    ctx, batch = make_ctx(), make_batch(advantage=(5.0, 5.0, -5.0, -5.0))
    prepared = prepare_awm_batch(ctx, batch, microbatch_id=0, optim_step_idx=0)
    v = velocity(prepared)
    logp = torch.empty(B)
    run(ctx, batch, prepared, v.detach(), write_old_log_prob=True, old_log_prob_from_new=False)
    logp.copy_(batch["old_log_prob"])
    # ratio e ≈ 2.72 > 1 + c (pairs 0, 2) and e⁻¹ ≈ 0.37 inside [0, 2] (pairs 1, 3): A' > 0 clipped above,
    # A' < 0 at ratio > 1 + c takes the unclipped branch (max picks it), so only pair 0 has zero gradient
    batch["old_log_prob"] = logp - torch.tensor([1.0, -1.0, 1.0, -1.0])
    run(ctx, batch, prepared, v, old_log_prob_from_new=False).backward()
    per_pair = v.grad.reshape(B, -1).abs().sum(dim=1)
    assert per_pair[0] == 0.0
    assert (per_pair[1:] > 0).all()


def test_zero_advantage_at_the_reference_and_the_anchor_gives_zero_loss_and_gradient():
    ctx = make_ctx(awm_kl_beta=1e-3, awm_ema_kl_beta=1.0)
    batch = make_batch(advantage=(0.0, 0.0, 0.0, 0.0))
    prepared = prepare_awm_batch(ctx, batch, microbatch_id=0, optim_step_idx=0)
    v = velocity(prepared)
    frozen = {"ref": v.detach().clone(), EMA_ANCHOR.name: v.detach().clone()}
    loss = run(ctx, batch, prepared, v, frozen)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.count_nonzero(v.grad) == 0


def test_kl_terms_are_weighted_mean_squared_gaps_to_the_reference_and_the_anchor():
    beta, beta_ema = 1e-3, 1.0
    ctx = make_ctx(awm_kl_beta=beta, awm_ema_kl_beta=beta_ema)
    batch = make_batch(advantage=(0.0, 0.0, 0.0, 0.0))
    prepared = prepare_awm_batch(ctx, batch, microbatch_id=0, optim_step_idx=0)
    v = velocity(prepared)
    g = torch.Generator().manual_seed(9)
    v_ref, v_ema = (v.detach() + torch.randn(v.shape, generator=g) for _ in range(2))
    metrics = WindowMetrics()
    loss = run(ctx, batch, prepared, v, {"ref": v_ref, EMA_ANCHOR.name: v_ema}, metrics=metrics)
    kl = sum(((v[b] - v_ref[b]) ** 2).sum().item() / DIMS for b in range(B))
    ema_kl = sum(((v[b] - v_ema[b]) ** 2).sum().item() / DIMS for b in range(B))
    assert loss.item() == pytest.approx(beta * kl + beta_ema * ema_kl, rel=1e-5)
    assert metrics.means()["train/kl"] == pytest.approx(kl / B, rel=1e-5)
    assert metrics.means()["train/ema_kl"] == pytest.approx(ema_kl / B, rel=1e-5)


def test_a_missing_anchor_prediction_names_the_flag_and_the_network():
    ctx, batch = make_ctx(awm_ema_kl_beta=1.0), make_batch()
    prepared = prepare_awm_batch(ctx, batch, microbatch_id=0, optim_step_idx=0)
    with pytest.raises(KeyError, match="awm-ema-kl-beta.*ema_anchor"):
        run(ctx, batch, prepared, velocity(prepared))


def test_recompute_pass_stores_the_old_log_prob_and_the_next_pass_has_ratio_one():
    ctx, batch = make_ctx(), make_batch()
    prepared = prepare_awm_batch(ctx, batch, microbatch_id=5, optim_step_idx=1)
    v = velocity(prepared)
    assert run(ctx, batch, prepared, v.detach(), write_old_log_prob=True, old_log_prob_from_new=False) is None
    u = prepared.extras["noise"] - prepared.extras["x0"]
    err = ((v.detach().double() - u.double()) ** 2).reshape(B, -1).mean(dim=1)
    sigma = torch.tensor(SIGMA, dtype=torch.float64)
    hand = -(sigma / 0.25) * ((err + 1e-10) ** 0.25 - 1e-10**0.25)
    torch.testing.assert_close(batch["old_log_prob"], hand.float(), rtol=1e-6, atol=0)
    metrics = WindowMetrics()
    run(ctx, batch, prepared, v, metrics=metrics, old_log_prob_from_new=False)
    assert metrics.means()["train/awm_ratio_mean"] == 1.0


@pytest.mark.parametrize(("step", "decay"), [(0, 0.0), (1, 0.001), (150, 0.15), (300, 0.3), (5000, 0.3)])
def test_ema_anchor_decay_is_min_of_cap_and_rate_times_step(step, decay):
    assert decay_ema_anchor(make_ctx(), global_step=step) == {EMA_ANCHOR.name: pytest.approx(decay, abs=1e-15)}


def test_the_metrics_it_logs_identify_an_awm_run_for_the_plot():
    ctx = make_ctx(awm_kl_beta=1e-3, awm_ema_kl_beta=1.0)
    batch = make_batch()
    prepared = prepare_awm_batch(ctx, batch, microbatch_id=0, optim_step_idx=0)
    v = velocity(prepared)
    metrics = WindowMetrics()
    run(ctx, batch, prepared, v, {"ref": v.detach(), EMA_ANCHOR.name: v.detach()}, metrics=metrics)
    record = {**metrics.means(), "rollout/reward_mean": 0.5, "role": "actor"}
    assert infer_loss_type([record]) == "awm"  # not policy_loss, whose ratio keys it does not share
