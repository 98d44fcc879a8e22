"""The rollout hub: one rollout-side entry per loss type (the twin of the loss hub's `LOSS_HOOKS`), each in its
algorithm's file here; a module given with --algorithm-path adds `ROLLOUT_SPECS[name] = RolloutSpec(...)`. The
lookups (`get_rollout_spec`, `rollout_spec_of`) and the --async-rollout rule read them."""

from __future__ import annotations

import argparse

from miles.algorithms import get_algorithm
from miles.rollout.requests import (
    group_initial_seeds,
    mean_recording_request,
    ode_eval,
    ode_request,
    sampler_request,
    sde_request,
)
from miles.rollout.rollout_hub import (
    awm,
    custom,
    direct_align,
    dmd2,
    dpo,
    draft,
    flow_dppo,
    flow_grpo,
    grpo_guard,
    nft,
    refl,
    sft,
)
from miles.rollout.rollout_hub.dataset import DATASET_SPEC, encode_dataset, encode_records, image_to_tensor
from miles.rollout.rollout_hub.dmd2 import generator_eval, generator_pairs, generator_request, one_pair
from miles.rollout.rollout_hub.nft import nft_pairs, nft_pairs_count
from miles.rollout.rollout_hub.pairs import (
    clean_latent_pairs,
    recompute_conflict,
    sde_pairs,
    sde_pairs_with_means,
    trained_steps_per_sample,
)
from miles.rollout.rollout_hub.spec import DatasetSpec, RolloutSpec

__all__ = [  # what a plugin builds its entry from
    "DATASET_SPEC",
    "ROLLOUT_SPECS",
    "DatasetSpec",
    "RolloutSpec",
    "check_async_rollout",
    "clean_latent_pairs",
    "encode_dataset",
    "encode_records",
    "generator_eval",
    "generator_pairs",
    "generator_request",
    "get_rollout_spec",
    "group_initial_seeds",
    "image_to_tensor",
    "mean_recording_request",
    "nft_pairs",
    "nft_pairs_count",
    "ode_eval",
    "ode_request",
    "one_pair",
    "recompute_conflict",
    "rollout_spec_of",
    "sampler_request",
    "sde_pairs",
    "sde_pairs_with_means",
    "sde_request",
    "trained_steps_per_sample",
]

ROLLOUT_SPECS: dict[str, RolloutSpec | DatasetSpec] = {
    "sft_loss": sft.SPEC,
    "policy_loss": flow_grpo.SPEC,
    "grpo_guard": grpo_guard.SPEC,
    "flow_dppo": flow_dppo.SPEC,
    "nft": nft.SPEC,
    "dmd2": dmd2.SPEC,
    "dpo": dpo.SPEC,
    "awm": awm.SPEC,
    "refl": refl.SPEC,
    "draft": draft.SPEC,
    "direct_align": direct_align.SPEC,
    "custom_loss": custom.SPEC,
}


def get_rollout_spec(loss_type: str) -> RolloutSpec | DatasetSpec:
    """The entry registered for `loss_type`, checked against its declaration: an algorithm whose declaration says
    `uses_engines` has a RolloutSpec, one fed from a dataset a DatasetSpec."""
    if loss_type not in ROLLOUT_SPECS:
        raise ValueError(
            f"no rollout entry for --loss-type {loss_type} (known: {', '.join(sorted(ROLLOUT_SPECS))}): register "
            f"ROLLOUT_SPECS[{loss_type!r}] = RolloutSpec(...) in its --algorithm-path module"
        )
    spec = ROLLOUT_SPECS[loss_type]
    algorithm = get_algorithm(loss_type)
    if algorithm.uses_engines != isinstance(spec, RolloutSpec):
        wanted = "RolloutSpec" if algorithm.uses_engines else "DatasetSpec"
        raise ValueError(
            f"--loss-type {loss_type}: its declaration says uses_engines={algorithm.uses_engines}, so its "
            f"ROLLOUT_SPECS entry must be a {wanted}, not a {type(spec).__name__}"
        )
    says_stale = isinstance(spec, RolloutSpec) and spec.stale_batch is not None
    if algorithm.async_rollout != says_stale:
        wanted = "says" if algorithm.async_rollout else "does not say"
        raise ValueError(
            f"--loss-type {loss_type}: its declaration says async_rollout={algorithm.async_rollout}, so its "
            f"ROLLOUT_SPECS entry {wanted} what the loss does with a stale batch (RolloutSpec.stale_batch); it "
            f"{'does not' if algorithm.async_rollout else 'does'}"
        )
    return spec


def rollout_spec_of(args: argparse.Namespace) -> RolloutSpec | DatasetSpec:
    """The run's rollout side: its loss type's entry, or with --train-only the dataset that entry names."""
    spec = get_rollout_spec(args.loss_type)
    if not args.train_only or isinstance(spec, DatasetSpec):
        return spec
    if spec.dataset is None:
        raise ValueError(
            f"--train-only trains on dataset pairs, and --loss-type {args.loss_type} names none "
            "(RolloutSpec.dataset): drop --train-only"
        )
    return spec.dataset


def check_async_rollout(args: argparse.Namespace) -> None:
    """--async-rollout trains each batch one update after its weights: refuse it where that would be wrong."""
    if not args.async_rollout:
        return
    if args.debug_rollout_only:
        raise ValueError(
            "--async-rollout overlaps generation with training; --debug-rollout-only has no training to overlap"
        )
    spec = rollout_spec_of(args)
    if isinstance(spec, DatasetSpec):
        raise ValueError(
            f"--async-rollout overlaps generation with training; --loss-type {args.loss_type} trains on dataset "
            "pairs here (no generation to overlap)"
        )
    if spec.stale_batch is None:
        raise ValueError(
            f"--async-rollout: --loss-type {args.loss_type} does not declare what it does with a batch generated one "
            "update behind the trainer (RolloutSpec.stale_batch), so it could train a stale batch as if on-policy; "
            "run it without --async-rollout"
        )
    conflict = spec.stale_batch_conflict(args)
    if conflict is not None:
        raise ValueError(f"--async-rollout with --loss-type {args.loss_type}: {conflict}")
