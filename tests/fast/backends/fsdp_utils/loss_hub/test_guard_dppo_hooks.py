"""The grpo_guard and flow_dppo formulas on hand-built pairs: the recompute pass stores μ_old and the old log-prob,
after which the same prediction gives r̂ = r = 1 and the on-policy loss written out; a formula without μ_old says how
to get it."""

import argparse
from types import MappingProxyType

import pytest
import torch

from miles.backends.fsdp_utils.loss_hub import LOSS_HOOKS, check_loss_hooks
from miles.backends.fsdp_utils.loss_hub.flow_dppo import dppo_formula
from miles.backends.fsdp_utils.loss_hub.grpo_guard import guard_formula
from miles.backends.fsdp_utils.loss_hub.types import DiffusionLossContext, PreparedBatch, WindowMetrics

B = 3


def make_ctx():
    args = argparse.Namespace(
        diffusion_sde_type="sde",
        diffusion_noise_level=1.2,
        diffusion_adv_clip_max=5.0,
        diffusion_kl_beta=0.0,
        grpo_guard_clip_range=2e-6,
        grpo_guard_no_step_reweight=False,
        flow_dppo_kl_threshold=1e-5,
    )
    return DiffusionLossContext(args, "actor", 0, 0, 1, torch.device("cpu"), torch.float32, None, MappingProxyType({}))


def make_pairs():
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(B, 2, 4, 4, generator=g)
    return {
        "latents": latents,
        "next_latents": latents + 0.1 * torch.randn(B, 2, 4, 4, generator=g),
        "sigma": torch.tensor([1.0, 0.8, 0.5]),
        "sigma_next": torch.tensor([0.9, 0.6, 0.45]),
        "sigma_max": torch.full((B,), 0.9),
        "rollout_log_prob": torch.zeros(B),
        "old_log_prob": torch.zeros(B),
        "rollout_mean": torch.zeros(B, 2, 4, 4),
        "old_mean": torch.zeros(B, 2, 4, 4),
        "advantage": torch.tensor([1.0, -2.0, 7.0]),
    }


def call(formula, pairs, velocity, **keywords):
    prepared = PreparedBatch(latents=pairs["latents"], sigmas=pairs["sigma"], embeds=None)
    metrics = WindowMetrics()
    out = formula(
        make_ctx(),
        pairs,
        prepared,
        new_pred=velocity,
        frozen_preds=MappingProxyType({}),
        metrics=metrics,
        optim_step_idx=1,
        train_output_inputs=[],
        **keywords,
    )
    return out, metrics.means()


@pytest.mark.parametrize("formula", [guard_formula, dppo_formula])
def test_after_the_recompute_pass_the_ratio_is_one_and_the_loss_is_on_policy(formula):
    pairs = make_pairs()
    velocity = torch.randn(B, 2, 4, 4, generator=torch.Generator().manual_seed(1), requires_grad=True)
    assert call(formula, pairs, velocity.detach(), write_old_log_prob=True)[0] is None
    assert pairs["old_mean"].abs().sum() > 0 and pairs["old_log_prob"].abs().sum() > 0
    loss, metrics = call(formula, pairs, velocity)
    assert metrics["train/ratio_mean"] == 1.0
    adv = torch.tensor([1.0, -2.0, 5.0])  # clamped to ±5
    weight = 1 / torch.tensor([0.1, 0.2, 0.05]) if formula is guard_formula else torch.ones(B)  # 1/(−dt)
    assert loss.item() == pytest.approx(-(adv * weight).sum().item(), rel=1e-6)
    loss.backward()
    assert velocity.grad.abs().sum() > 0


@pytest.mark.parametrize("formula", [guard_formula, dppo_formula])
def test_pairs_without_the_rollout_means_name_the_missing_column(formula):
    pairs = make_pairs()
    del pairs["old_mean"]
    with pytest.raises(KeyError, match="old_mean.*record_means"):
        call(formula, pairs, torch.zeros(B, 2, 4, 4))


@pytest.mark.parametrize("loss_type", ["grpo_guard", "flow_dppo"])
def test_the_entries_take_the_ratio_keywords(loss_type):
    check_loss_hooks(LOSS_HOOKS[(loss_type, "actor")], log_prob_ratio=True)
