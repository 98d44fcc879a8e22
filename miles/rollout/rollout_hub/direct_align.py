"""direct_align, rollout side: the policy's clean ODE sample x₀ and the initial noise ε it started from (the input
of step 0, recorded): the trainer injects that known ε back at σ and recovers x̂₀. One train pair per sample."""

from __future__ import annotations

import argparse

from miles.rollout.engine_api import GenerateRequest
from miles.rollout.requests import recorded_ode_request
from miles.rollout.rollout_hub.pairs import one_pair_per_sample, recorded_step_pairs
from miles.rollout.rollout_hub.spec import RolloutSpec
from miles.utils.types import Sample

STALE_DIRECT_ALIGN_BATCH = (
    "off-policy by construction: the loss re-noises the clean samples with their known noise and needs no log-prob "
    "of the policy that sampled them; samples from the previous weights are ordinary training data"
)


def direct_align_request(
    args: argparse.Namespace, samples: list[Sample], *, rollout_id: int, resolution: int
) -> GenerateRequest:
    return recorded_ode_request(args, samples, resolution=resolution, step=0)


SPEC = RolloutSpec(
    build_request=direct_align_request,
    convert=recorded_step_pairs,
    pairs_per_sample=one_pair_per_sample,
    stale_batch=STALE_DIRECT_ALIGN_BATCH,
)
