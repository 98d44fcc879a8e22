"""dmd2, rollout side: the few-step generator sampled with the `renoise` kernel (backward simulation to the one
step j trained this rollout), one train pair per sample (ALGORITHMS.md, dmd2)."""

from __future__ import annotations

import argparse
from typing import Any

import torch

from miles.rollout.conditioning import negative_columns
from miles.rollout.engine_api import GenerateRequest, GenerateResult
from miles.rollout.requests import source_images_of
from miles.rollout.rollout_hub.pairs import REWARD_METADATA
from miles.rollout.rollout_hub.spec import RolloutSpec
from miles.utils.json_column import encode_json_column
from miles.utils.seeding import stream_rng
from miles.utils.types import Sample, TrainPairs

# Keeps the per-rollout step draw apart from other seeded streams of the same (seed, rollout).
_STEP_SALT = 0x444D44
STALE_DMD2_BATCH = (
    "off-policy by construction: the rollout gives only the generator's inputs (x_t on its grid); the critic and "
    "teacher targets are computed at train time from the current networks"
)


def dmd2_trained_step(num_steps: int, *, seed: int, rollout_id: int) -> int:
    """The generator step j ∈ [0, k) trained this rollout (backward simulation), drawn from (seed, rollout)."""
    if num_steps < 1:
        raise ValueError(f"--dmd2-generator-steps must be >= 1, got {num_steps}")
    return int(stream_rng(seed, rollout_id, _STEP_SALT).integers(num_steps))


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
        source_images=source_images_of(samples),
    )


def generator_pairs(
    args: argparse.Namespace,
    samples: list[Sample],
    result: GenerateResult,
    advantages: torch.Tensor,
    *,
    rollout_id: int,
) -> TrainPairs:
    """One pair per sample, in sample order, from a `renoise` run with one trained step j (advantages unused).

    Columns: latents (the generator's input x_t at step j: pure noise for j = 0), sigma (σ_j), x (the engine's
    x̂₀ at step j: the detached generator sample the critic trains on and the DMD gradient is evaluated at),
    the conditioning (`cond/*`), the negative conditioning (`negative_cond/*`, the teacher's CFG branch),
    sample_index, step_index; with --dmd2-reward-weight > 0 also reward_metadata (the prompts' metadata, JSON).
    """
    if result.denoised is None:
        raise ValueError("dmd2 pairs need the generator's x̂₀: sample with sde_type='renoise'")
    batch, steps = result.latents.shape[:2]
    if steps != 1:
        raise ValueError(f"dmd2 trains one generator step per rollout, the engine recorded {steps}")
    if result.negative is None:
        raise ValueError("dmd2 pairs need negative prompt embeddings for the teacher's CFG: request return_negative")
    step = int(result.trained_steps[0])
    pairs: TrainPairs = {
        "latents": result.latents[:, 0].float().contiguous(),
        "sigma": result.sigmas[step].float().expand(batch).clone(),
        "x": result.denoised[:, 0].float().contiguous(),
        **result.conditioning.to_columns(),
        **negative_columns(result.negative, batch),
        "sample_index": torch.arange(batch),
        "step_index": torch.full((batch,), step, dtype=torch.long),
    }
    if args.dmd2_reward_weight > 0:  # the generator's reward term scores against each prompt's metadata
        pairs[REWARD_METADATA] = encode_json_column([{**s.metadata, "prompt": s.prompt} for s in samples])
    return pairs


def one_pair(args: argparse.Namespace, request: GenerateRequest) -> int:
    return 1


def generator_step_metric(request: GenerateRequest) -> dict[str, Any]:
    return {"rollout/dmd2_generator_step": request.trained_steps[0]}


def generator_eval(args: argparse.Namespace) -> dict[str, Any]:
    """The few-step generator, sampled exactly as its rollouts are (CFG-free)."""
    return {"sde_type": "renoise", "num_steps": args.dmd2_generator_steps, "shift": args.dmd2_timestep_shift}


SPEC = RolloutSpec(
    build_request=generator_request,
    convert=generator_pairs,
    pairs_per_sample=one_pair,
    metrics=generator_step_metric,
    eval_sampler=generator_eval,
    stale_batch=STALE_DMD2_BATCH,
)
