"""policy_loss conversion: one rollout's samples -> Flow-GRPO train pairs, one transition per trained step."""

from __future__ import annotations

import torch

from miles.rollout.data_conversion_hub.conditioning import negative_columns
from miles.utils.types import TrainPairs


def expand_samples_to_train_pairs(result, advantages: torch.Tensor) -> TrainPairs:
    """Sample-major pairs: sample b's K transitions are rows b·K .. b·K+K−1, so contiguous shards keep samples whole.

    `result` is the engine's `GenerateResult`; `advantages` (B,) one per sample.
    """
    batch, steps = result.log_probs.shape
    if steps == 0:
        raise ValueError("the step strategy selected no trained steps: nothing to train on")
    index = torch.tensor(result.trained_steps, dtype=torch.long)
    sigmas = result.sigmas.float()

    def per_pair(x: torch.Tensor) -> torch.Tensor:  # (B, ...) -> (B·K, ...)
        return x.repeat_interleave(steps, dim=0)

    log_probs = result.log_probs.reshape(-1).float()
    pairs: TrainPairs = {
        "latents": result.latents.reshape(batch * steps, *result.latents.shape[2:]).float(),
        "next_latents": result.next_latents.reshape(batch * steps, *result.next_latents.shape[2:]).float(),
        "sigma": sigmas[index].repeat(batch),
        "sigma_next": sigmas[index + 1].repeat(batch),
        "sigma_max": sigmas[1].expand(batch * steps).clone(),
        "rollout_log_prob": log_probs.clone(),
        "old_log_prob": log_probs.clone(),
        "advantage": per_pair(advantages.float()),
        "sample_index": per_pair(torch.arange(batch)),
        "step_index": index.repeat(batch),
        **result.conditioning.repeat_interleave(steps).to_columns(),
    }
    if result.negative is not None:
        pairs |= negative_columns(result.negative, batch * steps)
    return pairs
