"""dmd2: the critic (fake score) hooks, whose train output is the per-pair DMD target x − g from the teacher's
prediction (run by the trunk in the scoring window), and the generator (actor) hooks that regress x̂₀ onto it
(ALGORITHMS.md, dmd2; ARCHITECTURE §4-§6)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

import torch

from miles.backends.fsdp_utils.loss_hub.noise import pair_generators, pair_noise
from miles.backends.fsdp_utils.loss_hub.reward_grad import pair_metadatas, score_x0
from miles.backends.fsdp_utils.loss_hub.types import (
    DiffusionLossContext,
    Guidance,
    PreparedBatch,
    WindowMetrics,
    conditioning_from_pairs,
    frozen_prediction,
)
from miles.diffusion.dmd import critic_loss, dmd_gradient, generator_loss, sample_dmd_timesteps, x0_from_velocity
from miles.diffusion.reward_grad import reward_objective
from miles.diffusion.schedule import add_noise
from miles.utils.types import TrainPairs, num_pairs

TEACHER_NETWORK = "teacher"
ROW = "critic_row"  # the critic's tiled pairs remember their row in the rank's shard
TARGET = "dmd_target"  # the critic's train-output column; the actor reads it as `peer/dmd_target`
_CRITIC_SALT = 0x444D43


def critic_windows(args: argparse.Namespace) -> int:
    return int(args.critic_num_steps_per_rollout)


def timestep_shift(ctx: DiffusionLossContext) -> float:
    shift = ctx.args.dmd2_timestep_shift
    return float(ctx.family.scheduler_shift if shift is None else shift)


# ---- critic -------------------------------------------------------------------------------------------------------
def tile_critic_pairs(ctx: DiffusionLossContext, train_pairs: TrainPairs) -> TrainPairs:
    """Every critic window runs over all of the rank's pairs: the pairs tiled once per window, so the last
    (scoring) window covers each pair exactly once, with a `critic_row` column naming its row in the shard."""
    windows = critic_windows(ctx.args)
    rows = torch.arange(num_pairs(train_pairs))
    tiled = {key: torch.cat([value] * windows) for key, value in train_pairs.items()}
    tiled[ROW] = torch.cat([rows] * windows)
    return tiled


def scoring_window(ctx: DiffusionLossContext, optim_step_idx: int) -> bool:
    """The critic's last window scores: each pair once, against the teacher, before that window's update."""
    return optim_step_idx == critic_windows(ctx.args) - 1


def prepare_critic_batch(
    ctx: DiffusionLossContext,
    batch: TrainPairs,
    *,
    microbatch_id: int,
    optim_step_idx: int,
    pad_to_len: int | None = None,
) -> PreparedBatch:
    """x_t = (1 − t)·x + t·ε on the detached generator sample x, t shifted and clamped, both seeded by ids; no CFG.
    In the scoring window it names the teacher, run on the same x_t with CFG --dmd2-real-guidance-scale."""
    args = ctx.args
    x = batch["x"].float()
    generators = pair_generators(ctx, batch, optim_step_idx, salt=_CRITIC_SALT)
    limits = {"shift": timestep_shift(ctx), "t_min": args.dmd2_t_min, "t_max": args.dmd2_t_max}
    t = torch.cat([sample_dmd_timesteps(1, generator=g, **limits) for g in generators])
    noise = pair_noise(generators, x.shape)
    x, noise, t = x.to(ctx.device), noise.to(ctx.device), t.to(ctx.device)
    frozen: tuple[str, ...] = ()
    guidance: dict[str, Guidance] = {}
    if scoring_window(ctx, optim_step_idx):
        scale = float(args.dmd2_real_guidance_scale)
        negative = conditioning_from_pairs(batch, ctx.device, prefix="negative_") if scale > 1 else None
        frozen, guidance = (TEACHER_NETWORK,), {TEACHER_NETWORK: Guidance(scale, negative)}
    return PreparedBatch(
        latents=add_noise(x, noise, t),
        sigmas=t,
        embeds=conditioning_from_pairs(batch, ctx.device),
        frozen_networks=frozen,
        frozen_guidance=guidance,
        extras={"x": x, "noise": noise},
    )


def critic_formula(
    ctx: DiffusionLossContext,
    batch: TrainPairs,
    prepared: PreparedBatch,
    *,
    new_pred: torch.Tensor,
    frozen_preds: Mapping[str, torch.Tensor],
    metrics: WindowMetrics,
    optim_step_idx: int,
    train_output_inputs: list,
    **kwargs,
) -> torch.Tensor:
    """Sum of the critic's flow-matching losses; in the scoring (last) window it also appends, for the train-output
    hook, the pairs' rows, x, x̂_fake (this critic) and x̂_real (the teacher's `frozen_preds["teacher"]`)."""
    x, noise = prepared.extras["x"], prepared.extras["noise"]
    loss = critic_loss(new_pred, noise, x)
    metrics.add("train/critic_loss", loss)
    metrics.add("train/loss", loss)
    metrics.add("train/t_mean", prepared.sigmas)
    if scoring_window(ctx, optim_step_idx):
        v_real = frozen_prediction(frozen_preds, TEACHER_NETWORK, "the dmd2 critic's scoring window")
        x_t, t = prepared.latents.detach(), prepared.sigmas.detach()
        train_output_inputs.append(
            {
                "rows": batch[ROW].clone(),
                "x": x.detach(),
                "x_hat_fake": x0_from_velocity(x_t, new_pred.detach(), t),
                "x_hat_real": x0_from_velocity(x_t, v_real, t),
            }
        )
    return loss.sum()


@torch.no_grad()
def critic_train_output(ctx: DiffusionLossContext, train_pairs: TrainPairs, train_output_inputs: list) -> Any:
    """g = dmd_gradient(x, x̂_fake, x̂_real) on the scoring window's entries, and per pair of the rank's shard
    `{"dmd_target": x − g}` (float32, CPU), for the paired actor rank."""
    total = num_pairs(train_pairs) // critic_windows(ctx.args)
    target: torch.Tensor | None = None
    covered = torch.zeros(total, dtype=torch.long)
    for entry in train_output_inputs:
        x = entry["x"]
        g = dmd_gradient(x, entry["x_hat_fake"], entry["x_hat_real"])
        if target is None:
            target = torch.empty(total, *x.shape[1:], dtype=torch.float32)
        rows = entry["rows"].cpu()
        target[rows] = (x.float() - g).cpu()
        covered[rows] += 1
    if target is None or not bool((covered == 1).all()):
        raise RuntimeError(
            f"the dmd2 critic's scoring window must cover each of the rank's {total} pairs once; coverage "
            f"{covered.tolist()} (was the train-input hook replaced?)"
        )
    return {TARGET: target}


# ---- generator (actor) --------------------------------------------------------------------------------------------
def prepare_generator_batch(
    ctx: DiffusionLossContext,
    batch: TrainPairs,
    *,
    microbatch_id: int,
    optim_step_idx: int,
    pad_to_len: int | None = None,
) -> PreparedBatch:
    """The generator's recorded input x_t at σ_j with its prompt; CFG-free, as the engine sampled it."""
    return PreparedBatch(
        latents=batch["latents"].to(ctx.device),
        sigmas=batch["sigma"].to(ctx.device),
        embeds=conditioning_from_pairs(batch, ctx.device),
    )


def generator_formula(
    ctx: DiffusionLossContext,
    batch: TrainPairs,
    prepared: PreparedBatch,
    *,
    new_pred: torch.Tensor,
    metrics: WindowMetrics,
    optim_step_idx: int,
    **kwargs,
) -> torch.Tensor:
    """Sum over pairs of 0.5·mean((x_θ − (x − g))²), x_θ = x_t − σ_j·v_θ: its gradient at x_θ = x is g/numel."""
    key = "peer/" + TARGET
    if key not in batch:
        raise KeyError(
            f"the dmd2 generator needs {key!r} from the critic group's train output; pairs have {sorted(batch)}"
        )
    x_theta = x0_from_velocity(prepared.latents, new_pred, prepared.sigmas)
    target = batch[key].to(x_theta.device).float()
    loss = generator_loss(x_theta, target, reduction="none")
    with torch.no_grad():
        x = batch["x"].to(x_theta.device).float()
        g = (x - target).flatten(1)
        metrics.add("train/dmd_loss", loss)
        metrics.add("train/dmd_grad_norm_mean", g.norm(dim=1))
        metrics.add("train/dmd_grad_abs_mean", g.abs().mean(dim=1))
        metrics.add("train/sigma_mean", prepared.sigmas)
        if optim_step_idx == 0:  # before this call's first update x_θ must reproduce the engine's x̂₀
            metrics.add("train/generator_x0_abs_diff", (x_theta.detach() - x).flatten(1).abs().mean(dim=1))
    if ctx.args.dmd2_reward_weight > 0:  # reward-guided distillation (DMDR): + λ·φ(R(x_θ)) on the same x_θ
        loss = loss + reward_term(ctx, batch, x_theta, metrics)
    metrics.add("train/loss", loss)
    return loss.sum()


def reward_term(
    ctx: DiffusionLossContext, batch: TrainPairs, x_theta: torch.Tensor, metrics: WindowMetrics
) -> torch.Tensor:
    """(B,) λ·φ(R(x_θ)): the differentiable reward of the generator's output, λ = --dmd2-reward-weight, φ the hinge
    --dmd2-reward-hinge or −R; the critic and the teacher never see it."""
    reward = score_x0(ctx, x_theta, pair_metadatas(batch))
    term = float(ctx.args.dmd2_reward_weight) * reward_objective(reward, ctx.args.dmd2_reward_hinge)
    metrics.add("train/dmd2_reward_mean", reward)
    metrics.add("train/dmd2_reward_loss", term)
    return term
