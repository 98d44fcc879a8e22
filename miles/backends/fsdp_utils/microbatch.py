"""build_microbatch_schedule: windows of micro-batches, numbered straight across windows (ARCHITECTURE §5); and what
FSDP2 communicates between the micro-batches of one window (`accumulate_gradients`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor


@dataclass(frozen=True)
class MicroBatch:
    microbatch_id: int
    start: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start


def build_microbatch_schedule(num_pairs: int, num_windows: int, micro_batch_size: int) -> list[list[MicroBatch]]:
    """Split `num_pairs` rank-local pairs into `num_windows` equal windows of micro-batches.

    `microbatch_id` counts from 0 across windows; the last micro-batch of a window may be smaller.
    """
    if num_windows < 1 or micro_batch_size < 1:
        raise ValueError(f"need ≥ 1 window and micro-batch size ≥ 1, got {num_windows} and {micro_batch_size}")
    if num_pairs % num_windows != 0 or num_pairs == 0:
        raise ValueError(
            f"{num_pairs} train pairs on this rank cannot form {num_windows} equal non-empty windows "
            "(check --global-batch-size, --num-steps-per-rollout and --dp-size)"
        )
    per_window = num_pairs // num_windows
    schedule: list[list[MicroBatch]] = []
    next_id = 0
    for window in range(num_windows):
        base = window * per_window
        micro_batches = []
        for start in range(0, per_window, micro_batch_size):
            end = min(start + micro_batch_size, per_window)
            micro_batches.append(MicroBatch(next_id, base + start, base + end))
            next_id += 1
        schedule.append(micro_batches)
    return schedule


def pairs_in_window(window: list[MicroBatch]) -> int:
    return sum(mb.size for mb in window)


def window_weight_totals(weights: torch.Tensor, schedule: list[list[MicroBatch]]) -> torch.Tensor:
    """(windows, 2) float64: each window's sum of a per-pair weight column and its pair count on this rank (the
    trunk sums them over the ranks)."""
    w = weights.detach().to("cpu", torch.float64).reshape(-1)
    rows = [[float(w[window[0].start : window[-1].end].sum()), float(pairs_in_window(window))] for window in schedule]
    return torch.tensor(rows, dtype=torch.float64).reshape(len(schedule), 2)


def weighted_denominator(window: list[MicroBatch], weight_sum: float, pair_count: float) -> float:
    """What this rank divides the window's loss sum by under a pair weight w: its pair count times the window's weight
    per pair over every rank (`weight_sum` / `pair_count`, both summed over the ranks). The ranks' gradients are then
    averaged into Σ w·ℓ / Σ w over the window's pairs on all ranks: for 0/1 weights the mean over the pairs that
    train, whatever number of weight-0 pairs ride along. All weights 1 give the pair count exactly; a window whose
    weights are all 0 keeps it too (its loss is 0)."""
    count = pairs_in_window(window)
    return count if weight_sum <= 0 else count * (weight_sum / pair_count)


def is_hybrid(model: FSDPModule) -> bool:
    """Whether FSDP2 shards `model` on a 2-D (replicate, shard) mesh (`--fsdp-shard-size`)."""
    # fully_shard makes the module a subclass of its own class and FSDPModule: both, which no annotation says
    param = next((p for p in model.parameters() if isinstance(p, DTensor)), None)  # type: ignore[attr-defined]
    return param is not None and param.device_mesh.ndim > 1


def accumulate_gradients(model: FSDPModule, last_in_window: bool, *, world_size: int, cpu_offload: bool) -> None:
    """Set what FSDP2 communicates after the next backward of a window (`last_in_window`: the one before the step).

    - World size 1 without CPU offload: one rank holds every shard, so full gradients accumulate and the blocks stay
      gathered until the last backward (no reduce-scatter, no reshard in between).
    - A 2-D mesh: every backward reduce-scatters within the shard group (gradients stay sharded), but the all-reduce
      across replicas (across nodes) runs only after the last; FSDP2 sums the earlier reduce-scatter outputs into it,
      so the step sees the same gradients with one all-reduce per optimizer step instead of one per micro-batch.
    - Plain FSDP2 over several ranks (or CPU offload at world size 1): every backward reduce-scatters, as by default.
    """
    if world_size == 1 and not cpu_offload:
        model.set_requires_gradient_sync(last_in_window)
        model.set_reshard_after_backward(last_in_window)
    elif world_size > 1 and is_hybrid(model):
        model.set_requires_all_reduce(last_in_window)
