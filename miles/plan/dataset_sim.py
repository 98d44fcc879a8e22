"""The trainer's window of a run on dataset pairs (a `DatasetSpec`: --loss-type sft_loss --train-only, dpo on a
--dpo-preference-data file, custom_loss under --train-only): the run's first records encoded as the rollout manager
encodes them at start-up (`DatasetSpec.encode`: the VAE and the text encoders, on the host), on fake tensors, so the
pairs have the real run's shapes and dtypes. No engine starts in such a run, and nothing of this encode is on a GPU."""

from __future__ import annotations

import argparse
import copy
import math

import torch
from torch.utils.flop_counter import FlopCounterMode

from miles.backends.fsdp_utils.fsdp import parse_dtype
from miles.models.base import TrainPipelineConfig, get_train_pipeline_config
from miles.models.conditioning import Conditioning
from miles.models.options import family_options
from miles.plan.fake import movable_fake_modules, per_tensor_equivalents, plan_tensor_mode
from miles.rollout.rollout_hub.dataset import dataset_records
from miles.rollout.rollout_hub.spec import DatasetSpec
from miles.utils.types import TrainPairs, shard_pairs


def dataset_window(args: argparse.Namespace, spec: DatasetSpec, rows: int) -> tuple[TrainPairs, float]:
    """One data-parallel rank's window of `rows` pairs, dealt as the rollout manager deals them (`shard_pairs`), and
    the FLOPs of one transformer forward of one pair (`pair_forward_flops`: no engine measures them here)."""
    family = get_train_pipeline_config(args.hf_checkpoint, args.model_family, **family_options(args))
    resolution = args.resolution or family.default_resolution
    # a built-in world makes only the rows the window takes (its images are drawn at the run's resolution)
    few = copy.copy(args)
    few.builtin_dataset_size, few.allow_repeated_prompts = rows, True
    records = dataset_records(few, spec, resolution=resolution)
    records = (records * math.ceil(rows / max(1, len(records))))[:rows]
    with plan_tensor_mode(True), movable_fake_modules(), per_tensor_equivalents():
        pairs = spec.encode(args, family, records, resolution=resolution)
        family.release_text_encoders()
        flops = pair_forward_flops(args, family, pairs)
    return shard_pairs(pairs, 1)[0], flops


def pair_forward_flops(args: argparse.Namespace, family: TrainPipelineConfig, pairs: TrainPairs) -> float:
    """One transformer forward of the first pair at a middle noise level, counted on the fake transformer built
    from its config (under the simulation, nothing is read)."""
    transformer = family.load_transformer(args.hf_checkpoint, dtype=parse_dtype(args.diffusion_forward_dtype))
    latents = next(value for key, value in pairs.items() if key.startswith("x0"))[:1]
    cond = Conditioning.from_columns({k: v[:1] for k, v in pairs.items()})
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        family.predict_velocity(transformer, latents, torch.full((1,), 0.5), cond)
    return float(counter.get_total_flops())
