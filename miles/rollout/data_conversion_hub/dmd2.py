"""dmd2 conversion: one few-step generator rollout -> DMD2 train pairs, one per sample (ALGORITHMS.md, dmd2).

The engine samples the generator with the `renoise` kernel and records the one trained step j of the rollout.
"""

from __future__ import annotations

import torch

from miles.rollout.data_conversion_hub.conditioning import negative_columns
from miles.utils.seeding import stream_rng
from miles.utils.types import TrainPairs

# Keeps the per-rollout step draw apart from other seeded streams of the same (seed, rollout).
_STEP_SALT = 0x444D44


def dmd2_trained_step(num_steps: int, *, seed: int, rollout_id: int) -> int:
    """The generator step j ∈ [0, k) trained this rollout (backward simulation), drawn from (seed, rollout)."""
    if num_steps < 1:
        raise ValueError(f"--dmd2-generator-steps must be >= 1, got {num_steps}")
    return int(stream_rng(seed, rollout_id, _STEP_SALT).integers(num_steps))


def expand_samples_to_dmd2_pairs(result) -> TrainPairs:
    """One pair per sample, in sample order; `result` is the engine's `GenerateResult` of a `renoise` run with
    one trained step j.

    Columns: latents (the generator's input x_t at step j: pure noise for j = 0), sigma (σ_j), x (the engine's
    x̂₀ at step j: the detached generator sample the critic trains on and the DMD gradient is evaluated at),
    the conditioning (`cond/*`), the negative conditioning (`negative_cond/*`, the teacher's CFG branch),
    sample_index, step_index.
    """
    if result.denoised is None:
        raise ValueError("dmd2 pairs need the generator's x̂₀: sample with sde_type='renoise'")
    batch, steps = result.latents.shape[:2]
    if steps != 1:
        raise ValueError(f"dmd2 trains one generator step per rollout, the engine recorded {steps}")
    if result.negative is None:
        raise ValueError("dmd2 pairs need negative prompt embeddings for the teacher's CFG: request return_negative")
    step = int(result.trained_steps[0])
    return {
        "latents": result.latents[:, 0].float().contiguous(),
        "sigma": result.sigmas[step].float().expand(batch).clone(),
        "x": result.denoised[:, 0].float().contiguous(),
        **result.conditioning.to_columns(),
        **negative_columns(result.negative, batch),
        "sample_index": torch.arange(batch),
        "step_index": torch.full((batch,), step, dtype=torch.long),
    }
