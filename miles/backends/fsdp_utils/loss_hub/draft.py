"""draft, train side: DRaFT-K, the trunk unrolls the last K Euler steps from the rollout's x_{N−K} with gradient
(each step checkpointed) and the reward is ascended on the result x_N; DRaFT-LV (K = 1, n copies): the last step's
forward also runs on n re-noised copies (1 − σ)·sg(x_N) + σ·ε_m, each scored at its one-step x̂₀
(ALGORITHMS.md, DRaFT; docs/user-guide/reward-gradients.md)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from miles.backends.fsdp_utils.loss_hub.noise import pair_generators, pair_noise
from miles.backends.fsdp_utils.loss_hub.reward_grad import (
    pair_metadatas,
    prepare_reward_batch,
    reward_loss,
    score_x0,
)
from miles.backends.fsdp_utils.loss_hub.types import DiffusionLossContext, PreparedBatch, WindowMetrics
from miles.diffusion.reward_grad import lv_copies, one_step_x0
from miles.utils.types import TrainPairs

_LV_SALT = 0x44524654  # keeps the copies' noise apart from other per-pair streams


def unroll_grid(batch: TrainPairs) -> torch.Tensor:
    """σ_{N−K}, ..., σ_N = 0: the tail of the rollout's own σ grid from the recorded step (one grid per rollout)."""
    return batch["sigma_tail"][0].float()


def prepare_draft_batch(
    ctx: DiffusionLossContext,
    batch: TrainPairs,
    *,
    microbatch_id: int,
    optim_step_idx: int,
    pad_to_len: int | None = None,
) -> PreparedBatch:
    """K > 1 (or no copies): the K-step unroll from x_{N−K}. LV: one forward at σ_{N−1} of 1 + n rows per pair,
    x_{N−1} then its n copies, the copies' ε drawn per pair row."""
    copies = int(ctx.args.draft_lv_copies)
    if copies == 0:
        grid = unroll_grid(batch)
        return prepare_reward_batch(ctx, batch, batch["latents"], batch["sigma"], unroll_sigmas=grid)
    x, final, sigma = batch["latents"].float(), batch["final_latents"].float(), batch["sigma"].float()
    generators = pair_generators(ctx, batch, optim_step_idx, salt=_LV_SALT)
    noise = torch.stack([pair_noise(generators, x.shape) for _ in range(copies)], dim=1)  # (B, n, ...)
    rows = torch.cat([x.unsqueeze(1), lv_copies(final, noise, float(sigma[0]))], dim=1).flatten(0, 1)
    return prepare_reward_batch(ctx, batch, rows, sigma.repeat_interleave(copies + 1), copies=copies + 1)


def draft_formula(
    ctx: DiffusionLossContext,
    batch: TrainPairs,
    prepared: PreparedBatch,
    *,
    new_pred: torch.Tensor,
    frozen_preds: Mapping[str, torch.Tensor],
    metrics: WindowMetrics,
    optim_step_idx: int,
    unrolled: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor:
    """Σ over pairs of λ·φ(R) of x_N (DRaFT-K) or the mean over x_N and its copies' x̂₀ (LV) (+ the velocity
    penalty). Before the first update x_N must reproduce the engine's final latents (`train/draft_final_abs_diff`)."""
    copies = int(ctx.args.draft_lv_copies) + 1
    if unrolled is None:  # LV: row 0 of each pair is x_{N−1}, its one-step x̂₀ is the Euler step to σ_N = 0
        x0 = one_step_x0(prepared.latents, new_pred, prepared.sigmas)
        final = x0.reshape(-1, copies, *x0.shape[1:])[:, 0]
    else:
        x0 = final = unrolled
    reward = score_x0(ctx, x0, pair_metadatas(batch, copies))
    if optim_step_idx == 0:
        with torch.no_grad():
            diff = (final.detach() - batch["final_latents"].to(final.device).float()).flatten(1).abs().mean(dim=1)
            metrics.add("train/draft_final_abs_diff", diff)
    return reward_loss(ctx, reward, new_pred, frozen_preds, metrics, copies=copies)
