"""The rollout side of an algorithm, one entry per loss type (the twin of the loss hub's `LOSS_HOOKS`): how its
rollouts are requested from the engines, how samples become train pairs, how many pairs a sample gives, whether
rewards are scored, and how its held-out eval samples."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from miles.rollout.data_conversion_hub.dmd2 import dmd2_trained_step, expand_samples_to_dmd2_pairs
from miles.rollout.data_conversion_hub.flow_grpo import expand_samples_to_train_pairs
from miles.rollout.data_conversion_hub.nft import expand_samples_to_nft_pairs, nft_pairs_per_sample
from miles.rollout.engine import GenerateRequest, GenerateResult
from miles.rollout.step_strategy_hub import select_trained_steps
from miles.utils.types import Sample, TrainPairs

RequestFn = Callable[..., GenerateRequest]  # (args, samples, *, rollout_id, resolution) -> GenerateRequest
ConvertFn = Callable[..., TrainPairs]  # (args, samples, result, advantages, *, rollout_id) -> TrainPairs
PairsPerSampleFn = Callable[..., int]  # (args, request) -> pairs per sample, sample-major in the converted pairs


def group_initial_seeds(samples: list[Sample]) -> list[int]:
    """--diffusion-shared-initial-noise: every sample starts from its group's first sample's initial latent."""
    first: dict[int, int] = {}
    for sample in samples:
        first.setdefault(sample.group_index, sample.seed)
    return [first[sample.group_index] for sample in samples]


def no_metrics(request: GenerateRequest) -> dict[str, Any]:
    return {}


def ode_eval(args: argparse.Namespace) -> dict[str, Any]:
    """Held-out prompts sampled with the deterministic ODE at --diffusion-eval-num-steps."""
    return {"sde_type": "ode", "num_steps": args.diffusion_eval_num_steps}


@dataclass(frozen=True)
class RolloutSpec:
    """What the rollout steps need to know of one loss type."""

    build_request: RequestFn
    convert: ConvertFn
    pairs_per_sample: PairsPerSampleFn
    scores_rewards: bool = True  # False: rewards only when --rm-type / --custom-rm-path ask (as metrics)
    metrics: Callable[[GenerateRequest], dict[str, Any]] = no_metrics
    eval_sampler: Callable[[argparse.Namespace], dict[str, Any]] = ode_eval
    # --async-rollout: what the loss does with a batch generated one update behind the trainer (None: it is not
    # known to be right, and --async-rollout is refused), and the flags with which it would be wrong (an error, or None)
    stale_batch: str | None = None
    stale_batch_conflict: Callable[[argparse.Namespace], str | None] = lambda args: None


# ---- Flow-GRPO (and custom losses): SDE trajectories with per-step log-probs ---------------------------------------
def sampler_request(
    args: argparse.Namespace, samples: list[Sample], *, resolution: int, sde_type: str, trained_steps: list[int]
) -> GenerateRequest:
    """The sampling flags' request for `samples` (CFG, steps, noise, shared initial noise) with the given kernel."""
    return GenerateRequest(
        prompts=[s.prompt for s in samples],
        seeds=[s.seed for s in samples],
        initial_seeds=group_initial_seeds(samples) if args.diffusion_shared_initial_noise else None,
        num_steps=args.diffusion_num_steps,
        guidance_scale=args.diffusion_guidance_scale,
        negative_prompt=args.negative_prompt,
        sde_type=sde_type,
        noise_level=args.diffusion_noise_level,
        trained_steps=trained_steps,
        resolution=resolution,
    )


def sde_request(
    args: argparse.Namespace, samples: list[Sample], *, rollout_id: int, resolution: int
) -> GenerateRequest:
    """The --diffusion-sde-type kernel on the steps the step strategy picks, with CFG as configured."""
    trained = select_trained_steps(args, rollout_id)
    return sampler_request(
        args, samples, resolution=resolution, sde_type=args.diffusion_sde_type, trained_steps=trained
    )


def sde_pairs(
    args: argparse.Namespace,
    samples: list[Sample],
    result: GenerateResult,
    advantages: torch.Tensor,
    *,
    rollout_id: int,
) -> TrainPairs:
    return expand_samples_to_train_pairs(result, advantages)


def trained_steps_per_sample(args: argparse.Namespace, request: GenerateRequest) -> int:
    return len(request.trained_steps)


# ---- DiffusionNFT: deterministic ODE samples, clean latents -------------------------------------------------------
def ode_request(
    args: argparse.Namespace, samples: list[Sample], *, rollout_id: int, resolution: int
) -> GenerateRequest:
    """Deterministic ODE sampling, nothing recorded but the clean latents."""
    return sampler_request(args, samples, resolution=resolution, sde_type="ode", trained_steps=[])


def nft_pairs(
    args: argparse.Namespace,
    samples: list[Sample],
    result: GenerateResult,
    advantages: torch.Tensor,
    *,
    rollout_id: int,
) -> TrainPairs:
    return expand_samples_to_nft_pairs(
        result,
        advantages,
        timestep_fraction=args.diffusion_nft_timestep_fraction,
        seed=args.rollout_seed,
        rollout_id=rollout_id,
    )


def nft_pairs_count(args: argparse.Namespace, request: GenerateRequest) -> int:
    return nft_pairs_per_sample(args.diffusion_num_steps, args.diffusion_nft_timestep_fraction)


# ---- DMD2: the few-step generator ---------------------------------------------------------------------------------
def generator_request(
    args: argparse.Namespace, samples: list[Sample], *, rollout_id: int, resolution: int
) -> GenerateRequest:
    """The generator's k-step `renoise` run, CFG-free, recording the step j drawn for this rollout; the negative
    prompt is encoded for the teacher's CFG on the train side."""
    k = args.dmd2_generator_steps
    return GenerateRequest(
        prompts=[s.prompt for s in samples],
        seeds=[s.seed for s in samples],
        num_steps=k,
        guidance_scale=1.0,
        negative_prompt=args.negative_prompt,
        sde_type="renoise",
        noise_level=0.0,
        trained_steps=[dmd2_trained_step(k, seed=args.rollout_seed, rollout_id=rollout_id)],
        resolution=resolution,
        shift=args.dmd2_timestep_shift,
        return_negative=True,
    )


def generator_pairs(
    args: argparse.Namespace,
    samples: list[Sample],
    result: GenerateResult,
    advantages: torch.Tensor,
    *,
    rollout_id: int,
) -> TrainPairs:
    return expand_samples_to_dmd2_pairs(result)


def one_pair(args: argparse.Namespace, request: GenerateRequest) -> int:
    return 1


def generator_step_metric(request: GenerateRequest) -> dict[str, Any]:
    return {"rollout/dmd2_generator_step": request.trained_steps[0]}


def generator_eval(args: argparse.Namespace) -> dict[str, Any]:
    """The few-step generator, sampled exactly as its rollouts are (CFG-free)."""
    return {"sde_type": "renoise", "num_steps": args.dmd2_generator_steps, "shift": args.dmd2_timestep_shift}


def recompute_conflict(args: argparse.Namespace) -> str | None:
    if args.diffusion_recompute_old_log_prob:
        return (
            "--diffusion-recompute-old-log-prob replaces the rollout's behaviour log-probs by the current policy's, "
            "so a batch generated one update behind would be trained as if on-policy; drop one of the two flags"
        )
    return None


STALE_POLICY_BATCH = (
    "the behaviour log-probs are the rollout's, recorded by the engine with the weights it sampled with, so the "
    "ratio is taken against them and clipped as usual: PPO's importance ratio for a behaviour policy one update old"
)
STALE_NFT_BATCH = (
    "off-policy by construction: the loss noises the clean samples afresh and needs only their rewards, no "
    "log-prob of the policy that sampled them; samples from the previous weights are ordinary training data"
)
STALE_DMD2_BATCH = (
    "off-policy by construction: the rollout gives only the generator's inputs (x_t on its grid); the critic and "
    "teacher targets are computed at train time from the current networks"
)

_FLOW_GRPO = RolloutSpec(build_request=sde_request, convert=sde_pairs, pairs_per_sample=trained_steps_per_sample)
ROLLOUT_SPECS: dict[str, RolloutSpec] = {
    "policy_loss": dataclasses.replace(
        _FLOW_GRPO, stale_batch=STALE_POLICY_BATCH, stale_batch_conflict=recompute_conflict
    ),
    "custom_loss": _FLOW_GRPO,  # a custom loss trains Flow-GRPO's pairs unless a conversion path replaces them
    "nft": RolloutSpec(
        build_request=ode_request, convert=nft_pairs, pairs_per_sample=nft_pairs_count, stale_batch=STALE_NFT_BATCH
    ),
    "dmd2": RolloutSpec(
        build_request=generator_request,
        convert=generator_pairs,
        pairs_per_sample=one_pair,
        scores_rewards=False,
        metrics=generator_step_metric,
        eval_sampler=generator_eval,
        stale_batch=STALE_DMD2_BATCH,
    ),
}


def get_rollout_spec(loss_type: str) -> RolloutSpec:
    if loss_type not in ROLLOUT_SPECS:
        raise ValueError(
            f"no rollout entry for --loss-type {loss_type} (known: {', '.join(sorted(ROLLOUT_SPECS))}); "
            "sft_loss trains on dataset pairs with --train-only"
        )
    return ROLLOUT_SPECS[loss_type]


def check_async_rollout(args: argparse.Namespace) -> None:
    """--async-rollout trains each batch one update after its weights: refuse it where that would be wrong."""
    if not getattr(args, "async_rollout", False):
        return
    if args.train_only or args.debug_rollout_only:
        flag = "--train-only" if args.train_only else "--debug-rollout-only"
        raise ValueError(f"--async-rollout overlaps generation with training; {flag} has no generation to overlap")
    spec = get_rollout_spec(args.loss_type)
    if spec.stale_batch is None:
        raise ValueError(
            f"--async-rollout: --loss-type {args.loss_type} does not declare what it does with a batch generated one "
            "update behind the trainer (RolloutSpec.stale_batch), so it could train a stale batch as if on-policy; "
            "run it without --async-rollout"
        )
    conflict = spec.stale_batch_conflict(args)
    if conflict is not None:
        raise ValueError(f"--async-rollout with --loss-type {args.loss_type}: {conflict}")
