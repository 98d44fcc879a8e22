"""One simulated process of the run: a rollout engine's start-up and one generate call, a trainer rank's start-up,
one optimizer window, the weight export and a sleep / wake, each the library's own code (`DiffusionEngine`,
`FSDPTrainRayActor`) on fake tensors, its memory tracked per phase (`PlanTracker`)."""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import gc
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.flop_counter import FlopCounterMode

from miles.algorithms import role_settings
from miles.backends.fsdp_utils.actor import FSDPTrainRayActor
from miles.backends.fsdp_utils.ema import local_tensor
from miles.backends.fsdp_utils.fsdp import build_mesh, parse_dtype
from miles.backends.fsdp_utils.lora import lora_config_from_args
from miles.models.base import family_options, get_train_pipeline_config
from miles.models.conditioning import Conditioning
from miles.plan.copies import find_copy, keep_copy
from miles.plan.fake import (
    device_paths,
    fake_process_group,
    movable_fake_modules,
    per_tensor_equivalents,
    plan_tensor_mode,
    value_only_ops_skipped,
)
from miles.plan.replay import Ledger, replay_decodes
from miles.plan.sync import SyncBuffers, push, sync_buffers, take_after_window
from miles.plan.tracker import Collective, PlanTracker
from miles.rollout.engine import DiffusionEngine
from miles.rollout.engine_api import GenerateResult
from miles.rollout.prompt_cache import frees_text_encoders
from miles.rollout.prompt_encoder import fill_step
from miles.rollout.rollout_hub import rollout_spec_of
from miles.utils.types import Sample, TrainPairs, num_pairs, shard_pairs

logger = logging.getLogger(__name__)


@dataclass
class ProcessPlan:
    """What one simulated process held: its peak bytes per phase, what its resident state is made of, the
    collectives it issued, and the wall time of its simulation."""

    name: str
    rank: int
    peaks: dict[str, int]
    after: dict[str, int] = field(default_factory=dict)  # live bytes at each phase's end (what stays resident)
    params_bytes: int = 0
    grads_bytes: int = 0
    optimizer_bytes: int = 0
    other_state_bytes: int = 0  # shadows / EMA / frozen networks (a teacher)
    host_bytes: int = 0  # what it keeps on the host (its sleep buffer)
    export_bytes: int = 0  # the weights it sends the engines per sync (rank 0)
    sync_buffer_bytes: int = 0  # the weight sync's bucket buffers it holds for the whole run (rank 0, on a GPU)
    collectives: list[Collective] = field(default_factory=list)
    seconds: float = 0.0
    forward_flops_per_sample: float = 0.0  # an engine's: one transformer forward of one sample (its CFG rows too)
    before_step_bytes: int = 0  # a trainer's: the train phase's peak before its first optimizer step
    passes: dict[str, int] = field(default_factory=dict)  # a trainer's forwards per micro-batch: "grad", "no_grad"

    @property
    def peak_bytes(self) -> int:
        return max(self.peaks.values(), default=0)

    @property
    def peak_phase(self) -> str:
        return max(self.peaks, key=self.peaks.get) if self.peaks else "-"

    @property
    def activations_bytes(self) -> int:
        resident = self.params_bytes + self.grads_bytes + self.optimizer_bytes + self.other_state_bytes
        return max(0, self.peak_bytes - resident - self.sync_buffer_bytes)


def simulation_args(args: argparse.Namespace) -> argparse.Namespace:
    """The run's flags as the simulated processes see them: on the fake CPU device (the planned device's dtypes
    were derived already), one optimizer window per role."""
    sim = copy.copy(args)
    sim.planned_device = "cpu" if args.device == "cpu" else "cuda"  # what the plan is for (`run.planned_device`)
    sim.device = "cpu"
    sim.prefetch_microbatches = "off"  # a side stream of the real GPU run; the same calls in the same order
    sim.num_steps_per_rollout = 1
    for role_steps in [k for k in vars(sim) if k.endswith("_num_steps_per_rollout")]:
        setattr(sim, role_steps, 1)
    return sim


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for tensor in tensors:
        local = local_tensor(tensor) if isinstance(tensor, DTensor) else tensor
        storage = local.untyped_storage()
        seen[id(storage)] = storage.nbytes()
    return sum(seen.values())


# ---- the engine --------------------------------------------------------------------------------------------
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
    flops: FlopCounterMode
    run_every: bool = False  # on real tensors every step runs (the sampler needs real velocities)
    calls: int = 0
    step_flops: float = 0.0
    rows: int = 1  # samples in the forward that ran

    def __call__(self, network: Any, latents: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.calls += 1
        if self.calls > 1:
            return self.forward(network, latents, *args, **kwargs) if self.run_every else torch.empty_like(latents)
        before = self.flops.get_total_flops()
        out = self.forward(network, latents, *args, **kwargs)
        self.step_flops = float(self.flops.get_total_flops() - before)
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
        request = rollout_spec_of(args).build_request(args, samples, rollout_id=0, resolution=resolution)
        if frees_text_encoders(args, engine.family):
            with tracker.in_phase("start-up"):
                _fill_prompt_cache(engine, request)
        weights = list(engine.transformer.parameters()) + list(engine.transformer.buffers())
        resident = _storage_bytes(weights + [t for m in engine.family.loaded_modules() for t in m.parameters()])
        with tracker.in_phase("generate"), FlopCounterMode(display=False) as flops:
            once = ForwardOnce(engine.family.predict_velocity, flops, run_every=not fake)
            engine.family.predict_velocity = once
            ledger = Ledger(flops)
            if fake:  # each micro-batch's decode is the first's: replayed (on real tensors all run)
                replay_decodes(engine.family, tracker, ledger)
            result = engine.generate(request)
        total_flops = ledger.total() + (0 if once.run_every else (once.calls - 1) * once.step_flops)
    plan = ProcessPlan("engine", 0, dict(tracker.peaks), dict(tracker.after), params_bytes=resident)
    plan.forward_flops_per_sample = once.step_flops / max(1, once.rows)
    plan.collectives = tracker.collectives
    plan.seconds = time.perf_counter() - started
    return plan, result, samples, float(total_flops)


def _fill_prompt_cache(engine: DiffusionEngine, request: Any) -> None:
    """The start-up's prompt-cache fill as `PromptEncoder.fill` runs it: the request's distinct prompts encoded
    `fill_step` at a time (every row kept, as generate reads the cache's entries back) and the negative prompt; the
    text encoders are then freed, and generate reads the rows without them."""
    family, device = engine.family, engine.prompt_encoder.device
    prompts, rows = list(dict.fromkeys(request.prompts)), {}
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
    engine.prompt_encoder.encode_request = lambda *args, **kwargs: (embeds, negative)


def latent_shape(args: argparse.Namespace) -> tuple[int, ...]:
    """One sample's latent shape at the run's resolution (the family's default without --resolution)."""
    family = get_train_pipeline_config(args.hf_checkpoint, args.model_family, **family_options(args))
    return tuple(family.latent_shape(args.resolution or family.default_resolution))


def _family_name(args: argparse.Namespace) -> str:
    return get_train_pipeline_config(args.hf_checkpoint, args.model_family, **family_options(args)).name


# ---- a trainer rank ----------------------------------------------------------------------------------------
class PlannedTrainer(FSDPTrainRayActor):
    """The trainer actor as one simulated rank: it joins the planner's fake process group instead of a real one."""

    def _join_process_group(self, master_addr: str, master_port: int) -> None:
        return None


def train_pairs_for_rank(args: argparse.Namespace, samples: list[Sample], result: GenerateResult) -> TrainPairs:
    """One optimizer window's pairs of one data-parallel rank (`samples` are its share of the window), converted by
    the algorithm's own rollout side from the engine's (fake) result with zero advantages, dealt as the rollout
    manager deals them (`shard_pairs`: each row gets its `pair_index`)."""
    spec = rollout_spec_of(args)
    pairs = spec.convert(args, samples, result, torch.zeros(len(samples)), rollout_id=0)
    return shard_pairs(pairs, 1)[0]


def simulate_trainer_rank(
    args: argparse.Namespace,
    role: str,
    rank: int,
    world_size: int,
    pairs: TrainPairs,
    peer_output: Any = None,
    *,
    export: bool = True,
    sleeps: bool = False,
    fake: bool = True,
    after_window: ProcessPlan | None = None,
    tracker: PlanTracker | None = None,
    window: TrainPairs | None = None,
) -> tuple[ProcessPlan, Any]:
    """Rank `rank` of the role's `world_size` ranks: start-up (sharded load, LoRA, checkpointing, optimizer), one
    optimizer window on `pairs`, the weight export (rank 0 keeps the engines' copy: host memory, not counted in the
    phase's device peak), sleep and wake. `fake=False` runs the same steps on real tensors (world size 1).
    `after_window`: the same rank planned under another micro-batch or checkpointing, whose phases after the window
    are taken instead of simulated again (`AFTER_WINDOW`: they start from the same resident state). `fake=False`
    with `args.device` cuda runs it on the GPU over NCCL (world size 1; `scripts/gpu_check_plan.py`). `window`: the
    role's whole window (`pairs` is its first micro-batch; only where no other role needs this one's output): a copy
    of the rank after its start-up is kept (`copies.keep_copy`), and a re-plan (`after_window`) that changes only
    the micro-batch runs its window from such a copy instead of simulating the start-up again."""
    started = time.perf_counter()
    kept = find_copy(role, rank, args) if window is not None and after_window is not None else None
    if kept is not None:
        plan = kept[0].window(kept[1])
        take_after_window(plan, after_window)
        plan.seconds = time.perf_counter() - started
        return plan, None
    tracker = tracker or PlanTracker()
    device = "cpu" if fake else args.device  # `simulation_args`: cpu
    with _process_group(rank, world_size, fake, device):
        actor = PlannedTrainer(world_size, rank, role)
        # the mesh is built outside the fake mode (its rank tables are real tensors)
        actor.mesh = build_mesh(world_size, args.fsdp_shard_size, device) or init_device_mesh(device, (world_size,))
        with (
            plan_tensor_mode(fake),
            movable_fake_modules(),
            device_paths(args.planned_device, fake),
            value_only_ops_skipped(),
            tracker,
        ):
            with tracker.in_phase("start-up"):
                actor.init(args, "planner", 0)
                sync = sync_buffers(args, actor) if export and role == "actor" else None
            for group in actor.optimizer.param_groups:  # the per-tensor step: AdamW's memory, without the fused
                group.update(fused=False, foreach=False)  # kernel's slow sharding propagation over 1000s of DTensors
            if window is not None and fake:
                keep_copy(role, rank, args, functools.partial(_window_of_copy, actor, tracker, window, sync))
            plan, output = _window(actor, role, rank, tracker, pairs, peer_output)
            _note_sync(plan, sync, rank)
            if sync is not None and after_window is None:
                with tracker.in_phase("weight sync"):
                    push(actor)
            if sleeps and after_window is None:
                with tracker.in_phase("sleep"):
                    report = actor.sleep()
                    plan.host_bytes = int(report["copied_bytes"])
                with tracker.in_phase("wake"):
                    actor.wake()
        actor.prefetcher.shutdown()
    plan.peaks, plan.after = dict(tracker.peaks), dict(tracker.after)
    if after_window is not None:
        take_after_window(plan, after_window)
    plan.collectives = tracker.collectives
    plan.seconds = time.perf_counter() - started
    return plan, output


def _note_sync(plan: ProcessPlan, sync: SyncBuffers | None, rank: int) -> None:
    if sync is not None:
        plan.export_bytes = sync.plan.total_bytes if rank == 0 else 0
        plan.sync_buffer_bytes = sync.buffer_bytes


def _window_of_copy(
    actor: FSDPTrainRayActor, tracker: PlanTracker, window: TrainPairs, sync: SyncBuffers | None, changed: dict
) -> ProcessPlan:
    """In a copy of a rank after its start-up (`copies`): the window under the `changed` micro-batch flags, on its
    first micro-batch of `window` as `run.simulate_roles` cuts it; the plan as far as the window (a re-plan takes
    the later phases from the plan it changes)."""
    vars(actor.args).update(changed)
    actor.settings = role_settings(actor.args, actor.role)
    simulated = min(num_pairs(window), actor.settings["micro_batch_size"])
    with _disable_current_modes():  # cut outside the tracker, as `run.simulate_roles` cuts it
        pairs = {key: value[:simulated] for key, value in window.items()}
    plan, _ = _window(actor, actor.role, actor.rank, tracker, pairs, None)
    _note_sync(plan, sync, actor.rank)
    plan.peaks, plan.after = dict(tracker.peaks), dict(tracker.after)
    plan.collectives = tracker.collectives
    return plan


def _window(
    actor: FSDPTrainRayActor, role: str, rank: int, tracker: PlanTracker, pairs: TrainPairs, peer_output: Any
) -> tuple[ProcessPlan, Any]:
    """The rank's optimizer window in the train phase: its plan (what stays resident, the forwards it ran, the
    phase's peak before the optimizer's first step) and the window's output."""
    passes = {"grad": 0, "no_grad": 0}
    actor._predict = _counted(actor._predict, passes)
    before_step: list[int] = []
    actor.optimizer.register_step_pre_hook(
        lambda *_: None if before_step else before_step.append(tracker.peaks.get("train", 0))
    )
    with tracker.in_phase("train"):
        output = actor.train_pairs(0, pairs, peer_output)
    plan = _resident(actor, role, rank, tracker)
    plan.passes = passes
    plan.before_step_bytes = before_step[0] if before_step else tracker.peaks["train"]
    return plan, output


@contextlib.contextmanager
def _process_group(rank: int, world_size: int, fake: bool, device: str) -> Iterator[None]:
    """The simulated rank's process group (`fake_process_group`); for a real run on one GPU, gloo and NCCL at world
    size 1 (FSDP2's collectives on CUDA tensors go over NCCL, as in a run)."""
    if fake or device != "cuda":
        with fake_process_group(rank, world_size, fake=fake):
            yield
        return
    if world_size != 1 or dist.is_initialized():
        raise RuntimeError(
            f"a real trainer rank on cuda runs at world size 1 alone, without a process group ({world_size=})"
        )
    torch.cuda.set_device(0)
    dist.init_process_group("cpu:gloo,cuda:nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _counted(predict: Any, passes: dict[str, int]) -> Any:
    """The trainer's `_predict`, counting its calls with and without gradients (the window's FLOPs follow from them:
    a FLOP counter cannot wrap the window, it keeps activation checkpointing's activations alive)."""

    def counted(*args: Any, **kwargs: Any) -> Any:
        passes["grad" if torch.is_grad_enabled() else "no_grad"] += 1
        return predict(*args, **kwargs)

    return counted


def _resident(actor: FSDPTrainRayActor, role: str, rank: int, tracker: PlanTracker) -> ProcessPlan:
    """The rank's state after its window: parameters, gradients (freed by the next window's zero_grad, so counted
    at their peak: one sharded copy), AdamW's moments, and the rest (shadows, EMA, frozen networks)."""
    params = list(actor.model.parameters())
    optimizer = [v for s in actor.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    trainable = [p for p in params if p.requires_grad]
    grads_bytes = sum(local_tensor(p).numel() * p.dtype.itemsize for p in trainable)
    others = [t for s in [actor.ema, *actor.shadows.values()] if s is not None for t in s.tensors()]
    others += [t for m in actor.loaded.values() for t in m.parameters()]
    return ProcessPlan(
        role,
        rank,
        {},
        params_bytes=_storage_bytes(params),
        grads_bytes=grads_bytes,
        optimizer_bytes=_storage_bytes(optimizer),
        other_state_bytes=_storage_bytes(others) if others else 0,
    )
