"""DanceGRPO's trained steps as a step strategy: a random 60% of the sampling steps, drawn afresh each rollout (the
last step is never trained). Pass it with

    --diffusion-step-strategy-path examples/dance_grpo_steps.py:random_steps

together with `--diffusion-sde-type dance`: every chosen step samples with the kernel and is trained, the others run
the ODE. The built-in strategies place one contiguous window, which is not DanceGRPO's choice (its
`timestep_fraction` trains a random permutation's first 60% of the steps)."""

from __future__ import annotations

import argparse

from miles.utils.seeding import stream_rng

TRAINED_FRACTION = 0.6  # DanceGRPO's timestep_fraction
STREAM = 0xDA7CE  # this strategy's own seeded stream, independent of the other (rollout_seed, rollout_id) draws


def random_steps(args: argparse.Namespace, rollout_id: int, num_steps: int) -> list[int]:
    """int(0.6·num_steps) distinct steps of [0, num_steps − 2], sorted; the same on every rank and engine (seeded
    by --rollout-seed and the rollout id only)."""
    count = min(max(1, int(TRAINED_FRACTION * num_steps)), num_steps - 1)
    rng = stream_rng(int(args.rollout_seed), rollout_id, STREAM)
    return sorted(int(s) for s in rng.choice(num_steps - 1, size=count, replace=False))
