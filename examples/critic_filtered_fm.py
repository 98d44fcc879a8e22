"""A whole algorithm from outside miles, with a critic role and a flag of its own: critic-filtered flow matching
(`cffm`), the second worked example of docs/user-guide/customization.md. Run it with

    python train_diffusion.py --algorithm-path examples/critic_filtered_fm.py --loss-type cffm --critic-lr 3e-4

The maths, on clean ODE samples x₀ with GRPO advantages A (c = --diffusion-adv-clip-max), each pair re-noised to
x_t = (1 − t)·x₀ + t·ε and scored by flow-matching errors e(v) = mean over dims of (v − (ε − x₀))²:
- the critic, trained first each rollout, is a flow-matching model of the better-than-their-group samples: it
  minimises max(A, 0)/c · e(v_critic). Its train output is each pair's error e(v_critic) under the critic, measured in
  the same forward, before the critic's update of that window: how far the sample is from what the good ones look like.
- the actor imitates the better samples too, but down-weights those the critic finds atypical:
  max(A, 0)/c · exp(−e_critic / τ) · e(v_actor), τ = --cffm-temperature.
A toy (in the spirit of reward-weighted regression with a learned filter) that exercises every surface a plugin has:
a declaration with its own flag, range, rule and progress key, a critic role with its `--critic-*` overrides and its
own locked save folder, a plot panel, both LOSS_HOOKS entries and a ROLLOUT_SPECS entry.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

import torch

from miles.algorithms import Algorithm, Role, register_algorithm
from miles.algorithms.base import COMMON_PANELS
from miles.backends.fsdp_utils.loss_hub import LOSS_HOOKS, LossHooks
from miles.backends.fsdp_utils.loss_hub.noise import pair_generators, pair_noise
from miles.backends.fsdp_utils.loss_hub.types import PreparedBatch, WindowMetrics, conditioning_from_pairs
from miles.diffusion.schedule import add_noise
from miles.rollout.rollout_hub import ROLLOUT_SPECS, RolloutSpec, nft_pairs, nft_pairs_count, ode_request
from miles.utils.ranges import POSITIVE

NAME = "cffm"
ERROR = "critic_error"  # the critic's train-output column; the actor reads it as `peer/critic_error`


# ---- the maths: pure functions over tensors -----------------------------------------------------------------------
def flow_matching_error(v: torch.Tensor, noise: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
    """Per pair: mean over dims of (v − (ε − x₀))²."""
    return ((v.float() - (noise - x0)) ** 2).flatten(1).mean(dim=1)


def imitation_weight(advantage: torch.Tensor, clip: float) -> torch.Tensor:
    """max(A, 0)/c with A clamped to [−c, c]: samples better than their group, in [0, 1]."""
    return advantage.clamp(-clip, clip).clamp_min(0.0) / clip


def critic_filter(critic_error: torch.Tensor, temperature: float) -> torch.Tensor:
    """exp(−e_critic / τ): 1 for a sample the critic reproduces exactly, → 0 for one far from the good samples."""
    return torch.exp(-critic_error.float() / temperature)


# ---- the declaration: what the parser, the driver, the console and the plot ask -----------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("cffm (examples/critic_filtered_fm.py)")
    group.add_argument(
        "--cffm-temperature", type=float, default=1.0, help="τ of the critic's filter exp(−e_critic / τ)."
    )


def validate(args: argparse.Namespace) -> list[str]:
    if args.diffusion_guidance_scale > 1:
        return [f"--loss-type {NAME} trains CFG-free velocities: --diffusion-guidance-scale must be ≤ 1"]
    return []


ALGORITHM = register_algorithm(
    Algorithm(
        name=NAME,
        roles=(Role("critic"), Role("actor")),  # the critic trains first; its output feeds the actor's ranks
        samples_sde=False,
        guidance_scale=1.0,
        add_arguments=add_arguments,
        flag_ranges={"cffm_temperature": POSITIVE},
        validate=validate,
        progress_keys=(
            ("reward", "rollout/reward_mean", ".3f"),
            ("critic", "train/critic_fm_loss", ".4f"),
            ("filter", "train/critic_filter_mean", ".3f"),
        ),
        plot_panels=(
            ("rollout reward", ("rollout/reward_mean",)),
            ("critic flow-matching loss", ("critic/train/critic_fm_loss",)),
            ("critic filter of the actor's pairs", ("train/critic_filter_mean",)),
            *COMMON_PANELS,
        ),
        identifying_metrics=("train/critic_filter_mean",),
    )
)


# ---- the train side: one prepare for both roles, a formula and a train output per role ----------------------------
def prepare(ctx, batch, *, microbatch_id: int, optim_step_idx: int, pad_to_len=None) -> PreparedBatch:
    """x_t = (1 − t)·x₀ + t·ε at the pair's recorded t, ε seeded by the role's micro-batch id; CFG-free."""
    x0, t = batch["x0"].float(), batch["t"].float()
    noise = pair_noise(pair_generators(ctx, batch, optim_step_idx), x0.shape)
    x0, noise, t = x0.to(ctx.device), noise.to(ctx.device), t.to(ctx.device)
    return PreparedBatch(
        latents=add_noise(x0, noise, t),
        sigmas=t,
        embeds=conditioning_from_pairs(batch, ctx.device),
        extras={"x0": x0, "noise": noise},
    )


def critic_formula(
    ctx,
    batch,
    prepared: PreparedBatch,
    *,
    new_pred: torch.Tensor,
    frozen_preds: Mapping[str, torch.Tensor],
    metrics: WindowMetrics,
    optim_step_idx: int,
    train_output_inputs: list,
    **kwargs,
) -> torch.Tensor:
    """Sum of max(A, 0)/c · e(v_critic); each pair's e(v_critic) goes to the train output (windows and micro-batches
    are contiguous ranges of the rank's pairs, so the entries in order are the pairs in order)."""
    error = flow_matching_error(new_pred, prepared.extras["noise"], prepared.extras["x0"])
    weight = imitation_weight(batch["advantage"].to(error.device).float(), ctx.args.diffusion_adv_clip_max)
    loss = weight * error
    metrics.add("train/critic_fm_loss", error)
    metrics.add("train/loss", loss)
    train_output_inputs.append(error.detach().cpu())
    return loss.sum()


def critic_train_output(ctx, train_pairs, train_output_inputs: list) -> dict[str, Any]:
    """Per pair of the rank's shard, the critic's flow-matching error, for the paired actor rank."""
    errors = torch.cat(train_output_inputs)
    expected = len(train_pairs["x0"])
    if errors.numel() != expected:
        raise RuntimeError(f"the cffm critic scored {errors.numel()} pairs, its shard holds {expected}")
    return {ERROR: errors}


def actor_formula(
    ctx,
    batch,
    prepared: PreparedBatch,
    *,
    new_pred: torch.Tensor,
    frozen_preds: Mapping[str, torch.Tensor],
    metrics: WindowMetrics,
    optim_step_idx: int,
    **kwargs,
) -> torch.Tensor:
    """Sum of max(A, 0)/c · exp(−e_critic / τ) · e(v_actor)."""
    key = "peer/" + ERROR
    if key not in batch:
        raise KeyError(f"the cffm actor needs {key!r} from the critic group's train output; pairs have {sorted(batch)}")
    error = flow_matching_error(new_pred, prepared.extras["noise"], prepared.extras["x0"])
    advantage = batch["advantage"].to(error.device).float()
    kept = critic_filter(batch[key].to(error.device), ctx.args.cffm_temperature)
    loss = imitation_weight(advantage, ctx.args.diffusion_adv_clip_max) * kept * error
    metrics.add("train/loss", loss)
    metrics.add("train/critic_filter_mean", kept)
    metrics.add("train/imitated_frac", (advantage > 0).float())
    return loss.sum()


LOSS_HOOKS[(NAME, "critic")] = LossHooks(prepare=prepare, formula=critic_formula, train_output=critic_train_output)
LOSS_HOOKS[(NAME, "actor")] = LossHooks(prepare=prepare, formula=actor_formula)

# ---- the rollout side: DiffusionNFT's ODE samples and clean-latent pairs, one ROLLOUT_SPECS entry ------------------
ROLLOUT_SPECS[NAME] = RolloutSpec(build_request=ode_request, convert=nft_pairs, pairs_per_sample=nft_pairs_count)
