"""The shared policy step on hand-built transitions: the prepare replays the recorded inputs (CFG as sampled, `ref`
named only for a KL with a reference), μ_old from the column or the current step, the recompute pass's store, the
train/rollout parity metrics in window 0 only, and the KL to `ref` added with its weight."""

from types import MappingProxyType

import pytest
import torch

from miles.backends.fsdp_utils.loss_hub.policy import (
    old_mean_of,
    policy_step,
    prepare_policy_batch,
    record_rollout_parity,
    store_old_step,
    uses_reference,
    with_reference_kl,
)
from miles.backends.fsdp_utils.loss_hub.types import WindowMetrics
from tests.fast.backends.fsdp_utils.loss_hub.policy_pairs import B, make_ctx, make_pairs


def velocity(seed=1):
    return torch.randn(B, 2, 4, 4, generator=torch.Generator().manual_seed(seed))


def test_the_reference_is_used_only_with_a_kl_weight_and_a_ref_mode():
    assert not uses_reference(make_ctx(diffusion_kl_beta=0.1, ref_mode="none").args)
    assert not uses_reference(make_ctx(diffusion_kl_beta=0.0, ref_mode="ema").args)
    assert uses_reference(make_ctx(diffusion_kl_beta=0.1, ref_mode="lora_base").args)


def test_prepare_replays_the_recorded_inputs_with_cfg_as_sampled():
    pairs = {**make_pairs(), "cond/prompt_embeds": torch.ones(B, 5), "negative_cond/prompt_embeds": torch.zeros(B, 5)}
    plain = prepare_policy_batch(
        make_ctx(diffusion_guidance_scale=1.0, ref_mode="none"), pairs, microbatch_id=0, optim_step_idx=0
    )
    assert torch.equal(plain.latents, pairs["latents"]) and torch.equal(plain.sigmas, pairs["sigma"])
    assert plain.negative is None and plain.frozen_networks == () and plain.guidance_scale == 1.0
    assert torch.equal(plain.embeds["prompt_embeds"], torch.ones(B, 5))
    guided = prepare_policy_batch(
        make_ctx(diffusion_guidance_scale=4.5, diffusion_kl_beta=0.1, ref_mode="ema"),
        pairs,
        microbatch_id=1,
        optim_step_idx=2,
    )
    assert torch.equal(guided.negative["prompt_embeds"], torch.zeros(B, 5)) and guided.guidance_scale == 4.5
    assert guided.frozen_networks == ("ref",)


def test_old_mean_is_the_column_or_before_any_update_the_current_step():
    ctx, pairs = make_ctx(), make_pairs()
    pairs["old_mean"] = torch.full((B, 2, 4, 4), 3.0)
    step = policy_step(ctx, pairs, velocity().requires_grad_(True))
    assert torch.equal(old_mean_of(pairs, step, old_log_prob_from_new=False), pairs["old_mean"])
    current = old_mean_of(pairs, step, old_log_prob_from_new=True)
    assert torch.equal(current, step.mean) and not current.requires_grad
    del pairs["old_mean"]
    with pytest.raises(KeyError, match=r"no 'old_mean' column .*GenerateRequest\.record_means"):
        old_mean_of(pairs, step, old_log_prob_from_new=False)


def test_the_recompute_pass_stores_the_current_step_as_the_old_one():
    ctx, pairs = make_ctx(), make_pairs()
    step = policy_step(ctx, pairs, velocity())
    store_old_step(pairs, step)
    assert torch.equal(pairs["old_mean"], step.mean) and torch.equal(pairs["old_log_prob"], step.log_prob)


def test_the_parity_with_the_rollout_is_measured_in_window_0_only():
    ctx, pairs = make_ctx(), make_pairs()
    step = policy_step(ctx, pairs, velocity())
    later = WindowMetrics()
    record_rollout_parity(pairs, step, later, optim_step_idx=1)
    assert later.means() == {}
    first = WindowMetrics()
    record_rollout_parity(pairs, step, first, optim_step_idx=0)
    means = first.means()
    assert means["train/log_prob_abs_diff"] == pytest.approx(step.log_prob.abs().mean().item())
    per_pair_max = step.mean.abs().reshape(B, -1).max(dim=1).values
    assert means["train/mean_abs_diff"] == pytest.approx(per_pair_max.mean().item())


def test_the_kl_to_ref_is_added_with_its_weight_only_when_ref_predicted():
    ctx, pairs = make_ctx(diffusion_kl_beta=0.5), make_pairs()
    v = velocity()
    step = policy_step(ctx, pairs, v)
    loss, metrics = torch.zeros(B), WindowMetrics()
    assert with_reference_kl(ctx, pairs, step, MappingProxyType({}), metrics, loss) is loss
    assert metrics.means() == {}
    same = with_reference_kl(ctx, pairs, step, {"ref": v}, WindowMetrics(), loss)
    assert torch.equal(same, loss)  # v_ref = v: no KL
    moved = with_reference_kl(ctx, pairs, step, {"ref": velocity(seed=2)}, metrics, loss)
    kl = metrics.means()["train/kl"]
    assert kl > 0 and moved.sum().item() == pytest.approx(0.5 * B * kl, rel=1e-5)
