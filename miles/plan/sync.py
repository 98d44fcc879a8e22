"""The weight sync as the planner simulates it (`simulate_trainer_rank`): the bucket plan and rank 0's buffers
`prepare_weight_sync` makes, the push's gathers, and the phases after a trainer's window that a re-plan of the window
takes from the plan it changes."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from miles.backends.fsdp_utils.actor import FSDPTrainRayActor
from miles.backends.fsdp_utils.gather import gathered_tensors
from miles.backends.fsdp_utils.weight_push import PUSH_GATHER_BYTES, sync_plan
from miles.weight_sync.protocol import SyncPlan, bucket_bytes_for
from miles.weight_sync.transports import SLOTS

if TYPE_CHECKING:
    from miles.plan.process import ProcessPlan


AFTER_WINDOW = ("weight sync", "sleep", "wake")  # the phases after a trainer's window, in order


def take_after_window(plan: ProcessPlan, other: ProcessPlan) -> None:
    """`other`'s phases after the window (and what they measured: the host copy of a sleep) into `plan`."""
    for phase in AFTER_WINDOW:
        if phase in other.peaks:
            plan.peaks[phase] = other.peaks[phase]
        if phase in other.after:
            plan.after[phase] = other.after[phase]
    plan.host_bytes = other.host_bytes


@dataclass
class SyncBuffers:
    """The weight sync's bucket plan and what rank 0 holds for it for the whole run (its `SLOTS` bucket buffers on
    the GPU with `cuda_ipc` / `nccl`; none on CPU, where `shm` buckets are a shared file)."""

    plan: SyncPlan
    buffers: torch.Tensor | None

    @property
    def buffer_bytes(self) -> int:
        return 0 if self.buffers is None else self.buffers.nbytes


def sync_buffers(args: argparse.Namespace, actor: FSDPTrainRayActor) -> SyncBuffers:
    """`prepare_weight_sync` as the run calls it after start-up: the bucket plan (every rank) and rank 0's buffers."""
    keep, as_dtype = actor.export.filters()
    device = args.planned_device  # `simulation_args`: the device the plan is for
    plan = sync_plan(actor.model, bucket_bytes_for(args.weight_sync_bucket_mb, device), keep, as_dtype)
    on_gpu = device == "cuda" and actor.rank == 0
    return SyncBuffers(plan, torch.empty(SLOTS * plan.buffer_bytes, dtype=torch.uint8) if on_gpu else None)


def push(actor: FSDPTrainRayActor) -> None:
    """`push_weights`' device side: the engines' weights gathered `PUSH_GATHER_BYTES` at a time, each tensor's pieces
    written into a bucket slot (held above) and dropped."""
    export = actor.export
    keep, as_dtype = export.filters()
    with export.weights_in():
        for _name, _shape, pieces, _ in gathered_tensors(
            actor.model, bucket_bytes=PUSH_GATHER_BYTES["cuda"], keep=keep, as_dtype=as_dtype
        ):
            del pieces
