"""The rollout engine: `DiffusionEngine`, the built-in `RolloutEngine` (`miles.rollout.engine_api`), which denoises
with a model family's networks and records SDE trajectories and log-probs.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

import torch

from miles.diffusion.dmd import x0_from_velocity
from miles.diffusion.dpm_solver import dpm_solver_pp_step, flash_sigmas
from miles.diffusion.schedule import sampling_sigmas
from miles.diffusion.sde import get_sde_kernel, renoise_sigmas
from miles.models.base import get_train_pipeline_config
from miles.models.compile import check_compile, compile_counters, compile_transformer
from miles.models.conditioning import Conditioning
from miles.models.loading.checkpoint_files import load_transformer_direct
from miles.rollout.engine_api import INITIAL_WEIGHTS_VERSION, GenerateRequest, GenerateResult, draw_sample_noise
from miles.rollout.engine_lora import EngineLora
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
from miles.utils.weight_checksum import TensorChecksum, verify_loaded
from miles.weight_sync.protocol import SyncPlan
from miles.weight_sync.receiver import bind_resident, check_plan, drain, receive_into, unbind
from miles.weight_sync.transports import Transport, TransportSpec

logger = logging.getLogger(__name__)


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
        self.lora = EngineLora(self.transformer, self.lora_config) if self.lora_config is not None else None
        self.transformer.requires_grad_(False)
        # after the adapter, as the trainer compiles after apply_lora: both sides run the same compiled blocks
        compile_transformer(self.transformer, self.family.transformer_blocks(self.transformer), compile_mode)
        self.compile_mode = compile_mode
        self.version = INITIAL_WEIGHTS_VERSION
        self.generate_threads: int | None = None  # torch threads while generating (None: the base count)
        self.swap = HostSwap(self.device)  # sleep / wake (--colocate-sleep)
        self.weights_pending = False  # the trained weights were released by a sleep and not loaded since
        self.sync: tuple[Transport, SyncPlan] | None = None  # the weight sync's engine end (open_weight_sync)
        self.sync_bound: dict[str, torch.Tensor] = {}  # resident `shm`: tensors that are views of the shared file
        self.micro_batch_size = micro_batch_size  # --rollout-micro-batch-size
        self._progress = EngineProgress()
        logger.info("engine ready: %s on %s (%s)", self.family, self.device, "LoRA" if lora_config else "full")

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
        if self.lora is None:
            return list(self.transformer.state_dict(keep_vars=True).values())
        params = dict(self.transformer.named_parameters())
        return [params[name] for name in set(self.lora.names.values())]

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
        if self.lora is None:
            self.sync_bound = unbind(self.sync_bound, self.transformer.state_dict(keep_vars=True))  # its own load
            self.transformer.load_state_dict(weights, strict=True)
            loaded = self.transformer.state_dict()
        else:
            loaded = self.lora.load(weights)
        if checksums is not None:
            verify_loaded(checksums, loaded, weights, version=version)
        self.version = int(version)
        self.weights_pending = False
        logger.info("engine loaded weights version %d (%d tensors)", version, len(weights))

    # the prompt cache (--prompt-cache)
    def fill_prompt_cache(
        self, prompts: list[str], negative_prompts: list[str], resolution: int | None = None, guided: bool = False
    ) -> dict[str, int]:
        """Encode into the prompt cache those of `prompts` (text only) and `negative_prompts` it lacks, with the
        generate phase's thread count (part of a CPU entry's key), at most a micro-batch of the run's generate calls
        (at `resolution`, `guided` or not) at a time; {"found": n, "encoded": m}."""
        with torch_threads(self.generate_threads):
            micro_batch = self.micro_batch(resolution, guided)
            return self.prompt_encoder.fill(prompts, negative_prompts, micro_batch=micro_batch)

    def micro_batch(self, resolution: int | None, guided: bool) -> int | None:
        """Samples per forward at `resolution` (`--rollout-micro-batch-size` on this device; None: the whole share)."""
        shape, device_type = self.family.latent_shape(resolution), self.device.type
        return resolve_rollout_micro_batch_size(
            self.micro_batch_size, latent_shape=shape, guided=guided, device_type=device_type
        )

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
        targets = self._sync_targets(plan)
        check_plan(plan, targets, complete=self.lora_config is None)
        device = self.device if spec.kind in ("cuda_ipc", "nccl") else torch.device("cpu")
        transport = Transport(spec, rank, device, opener)
        self.sync_bound = unbind(self.sync_bound, targets)  # a new sync group (another trainer): not the old file
        # resident `shm` (full fine-tuning; a LoRA engine's adapters are small and rebuilt by a dropping sleep):
        # the parameters become views of the file the trainer writes
        self.sync_bound = bind_resident(transport, plan, targets) if self.lora_config is None else {}
        self.sync = (transport, plan)

    @torch.no_grad()
    def receive_weights(self, version: int) -> None:
        """Take one sync from the trainer, bucket by bucket, into the parameters in place, verifying each bucket's
        checksums (`WeightSyncError` naming the tensor; the version stays the old one); wakes a sleeping engine."""
        if self.sync is None:
            raise RuntimeError("receive_weights before open_weight_sync: the engine has not joined the sync group")
        self.wake()
        transport, plan = self.sync
        if version <= self.version:
            logger.warning(
                "ignoring weights version %d: engine already holds version %d%s",
                version,
                self.version,
                " (its parameters shared with the trainer's writes take it all the same)" if self.sync_bound else "",
            )
            drain(transport, plan)
            return
        receive_into(transport, plan, self._sync_targets(plan), version, self.sync_bound)
        self.version = int(version)
        self.weights_pending = False
        logger.info(
            "engine loaded weights version %d (%d buckets, %d bytes)", version, len(plan.buckets), plan.total_bytes
        )

    def _sync_targets(self, plan: SyncPlan) -> dict[str, torch.Tensor]:
        """The tensors a sync writes into, by the names the trainer sends: the transformer's state dict, or its LoRA
        weights (every one of which a plan must carry)."""
        if self.lora is None:
            return self.transformer.state_dict(keep_vars=True)
        return self.lora.sync_targets(plan)

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
        bounds = micro_batch_bounds(batch, self.micro_batch(request.resolution, guided))
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


def _stack_steps(steps: list[torch.Tensor], batch: int, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.stack(steps, dim=1).cpu() if steps else torch.zeros(batch, 0, *shape)
