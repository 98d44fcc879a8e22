"""The planner's rollout engine: its start-up (weights, text encoders, VAE, the prompt-cache fill) and one generate
call for its share, the library's own `DiffusionEngine` on fake tensors, each transformer forward run once per input
layout and each micro-batch's decode replayed (`replay`), its memory tracked per phase."""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import time
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch
from torch.utils.flop_counter import FlopCounterMode

from miles.backends.fsdp_utils.fsdp import parse_dtype
from miles.backends.fsdp_utils.lora import lora_config_from_args
from miles.models.base import family_options, get_train_pipeline_config
from miles.models.conditioning import Conditioning
from miles.plan.fake import (
    movable_fake_modules,
    per_tensor_equivalents,
    plan_tensor_mode,
)
from miles.plan.process import ProcessPlan, storage_bytes
from miles.plan.replay import Ledger, replay_decodes
from miles.plan.replay_layers import LayerReplay, replay_layers
from miles.plan.tracker import PlanTracker
from miles.rollout.engine import DiffusionEngine
from miles.rollout.engine_api import GenerateResult
from miles.rollout.prompt_cache import frees_text_encoders
from miles.rollout.prompt_encoder import fill_step
from miles.rollout.rollout_hub import rollout_spec_of
from miles.rollout.rollout_hub.spec import RolloutSpec
from miles.utils.types import Sample

logger = logging.getLogger(__name__)


def engine_rollout_spec(args: argparse.Namespace) -> RolloutSpec:
    """The rollout side the simulated engine's call and the trainer's pairs come from; a run on dataset pairs
    (--train-only, e.g. --loss-type sft_loss) has none, and the planner does not simulate it: refused, naming why."""
    spec = rollout_spec_of(args)
    if not isinstance(spec, RolloutSpec):
        with_flag = " with --train-only" if args.train_only else ""
        raise ValueError(
            f"--plan simulates the rollout engines' generate call and the train pairs made of it; --loss-type "
            f"{args.loss_type}{with_flag} trains on dataset pairs (a DatasetSpec), which the planner does not simulate"
        )
    return spec


def engine_samples(args: argparse.Namespace, count: int) -> list[Sample]:
    """`count` samples of one prompt group after another, each group its own prompt (their text is irrelevant:
    every prompt is encoded at its longest; a prompt-cache fill encodes each distinct one), source images where the
    family takes them."""
    family = get_train_pipeline_config(args.hf_checkpoint, args.model_family, **family_options(args))
    resolution = args.resolution or family.default_resolution
    low = family.source_image_range[0]
    sources = [torch.zeros(resolution, resolution, 3, dtype=torch.uint8).numpy()] * low if low else None
    return [
        Sample(
            index=i,
            prompt=f"prompt {i // args.n_samples_per_prompt}",
            group_index=i // args.n_samples_per_prompt,
            seed=i,
            source_images=sources,
        )
        for i in range(count)
    ]


@dataclass
class ForwardOnce:
    """Stands in for a family's `predict_velocity` in the simulated engine: the first call runs (its memory and
    FLOPs are every step's: a step's forward is the same at every σ), later ones return an uninitialised velocity
    of the latents' shape, and are counted, so the FLOPs of a generate call are those of the real one."""

    forward: Any
    flops: Ledger  # the FLOPs counted and replayed (`replay`, `replay_layers`)
    run_every: bool = False  # on real tensors every step runs (the sampler needs real velocities)
    calls: int = 0
    step_flops: float = 0.0
    rows: int = 1  # samples in the forward that ran

    def __call__(self, network: Any, latents: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.calls += 1
        if self.calls > 1:
            return self.forward(network, latents, *args, **kwargs) if self.run_every else torch.empty_like(latents)
        before = self.flops.total()
        out = self.forward(network, latents, *args, **kwargs)
        self.step_flops = float(self.flops.total() - before)
        self.rows = int(latents.shape[0])
        return out


def simulate_engine(
    args: argparse.Namespace,
    rows: int,
    *,
    fake: bool = True,
    micro_batch_size: int | str = "auto",
    tracker: PlanTracker | None = None,
) -> tuple[ProcessPlan, GenerateResult, list[Sample], float]:
    """A rollout engine process: its start-up (transformer, text encoders, VAE in the forward dtype), then one
    generate call of `rows` samples as the algorithm requests them (one transformer forward run, the others
    counted: `ForwardOnce`); returns its plan, the result (the trainer's simulation converts it), the samples and
    the call's FLOPs. `fake=False` on `args.device` cuda runs it for real on the GPU (`scripts/gpu_check_plan.py`
    measures it with its own `tracker`)."""
    started = time.perf_counter()
    tracker = tracker or PlanTracker()
    lora = lora_config_from_args(args, _family_name(args)) if args.use_lora else None
    samples = engine_samples(args, rows)
    ledger = Ledger(FlopCounterMode(display=False))  # counts in generate; `replay_layers` adds what it replays
    layers = LayerReplay(tracker, ledger)
    with plan_tensor_mode(fake), movable_fake_modules(), per_tensor_equivalents(), tracker:
        with tracker.in_phase("start-up"):
            engine = DiffusionEngine(
                args.hf_checkpoint,
                model_family=args.model_family,
                device=args.device,  # `simulation_args`: cpu
                forward_dtype=parse_dtype(args.diffusion_forward_dtype),
                lora_config=lora,
                family_options=family_options(args),
                micro_batch_size=micro_batch_size,
            )
        resolution = args.resolution or engine.family.default_resolution
        if fake:  # repeated layers without gradients: one of each kind runs (on real tensors all run)
            replay_layers(layers, [engine.transformer, *engine.family.loaded_modules()])
        request = engine_rollout_spec(args).build_request(args, samples, rollout_id=0, resolution=resolution)
        cached: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
        if frees_text_encoders(args, engine.family):
            with tracker.in_phase("start-up"):
                cached = _fill_prompt_cache(engine, request)
        weights = list(engine.transformer.parameters()) + list(engine.transformer.buffers())
        resident = storage_bytes(weights + [t for m in engine.family.loaded_modules() for t in m.parameters()])
        with tracker.in_phase("generate"), ledger.flops:
            once = ForwardOnce(engine.family.predict_velocity, ledger, run_every=not fake)
            with cached, mock.patch.object(engine.family, "predict_velocity", once):
                if fake:  # each micro-batch's decode is the first's: replayed (on real tensors all run)
                    replay_layers(layers, engine.family.loaded_modules())  # a VAE loaded since
                    replay_decodes(engine.family, tracker, ledger)
                result = engine.generate(request)
        total_flops = ledger.total() + (0 if once.run_every else (once.calls - 1) * once.step_flops)
    plan = ProcessPlan("engine", 0, dict(tracker.peaks), dict(tracker.after), params_bytes=resident)
    plan.forward_flops_per_sample = once.step_flops / max(1, once.rows)
    plan.collectives = tracker.collectives
    plan.seconds = time.perf_counter() - started
    return plan, result, samples, float(total_flops)


def _fill_prompt_cache(engine: DiffusionEngine, request: Any) -> contextlib.AbstractContextManager[object]:
    """The start-up's prompt-cache fill as `PromptEncoder.fill` runs it: the request's distinct prompts encoded
    `fill_step` at a time (every row kept, as generate reads the cache's entries back) and the negative prompt; the
    text encoders are then freed, and generate reads the rows without them (under the returned patch)."""
    family, device = engine.family, engine.prompt_encoder.device
    prompts = list(dict.fromkeys(request.prompts))
    rows: dict[str, Conditioning] = {}
    step = fill_step(family, engine.micro_batch(request.resolution, request.guidance_scale > 1.0))
    for start in range(0, len(prompts), step):
        chunk = prompts[start : start + step]
        batch = family.encode_prompts(chunk, device=device)
        rows.update((text, batch.rows(i)) for i, text in enumerate(chunk))
    embeds = Conditioning.cat([rows[text] for text in request.prompts])
    negative = None
    if request.guidance_scale > 1.0 or request.return_negative:
        negative = family.encode_prompts([request.negative_prompt], device=device)
    family.release_text_encoders()
    gc.collect()
    return mock.patch.object(engine.prompt_encoder, "encode_request", lambda *args, **kwargs: (embeds, negative))


def latent_shape(args: argparse.Namespace) -> tuple[int, ...]:
    """One sample's latent shape at the run's resolution (the family's default without --resolution)."""
    family = get_train_pipeline_config(args.hf_checkpoint, args.model_family, **family_options(args))
    return tuple(family.latent_shape(args.resolution or family.default_resolution))


def _family_name(args: argparse.Namespace) -> str:
    return get_train_pipeline_config(args.hf_checkpoint, args.model_family, **family_options(args)).name
