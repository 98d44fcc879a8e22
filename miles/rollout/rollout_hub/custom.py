"""custom_loss, rollout side: Flow-GRPO's SDE trajectories and pairs (unless
--custom-convert-samples-to-train-data-path replaces the conversion), or with --train-only SFT's dataset pairs."""

from __future__ import annotations

from miles.rollout.rollout_hub import flow_grpo, sft
from miles.rollout.rollout_hub.spec import RolloutSpec

# no stale_batch: what the user's loss does with a batch one update old is not known, so --async-rollout is refused
SPEC = RolloutSpec(
    build_request=flow_grpo.sde_request,
    convert=flow_grpo.sde_pairs,
    pairs_per_sample=flow_grpo.trained_steps_per_sample,
    dataset=sft.SPEC,
)
