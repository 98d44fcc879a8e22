"""RolloutManager: data source, engines, rewards, advantages and conversion; a rollout id -> one box per dp rank."""

from __future__ import annotations

import argparse
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from miles.algorithms import algorithm_of
from miles.arguments.engine import engine_timeouts
from miles.arguments.hook_paths import load_path_flags
from miles.arguments.records import RolloutFlags
from miles.backends.fsdp_utils.fsdp import parse_dtype
from miles.models.base import family_options, get_train_pipeline_config
from miles.ray.actor_pool import ActorPool
from miles.ray.engine_group import RolloutEngineGroup
from miles.ray.reward_workers import RewardWorkerPool
from miles.ray.weight_sync import WeightSyncLink
from miles.rollout import steps
from miles.rollout.data_source import PromptDataSource, load_records, records_digest
from miles.rollout.engine_api import GenerateResult
from miles.rollout.media_files import save_rollout_media
from miles.rollout.monitors import DriftWatch, monitor_metrics, watches
from miles.rollout.prompt_cache import DRAWING_HOOKS, PromptCacheConfig, prompt_cache_config
from miles.rollout.rm_hub import reward_metrics, reward_spec_from_args
from miles.rollout.rm_hub.clip import CLIP_EMBEDDING_KEY
from miles.rollout.rm_hub.media import attach_media
from miles.rollout.rollout_hub import DatasetSpec, RolloutSpec, rollout_spec_of
from miles.rollout.rollout_hub.dataset import dataset_records
from miles.utils.box import Box
from miles.utils.distributed import engine_cpus, uses_gpu
from miles.utils.types import Sample, TrainPairs

logger = logging.getLogger(__name__)
REWARD_TERMS = steps.REWARD_TERMS  # Sample.extra key: the sample's value of each weighted reward


class RolloutManager:
    """The run's rollout entry (`rollout_spec_of`) decides: a DatasetSpec's records are encoded once and each rollout
    trains the rows the data source picks; a RolloutSpec's rollouts the engines generate and the rewards score."""

    def __init__(
        self, args: argparse.Namespace, *, wait: bool = True, colocation: Any = None, pool: ActorPool | None = None
    ) -> None:
        """With `wait=False` the engines and reward workers load in the background until `wait_ready` (the driver
        starts the trainer ranks meanwhile). `colocation`: the shared placement group of --colocate. `pool`: where
        the engines come from and go back to (`miles.ray.actor_pool`)."""
        self.args, self._wait, self._colocation, self._pool = args, wait, colocation, pool
        self.flags = flags = RolloutFlags.from_args(args)
        self.family = get_train_pipeline_config(flags.hf_checkpoint, flags.model_family, **family_options(args))
        self.resolution = flags.resolution or self.family.default_resolution
        self.engines: RolloutEngineGroup | None = None
        self.rewards: RewardWorkerPool | None = None
        self.prompt_cache: PromptCacheConfig | None = None
        self.dataset_pairs: TrainPairs | None = None
        self.weights_version = 0
        self.weight_sync: WeightSyncLink | None = None  # made at the first sync with engines
        self.last_metrics: dict[str, float] = {}
        self.drift = DriftWatch(
            watches(flags.monitor_image_drift, flags.monitor_norm_drift, flags.monitor_diversity_collapse)
        )
        self.hooks = load_path_flags(args)  # the rollout steps the path flags replace, {flag dest: function}
        self.zero_advantages = steps.ZeroAdvantageWatch(algorithm_of(args).group_advantages, flags.n_samples_per_prompt)
        self.spec = rollout_spec_of(args)
        if isinstance(self.spec, DatasetSpec):
            self._init_dataset(self.spec)
        else:
            self._init_rl(self.spec)

    # ---- dataset-fed (DatasetSpec) --------------------------------------------------------------
    def _init_dataset(self, spec: DatasetSpec) -> None:
        started = time.perf_counter()
        records = dataset_records(self.args, spec, resolution=self.resolution)
        self.dataset_pairs = spec.encode(self.args, self.family, records, resolution=self.resolution)
        logger.info("encoded %d dataset records in %.1fs", len(records), time.perf_counter() - started)
        self.source = self._source(records)

    def _source(self, records: list[dict[str, Any]]) -> PromptDataSource:
        flags = self.flags
        return PromptDataSource(
            len(records),
            flags.rollout_batch_size,
            seed=flags.rollout_seed,
            shuffle=not flags.no_rollout_shuffle,
            digest=records_digest(records),
        )

    # ---- engine-fed (RolloutSpec) ---------------------------------------------------------------
    def _init_rl(self, spec: RolloutSpec) -> None:
        args, flags = self.args, self.flags
        self.rl_spec = spec  # the engine-fed entry (`self.spec`, typed): each rollout's request, pairs and metrics
        self.records = load_records(args, with_images=False, resolution=self.resolution)
        self.source = self._source(self.records)
        if flags.load_debug_rollout_data:
            logger.info("replaying rollouts from %s: no engine started", flags.load_debug_rollout_data)
            return
        gpu = uses_gpu(args)
        forward_dtype = parse_dtype(flags.diffusion_forward_dtype)  # the trainer's: log-probs must match (§7)
        self.prompt_cache = prompt_cache_config(args, self.family, forward_dtype)
        self.engines = RolloutEngineGroup(
            flags.hf_checkpoint,
            num_engines=flags.rollout_num_engines,
            model_family=flags.model_family,
            num_cpus_per_engine=engine_cpus(args),
            num_gpus_per_engine=flags.rollout_gpus_per_engine if gpu else 0.0,
            forward_dtype=forward_dtype,
            lora_config=self._lora_config(),
            family_options=family_options(args),
            compile_mode=flags.compile,
            prompt_cache=self.prompt_cache,
            micro_batch_size=flags.rollout_micro_batch_size,
            timeouts=engine_timeouts(args),
            wait=self._wait,
            colocation=self._colocation,
            pool=self._pool,
        )
        # an algorithm that scores no rewards (its declaration) scores them only when asked, as metrics
        if algorithm_of(args).scores_rewards or flags.rm_type or flags.custom_rm_path or flags.rm_url:
            self.rewards = RewardWorkerPool(
                args, reward_spec_from_args(args), num_workers=flags.rm_num_workers, wait=self._wait
            )

    def wait_ready(self) -> None:
        """Wait until the engines and reward workers started by `__init__(wait=False)` are up."""
        if self.engines is not None:
            self.engines.wait_ready()
        if self.rewards is not None:
            self.rewards.wait_ready()

    def fill_prompt_cache(self, eval_prompts: list[str] | None, start_rollout_id: int = 0) -> None:
        """With a prompt cache: the engines encode the prompts of rollouts `start_rollout_id`.. and `eval_prompts` (None:
        unknown) once, then free their text encoders unless a hook may bring others (`DRAWING_HOOKS`)."""
        if self.engines is None or self.prompt_cache is None or any(r.get("source_images") for r in self.records):
            return  # prompts with source images are cached as they come, and the text encoders stay
        started, rollouts = time.perf_counter(), range(start_rollout_id, self.flags.num_rollout)
        drawn = sorted({index for rollout_id in rollouts for index in self.source.indices(rollout_id)})
        prompts = [self.records[index]["prompt"] for index in drawn] + list(eval_prompts or [])
        complete = eval_prompts is not None and not any(flag in self.hooks for flag in DRAWING_HOOKS)
        guided = self.flags.diffusion_guidance_scale > 1.0
        negatives = [self.flags.negative_prompt]
        stats = self.engines.fill_prompt_cache(prompts, negatives, complete, self.flags.resolution, guided)
        logged = {**stats, "seconds": round(time.perf_counter() - started, 1)}
        logger.info("prompt cache %s: %s%s", self.prompt_cache.directory, logged, "" if complete else ", encoders kept")

    def show_engine_progress(self, display: Callable[[str], None]) -> None:
        """`display(text)` with the engines' progress while a generation is awaited ("generate 37/80 steps"; "" when
        it is in)."""
        if self.engines is not None:
            self.engines.on_progress = display

    def _lora_config(self) -> dict | None:
        if not self.flags.use_lora:
            return None
        from miles.backends.fsdp_utils.lora import lora_config_from_args  # local: peft costs ~1.3 s per process

        return lora_config_from_args(self.args, self.family.name)

    def generate(self, rollout_id: int) -> list[Box]:
        if self.dataset_pairs is not None:
            index = torch.tensor(self.source.indices(rollout_id))
            return self._boxes({key: value[index] for key, value in self.dataset_pairs.items()})
        if self.flags.load_debug_rollout_data:
            return self._boxes(torch.load(self._debug_path(self.flags.load_debug_rollout_data, rollout_id)))
        if "rollout_function_path" in self.hooks:
            pairs = self.hooks["rollout_function_path"](self.args, rollout_id, self)
        else:
            pairs = self._rl_rollout(rollout_id)
        if self.flags.save_debug_rollout_data:
            os.makedirs(self.flags.save_debug_rollout_data, exist_ok=True)
            torch.save(pairs, self._debug_path(self.flags.save_debug_rollout_data, rollout_id))
        return self._boxes(pairs)

    def _boxes(self, pairs: TrainPairs) -> list[Box]:
        return steps.shard(pairs, self.flags.dp_size)

    @staticmethod
    def _debug_path(directory: str, rollout_id: int) -> str:
        path = os.path.join(directory, f"rollout_{rollout_id:07d}.pt")
        if not os.path.isdir(directory):
            raise FileNotFoundError(f"--load-debug-rollout-data {directory}: directory not found")
        return path

    def _rl_rollout(self, rollout_id: int) -> TrainPairs:
        """sample -> generate -> score -> filter (with refills) -> advantages -> convert -> order; timed per phase."""
        args, spec = self.args, self.rl_spec
        t0 = time.perf_counter()
        samples, result, request, rounds = self._collect(rollout_id)
        t1 = time.perf_counter()
        scored = self.rewards is not None
        rewards = torch.tensor([s.reward if scored else 0.0 for s in samples], dtype=torch.float32)
        if "rollout_sample_filter_path" in self.hooks:
            self.hooks["rollout_sample_filter_path"](args, samples)
        advantages = steps.compute_advantages(args, samples, rewards, self.hooks.get("custom_reward_post_process_path"))
        t2 = time.perf_counter()
        convert = self.hooks.get("custom_convert_samples_to_train_data_path")
        if convert is not None:  # the user's pairs, in the user's order
            pairs, per_sample = convert(args, result, advantages), None
        else:
            per_sample = spec.pairs_per_sample(args, request)
            pairs = steps.order_pairs(
                spec.convert(args, samples, result, advantages, rollout_id=rollout_id),
                len(samples),
                per_sample,
                seed=self.flags.rollout_seed,
                rollout_id=rollout_id,
            )
        self.last_metrics = {
            **(self._reward_metrics(samples, rewards, advantages) if scored else {}),
            **(self.zero_advantages.check(rollout_id, rewards, advantages) if scored else {}),
            "rollout/trained_steps": per_sample if per_sample is not None else len(request.trained_steps),
            "rollout/weights_version": result.weights_version,
            **spec.metrics(request),
            **({"rollout/dynamic_sampling_rounds": rounds} if "dynamic_sampling_filter_path" in self.hooks else {}),
            **self._removed_metric(samples),
            **self._monitor_metrics(rollout_id, samples, result),
            "perf/rollout_s": t1 - t0,
            "perf/reward_s": t2 - t1,
            **{f"perf/engine_{name}": value for name, value in (result.compile_counters or {}).items()},
        }
        save_rollout_media(self.flags, rollout_id, result, samples)
        return pairs

    def _monitor_metrics(self, rollout_id: int, samples: list[Sample], result: Any) -> dict[str, float]:
        """The reward-hacking monitors of the batch (`miles.rollout.monitors`), their warnings, `monitor/alerts`."""
        groups = [[s.index for s in group] for group in steps.split_groups(samples)]
        per_reward = steps.per_reward(samples)
        embeddings = None
        if samples and all(CLIP_EMBEDDING_KEY in s.extra for s in samples):
            embeddings = np.stack([s.extra[CLIP_EMBEDDING_KEY] for s in samples])
        metrics = monitor_metrics(result.images, result.final_latents.float().numpy(), groups, per_reward, embeddings)
        return {**metrics, "monitor/alerts": len(self.drift.check(rollout_id, metrics))}

    def _collect(self, rollout_id: int) -> tuple[list[Sample], Any, Any, int]:
        """Samples of the rollout's prompt groups, generated and scored. With a dynamic-sampling filter, dropped
        groups are refilled with new prompts for up to --dynamic-sampling-max-rounds rounds (then the batch is
        completed with dropped groups, with a warning). Returns (samples, engine result, request, refill rounds)."""
        args, wanted = self.args, self.flags.rollout_batch_size
        keep = self.hooks.get("dynamic_sampling_filter_path")
        kept: list[tuple[list[Sample], list[int], Any]] = []  # (group, its rows in its round's result, that result)
        dropped: list[tuple[list[Sample], list[int], Any]] = []
        first_index, rounds = 0, 0
        while True:
            samples = self._sample(rollout_id, wanted - len(kept), attempt=rounds, first_index=first_index)
            first_index += len(samples)
            request = self.rl_spec.build_request(args, samples, rollout_id=rollout_id, resolution=self.resolution)
            result = self._generate_and_score(samples, request, rollout_id)
            for group in steps.split_groups(samples):
                rows = [s.index - samples[0].index for s in group]
                keeps = keep is None or steps.keeps_group(keep, args, group)
                (kept if keeps else dropped).append((group, rows, result))
            if len(kept) >= wanted or rounds >= self.flags.dynamic_sampling_max_rounds:
                break
            rounds += 1
        if rounds == 0 and not dropped:
            return samples, result, request, rounds  # nothing dropped: the one generated batch as it is
        if len(kept) < wanted:
            logger.warning(
                "rollout %d: the dynamic-sampling filter kept %d of %d prompt groups after %d refill round(s); "
                "completing the batch with dropped groups",
                rollout_id,
                len(kept),
                wanted,
                rounds,
            )
            kept += dropped[: wanted - len(kept)]
        samples = [s for group, _, _ in kept for s in group]
        result = GenerateResult.concat([steps.select_rows(res, rows) for _, rows, res in kept])
        steps.renumber(samples)
        return samples, result, request, rounds

    def _sample(self, rollout_id: int, num_prompts: int, *, attempt: int, first_index: int) -> list[Sample]:
        """The sample step: prompt records (the data source's, or --data-source-path's) -> samples. Refill rounds
        (attempt ≥ 1) draw fresh prompts from a seeded stream."""
        args = self.args
        first_group = first_index // self.flags.n_samples_per_prompt
        if "data_source_path" in self.hooks:
            records = list(self.hooks["data_source_path"](args, rollout_id, num_prompts, attempt))
            if len(records) != num_prompts:
                raise ValueError(
                    f"--data-source-path returned {len(records)} prompt records for rollout {rollout_id} "
                    f"(attempt {attempt}); {num_prompts} were asked for"
                )
            indices: Any = range(len(records))
        elif attempt == 0:
            records, indices = self.records, self.source.indices(rollout_id)
        else:
            records = self.records
            indices = steps.refill_record_indices(
                len(records), num_prompts, seed=self.flags.rollout_seed, rollout_id=rollout_id, round_index=attempt
            )
        return steps.make_samples(
            args,
            records,
            indices,
            rollout_id,
            first_index=first_index,
            first_group=first_group,
            resolution=self.resolution,
        )

    def _generate_and_score(self, samples: list[Sample], request: Any, rollout_id: int) -> Any:
        """The generate and score steps. With --generate-chunk-size N (and rewards to score, with the built-in
        engines) the batch is generated N samples at a time and each chunk is scored while the engines generate the
        next one: the same samples, rewards and pairs as generating and scoring those chunks one after the other
        (rewards are per sample: the reward workers already score contiguous slices)."""
        chunk = self.flags.generate_chunk_size
        if not chunk or chunk >= len(samples) or self.rewards is None or "custom_generate_function_path" in self.hooks:
            result = self._generate(request, rollout_id)
            self._score(samples, result, rollout_id)
            return result
        bounds = [(start, min(start + chunk, len(samples))) for start in range(0, len(samples), chunk)]
        engines = self._engines()
        pending = engines.submit(request.rows(*bounds[0]), rollout_id)
        parts = []
        for k, (start, end) in enumerate(bounds):
            part = engines.collect(pending)
            if k + 1 < len(bounds):  # the engines start on the next chunk before this one is scored
                pending = engines.submit(request.rows(*bounds[k + 1]), rollout_id)
            self._score(samples[start:end], part, rollout_id)
            parts.append(part)
        return GenerateResult.concat(parts)

    def _generate(self, request: Any, rollout_id: int) -> Any:
        """The generate step: the engines, or --custom-generate-function-path with the engines at hand."""
        if "custom_generate_function_path" in self.hooks:
            return self.hooks["custom_generate_function_path"](self.args, self.engines, request)
        return self._engines().generate(request, rollout_id=rollout_id)

    def _engines(self) -> RolloutEngineGroup:
        """The rollout engines, which a replay of saved rollouts (--load-debug-rollout-data) never starts."""
        if self.engines is None:
            raise RuntimeError("no rollout engines to generate with: this manager replays saved rollouts")
        return self.engines

    def _score(self, samples: list[Sample], result: Any, rollout_id: int | None = None) -> None:
        """The score step: each sample gets its media (`attach_media`: image, or frames + fps + audio) and, when
        rewards are scored, its weighted reward and terms."""
        attach_media(samples, result)
        if self.rewards is None:
            return
        totals, per_reward = self.rewards.score(samples, rollout_id)
        for i, (sample, value) in enumerate(zip(samples, totals)):
            sample.reward = value
            sample.extra[REWARD_TERMS] = {name: values[i] for name, values in per_reward.items()}

    @staticmethod
    def _reward_metrics(samples: list[Sample], rewards: torch.Tensor, advantages: torch.Tensor) -> dict[str, float]:
        per_reward, totals = steps.per_reward(samples), [s.reward for s in samples if s.reward is not None]
        if len(totals) != len(samples):
            raise ValueError(f"reward metrics of {len(samples) - len(totals)} unscored sample(s)")
        return {
            **reward_metrics(totals, per_reward, samples),
            "rollout/reward_std": float(rewards.std(unbiased=False)),
            "rollout/advantage_abs_mean": float(advantages.abs().mean()),
        }

    def _removed_metric(self, samples: list[Sample]) -> dict[str, float]:
        if "rollout_sample_filter_path" not in self.hooks:
            return {}
        return {"rollout/removed_samples_frac": sum(s.remove_sample for s in samples) / max(len(samples), 1)}

    def update_weights(
        self, actor_group: Any, before_load: Any = None, *, rollout_id: int | None = None, version: int | None = None
    ) -> float:
        """Push the actor's weights (or LoRA / EMA weights, as the actor decides) to every engine over the weight
        sync group (`miles.ray.weight_sync`: no pickles, no object store); seconds from the gather until every engine
        holds and has verified them. `before_load()` runs once the engines hold them (`--colocate-sleep`: the trainer
        ranks sleep and the engines, awake since they received, stay so). `rollout_id`: the rollout an engine's
        failure names (None for the sync before the first rollout). `version`: the weights version to give (default:
        one more than the last; a resumed run's first sync continues the uninterrupted count)."""
        self.weights_version = self.weights_version + 1 if version is None else version
        seconds = 0.0
        if self.engines is not None:
            if self.weight_sync is None:
                self.weight_sync = WeightSyncLink(self.args, self.engines)
            seconds = self.weight_sync.push(actor_group, self.weights_version, rollout_id)
        if before_load is not None:
            before_load()
        return seconds

    def metrics(self, rollout_id: int) -> dict[str, Any]:
        return {"rollout/epoch": self.source.epoch_of(rollout_id), **self.last_metrics}

    def shutdown(self) -> None:
        if self.engines is not None:
            self.engines.shutdown()
        if self.rewards is not None:
            self.rewards.shutdown()
