"""One simulated trainer rank of the run: its start-up, one optimizer window, the weight export and a sleep / wake,
the library's own `FSDPTrainRayActor` on fake tensors, its memory tracked per phase (`PlanTracker`); the engine's
simulation is `engine_sim`, what a simulated process holds `process`."""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import time
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import _disable_current_modes

from miles.algorithms import role_settings
from miles.backends.fsdp_utils.actor import FSDPTrainRayActor
from miles.backends.fsdp_utils.ema import local_tensor
from miles.backends.fsdp_utils.fsdp import build_mesh
from miles.plan.copies import find_copy, keep_copy
from miles.plan.engine_sim import engine_rollout_spec
from miles.plan.fake import (
    device_paths,
    fake_process_group,
    movable_fake_modules,
    plan_tensor_mode,
    value_only_ops_skipped,
)
from miles.plan.process import ProcessPlan, storage_bytes
from miles.plan.replay_layers import LayerReplay, replay_layers
from miles.plan.sync import SyncBuffers, push, sync_buffers, take_after_window
from miles.plan.tracker import PlanTracker
from miles.rollout.engine_api import GenerateResult
from miles.utils.types import Sample, TrainPairs, num_pairs, shard_pairs

logger = logging.getLogger(__name__)


# ---- a trainer rank ----------------------------------------------------------------------------------------
class PlannedTrainer(FSDPTrainRayActor):
    """The trainer actor as one simulated rank: it joins the planner's fake process group instead of a real one."""

    def _join_process_group(self, master_addr: str, master_port: int) -> None:
        return None


def train_pairs_for_rank(args: argparse.Namespace, samples: list[Sample], result: GenerateResult) -> TrainPairs:
    """One optimizer window's pairs of one data-parallel rank (`samples` are its share of the window), converted by
    the algorithm's own rollout side from the engine's (fake) result with zero advantages, dealt as the rollout
    manager deals them (`shard_pairs`: each row gets its `pair_index`)."""
    spec = engine_rollout_spec(args)
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
    phase's device peak), sleep and wake. `fake=False`: the same steps on real tensors (world size 1; on the GPU over
    NCCL with `args.device` cuda, `scripts/gpu_check_plan.py`). `after_window`: the same rank under another
    micro-batch or checkpointing, whose phases after the window are taken (`AFTER_WINDOW`). `window`: the role's whole
    window (`pairs` its first micro-batch): a copy of the rank after start-up is kept (`copies.keep_copy`) and a
    micro-batch-only re-plan runs its window from it."""
    started = time.perf_counter()
    if window is not None and after_window is not None and (kept := find_copy(role, rank, args)) is not None:
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
                sync = _start_up(actor, args, tracker, fake, export)
            for group in actor.optimizer.param_groups:  # the per-tensor step: AdamW's memory, without the fused
                group.update(fused=False, foreach=False)  # kernel's slow sharding propagation over 1000s of DTensors
            if window is not None and fake:
                keep_copy(role, rank, args, functools.partial(_window_of_copy, actor, tracker, window, sync))
            plan, output = _window(actor, role, rank, tracker, pairs, peer_output)
            _note_sync(plan, sync, rank)
            if after_window is None:
                _sync_and_sleep(actor, tracker, plan, sync, sleeps)
        if actor.prefetcher is not None:  # None until init built it
            actor.prefetcher.shutdown()
    plan.peaks, plan.after = dict(tracker.peaks), dict(tracker.after)
    if after_window is not None:
        take_after_window(plan, after_window)
    plan.collectives = tracker.collectives
    plan.seconds = time.perf_counter() - started
    return plan, output


def _start_up(
    actor: FSDPTrainRayActor, args: argparse.Namespace, tracker: PlanTracker, fake: bool, export: bool
) -> SyncBuffers | None:
    """The rank's start-up and, for the actor, the weight sync's buffers; on fake tensors its forwards without
    gradients then run one layer of each kind (`replay_layers`)."""
    actor.init(args, "planner", 0)
    if fake:
        replay_layers(LayerReplay(tracker, None), [actor.model, *actor.loaded.values()])
    return sync_buffers(args, actor) if export and actor.role == "actor" else None


def _sync_and_sleep(
    actor: FSDPTrainRayActor, tracker: PlanTracker, plan: ProcessPlan, sync: SyncBuffers | None, sleeps: bool
) -> None:
    """The phases after the window: the weight push to the engines (the actor) and a colocated sleep / wake."""
    if sync is not None:
        with tracker.in_phase("weight sync"):
            push(actor)
    if sleeps:
        with tracker.in_phase("sleep"):
            report = actor.sleep()
            plan.host_bytes = int(report["copied_bytes"])
        with tracker.in_phase("wake"):
            actor.wake()


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
    before_step: list[int] = []
    actor.optimizer.register_step_pre_hook(
        lambda *_: None if before_step else before_step.append(tracker.peaks.get("train", 0))
    )
    with tracker.in_phase("train"), mock.patch.object(actor, "_predict", _counted(actor._predict, passes)):
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
        params_bytes=storage_bytes(params),
        grads_bytes=grads_bytes,
        optimizer_bytes=storage_bytes(optimizer),
        other_state_bytes=storage_bytes(others) if others else 0,
    )
