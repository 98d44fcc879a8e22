"""refl, rollout side: the policy's ODE sample, recording the input x_j of the step j drawn this rollout from the last
--refl-last-steps of the grid (the no-gradient part of ReFL), one train pair per sample."""

from __future__ import annotations

import argparse
from typing import Any

from miles.rollout.engine_api import GenerateRequest
from miles.rollout.requests import recorded_ode_request
from miles.rollout.rollout_hub.pairs import one_pair_per_sample, recorded_step_pairs
from miles.rollout.rollout_hub.spec import RolloutSpec
from miles.utils.seeding import stream_rng
from miles.utils.types import Sample

_STEP_SALT = 0x5245464C  # keeps the per-rollout step draw apart from other seeded streams of the same rollout


def refl_step(num_steps: int, last_steps: int, *, seed: int, rollout_id: int) -> int:
    """j uniform over the last `last_steps` grid indices (num_steps − last_steps .. num_steps − 1), per rollout."""
    if not 1 <= last_steps <= num_steps:
        raise ValueError(f"--refl-last-steps {last_steps} must lie in [1, --diffusion-num-steps {num_steps}]")
    return num_steps - 1 - int(stream_rng(seed, rollout_id, _STEP_SALT).integers(last_steps))


def refl_request(
    args: argparse.Namespace, samples: list[Sample], *, rollout_id: int, resolution: int
) -> GenerateRequest:
    step = refl_step(args.diffusion_num_steps, args.refl_last_steps, seed=args.rollout_seed, rollout_id=rollout_id)
    return recorded_ode_request(args, samples, resolution=resolution, step=step)


def refl_metrics(request: GenerateRequest) -> dict[str, Any]:
    return {"rollout/refl_step": request.trained_steps[0]}


SPEC = RolloutSpec(
    build_request=refl_request, convert=recorded_step_pairs, pairs_per_sample=one_pair_per_sample, metrics=refl_metrics
)
