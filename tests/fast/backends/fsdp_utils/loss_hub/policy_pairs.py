"""Hand-built recorded SDE transitions for the formulas on the shared policy step (policy_loss, grpo_guard,
flow_dppo): a context with their flags, three pairs with advantages past the clip, and a call of a formula as the
trunk makes it."""

from __future__ import annotations

import argparse
from types import MappingProxyType

import torch

from miles.backends.fsdp_utils.loss_hub.types import DiffusionLossContext, PreparedBatch, WindowMetrics

B = 3


def make_ctx(**overrides):
    args = argparse.Namespace(
        **{
            "diffusion_sde_type": "sde",
            "diffusion_noise_level": 1.2,
            "diffusion_adv_clip_max": 5.0,
            "diffusion_kl_beta": 0.0,
            "diffusion_clip_range": 1e-4,
            "grpo_guard_clip_range": 2e-6,
            "grpo_guard_no_step_reweight": False,
            "flow_dppo_kl_threshold": 1e-5,
            **overrides,
        }
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


def call(formula, pairs, velocity, ctx=None, frozen_preds=None, optim_step_idx=1, **keywords):
    prepared = PreparedBatch(latents=pairs["latents"], sigmas=pairs["sigma"], embeds=None)
    metrics = WindowMetrics()
    out = formula(
        ctx or make_ctx(),
        pairs,
        prepared,
        new_pred=velocity,
        frozen_preds=MappingProxyType(frozen_preds or {}),
        metrics=metrics,
        optim_step_idx=optim_step_idx,
        train_output_inputs=[],
        **keywords,
    )
    return out, metrics.means()
