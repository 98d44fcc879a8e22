"""custom_loss, rollout side: the shared SDE request and transition pairs (Flow-GRPO's, unless
--custom-convert-samples-to-train-data-path replaces the conversion), or with --train-only the dataset pairs."""

from __future__ import annotations

from miles.rollout.requests import sde_request
from miles.rollout.rollout_hub.dataset import DATASET_SPEC
from miles.rollout.rollout_hub.pairs import sde_pairs, trained_steps_per_sample
from miles.rollout.rollout_hub.spec import RolloutSpec

# no stale_batch: what the user's loss does with a batch one update old is not known, so --async-rollout is refused
SPEC = RolloutSpec(
    build_request=sde_request,
    convert=sde_pairs,
    pairs_per_sample=trained_steps_per_sample,
    dataset=DATASET_SPEC,
)
