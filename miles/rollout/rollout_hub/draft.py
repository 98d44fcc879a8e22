"""draft, rollout side: the policy's ODE sample, recording the input x_{N−K} of the first of the last --draft-k
steps (the trainer differentiates those K steps from it), one train pair per sample."""

from __future__ import annotations

import argparse

from miles.rollout.engine_api import GenerateRequest
from miles.rollout.requests import recorded_ode_request
from miles.rollout.rollout_hub.pairs import one_pair_per_sample, recorded_step_pairs
from miles.rollout.rollout_hub.spec import RolloutSpec
from miles.utils.types import Sample


def draft_request(
    args: argparse.Namespace, samples: list[Sample], *, rollout_id: int, resolution: int
) -> GenerateRequest:
    if not 1 <= args.draft_k <= args.diffusion_num_steps:
        raise ValueError(f"--draft-k {args.draft_k} must lie in [1, --diffusion-num-steps {args.diffusion_num_steps}]")
    return recorded_ode_request(args, samples, resolution=resolution, step=args.diffusion_num_steps - args.draft_k)


SPEC = RolloutSpec(build_request=draft_request, convert=recorded_step_pairs, pairs_per_sample=one_pair_per_sample)
