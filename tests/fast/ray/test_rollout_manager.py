"""The rollout manager and the evaluator ask the run's rollout entry: a dataset entry is encoded once and each
rollout trains the rows the data source picks (no engine, no Ray); the eval samples with the entry's sampler."""

from __future__ import annotations

import pytest
import torch

from miles.arguments.parser import parse_args
from miles.ray.evaluator import Evaluator
from miles.ray.rollout_manager import RolloutManager
from miles.rollout import steps
from miles.rollout.data_source import PromptDataSource
from miles.rollout.requests import ode_eval
from miles.rollout.rollout_hub import ROLLOUT_SPECS, DatasetSpec, generator_eval
from miles.utils.types import shard_pairs

BASE = ["--prompt-data", "builtin:shapes", "--log-level", "WARNING"]
RECORDS = 6


def sft_args(pipeline_dir, *extra):
    return parse_args(
        [
            *BASE, "--hf-checkpoint", pipeline_dir, "--loss-type", "sft_loss", "--train-only", "--builtin-dataset-size", str(RECORDS),
            "--rollout-batch-size", "4", "--num-steps-per-rollout", "2", "--dp-size", "2", *extra,
        ]
    )  # fmt: skip


def test_a_dataset_entry_is_encoded_once_and_each_rollout_trains_the_data_sources_rows(monkeypatch, tiny_pipeline_dir):
    encoded = []

    def encode(args, family, records, *, resolution):  # row i names record i
        encoded.append([r["prompt"] for r in records])
        return {"record": torch.arange(len(records)), "x0": torch.randn(len(records), 2)}

    monkeypatch.setitem(ROLLOUT_SPECS, "sft_loss", DatasetSpec(encode=encode))
    monkeypatch.setattr(steps, "shard", shard_pairs)  # the shards themselves, not boxes in Ray's object store
    args = sft_args(tiny_pipeline_dir)
    manager = RolloutManager(args)
    assert manager.engines is None and manager.rewards is None
    source = PromptDataSource(RECORDS, 4, seed=args.rollout_seed, shuffle=True)
    seen = []
    for rollout_id in range(3):
        shards = manager.generate(rollout_id)
        assert len(shards) == 2 and all(len(s["record"]) == 2 for s in shards)
        rows = torch.cat([s["record"] for s in shards])[torch.cat([s["pair_index"] for s in shards]).argsort()].tolist()
        assert rows == list(source.indices(rollout_id))
        seen += rows
    assert len(encoded) == 1 and len(encoded[0]) == RECORDS  # once, every record
    assert sorted(seen) == sorted(list(range(RECORDS)) * 2)  # 12 rows: two whole epochs


def test_the_eval_samples_with_the_entrys_sampler(tiny_pipeline_dir):
    common = [*BASE, "--hf-checkpoint", tiny_pipeline_dir, "--eval-num-prompts", "2"]
    assert Evaluator(parse_args([*common, "--loss-type", "nft"])).sampler is ode_eval
    dmd2 = parse_args([*common, "--loss-type", "dmd2", "--teacher-load", tiny_pipeline_dir])
    assert Evaluator(dmd2).sampler is generator_eval
    with pytest.raises(
        ValueError, match="sft_loss trains on dataset pairs here with none started: pass --eval-interval"
    ):
        Evaluator(sft_args(tiny_pipeline_dir))
