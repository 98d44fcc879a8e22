"""What one simulated process of a plan holds (`ProcessPlan`), the run's flags as the simulated processes see them,
and the bytes of a set of tensors' storages: shared by the engine's and the trainer ranks' simulations."""

from __future__ import annotations

import argparse
import copy
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor

from miles.backends.fsdp_utils.ema import local_tensor
from miles.plan.tracker import Collective


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
        return max(self.peaks, key=self.peaks.__getitem__) if self.peaks else "-"

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


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for tensor in tensors:
        local = local_tensor(tensor) if isinstance(tensor, DTensor) else tensor
        storage = local.untyped_storage()
        seen[id(storage)] = storage.nbytes()
    return sum(seen.values())
