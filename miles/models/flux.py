"""The FLUX.1 family: FluxTransformer2DModel, CLIP (pooled) + T5 text encoders, AutoencoderKL, flow matching with a
resolution-dependent shift. Computed exactly as `diffusers.FluxPipeline` does, from a local pipeline folder.

Latent layout: miles holds FLUX latents unpacked, (C, H, W) like SD3's; `predict_velocity` packs them into the
pipeline's 2x2 patch sequence (with its image position ids) and unpacks the velocity. Packing is a permutation, so
Euler steps, SDE log-probs (means over dims), encoding, decoding and rewards need nothing FLUX-specific.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
from diffusers.pipelines.flux.pipeline_flux import calculate_shift
from torch import nn

from miles.models.base import compute_dtype, register_train_pipeline_config
from miles.models.conditioning import Conditioning
from miles.models.sd3 import SD3PipelineConfig

logger = logging.getLogger(__name__)

_FLUX_MAX_T5_LENGTH = 512  # FluxPipeline's default (and maximum) max_sequence_length


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> (B, H/2 * W/2, 4C): FluxPipeline._pack_latents (2x2 patches, channels-major within a patch)."""
    b, c, h, w = latents.shape
    patches = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return patches.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(packed: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """The inverse of `pack_latents` for latents of `height` x `width` (FluxPipeline._unpack_latents)."""
    b, _, channels = packed.shape
    patches = packed.view(b, height // 2, width // 2, channels // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return patches.reshape(b, channels // 4, height, width)


def latent_image_ids(height: int, width: int, device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
    """(height * width, 3) position ids (0, row, column) of the packed sequence (FluxPipeline._prepare_latent_image_ids,
    with height and width counted in 2x2 patches)."""
    ids = torch.zeros(height, width, 3)
    ids[..., 1] = ids[..., 1] + torch.arange(height)[:, None]
    ids[..., 2] = ids[..., 2] + torch.arange(width)[None, :]
    return ids.reshape(height * width, 3).to(device=device, dtype=dtype)


@register_train_pipeline_config
class FluxPipelineConfig(SD3PipelineConfig):
    """FLUX.1 pipeline folders (`FluxPipeline`): dev-style (guidance-distilled, `guidance_embeds`) and schnell-style.

    Guidance: with a guidance embedding, `guidance_scale` is the embedded value (the pipeline's `guidance_scale`,
    one forward, no negative); without one, `guidance_scale > 1` is the pipeline's true CFG (`true_cfg_scale` with a
    negative prompt). The VAE normalization, saving and checkpoint handling are SD3's (same folder conventions).
    """

    name = "flux"
    text_pipeline_class = FluxPipeline
    pipeline_class_name = "FluxPipeline"
    transformer_class = FluxTransformer2DModel
    # joint attention of the double-stream blocks; the single-stream blocks' to_q/to_k/to_v match too
    default_lora_targets = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")

    # networks
    def transformer_blocks(self, transformer: nn.Module) -> list[nn.Module]:
        """The double-stream then single-stream blocks FSDP shards one by one."""
        return [*transformer.transformer_blocks, *transformer.single_transformer_blocks]

    @property
    def guidance_embeds(self) -> bool:
        """Whether the folder's transformer is guidance-distilled (FLUX.1-dev) rather than CFG-free (schnell)."""
        if "guidance_embeds" not in self._loaded:  # read once: predict_velocity asks at every step
            config = self.read_json("transformer", "config.json")
            self._loaded["guidance_embeds"] = bool(config.get("guidance_embeds", False))
        return self._loaded["guidance_embeds"]

    # text: SD3's load_text_encoders builds `text_pipeline_class`
    @property
    def max_sequence_length(self) -> int:
        """T5 tokens per prompt: the T5 tokenizer's limit, at most FluxPipeline's default (512)."""
        return self.tokenizer_limit("tokenizer_2", _FLUX_MAX_T5_LENGTH)

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], device: torch.device | str | None = None) -> Conditioning:
        """`FluxPipeline.encode_prompt(max_sequence_length=...)`: `prompt_embeds` (B, L, D) the T5 sequence,
        `pooled_prompt_embeds` (B, P) CLIP's pooled output. The text ids are all zeros (L, 3), rebuilt in
        `predict_velocity` rather than stored per pair."""
        if not prompts:
            raise ValueError("encode_prompts needs at least one prompt")
        pipe = self.text_pipeline()
        prompt_embeds, pooled, _ = pipe.encode_prompt(
            prompt=list(prompts),
            prompt_2=None,
            device=pipe.text_encoder.device,
            num_images_per_prompt=1,
            max_sequence_length=self.max_sequence_length,
        )
        return Conditioning({"prompt_embeds": prompt_embeds, "pooled_prompt_embeds": pooled}).to(device=device)

    # media: SD3's encode_images / decode_latents on unpacked latents are FluxPipeline's (scale, then shift)

    # the flow
    def predict_velocity(
        self,
        transformer: nn.Module,
        latents: torch.Tensor,
        sigmas: torch.Tensor,
        embeds: Conditioning,
        *,
        guidance_scale: float = 1.0,
        negative: Conditioning | None = None,
    ) -> torch.Tensor:
        """The velocity (float32, latents' shape (B, C, H, W)) at noise levels `sigmas` (B,), as FluxPipeline's
        denoising loop computes it: packed latents, timestep sigma (the scheduler's timestep / 1000), the guidance
        embedding when the transformer has one, else true CFG uncond + w * (cond - uncond) when w > 1 (both
        branches in one batched forward). `negative` may be a batch of one (broadcast).
        """
        batch, _, height, width = latents.shape
        if sigmas.shape != (batch,):
            raise ValueError(f"sigmas must have shape ({batch},), got {tuple(sigmas.shape)}")
        if embeds.batch_size != batch:
            raise ValueError(f"embeds batch {embeds.batch_size} != latents batch {batch}")
        if height % 2 or width % 2:
            raise ValueError(f"FLUX latents pack 2x2 patches: height and width must be even, got {height}x{width}")
        dtype = compute_dtype(transformer)
        device = latents.device
        # the pipeline passes scheduler.timesteps (σ·1000, cast to the latents' dtype) divided by 1000
        timestep = (sigmas.to(device=device, dtype=torch.float32) * 1000.0).to(dtype) / 1000
        hidden, cond = pack_latents(latents.to(dtype)), embeds
        guidance = None
        if self.guidance_embeds:
            guidance = torch.full((batch,), float(guidance_scale), device=device, dtype=torch.float32)
        cfg = guidance is None and guidance_scale > 1.0
        if cfg:
            if negative is None:
                raise ValueError("true CFG (guidance_scale > 1 without a guidance embedding) needs negative embeddings")
            cond = Conditioning.cat([negative.expand(batch), embeds])
            hidden, timestep = torch.cat([hidden, hidden]), torch.cat([timestep, timestep])
        cond = cond.to(device=device, dtype=dtype)
        pred = transformer(
            hidden_states=hidden,
            timestep=timestep,
            guidance=guidance,
            pooled_projections=cond["pooled_prompt_embeds"],
            encoder_hidden_states=cond["prompt_embeds"],
            txt_ids=torch.zeros(cond["prompt_embeds"].shape[1], 3, device=device, dtype=dtype),
            img_ids=latent_image_ids(height // 2, width // 2, device, dtype),
            return_dict=False,
        )[0].float()
        if cfg:
            uncond, text = pred.chunk(2)
            pred = uncond + guidance_scale * (text - uncond)
        return unpack_latents(pred, height, width)

    def _scheduler_config(self) -> dict[str, Any]:
        if "scheduler_config" not in self._loaded:
            self._loaded["scheduler_config"] = self.read_json("scheduler", "scheduler_config.json")
        return self._loaded["scheduler_config"]

    def mu(self, resolution: int | None = None) -> float:
        """FluxPipeline's resolution-dependent shift: `calculate_shift` of the packed sequence length."""
        _, h, w = self.latent_shape(resolution)
        config = self._scheduler_config()
        return calculate_shift(
            (h // 2) * (w // 2),
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", 1.15),
        )

    def sampling_sigmas(self, num_steps: int, resolution: int | None = None) -> torch.Tensor:
        """FluxPipeline's grid: σ = linspace(1, 1/N, N) through the folder's scheduler with `mu(resolution)`, then 0."""
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(self._scheduler_config())
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=self.mu(resolution))
        return scheduler.sigmas.detach().to(torch.float32).cpu().clone()

    # geometry
    @property
    def scheduler_shift(self) -> float:
        """The training table's shift: 1 under dynamic shifting (FLUX.1: the table is unshifted, as diffusers' FLUX
        training scripts see it), the config's `shift` otherwise."""
        config = self._scheduler_config()
        return 1.0 if config.get("use_dynamic_shifting", False) else float(config.get("shift", 1.0))

    @property
    def patch_size(self) -> int:
        return 2  # the pipeline's 2x2 packing (the transformer's own patch_size is 1)

    @property
    def default_resolution(self) -> int:
        """The VAE's sample_size (1024 for FLUX.1: the pipeline's default 128 latents x 8)."""
        return int(self.read_json("vae", "config.json")["sample_size"])
