"""dpo, rollout side: online, ODE samples paired best vs worst within each prompt group; offline (--train-only), the
preference file's pairs encoded once with the family's VAE and text encoders.

A pair row holds the chosen and the rejected clean latent (`x0_w`, `x0_l`) and the prompt's conditioning; the ε and
σ the two share are drawn on the train side from ids (`loss_hub.dpo.prepare_dpo_batch`).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from miles.algorithms.dpo import read_preference_file
from miles.diffusion.dpo import best_worst_pair
from miles.rollout.engine_api import GenerateResult
from miles.rollout.requests import ode_request
from miles.rollout.rollout_hub.dataset import ENCODE_BATCH, encode_records, image_to_tensor
from miles.rollout.rollout_hub.spec import DatasetSpec, RolloutSpec
from miles.rollout.steps import split_groups
from miles.utils.types import Sample, TrainPairs

STALE_DPO_BATCH = (
    "off-policy by construction: the loss noises the clean samples afresh and needs only which of two samples scored "
    "higher, no log-prob of the policy that sampled them"
)


def one_pair_per_sample(args: argparse.Namespace, request: Any) -> int:
    return 1


def group_pairs(args: argparse.Namespace, samples: list[Sample]) -> list[tuple[int, int, bool]]:
    """(chosen row, rejected row, kept) of each prompt group in order, rows into the rollout's samples
    (`diffusion.dpo.best_worst_pair`: the first highest reward vs the last lowest; zero spread kept only with
    --dpo-keep-zero-spread). A sample a --rollout-sample-filter-path hook removed is no candidate."""
    pairs = []
    for group in split_groups(samples):
        candidates = [s for s in group if not s.remove_sample]
        if not candidates:
            pairs.append((group[0].index, group[0].index, False))
            continue
        rewards = [float(s.reward if s.reward is not None else 0.0) for s in candidates]
        chosen, rejected, kept = best_worst_pair(rewards, keep_zero_spread=args.dpo_keep_zero_spread)
        pairs.append((candidates[chosen].index, candidates[rejected].index, kept))
    return pairs


def online_pairs(
    args: argparse.Namespace,
    samples: list[Sample],
    result: GenerateResult,
    advantages: torch.Tensor,
    *,
    rollout_id: int,
) -> TrainPairs:
    """One pair row per sample (the batch invariant counts rows per sample): each of a group's n rows is the group's
    (chosen, rejected) pair, so every pair is trained at n independent (ε, σ) draws per rollout. A dropped group's rows
    carry `weight` 0: they add nothing to the loss, the gradient or the step's denominator (the trainer divides by
    the pairs that train) but keep every rank's windows the same size.

    Columns: x0_w, x0_l, weight, reward_gap (r_w − r_l), the conditioning (`cond/*`), sample_index."""
    batch = result.final_latents.shape[0]
    if len(samples) != batch:
        raise ValueError(f"{len(samples)} samples but the engine returned {batch} latents")
    first = samples[0].index
    chosen = torch.empty(batch, dtype=torch.long)
    rejected = torch.empty(batch, dtype=torch.long)
    weight = torch.zeros(batch, dtype=torch.float32)
    gap = torch.zeros(batch, dtype=torch.float32)
    rewards = [float(s.reward if s.reward is not None else 0.0) for s in samples]
    groups = split_groups(samples)
    for group, (best, worst, kept) in zip(groups, group_pairs(args, samples)):
        rows = torch.tensor([s.index - first for s in group])
        chosen[rows], rejected[rows] = best - first, worst - first
        weight[rows] = float(kept)
        gap[rows] = rewards[best - first] - rewards[worst - first]
    latents = result.final_latents.float()
    return {
        "x0_w": latents[chosen],
        "x0_l": latents[rejected],
        "weight": weight,
        "reward_gap": gap,
        **result.conditioning.to_columns(),  # a group's rows share one prompt
        "sample_index": torch.arange(batch),
    }


# ---- offline: the preference file -----------------------------------------------------------------------------
def preference_records(args: argparse.Namespace, *, resolution: int) -> list[dict[str, Any]]:
    """The dataset's records: one per preference pair, in file order (already validated at parse time)."""
    return [
        {"prompt": r.prompt, "metadata": {}, "image": r.chosen, "rejected": r.rejected}
        for r in read_preference_file(args.dpo_preference_data, check_images=False)
    ]


@torch.no_grad()
def preference_pairs(args: argparse.Namespace, family: Any, records: list[dict], *, resolution: int) -> TrainPairs:
    """Every record's chosen image and prompt through sft_loss's encoder path (`encode_records`), its rejected
    image through the same VAE; row i from records[i], weight 1."""
    family.load_vae()
    family.load_text_encoders()
    chosen = encode_records(family, records, resolution)
    rejected = []
    for start in range(0, len(records), ENCODE_BATCH):
        images = torch.stack(
            [image_to_tensor(r["rejected"], resolution) for r in records[start : start + ENCODE_BATCH]]
        )
        rejected.append(family.encode_images(images).float().cpu())
    x0_w = chosen.pop("x0")
    return {"x0_w": x0_w, "x0_l": torch.cat(rejected), "weight": torch.ones(x0_w.shape[0]), **chosen}


DATASET = DatasetSpec(encode=preference_pairs, records=preference_records)
SPEC = RolloutSpec(
    build_request=ode_request,
    convert=online_pairs,
    pairs_per_sample=one_pair_per_sample,
    stale_batch=STALE_DPO_BATCH,
    dataset=DATASET,
)
