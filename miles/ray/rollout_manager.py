"""RolloutManager: data source, encoders and conversion; turns a rollout id into one boxed shard per dp rank."""

from __future__ import annotations

import argparse
import logging
import time

import torch

from miles.models.base import get_train_pipeline_config
from miles.rollout.data_conversion_hub.sft import encode_sft_records
from miles.rollout.data_source import PromptDataSource, load_records
from miles.utils.box import Box, put_box
from miles.utils.types import shard_pairs

logger = logging.getLogger(__name__)


class RolloutManager:
    """With --train-only (SFT) there is no engine: dataset pairs are encoded once and served per rollout."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.family = get_train_pipeline_config(args.hf_checkpoint, args.model_family)
        self.resolution = args.resolution or self.family.default_resolution
        if not args.train_only:
            raise NotImplementedError("rollout engines arrive with policy_loss; use --train-only for sft_loss")
        started = time.perf_counter()
        records = load_records(args, with_images=True, resolution=self.resolution)
        self.family.load_vae()
        self.family.load_text_encoders()
        self.pairs = encode_sft_records(self.family, records, self.resolution)
        logger.info("encoded %d SFT records in %.1fs", len(records), time.perf_counter() - started)
        self.source = PromptDataSource(
            len(records), args.rollout_batch_size, seed=args.rollout_seed, shuffle=not args.no_rollout_shuffle
        )

    def generate(self, rollout_id: int) -> list[Box]:
        index = torch.tensor(self.source.indices(rollout_id))
        pairs = {key: value[index] for key, value in self.pairs.items()}
        return [put_box(shard) for shard in shard_pairs(pairs, self.args.dp_size)]

    def metrics(self, rollout_id: int) -> dict[str, float]:
        return {"rollout/epoch": self.source.epoch_of(rollout_id)}
