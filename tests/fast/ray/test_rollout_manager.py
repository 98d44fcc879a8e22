"""The rollout manager asks the run's rollout entry: a dataset entry is encoded once and each rollout trains the rows
the data source picks (no engine, no Ray). The prompt cache fill at start-up asks for the prompts the run's rollouts
draw (and the eval prompts), and keeps the text encoders when prompts may come from elsewhere."""

from __future__ import annotations

import torch

from miles.arguments.parser import default_args, parse_args
from miles.arguments.records import RolloutFlags
from miles.ray.rollout_manager import RolloutManager
from miles.rollout import steps
from miles.rollout.data_source import PromptDataSource
from miles.rollout.prompt_cache import PromptCacheConfig
from miles.rollout.rollout_hub import ROLLOUT_SPECS, DatasetSpec
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


class RecordingEngines:
    def __init__(self) -> None:
        self.calls = []

    def fill_prompt_cache(self, prompts, negatives, release, resolution, guided):
        assert (resolution, guided) == (48, True)  # the run's resolution and guidance (scale 4.5 > 1)
        self.calls.append((prompts, negatives, release))
        return {"found": 0, "encoded": len(set(prompts)) + len(negatives)}


def manager_of(records, hooks=None) -> RolloutManager:
    manager = RolloutManager.__new__(RolloutManager)
    manager.flags = RolloutFlags.from_args(
        default_args(num_rollout=3, negative_prompt="neg", resolution=48, diffusion_guidance_scale=4.5)
    )
    manager.records, manager.hooks, manager.engines = records, hooks or {}, RecordingEngines()
    manager.source = PromptDataSource(len(records), 2, seed=5, shuffle=True)
    manager.prompt_cache = PromptCacheConfig("unused", "f")
    return manager


def test_the_manager_fills_what_the_rollouts_draw_and_keeps_the_encoders_when_prompts_may_come_from_elsewhere():
    records = [{"prompt": f"prompt {i}"} for i in range(20)]
    manager = manager_of(records)
    manager.fill_prompt_cache(["eval a", "eval b"], start_rollout_id=1)
    drawn = sorted({i for rollout_id in (1, 2) for i in manager.source.indices(rollout_id)})
    assert manager.engines.calls == [([f"prompt {i}" for i in drawn] + ["eval a", "eval b"], ["neg"], True)]

    for hooks, eval_prompts in (({"data_source_path": print}, []), ({"dynamic_sampling_filter_path": print}, []),
                                ({}, None)):  # fmt: skip
        manager = manager_of(records, hooks)
        manager.fill_prompt_cache(eval_prompts)
        assert manager.engines.calls[0][2] is False  # filled, encoders kept

    manager = manager_of([{"prompt": "edit it", "source_images": ["a.png"]}])
    manager.fill_prompt_cache([])
    assert manager.engines.calls == []  # cached at first use, with the images
