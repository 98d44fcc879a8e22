"""The nft hooks against hand-written maths: seeded x_t, zero gradient at θ = θ_old for r = ½, sign flip under
r → 1 − r, the r = 1, β = 1 reduction to a t²/w-weighted flow-matching loss, and the KL to `ref`."""

import argparse
from types import MappingProxyType

import pytest
import torch

from miles.backends.fsdp_utils.loss_hub import LossHooks, check_loss_hooks
from miles.backends.fsdp_utils.loss_hub.nft import nft_formula, nft_old_decay, prepare_nft_batch
from miles.backends.fsdp_utils.loss_hub.types import DiffusionLossContext, WindowMetrics
from miles.utils.seeding import stream_generator
from miles.utils.types import slice_pairs

B, C, H, W, L, D, P = 3, 2, 4, 4, 5, 6, 7
CLIP = 5.0


class FakeFamily:
    """predict_velocity calls the network on (latents, sigmas); CFG and embeddings are ignored."""

    scheduler_shift = 3.0

    def predict_velocity(self, network, latents, sigmas, embeds, *, guidance_scale=1.0, negative=None):
        return network(latents, sigmas)


class ScaledNetwork(torch.nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = scale

    def forward(self, latents, sigmas):
        return self.scale * latents


def make_args(**overrides):
    values = dict(
        seed=1234,
        diffusion_adv_clip_max=CLIP,
        diffusion_nft_beta=1.0,
        diffusion_nft_disable_adaptive_weight=False,
        diffusion_nft_guidance_scale=1.0,
        diffusion_nft_kl_beta=0.0,
        diffusion_nft_old_decay_rate=0.001,
        diffusion_nft_old_decay_max=0.5,
        diffusion_nft_old_decay_flat_steps=0,
    )
    values.update(overrides)
    return argparse.Namespace(**values)


def make_ctx(networks=None, rollout_id=0, dp_rank=0, **overrides):
    return DiffusionLossContext(
        args=make_args(**overrides),
        role="actor",
        rollout_id=rollout_id,
        dp_rank=dp_rank,
        dp_size=1,
        device=torch.device("cpu"),
        forward_dtype=torch.float32,
        family=FakeFamily(),
        networks=MappingProxyType(networks or {}),
    )


def make_batch(advantage=None, negative=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    batch = {
        "x0": torch.randn(B, C, H, W, generator=g),
        "t": torch.tensor([0.9, 0.5, 0.2]),
        "advantage": torch.zeros(B) if advantage is None else torch.as_tensor(advantage, dtype=torch.float32),
        "cond/prompt_embeds": torch.randn(B, L, D, generator=g),
        "cond/pooled_prompt_embeds": torch.randn(B, P, generator=g),
        "sample_index": torch.arange(B),
        "pair_index": torch.arange(B) + 5,  # the rows' places in the rollout's batch (shard_pairs)
    }
    if negative:
        batch["negative_cond/prompt_embeds"] = torch.zeros(B, L, D)
        batch["negative_cond/pooled_prompt_embeds"] = torch.zeros(B, P)
    return batch


def run_formula(ctx, batch, prepared, new_pred, v_old, metrics=None, frozen_preds=None, **kwargs):
    """The formula as the trunk calls it, `v_old` the old policy's prediction (None: not predicted)."""
    frozen = {**({} if v_old is None else {"old": v_old}), **(frozen_preds or {})}
    return nft_formula(
        ctx,
        batch,
        prepared,
        new_pred=new_pred,
        frozen_preds=MappingProxyType(frozen),
        metrics=metrics if metrics is not None else WindowMetrics(),
        optim_step_idx=0,
        train_output_inputs=[],
        **kwargs,
    )


def grad_wrt_new_pred(ctx, batch, prepared, v_old):
    new_pred = v_old.clone().requires_grad_(True)
    run_formula(ctx, batch, prepared, new_pred, v_old).backward()
    return new_pred.grad


def test_nft_hooks_pass_the_signature_check():
    check_loss_hooks(LossHooks(prepare=prepare_nft_batch, formula=nft_formula))


def test_prepare_renoises_x0_with_noise_seeded_per_pair_and_window():
    ctx, batch = make_ctx(), make_batch()
    first = prepare_nft_batch(ctx, batch, microbatch_id=2, optim_step_idx=1)
    elsewhere = prepare_nft_batch(ctx, batch, microbatch_id=7, optim_step_idx=1)  # another rank's micro-batch
    other = prepare_nft_batch(ctx, batch, microbatch_id=2, optim_step_idx=2)
    assert torch.equal(first.latents, elsewhere.latents)
    assert not torch.equal(first.latents, other.latents)
    alone = prepare_nft_batch(ctx, slice_pairs(batch, 1, 2), microbatch_id=0, optim_step_idx=1)
    assert torch.equal(alone.extras["noise"][0], first.extras["noise"][1])  # a pair's ε ignores its neighbours
    pair = int(batch["pair_index"][1])
    expected_noise = torch.randn(
        first.extras["noise"].shape[1:], generator=stream_generator(ctx.args.seed, ctx.rollout_id, 1, pair, 0)
    )
    assert torch.equal(first.extras["noise"][1], expected_noise)
    t = batch["t"].reshape(-1, 1, 1, 1)
    expected = (1 - t) * batch["x0"] + t * first.extras["noise"]
    torch.testing.assert_close(first.latents, expected)
    assert torch.equal(first.sigmas, batch["t"]) and torch.equal(first.extras["x0"], batch["x0"])
    assert first.frozen_networks == ("old",) and first.guidance_scale == 1.0 and first.negative is None
    other_rollout = prepare_nft_batch(make_ctx(rollout_id=1), batch, microbatch_id=2, optim_step_idx=1)
    assert not torch.equal(first.latents, other_rollout.latents)


def test_prepare_with_guidance_uses_negative_columns_and_requires_them():
    ctx = make_ctx(diffusion_nft_guidance_scale=4.5)
    prepared = prepare_nft_batch(ctx, make_batch(negative=True), microbatch_id=0, optim_step_idx=0)
    assert prepared.guidance_scale == 4.5 and prepared.negative["prompt_embeds"].shape == (B, L, D)
    with pytest.raises(ValueError, match="negative prompt embeddings"):
        prepare_nft_batch(ctx, make_batch(), microbatch_id=0, optim_step_idx=0)


def test_zero_gradient_at_old_policy_for_zero_advantage():
    ctx, batch = make_ctx(), make_batch(advantage=[0.0, 0.0, 0.0])
    prepared = prepare_nft_batch(ctx, batch, microbatch_id=0, optim_step_idx=0)
    v_old = torch.randn(B, C, H, W, generator=torch.Generator().manual_seed(7))
    grad = grad_wrt_new_pred(ctx, batch, prepared, v_old)
    assert grad.abs().max() < 1e-6


@pytest.mark.parametrize("beta", [1.0, 0.1])
def test_gradient_at_old_policy_flips_sign_under_r_to_one_minus_r(beta):
    advantage = torch.tensor([2.0, -1.0, 4.0])  # r = 0.7, 0.4, 0.9
    ctx = make_ctx(diffusion_nft_beta=beta)
    v_old = torch.randn(B, C, H, W, generator=torch.Generator().manual_seed(7))
    batch_pos, batch_neg = make_batch(advantage=advantage), make_batch(advantage=-advantage)
    prepared = prepare_nft_batch(ctx, batch_pos, microbatch_id=0, optim_step_idx=0)
    grad_pos = grad_wrt_new_pred(ctx, batch_pos, prepared, v_old)
    grad_neg = grad_wrt_new_pred(ctx, batch_neg, prepared, v_old)
    assert grad_pos.abs().max() > 1e-4
    torch.testing.assert_close(grad_neg, -grad_pos)
    # by hand: at v_θ = v_old both implicit policies give x̂₀ = x_t − t·v_old, so the r and 1 − r terms pull
    # oppositely and d/dv_θ = −2·c·(2r − 1)·t·(x̂₀ − x₀) / (numel · w), w = mean |x̂₀ − x₀| (β cancels)
    r = advantage / CLIP / 2 + 0.5
    t = batch_pos["t"].reshape(-1, 1, 1, 1)
    err = prepared.latents - t * v_old - batch_pos["x0"]
    w = err.abs().reshape(B, -1).mean(dim=1).reshape(-1, 1, 1, 1)
    numel = C * H * W
    expected = -2 * CLIP * (2 * r.reshape(-1, 1, 1, 1) - 1) * t * err / (numel * w)
    torch.testing.assert_close(grad_pos, expected, rtol=1e-4, atol=1e-7)


def test_r_one_beta_one_is_a_t_squared_over_w_weighted_flow_matching_loss():
    ctx = make_ctx()
    batch = make_batch(advantage=[CLIP, 10.0, CLIP])  # clipped: r = 1
    prepared = prepare_nft_batch(ctx, batch, microbatch_id=5, optim_step_idx=0)
    g = torch.Generator().manual_seed(3)
    v_theta = torch.randn(B, C, H, W, generator=g).requires_grad_(True)
    v_old = torch.randn(B, C, H, W, generator=g)  # r = 1, β = 1: v_old drops out
    total = run_formula(ctx, batch, prepared, v_theta, v_old)
    target = prepared.extras["noise"] - batch["x0"]
    t = batch["t"]
    residual = (v_theta - target).reshape(B, -1)
    w = (t * residual.abs().mean(dim=1)).detach()  # mean |x̂₀ − x₀| = t·mean |v − (ε − x₀)|
    expected = (CLIP * t**2 * (residual**2).mean(dim=1) / w).sum()
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-6)
    (grad,) = torch.autograd.grad(total, v_theta)
    v_check = v_theta.detach().clone().requires_grad_(True)
    residual_check = (v_check - target).reshape(B, -1)
    (CLIP * t**2 * (residual_check**2).mean(dim=1) / w).sum().backward()
    torch.testing.assert_close(grad, v_check.grad, rtol=1e-5, atol=1e-7)


def test_metrics_are_per_pair():
    ctx, batch = make_ctx(), make_batch(advantage=[1.0, -1.0, 0.0])
    prepared = prepare_nft_batch(ctx, batch, microbatch_id=0, optim_step_idx=0)
    metrics = WindowMetrics()
    v = torch.randn(B, C, H, W)
    run_formula(ctx, batch, prepared, v + 0.1, v, metrics=metrics)
    for name in ("train/loss", "train/nft_positive_loss", "train/nft_negative_loss", "train/r_mean"):
        assert metrics.counts[name] == B
    assert "train/kl" not in metrics.sums
    assert metrics.means()["train/r_mean"] == pytest.approx(0.5)


def test_kl_names_the_ref_network_and_adds_its_weighted_mean_squared_gap():
    kl_beta = 0.25
    ctx = make_ctx(diffusion_nft_kl_beta=kl_beta)
    plain = make_ctx()
    batch = make_batch(advantage=[1.0, -2.0, 0.5])
    prepared = prepare_nft_batch(ctx, batch, microbatch_id=0, optim_step_idx=0)
    assert prepared.frozen_networks == ("old", "ref")
    assert prepare_nft_batch(plain, batch, microbatch_id=0, optim_step_idx=0).frozen_networks == ("old",)
    v_theta = torch.randn(B, C, H, W, generator=torch.Generator().manual_seed(9))
    v_old, v_ref = v_theta + 0.05, 0.5 * prepared.latents
    metrics = WindowMetrics()
    with_kl = run_formula(ctx, batch, prepared, v_theta, v_old, metrics=metrics, frozen_preds={"ref": v_ref})
    without = run_formula(plain, batch, prepared, v_theta, v_old)
    kl = ((v_theta - v_ref) ** 2).reshape(B, -1).mean(dim=1)
    torch.testing.assert_close(with_kl - without, kl_beta * kl.sum())
    assert metrics.counts["train/kl"] == B
    assert metrics.means()["train/kl"] == pytest.approx(kl.mean().item(), rel=1e-5)


def test_kl_without_the_ref_prediction_names_what_is_missing():
    ctx = make_ctx(diffusion_nft_kl_beta=0.1)
    batch = make_batch()
    prepared = prepare_nft_batch(ctx, batch, microbatch_id=0, optim_step_idx=0)
    v = torch.randn(B, C, H, W)
    with pytest.raises(KeyError, match="frozen_networks"):
        run_formula(ctx, batch, prepared, v, v)


def test_a_missing_old_prediction_names_the_network_and_where_to_ask_for_it():
    ctx, batch = make_ctx(), make_batch()
    prepared = prepare_nft_batch(ctx, batch, microbatch_id=0, optim_step_idx=0)
    v = torch.randn(B, C, H, W)
    with pytest.raises(KeyError, match="'old' network's prediction.*frozen_networks"):
        run_formula(ctx, batch, prepared, v, None)


def test_old_decay_reads_the_schedule_flags():
    args = make_args(
        diffusion_nft_old_decay_rate=0.0075, diffusion_nft_old_decay_max=0.999, diffusion_nft_old_decay_flat_steps=75
    )
    assert nft_old_decay(args, 10) == 0.0
    assert nft_old_decay(args, 75) == 0.0
    assert nft_old_decay(args, 175) == pytest.approx(0.75)
    assert nft_old_decay(args, 10_000) == pytest.approx(0.999)
    assert nft_old_decay(make_args(), 100) == pytest.approx(0.1)
