"""RolloutManager: data source, engines, rewards, advantages and conversion; a rollout id -> one box per dp rank."""

from __future__ import annotations

import argparse
import logging
import os
import time
from typing import Any

import numpy as np
import torch

from miles.models.base import get_train_pipeline_config
from miles.rollout.data_source import PromptDataSource, load_records, records_digest
from miles.utils.box import Box, put_box
from miles.utils.misc import load_function
from miles.utils.types import Sample, TrainPairs, shard_pairs

logger = logging.getLogger(__name__)


def sample_seed(rollout_seed: int, rollout_id: int, index: int) -> int:
    """Per-sample noise seed from (--rollout-seed, rollout id, index in the rollout)."""
    return int(np.random.SeedSequence([rollout_seed, rollout_id, index]).generate_state(1)[0])


def group_initial_seeds(samples: list[Sample]) -> list[int]:
    """--diffusion-shared-initial-noise: every sample starts from its group's first sample's initial latent."""
    first: dict[int, int] = {}
    for sample in samples:
        first.setdefault(sample.group_index, sample.seed)
    return [first[sample.group_index] for sample in samples]


class RolloutManager:
    """--train-only (SFT): dataset pairs encoded once. Otherwise: engines generate, rewards score, pairs go out."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.family = get_train_pipeline_config(args.hf_checkpoint, args.model_family)
        self.resolution = args.resolution or self.family.default_resolution
        self.engines = self.rewards = None
        self.weights_version = 0
        self.last_metrics: dict[str, float] = {}
        if args.train_only:
            self._init_sft()
        else:
            self._init_rl()

    # ---- SFT ----------------------------------------------------------------------------------
    def _init_sft(self) -> None:
        from miles.rollout.data_conversion_hub.sft import encode_sft_records

        started = time.perf_counter()
        records = load_records(self.args, with_images=True, resolution=self.resolution)
        self.family.load_vae()
        self.family.load_text_encoders()
        self.sft_pairs = encode_sft_records(self.family, records, self.resolution)
        logger.info("encoded %d SFT records in %.1fs", len(records), time.perf_counter() - started)
        self.source = self._source(records)

    def _source(self, records: list[dict[str, Any]]) -> PromptDataSource:
        args = self.args
        return PromptDataSource(
            len(records),
            args.rollout_batch_size,
            seed=args.rollout_seed,
            shuffle=not args.no_rollout_shuffle,
            digest=records_digest(records),
        )

    # ---- RL -----------------------------------------------------------------------------------
    def _init_rl(self) -> None:
        args = self.args
        self.records = load_records(args, with_images=False, resolution=self.resolution)
        self.source = self._source(self.records)
        if args.load_debug_rollout_data:
            logger.info("replaying rollouts from %s: no engine started", args.load_debug_rollout_data)
            return
        from miles.rollout.engine_group import RolloutEngineGroup
        from miles.rollout.rm_hub import reward_spec_from_args
        from miles.rollout.rm_hub.workers import RewardWorkerPool

        gpu = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
        self.engines = RolloutEngineGroup(
            args.hf_checkpoint,
            num_engines=args.rollout_num_engines,
            model_family=args.model_family,
            num_cpus_per_engine=args.rollout_cpus_per_engine if not gpu else 1.0,
            num_gpus_per_engine=args.rollout_gpus_per_engine if gpu else 0.0,
            lora_config=self._lora_config(),
        )
        if args.loss_type != "dmd2" or args.rm_type or args.custom_rm_path:  # dmd2 scores only when asked (metrics)
            self.rewards = RewardWorkerPool(args, reward_spec_from_args(args), num_workers=args.rm_num_workers)

    def _lora_config(self) -> dict | None:
        if not self.args.use_lora:
            return None
        from miles.backends.fsdp_utils.lora import lora_config_from_args

        return lora_config_from_args(self.args, self.family.name)

    def generate(self, rollout_id: int) -> list[Box]:
        if self.args.train_only:
            index = torch.tensor(self.source.indices(rollout_id))
            return self._boxes({key: value[index] for key, value in self.sft_pairs.items()})
        if self.args.load_debug_rollout_data:
            return self._boxes(torch.load(self._debug_path(self.args.load_debug_rollout_data, rollout_id)))
        pairs = self._rl_rollout(rollout_id)
        if self.args.save_debug_rollout_data:
            os.makedirs(self.args.save_debug_rollout_data, exist_ok=True)
            torch.save(pairs, self._debug_path(self.args.save_debug_rollout_data, rollout_id))
        return self._boxes(pairs)

    def _boxes(self, pairs: TrainPairs) -> list[Box]:
        return [put_box(shard) for shard in shard_pairs(pairs, self.args.dp_size)]

    @staticmethod
    def _debug_path(directory: str, rollout_id: int) -> str:
        path = os.path.join(directory, f"rollout_{rollout_id:07d}.pt")
        if not os.path.isdir(directory):
            raise FileNotFoundError(f"--load-debug-rollout-data {directory}: directory not found")
        return path

    def make_samples(self, rollout_id: int) -> list[Sample]:
        args, samples = self.args, []
        for group, record_index in enumerate(self.source.indices(rollout_id)):
            record = self.records[record_index]
            for _ in range(args.n_samples_per_prompt):
                index = len(samples)
                samples.append(
                    Sample(
                        index=index,
                        prompt=record["prompt"],
                        metadata=record.get("metadata") or {},
                        group_index=group,
                        seed=sample_seed(args.rollout_seed, rollout_id, index),
                    )
                )
        return samples

    def _rl_rollout(self, rollout_id: int) -> TrainPairs:
        from miles.rollout.advantages import compute_grpo_advantages
        from miles.rollout.data_conversion_hub.dmd2 import expand_samples_to_dmd2_pairs
        from miles.rollout.data_conversion_hub.flow_grpo import expand_samples_to_train_pairs
        from miles.rollout.data_conversion_hub.nft import expand_samples_to_nft_pairs, nft_pairs_per_sample
        from miles.rollout.engine import GenerateRequest
        from miles.rollout.rm_hub import reward_metrics
        from miles.rollout.step_strategy_hub import select_trained_steps

        args = self.args
        t0 = time.perf_counter()
        samples = self.make_samples(rollout_id)
        nft = args.loss_type == "nft"  # NFT samples deterministic ODE trajectories and trains on clean latents
        dmd2 = args.loss_type == "dmd2"  # DMD2 samples the few-step generator, CFG-free, and trains one step j
        if dmd2:
            request = self._dmd2_request(samples, rollout_id)
        else:
            request = GenerateRequest(
                prompts=[s.prompt for s in samples],
                seeds=[s.seed for s in samples],
                initial_seeds=group_initial_seeds(samples) if args.diffusion_shared_initial_noise else None,
                num_steps=args.diffusion_num_steps,
                guidance_scale=args.diffusion_guidance_scale,
                negative_prompt=args.negative_prompt,
                sde_type="ode" if nft else args.diffusion_sde_type,
                noise_level=args.diffusion_noise_level,
                trained_steps=[] if nft else select_trained_steps(args, rollout_id),
                resolution=self.resolution,
            )
        result = self.engines.generate(request, rollout_id=rollout_id)
        for sample, image in zip(samples, result.images):
            sample.image = image
        t1 = time.perf_counter()
        if self.rewards is not None:
            totals, per_reward = self.rewards.score(samples)
        else:  # dmd2 without a reward flag: nothing to score, rewards are only metrics there
            totals, per_reward = [0.0] * len(samples), {}
        rewards = torch.tensor(totals, dtype=torch.float32)
        for sample, value in zip(samples, totals):
            sample.reward = value if self.rewards is not None else None
        if args.custom_reward_post_process_path:
            advantages = torch.as_tensor(load_function(args.custom_reward_post_process_path)(args, samples, rewards))
        else:
            advantages = compute_grpo_advantages(
                rewards,
                args.n_samples_per_prompt,
                globalize_std=args.globalize_reward_std,
                normalize_std=not args.disable_grpo_std_normalization,
            )
        t2 = time.perf_counter()
        if args.custom_expand_samples_to_train_pairs_path:
            pairs = load_function(args.custom_expand_samples_to_train_pairs_path)(args, result, advantages)
            steps = None
        elif dmd2:
            pairs = expand_samples_to_dmd2_pairs(result)
            steps = 1
        elif nft:
            pairs = expand_samples_to_nft_pairs(
                result,
                advantages,
                timestep_fraction=args.diffusion_nft_timestep_fraction,
                seed=args.rollout_seed,
                rollout_id=rollout_id,
            )
            steps = nft_pairs_per_sample(args.diffusion_num_steps, args.diffusion_nft_timestep_fraction)
        else:
            pairs = expand_samples_to_train_pairs(result, advantages)
            steps = len(request.trained_steps)
        if steps is not None:  # whole samples in a seeded order, so every window mixes prompt groups
            order = torch.from_numpy(
                np.random.default_rng([args.rollout_seed, rollout_id, 7]).permutation(len(samples))
            )
            rows = (order[:, None] * steps + torch.arange(steps)[None, :]).reshape(-1)
            pairs = {key: value[rows] for key, value in pairs.items()}
        scored = self.rewards is not None
        self.last_metrics = {
            **(reward_metrics(totals, per_reward, samples) if scored else {}),
            **({"rollout/reward_std": float(rewards.std(unbiased=False))} if scored else {}),
            **({"rollout/advantage_abs_mean": float(advantages.abs().mean())} if scored else {}),
            "rollout/trained_steps": steps if steps is not None else len(request.trained_steps),
            "rollout/weights_version": result.weights_version,
            **({"rollout/dmd2_generator_step": request.trained_steps[0]} if dmd2 else {}),
            "perf/rollout_s": t1 - t0,
            "perf/reward_s": t2 - t1,
        }
        if args.image_grid_interval and rollout_id % args.image_grid_interval == 0:
            from miles.rollout.image_grid import save_image_grid

            path = os.path.join(args.output_dir, "images", f"rollout_{rollout_id:07d}.png")
            save_image_grid(result.images, path, columns=args.n_samples_per_prompt)
        return pairs

    def _dmd2_request(self, samples: list[Sample], rollout_id: int) -> Any:
        """The generator's k-step `renoise` run, CFG-free, recording the step j drawn for this rollout; the
        negative prompt is encoded for the teacher's CFG on the train side."""
        from miles.rollout.data_conversion_hub.dmd2 import dmd2_trained_step
        from miles.rollout.engine import GenerateRequest

        args = self.args
        k = args.dmd2_generator_steps
        return GenerateRequest(
            prompts=[s.prompt for s in samples],
            seeds=[s.seed for s in samples],
            num_steps=k,
            guidance_scale=1.0,
            negative_prompt=args.negative_prompt,
            sde_type="renoise",
            noise_level=0.0,
            trained_steps=[dmd2_trained_step(k, seed=args.rollout_seed, rollout_id=rollout_id)],
            resolution=self.resolution,
            shift=args.dmd2_timestep_shift,
            return_negative=True,
        )

    def update_weights(self, actor_group: Any) -> float:
        """Push the actor's weights (or LoRA / EMA weights, as the actor decides) to every engine; seconds taken."""
        if self.engines is None:
            return 0.0
        started = time.perf_counter()
        self.weights_version += 1
        self.engines.update_weights(actor_group.export_weights_ref(), self.weights_version)
        return time.perf_counter() - started

    def metrics(self, rollout_id: int) -> dict[str, Any]:
        return {"rollout/epoch": self.source.epoch_of(rollout_id), **self.last_metrics}

    def shutdown(self) -> None:
        if self.engines is not None:
            self.engines.shutdown()
        if self.rewards is not None:
            self.rewards.shutdown()
