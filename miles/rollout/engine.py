"""The rollout engine: the `RolloutEngine` interface, its request/result dataclasses, and `DiffusionEngine`, the
built-in implementation that denoises with a model family's networks and records SDE trajectories and log-probs.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, cast, runtime_checkable

import numpy as np
import torch

from miles.diffusion.dmd import x0_from_velocity
from miles.diffusion.dpm_solver import dpm_solver_pp_step, flash_sigmas
from miles.diffusion.schedule import sampling_sigmas
from miles.diffusion.sde import SDE_KERNELS, get_sde_kernel, renoise_sigmas
from miles.models.base import get_train_pipeline_config
from miles.models.checkpoint_files import load_transformer_direct
from miles.models.compile import check_compile, compile_counters, compile_transformer
from miles.models.conditioning import Conditioning
from miles.models.lora_targets import check_lora_targets
from miles.rollout.micro_batches import (
    AUTO,
    EngineProgress,
    micro_batch_bounds,
    resolve_rollout_micro_batch_size,
)
from miles.rollout.prompt_cache import PromptCacheConfig
from miles.rollout.prompt_encoder import PromptEncoder
from miles.utils.offload import HostSwap
from miles.utils.threads import node_info, torch_threads
from miles.utils.weight_checksum import TensorChecksum, WeightSyncError, verify_loaded
from miles.weight_sync.protocol import SyncPlan
from miles.weight_sync.receiver import check_plan, drain, receive_into
from miles.weight_sync.transports import Transport, TransportSpec

logger = logging.getLogger(__name__)

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
    trained_steps: list[int]  # steps sampled with the `sde_type` kernel and recorded; the others run `ode`
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
        last = self.num_steps - 1 if self.sde_type == "renoise" else self.num_steps - 2
        if steps != sorted(set(steps)) or (steps and (steps[0] < 0 or steps[-1] > last)):
            raise ValueError(
                f"trained_steps {steps} must be sorted, unique and in [0, {last}] "
                "(the last step is never trained, except by the renoise generator)"
            )
        if steps and self.sde_type == "ode":
            raise ValueError("--diffusion-sde-type ode has no log-probs to record: pass trained_steps=[]")
        if self.flash_ratio is not None and (not steps or self.sde_type == "renoise"):
            raise ValueError("flash_ratio (--mixgrpo-flash) runs after the trained steps: it needs an SDE window")


_T = TypeVar("_T")


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
        images = None if first.images is None else np.concatenate(_present([p.images for p in parts]))
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


class DiffusionEngine:
    """A model family's transformer, text encoders and VAE (eval, no grad) on one device.

    `family_options` go to the family (`miles.models.base.family_options`: --num-frames and the like).
    With `lora_config` (kwargs of `peft.LoraConfig`) an adapter is injected at init and `update_weights` takes
    only its weights; otherwise it takes the full transformer state dict (copied into the parameters in place, so
    compiled blocks keep their code). `compile_mode`: `--compile` (`miles.models.compile`). Wrapped by `ray.remote`
    where used. `prompt_cache` (`--prompt-cache`): read each prompt's conditioning from there, encoding only what is
    missing (`miles.rollout.prompt_encoder`).
    """

    def __init__(
        self,
        hf_checkpoint: str,
        *,
        model_family: str = "auto",
        device: str = "cpu",
        forward_dtype: torch.dtype = torch.float32,
        lora_config: dict[str, Any] | None = None,
        family_options: dict[str, Any] | None = None,
        compile_mode: str = "off",
        prompt_cache: PromptCacheConfig | None = None,
        micro_batch_size: int | str = AUTO,
    ) -> None:
        self.device = torch.device(device)
        self.family = get_train_pipeline_config(hf_checkpoint, model_family, **(family_options or {}))
        check_compile(self.family, compile_mode)
        # straight into the forward dtype on the device, tensor by tensor: no host copy of the weights (§11)
        self.transformer = load_transformer_direct(self.family, dtype=forward_dtype, device=self.device).eval()
        # with a prompt cache the text encoders load only when a prompt is missing from it
        load_text = functools.partial(self.family.load_text_encoders, device=self.device, dtype=forward_dtype)
        self.prompt_encoder = PromptEncoder(self.family, prompt_cache, load_text, self.device)
        self.family.load_vae(device=self.device, dtype=forward_dtype)
        self.lora_config = dict(lora_config) if lora_config is not None else None
        self._lora_names: dict[str, str] = {}
        if self.lora_config is not None:
            self._inject_lora(self.lora_config)
        self.transformer.requires_grad_(False)
        # after the adapter, as the trainer compiles after apply_lora: both sides run the same compiled blocks
        compile_transformer(self.transformer, self.family.transformer_blocks(self.transformer), compile_mode)
        self.compile_mode = compile_mode
        self.version = INITIAL_WEIGHTS_VERSION
        self.generate_threads: int | None = None  # torch threads while generating (None: the base count)
        self.swap = HostSwap(self.device)  # sleep / wake (--colocate-sleep)
        self.weights_pending = False  # the trained weights were released by a sleep and not loaded since
        self.sync: tuple[Transport, SyncPlan] | None = None  # the weight sync's engine end (open_weight_sync)
        self.micro_batch_size = micro_batch_size  # --rollout-micro-batch-size
        self._progress = EngineProgress()
        logger.info("engine ready: %s on %s (%s)", self.family, self.device, "LoRA" if lora_config else "full")

    def _inject_lora(self, lora_config: dict[str, Any]) -> None:
        from peft import LoraConfig  # local: peft costs ~1.3 s per process and only LoRA engines need it

        check_lora_targets(self.transformer, lora_config["target_modules"], "the rollout engine's transformer")
        # add_adapter is diffusers' PEFT mixin's; mypy sees an nn.Module, whose unknown attributes are tensors
        self.transformer.add_adapter(LoraConfig(**lora_config))  # type: ignore[operator]
        names = [n for n, _ in self.transformer.named_parameters() if "lora_" in n]
        # accept the engine's own names and PEFT's adapter-less export names (".lora_A.weight")
        self._lora_names = {n: n for n in names} | {n.replace(".default.", "."): n for n in names}

    # the interface
    def get_version(self) -> int:
        return self.version

    def health(self) -> bool:
        return True

    def progress(self) -> EngineProgress:
        """Where the current call is (`EngineProgress`); read by the driver while `generate` runs."""
        return self._progress

    def _report(self, **changes: Any) -> None:
        """A progress report: one tick more, with `changes` (one attribute assignment: a reader on another thread
        sees the old report or the new one)."""
        self._progress = dataclasses.replace(self._progress, ticks=self._progress.ticks + 1, **changes)

    def node_info(self) -> tuple[str, int]:
        """(Ray node id, cores) of this engine's process (where it runs inside a Ray actor)."""
        return node_info()

    def set_generate_threads(self, count: int | None) -> None:
        """Torch threads for `generate` (the node's cores when trainers share it); None: the base count."""
        self.generate_threads = count

    # sleep / wake (--colocate-sleep): the device memory goes to the trainer ranks while they train
    def _trained_tensors(self) -> list[torch.Tensor]:
        """What `update_weights` overwrites: the transformer's state dict, or only its LoRA weights."""
        if self.lora_config is None:
            return list(self.transformer.state_dict(keep_vars=True).values())
        params = dict(self.transformer.named_parameters())
        return [params[name] for name in set(self._lora_names.values())]

    def sleep(self, discard_weights: bool = False) -> dict[str, float]:
        """Move every network to the host and free its device memory. With `discard_weights` the trained weights
        are freed without a copy: the next `update_weights` must load them before `generate` runs again. (CPU
        weights memory-mapped from their files stay where they are: `kept_bytes`.)"""
        self.family.drop_cached_negatives()  # re-encoded on the device at the next use, the same values
        modules = [self.transformer, *self.family.loaded_modules()]
        tensors = [t for module in modules for t in (*module.parameters(), *module.buffers())]
        report = self.swap.sleep(tensors, discard=self._trained_tensors() if discard_weights else ())
        self.weights_pending = self.weights_pending or discard_weights
        logger.debug("engine asleep: %s", report.describe())
        return dataclasses.asdict(report)

    def wake(self) -> dict[str, float]:
        """Bring back what `sleep` moved (a no-op when awake)."""
        report = self.swap.wake()
        logger.debug("engine awake: %s", report.describe())
        return dataclasses.asdict(report)

    @torch.no_grad()
    def update_weights(
        self, weights: dict[str, torch.Tensor], version: int, checksums: dict[str, TensorChecksum] | None = None
    ) -> None:
        """Load new transformer weights (full state dict, or LoRA weights only) unless `version` is stale; wakes
        a sleeping engine first. With the trainer's `checksums`, verify what was loaded (`WeightSyncError` naming
        the tensor; the version stays the old one)."""
        self.wake()
        if version <= self.version:
            logger.warning("ignoring weights version %d: engine already holds version %d", version, self.version)
            return
        if self.lora_config is None:
            self.transformer.load_state_dict(weights, strict=True)
            loaded = self.transformer.state_dict()
        else:
            params = self._load_lora(weights)
            loaded = {key: params[self._lora_names[self._lora_key(key)]] for key in weights}
        if checksums is not None:
            verify_loaded(checksums, loaded, weights, version=version)
        self.version = int(version)
        self.weights_pending = False
        logger.info("engine loaded weights version %d (%d tensors)", version, len(weights))

    # the prompt cache (--prompt-cache)
    def fill_prompt_cache(self, prompts: list[str], negative_prompts: list[str]) -> dict[str, int]:
        """Encode into the prompt cache those of `prompts` (text only) and `negative_prompts` it lacks, with the
        generate phase's thread count (part of a CPU entry's key); {"found": n, "encoded": m}."""
        with torch_threads(self.generate_threads):
            return self.prompt_encoder.fill(prompts, negative_prompts)

    def prompt_cache_key(self) -> str | None:
        """The key of this engine's prompt cache entries in its generate phase (None without a cache): engines with
        the same key share entries."""
        with torch_threads(self.generate_threads):
            return self.prompt_encoder.cache_key()

    def release_text_encoders(self) -> bool:
        """Free the text encoders once the run's prompts are cached (a missing prompt loads them again); whether
        any were held. Wakes a sleeping engine first, so no host copy of them outlives them."""
        self.wake()
        return self.prompt_encoder.release_text_encoders()

    # the weight sync without pickles (miles.weight_sync): buckets copied into the parameters as they arrive
    def open_weight_sync(self, spec: TransportSpec, plan: SyncPlan, rank: int, opener: Any = None) -> None:
        """Join the sync group as `rank` (collective with the trainer's rank 0 and the other engines) once the plan
        is checked against this engine's tensors. `opener`: the `cuda_ipc` buffer's handle."""
        check_plan(plan, self._sync_targets(plan), complete=self.lora_config is None)
        device = self.device if spec.kind in ("cuda_ipc", "nccl") else torch.device("cpu")
        self.sync = (Transport(spec, rank, device, opener), plan)

    @torch.no_grad()
    def receive_weights(self, version: int) -> None:
        """Take one sync from the trainer, bucket by bucket, into the parameters in place, verifying each bucket's
        checksums (`WeightSyncError` naming the tensor; the version stays the old one); wakes a sleeping engine."""
        if self.sync is None:
            raise RuntimeError("receive_weights before open_weight_sync: the engine has not joined the sync group")
        self.wake()
        transport, plan = self.sync
        if version <= self.version:
            logger.warning("ignoring weights version %d: engine already holds version %d", version, self.version)
            drain(transport, plan)
            return
        receive_into(transport, plan, self._sync_targets(plan), version)
        self.version = int(version)
        self.weights_pending = False
        logger.info(
            "engine loaded weights version %d (%d buckets, %d bytes)", version, len(plan.buckets), plan.total_bytes
        )

    def _sync_targets(self, plan: SyncPlan) -> dict[str, torch.Tensor]:
        """The tensors a sync writes into, by the names the trainer sends: the transformer's state dict, or its LoRA
        weights (every one of which a plan must carry)."""
        if self.lora_config is None:
            return self.transformer.state_dict(keep_vars=True)
        params: dict[str, torch.Tensor] = dict(self.transformer.named_parameters())
        targets = {
            k: params[self._lora_names[self._lora_key(k)]] for k in plan.names if self._lora_key(k) in self._lora_names
        }
        missing = sorted(set(self._lora_names.values()) - {self._lora_names[self._lora_key(k)] for k in targets})
        if missing:
            raise WeightSyncError(f"the weight sync is missing {len(missing)} LoRA weights, e.g. {missing[:3]}")
        return targets

    def _load_lora(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copy the adapter's weights in; the transformer's parameters by name. Every exported adapter tensor must
        have a weight in this engine's adapter and every weight of it must be sent (else it would keep its init)."""
        unknown = sorted(k for k in weights if self._lora_key(k) not in self._lora_names)
        if unknown:
            raise WeightSyncError(
                f"update_weights got {len(unknown)} adapter tensors this engine's adapter has no weight for, e.g. "
                f"{unknown[:3]}: the trainer's and the engine's LoRA targets differ (a LoRA engine takes only keys "
                "containing 'lora_')"
            )
        targets = {self._lora_names[self._lora_key(k)]: v for k, v in weights.items()}
        missing = sorted(set(self._lora_names.values()) - set(targets))
        if missing:
            raise WeightSyncError(f"update_weights is missing {len(missing)} LoRA weights, e.g. {missing[:3]}")
        params: dict[str, torch.Tensor] = dict(self.transformer.named_parameters())
        for name, value in targets.items():
            params[name].copy_(value.to(device=params[name].device, dtype=params[name].dtype))
        return params

    @staticmethod
    def _lora_key(key: str) -> str:
        return key.removeprefix("transformer.")  # diffusers' LoRA files prefix keys with the component name

    def generate(self, request: GenerateRequest) -> GenerateResult:
        """`_generate` with the generate phase's thread count (`set_generate_threads`); wakes a sleeping engine."""
        self.wake()
        if self.weights_pending:
            raise RuntimeError(
                "this engine released its trained weights when it went to sleep (sleep(discard_weights=True)) and "
                f"no newer weights were loaded since (it holds version {self.version}): call update_weights first"
            )
        with torch_threads(self.generate_threads):
            return self._generate(request)

    @torch.no_grad()
    def _generate(self, request: GenerateRequest) -> GenerateResult:
        """Denoise the batch from σ = 1 on the family's sampling grid (`renoise`: the generator grid), in
        micro-batches of `--rollout-micro-batch-size` samples, reporting progress per step; see `GenerateResult` for
        what comes back. Each sample's noise is its own (`draw_sample_noise`), so micro-batches change no sample."""
        family, batch = self.family, len(request.prompts)
        shape = family.latent_shape(request.resolution)
        sigmas, flash_from = self._sigma_grid(request)
        guided = request.guidance_scale > 1.0  # scale 1: the conditional branch only
        size = resolve_rollout_micro_batch_size(
            self.micro_batch_size, latent_shape=shape, guided=guided, device_type=self.device.type
        )
        bounds = micro_batch_bounds(batch, size)
        self._report(phase="encode", steps_done=0, steps_total=(len(sigmas) - 1) * len(bounds), micro_batch=0,
                     micro_batches=len(bounds), samples=bounds[0][1])  # fmt: skip
        embeds, negative = self.prompt_encoder.encode_request(
            list(request.prompts),
            request.source_images,
            request.negative_prompt,
            negative=guided or request.return_negative,
        )
        noise = draw_sample_noise(
            request.seeds,
            request.num_steps,
            shape,
            request.initial_seeds,
            draw=functools.partial(family.draw_noise, resolution=request.resolution),
        )
        parts = []
        for k, (start, end) in enumerate(bounds):
            self._report(phase="denoise", micro_batch=k + 1, samples=end - start)
            rows = slice(start, end)
            own_negative = negative is not None and negative.batch_size == batch > 1  # a negative row per prompt
            part_negative = negative.rows(rows) if own_negative and negative is not None else negative
            part = self._denoise(request, sigmas, flash_from, embeds.rows(rows), part_negative, noise[rows])
            parts.append(part)
        self._report(phase="idle")
        return parts[0] if len(parts) == 1 else GenerateResult.concat(parts)

    def _sigma_grid(self, request: GenerateRequest) -> tuple[torch.Tensor, int | None]:
        """The request's σ grid (under MixGRPO-Flash compressed after the window) and the first step after the window
        (None without Flash)."""
        family = self.family
        shift = family.scheduler_shift if request.shift is None else request.shift
        if request.sde_type == "renoise":
            sigmas = renoise_sigmas(request.num_steps, shift)
        elif request.shift is None:  # the family's own grid (FLUX shifts it by resolution)
            sigmas = family.sampling_sigmas(request.num_steps, request.resolution)
        else:
            sigmas = sampling_sigmas(request.num_steps, shift)
        flash_from = None
        if (
            request.flash_ratio is not None
        ):  # the post grid follows the sampling grid's own shift (FLUX: e^μ, by resolution)
            flash_from = request.trained_steps[-1] + 1
            flash_shift = family.sampling_shift(request.resolution) if request.shift is None else request.shift
            sigmas = flash_sigmas(sigmas, flash_from - 1, request.flash_ratio, flash_shift)
        return sigmas, flash_from

    def _denoise(
        self,
        request: GenerateRequest,
        sigmas: torch.Tensor,
        flash_from: int | None,
        embeds: Conditioning,
        negative: Conditioning | None,
        noise: torch.Tensor,
    ) -> GenerateResult:
        """One micro-batch: its rows' conditioning and noise (B, num_steps + 1, *latent) through every step, decoded."""
        family, batch = self.family, noise.shape[0]
        sigmas_dev, noise = sigmas.to(self.device), noise.to(self.device)
        x = noise[:, 0].contiguous()
        kernel, ode = get_sde_kernel(request.sde_type), get_sde_kernel("ode")
        trained = set(request.trained_steps)
        recorded_in, recorded_out, log_probs, denoised, means = [], [], [], [], []
        denoised_prev = denoised_now = None  # MixGRPO-Flash: x̂₀ of the last two steps from the window's last one
        for i in range(len(sigmas) - 1):
            sigma, sigma_next = sigmas_dev[i].expand(batch), sigmas_dev[i + 1].expand(batch)
            velocity = family.predict_velocity(
                self.transformer, x, sigma, embeds, guidance_scale=request.guidance_scale, negative=negative
            )
            if flash_from is not None and i >= flash_from - 1:
                denoised_prev, denoised_now = denoised_now, x0_from_velocity(x, velocity, sigma)
                if i >= flash_from:  # the ODE after the window: DPM-Solver++(2M) on the compressed grid
                    s_prev, s_now, s_next = (float(s) for s in sigmas[i - 1 : i + 2])
                    x = dpm_solver_pp_step(
                        x, denoised_now, s_now, s_next, prev_denoised=denoised_prev, sigma_prev=s_prev
                    )
                    self._report(steps_done=self._progress.steps_done + 1)
                    continue
            step = kernel if i in trained or request.sde_type == "renoise" else ode  # the generator always renoises
            result = step(
                x,
                velocity,
                sigma,
                sigma_next,
                noise_level=request.noise_level,
                sigma_max=float(sigmas[1]),
                noise=noise[:, i + 1],
            )
            if i in trained:
                recorded_in.append(x.float())  # kept on the device: a copy per step would sync the GPU
                recorded_out.append(result.next_latents)
                log_probs.append(result.log_prob if result.log_prob is not None else torch.full_like(sigma, torch.nan))
                if request.sde_type == "renoise":
                    denoised.append(result.mean)  # renoise's mean is the step's x̂₀
                if request.record_means:
                    means.append(result.mean)
            x = result.next_latents
            self._report(steps_done=self._progress.steps_done + 1)
        return self._result(
            request, sigmas, x, embeds, negative, (recorded_in, recorded_out, log_probs, denoised, means)
        )

    def _result(
        self,
        request: GenerateRequest,
        sigmas: torch.Tensor,
        x: torch.Tensor,
        embeds: Conditioning,
        negative: Conditioning | None,
        recorded: tuple[list[torch.Tensor], ...],
    ) -> GenerateResult:
        """A micro-batch's `GenerateResult` from its final latents and recorded steps, decoded when asked."""
        family, batch, shape = self.family, x.shape[0], tuple(x.shape[1:])
        recorded_in, recorded_out, log_probs, denoised, means = recorded
        if request.decode:
            self._report(phase="decode")
        media = family.decode_latents(x) if request.decode else None
        return GenerateResult(
            images=None if media is None else media.pixels_uint8(),
            final_latents=x.float().cpu(),
            latents=_stack_steps(recorded_in, batch, shape),
            next_latents=_stack_steps(recorded_out, batch, shape),
            log_probs=torch.stack(log_probs, dim=1).cpu() if log_probs else torch.zeros(batch, 0),
            sigmas=sigmas,
            trained_steps=list(request.trained_steps),
            conditioning=embeds.to(device="cpu", dtype=torch.float32),
            negative=None if negative is None else negative.to(device="cpu", dtype=torch.float32),
            negative_per_prompt=negative is not None
            and request.source_images is not None
            and family.negative_per_prompt,
            weights_version=self.version,
            denoised=_stack_steps(denoised, batch, shape) if request.sde_type == "renoise" else None,
            means=_stack_steps(means, batch, shape) if request.record_means else None,
            fps=None if media is None else media.fps,
            audio=None if media is None or media.audio is None else media.audio.float().cpu(),
            sample_rate=None if media is None else media.sample_rate,
            compile_counters=None if self.compile_mode == "off" else compile_counters(),
        )


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


def _stack_steps(steps: list[torch.Tensor], batch: int, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.stack(steps, dim=1).cpu() if steps else torch.zeros(batch, 0, *shape)
