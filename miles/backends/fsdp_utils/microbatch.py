"""build_microbatch_schedule: windows of micro-batches, numbered straight across windows (ARCHITECTURE §5)."""

from __future__ import annotations

from dataclasses import dataclass


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
