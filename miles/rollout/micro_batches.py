"""An engine's share of a batch in micro-batches (`--rollout-micro-batch-size`), and the progress an engine reports
per denoising step (`EngineProgress`), which the driver reads to tell a slow engine from a dead one."""

from __future__ import annotations

import math
from dataclasses import dataclass

from miles.arguments.engine import AUTO

# auto on CUDA: at most this many latent positions (a sample's latent elements over its channels, times the forward's
# rows, CFG's included) in one transformer forward; 2^18 is 16 SD3 / FLUX images at 1024 px, or two 81-frame Wan
# clips at 480p: their temporaries stay a few GB in bf16 (the planner, miles/plan/, will supply a measured value)
CUDA_FORWARD_POSITIONS = 1 << 18


def resolve_rollout_micro_batch_size(
    setting: int | str, *, latent_shape: tuple[int, ...], guided: bool, device_type: str
) -> int | None:
    """The samples per forward of `--rollout-micro-batch-size` `setting` for latents of `latent_shape`, `guided`
    (CFG: two rows per sample) or not, on `device_type`; None: the whole share at once. A number is taken as it is;
    auto is the whole share on CPU and on CUDA the most samples whose forward holds at most CUDA_FORWARD_POSITIONS
    latent positions (at least one sample)."""
    if setting != AUTO:
        return int(setting)
    if device_type != "cuda":
        return None
    positions = math.prod(latent_shape[1:]) * (2 if guided else 1)
    return max(1, CUDA_FORWARD_POSITIONS // max(positions, 1))


def micro_batch_bounds(batch: int, size: int | None) -> list[tuple[int, int]]:
    """[start, end) of each micro-batch of `size` samples (the last may be smaller; None: one of the whole batch)."""
    size = batch if size is None else size
    return [(start, min(start + size, batch)) for start in range(0, batch, max(size, 1))] or [(0, 0)]


@dataclass(frozen=True)
class EngineProgress:
    """Where an engine is in its current call, as it last reported. `ticks` counts reports over the engine's life: a
    reader that sees it grow knows the engine moved. `steps_*` count denoising steps over every micro-batch of the
    call; `samples` is the current micro-batch's."""

    ticks: int = 0
    phase: str = "idle"  # idle | encode | denoise | decode
    steps_done: int = 0
    steps_total: int = 0
    micro_batch: int = 0  # 1-based, of `micro_batches`
    micro_batches: int = 0
    samples: int = 0

    def describe(self) -> str:
        if self.phase == "idle":
            return "idle"
        where = f"step {self.steps_done}/{self.steps_total}"
        if self.micro_batches > 1:
            where += f", micro-batch {self.micro_batch}/{self.micro_batches} of {self.samples} samples"
        return f"{self.phase}, {where}" if self.phase != "denoise" else where
