"""grpo_guard (GRPO-Guard), rollout side: the SDE request with the engine also recording each trained step's mean
μ_old, and the pairs with that mean as the `rollout_mean` / `old_mean` columns (the shared
`requests.mean_recording_request` and `pairs.sde_pairs_with_means`)."""

from __future__ import annotations

from miles.rollout.requests import mean_recording_request
from miles.rollout.rollout_hub.pairs import (
    STALE_MEAN_BATCH,
    recompute_conflict,
    sde_pairs_with_means,
    trained_steps_per_sample,
)
from miles.rollout.rollout_hub.spec import RolloutSpec

SPEC = RolloutSpec(
    build_request=mean_recording_request,
    convert=sde_pairs_with_means,
    pairs_per_sample=trained_steps_per_sample,
    stale_batch=STALE_MEAN_BATCH,
    stale_batch_conflict=recompute_conflict,
)
