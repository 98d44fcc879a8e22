"""The engine requests that belong to no one algorithm: the sampling flags' request with a chosen kernel, the SDE
request on the step strategy's steps (with or without the step means), the deterministic ODE request, the shared
initial noise of a prompt group, and the held-out eval's deterministic ODE."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from miles.rollout.engine_api import GenerateRequest
from miles.rollout.step_strategy_hub import flash_ratio, select_trained_steps
from miles.utils.types import Sample


def group_initial_seeds(samples: list[Sample]) -> list[int]:
    """--diffusion-shared-initial-noise: every sample starts from its group's first sample's initial latent."""
    first: dict[int, int] = {}
    for sample in samples:
        first.setdefault(sample.group_index, sample.seed)
    return [first[sample.group_index] for sample in samples]


def source_images_of(samples: list[Sample]) -> list[list[Any]] | None:
    """The samples' source images for a request (editing, image-to-video), or None when they are text-only."""
    if all(s.source_images is None for s in samples):
        return None
    return [list(s.source_images or []) for s in samples]


def sampler_request(
    args: argparse.Namespace, samples: list[Sample], *, resolution: int, sde_type: str, trained_steps: list[int]
) -> GenerateRequest:
    """The sampling flags' request for `samples` (CFG, steps, noise, shared initial noise, MixGRPO-Flash after the
    trained steps) with the given kernel."""
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
        flash_ratio=flash_ratio(args) if trained_steps else None,
        source_images=source_images_of(samples),
    )


def sde_request(
    args: argparse.Namespace, samples: list[Sample], *, rollout_id: int, resolution: int
) -> GenerateRequest:
    """The --diffusion-sde-type kernel on the steps the step strategy picks, with CFG as configured."""
    trained = select_trained_steps(args, rollout_id)
    return sampler_request(
        args, samples, resolution=resolution, sde_type=args.diffusion_sde_type, trained_steps=trained
    )


def mean_recording_request(
    args: argparse.Namespace, samples: list[Sample], *, rollout_id: int, resolution: int
) -> GenerateRequest:
    """`sde_request`, asking the engine for each trained step's mean μ_old too (the ratio-on-means losses)."""
    request = sde_request(args, samples, rollout_id=rollout_id, resolution=resolution)
    return dataclasses.replace(request, record_means=True)


def ode_request(
    args: argparse.Namespace, samples: list[Sample], *, rollout_id: int, resolution: int
) -> GenerateRequest:
    """Deterministic ODE sampling, nothing recorded but the clean latents."""
    return sampler_request(args, samples, resolution=resolution, sde_type="ode", trained_steps=[])


def recorded_ode_request(
    args: argparse.Namespace, samples: list[Sample], *, resolution: int, step: int
) -> GenerateRequest:
    """Deterministic ODE sampling that records the input of grid step `step` (and its Euler output): where a
    reward-gradient loss starts differentiating."""
    return sampler_request(args, samples, resolution=resolution, sde_type="ode", trained_steps=[step])


def ode_eval(args: argparse.Namespace) -> dict[str, Any]:
    """Held-out prompts sampled with the deterministic ODE at --diffusion-eval-num-steps."""
    return {"sde_type": "ode", "num_steps": args.diffusion_eval_num_steps}
