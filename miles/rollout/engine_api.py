"""What a rollout engine takes and returns: `GenerateRequest` (one batch to sample, checked as it is built),
`GenerateResult` (the trajectories, log-probs and media, joined across engines' parts with `concat`) and the
`RolloutEngine` interface that the built-in `DiffusionEngine` and serving engines implement, and the noise a
request's seeds stand for (`draw_sample_noise`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar, cast, runtime_checkable

import numpy as np
import torch

from miles.diffusion.sde import SDE_KERNELS
from miles.models.conditioning import Conditioning
from miles.utils.weight_checksum import TensorChecksum

# The version an engine reports before any update: the checkpoint as loaded. Any sync (version >= 0) replaces it.
INITIAL_WEIGHTS_VERSION = -1


@dataclass(frozen=True)
class GenerateRequest:
    """One batch to generate: prompt i is sampled from noise seeded by seeds[i]."""

    prompts: list[str]
    seeds: list[int]
    num_steps: int
    guidance_scale: float
    negative_prompt: str
    sde_type: str  # "sde" | "cps" | "ode" | "renoise" (DMD2's few-step generator, on the `renoise_sigmas` grid)
    noise_level: float
    trained_steps: list[int]  # steps sampled with the `sde_type` kernel and recorded (`ode`: recorded, no log-prob);
    # (except under `renoise`, which runs every step)
    resolution: int | None = None
    decode: bool = True
    shift: float | None = None  # σ-grid shift; None: the family's scheduler shift
    return_negative: bool = False  # encode the negative prompt even without CFG (DMD2's teacher needs it)
    initial_seeds: list[int] | None = None  # prompt i's initial latent from initial_seeds[i]; its steps' from seeds[i]
    # MixGRPO-Flash: after the last trained step L, DPM-Solver++(2M) on `flash_sigmas(grid, L, flash_ratio, s)`, s the
    # grid's own shift (`shift`, or the family's `sampling_shift` at the resolution: FLUX's e^μ)
    flash_ratio: float | None = None
    record_means: bool = False  # also return each trained step's mean μ_old (GenerateResult.means)
    # editing / image-to-video: prompt i's source images, each (H, W, 3) uint8 at the run's resolution (what
    # `miles.data.source_images` loads); None for text-only families
    source_images: list[list[np.ndarray]] | None = None

    def rows(self, start: int, end: int) -> GenerateRequest:
        """The request for prompts [start, end) only, with their seeds, initial seeds and source images."""
        initial = None if self.initial_seeds is None else list(self.initial_seeds[start:end])
        sources = None if self.source_images is None else list(self.source_images[start:end])
        return dataclasses.replace(
            self,
            prompts=list(self.prompts[start:end]),
            seeds=list(self.seeds[start:end]),
            initial_seeds=initial,
            source_images=sources,
        )

    def __post_init__(self) -> None:
        if len(self.prompts) != len(self.seeds):
            raise ValueError(f"GenerateRequest has {len(self.prompts)} prompts but {len(self.seeds)} seeds")
        if self.initial_seeds is not None and len(self.initial_seeds) != len(self.seeds):
            raise ValueError(f"GenerateRequest has {len(self.seeds)} seeds but {len(self.initial_seeds)} initial_seeds")
        if self.source_images is not None and len(self.source_images) != len(self.prompts):
            raise ValueError(
                f"GenerateRequest has {len(self.prompts)} prompts but {len(self.source_images)} source image lists"
            )
        if self.sde_type not in SDE_KERNELS:
            raise ValueError(f"unknown --diffusion-sde-type {self.sde_type!r}; valid: {', '.join(sorted(SDE_KERNELS))}")
        if self.num_steps < 1:
            raise ValueError(f"--diffusion-num-steps must be >= 1, got {self.num_steps}")
        steps = list(self.trained_steps)
        # the last step's Gaussian is too sharp to train on, but the renoise generator and an `ode` run recording the
        # inputs of the steps a reward-gradient loss differentiates (no log-probs: NaN) may record it
        last = self.num_steps - 1 if self.sde_type in ("renoise", "ode") else self.num_steps - 2
        if steps != sorted(set(steps)) or (steps and (steps[0] < 0 or steps[-1] > last)):
            raise ValueError(
                f"trained_steps {steps} must be sorted, unique and in [0, {last}] "
                "(the last step is never trained, except by the renoise generator and recorded ode steps)"
            )
        if self.flash_ratio is not None and (not steps or self.sde_type == "renoise"):
            raise ValueError("flash_ratio (--mixgrpo-flash) runs after the trained steps: it needs an SDE window")


_T = TypeVar("_T")


def _cat_images(images: list[np.ndarray]) -> np.ndarray:
    """The images joined along the batch; the planner's zeros (broadcasts of one zero) stay one, taking no memory."""
    if all(not any(a.strides) for a in images):
        rows = sum(a.shape[0] for a in images)
        return np.broadcast_to(np.zeros((), dtype=images[0].dtype), (rows, *images[0].shape[1:]))
    return np.concatenate(images)


def _present(values: list[_T | None]) -> list[_T]:
    """A field of the parts of one request that the first part has: every part has it (same request, same fields)."""
    return cast(list[_T], values)


@dataclass
class GenerateResult:
    """Batch-first float32 CPU tensors; K = len(trained_steps); `*latent` is the family's `latent_shape` (any rank).

    Decoded media travel as uint8, channels last: `images` holds (B, H, W, 3) images, or (B, F, H, W, 3) frames of
    a video family (then `fps`, and `audio` (B, channels, samples) at `sample_rate` Hz when the family has sound).
    """

    images: np.ndarray | None  # None without decode
    final_latents: torch.Tensor  # (B, *latent) x0 after the last step
    latents: torch.Tensor  # (B, K, *latent) inputs of the trained steps
    next_latents: torch.Tensor  # (B, K, *latent) their sampled outputs
    log_probs: torch.Tensor  # (B, K) the kernel's per-step log-prob (mean over dims); NaN for `renoise`
    sigmas: torch.Tensor  # (num_steps + 1,) the grid used (shorter under MixGRPO-Flash: `flash_sigmas`)
    trained_steps: list[int]
    conditioning: Conditioning  # B rows, the family's named tensors
    negative: Conditioning | None  # 1 row (or B: negative_per_prompt); None without CFG (or return_negative)
    weights_version: int
    denoised: torch.Tensor | None = None  # (B, K, *latent) x̂₀ = x − σ·v of the trained steps; `renoise` only
    means: torch.Tensor | None = None  # (B, K, *latent) the trained steps' means; only with request.record_means
    fps: float | None = None
    audio: torch.Tensor | None = None
    sample_rate: int | None = None
    # with --compile: the engine process's compile totals (`miles.models.compile.compile_counters`) after this batch
    compile_counters: dict[str, float] | None = None
    # the negative holds a row per prompt (a family whose negative encodes each prompt's source images)
    negative_per_prompt: bool = False

    @property
    def batch_size(self) -> int:
        return self.final_latents.shape[0]

    @staticmethod
    def concat(parts: list[GenerateResult]) -> GenerateResult:
        """Results of consecutive chunks of one request, joined in order along the batch."""
        if not parts:
            raise ValueError("GenerateResult.concat needs at least one result")
        first = parts[0]
        versions = sorted({p.weights_version for p in parts})
        if len(versions) > 1:
            raise ValueError(f"engines answered with different weights versions {versions}: a weight sync was missed")
        images = None if first.images is None else _cat_images(_present([p.images for p in parts]))
        audio = None if first.audio is None else torch.cat(_present([p.audio for p in parts]))
        negative = (
            Conditioning.cat(_present([p.negative for p in parts])) if first.negative_per_prompt else first.negative
        )
        return GenerateResult(
            images=images,
            final_latents=torch.cat([p.final_latents for p in parts]),
            latents=torch.cat([p.latents for p in parts]),
            next_latents=torch.cat([p.next_latents for p in parts]),
            log_probs=torch.cat([p.log_probs for p in parts]),
            sigmas=first.sigmas,
            trained_steps=list(first.trained_steps),
            conditioning=Conditioning.cat([p.conditioning for p in parts]),
            negative=negative,
            negative_per_prompt=first.negative_per_prompt,
            weights_version=versions[0],
            denoised=None if first.denoised is None else torch.cat(_present([p.denoised for p in parts])),
            means=None if first.means is None else torch.cat(_present([p.means for p in parts])),
            fps=first.fps,
            audio=audio,
            sample_rate=first.sample_rate,
            compile_counters=_most_of_each([p.compile_counters for p in parts]),
        )


@runtime_checkable
class RolloutEngine(Protocol):
    """What the rollout side needs from a generation engine (built-in, or a serving engine over HTTP)."""

    def generate(self, request: GenerateRequest) -> GenerateResult: ...

    def update_weights(
        self, weights: dict[str, torch.Tensor], version: int, checksums: dict[str, TensorChecksum] | None = None
    ) -> None: ...

    def get_version(self) -> int: ...

    def health(self) -> bool: ...


def _most_of_each(counters: list[dict[str, float] | None]) -> dict[str, float] | None:
    """Each counter's largest value over the engines' parts (None without --compile)."""
    present = [c for c in counters if c is not None]
    return {key: max(c[key] for c in present) for key in present[0]} if present else None


def draw_sample_noise(
    seeds: list[int],
    num_steps: int,
    shape: tuple[int, ...],
    initial_seeds: list[int] | None = None,
    draw: Callable[[torch.Generator], torch.Tensor] | None = None,
) -> torch.Tensor:
    """(B, num_steps + 1, *shape) float32 CPU: per sample, from `torch.Generator().manual_seed(seed)`, the initial
    latent then one draw per step, in that order. A sample's noise depends on its seed only, never on its
    batch-mates or on which steps are trained (`ode` steps draw and ignore theirs). With `initial_seeds`, row i's
    initial latent is the first draw of `initial_seeds[i]` instead; its step noise stays that of `seeds[i]`.

    `draw(generator)` makes one draw of `shape` (the family's `draw_noise`); default `torch.randn(shape)`."""
    if draw is None:

        def draw(generator: torch.Generator) -> torch.Tensor:
            return torch.randn(shape, generator=generator)

    out = torch.empty(len(seeds), num_steps + 1, *shape)
    for row, seed in enumerate(seeds):
        generator = torch.Generator().manual_seed(int(seed))
        for i in range(num_steps + 1):
            out[row, i] = draw(generator)
        if initial_seeds is not None:
            out[row, 0] = draw(torch.Generator().manual_seed(int(initial_seeds[row])))
    return out
