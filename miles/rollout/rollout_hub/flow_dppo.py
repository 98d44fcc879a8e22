"""flow_dppo (Flow-DPPO), rollout side: the same record as GRPO-Guard's (SDE transitions with their log-probs and the
engine's step means μ_old, which its KL trust region is measured against)."""

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
