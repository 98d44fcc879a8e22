"""policy_loss (Flow-GRPO), rollout side: SDE trajectories with per-step log-probs on the steps the step strategy
picks, one train pair per (sample, trained step) (the shared `requests.sde_request` and `pairs.sde_pairs`)."""

from __future__ import annotations

from miles.rollout.requests import sde_request
from miles.rollout.rollout_hub.pairs import STALE_POLICY_BATCH, recompute_conflict, sde_pairs, trained_steps_per_sample
from miles.rollout.rollout_hub.spec import RolloutSpec

SPEC = RolloutSpec(
    build_request=sde_request,
    convert=sde_pairs,
    pairs_per_sample=trained_steps_per_sample,
    stale_batch=STALE_POLICY_BATCH,
    stale_batch_conflict=recompute_conflict,
)
