"""The Stable Diffusion 3 family: SD3Transformer2DModel, CLIP x2 + T5 text encoders, AutoencoderKL, flow matching.

Everything is computed exactly as `diffusers.StableDiffusion3Pipeline` does, from a local pipeline folder.
"""

from __future__ import annotations

import logging

import torch
from diffusers import FlowMatchEulerDiscreteScheduler

# from its module, not the package: mypy reads `from diffusers import X` as diffusers' torch-less dummy class
from diffusers.models.transformers.transformer_sd3 import SD3Transformer2DModel
from torch import nn

from miles.models.base import compute_dtype, register_train_pipeline_config
from miles.models.conditioning import Conditioning
from miles.models.diffusers_family import (
    DiffusersFamily,
    check_velocity_inputs,
    decode_shift_scaled,
    encode_shift_scaled,
    square_latent_side,
)
from miles.models.media import Media

logger = logging.getLogger(__name__)

_SD3_DEFAULT_T5_LENGTH = 256  # StableDiffusion3Pipeline's default max_sequence_length


@register_train_pipeline_config
class SD3PipelineConfig(DiffusersFamily):
    """SD3 / SD3.5 pipeline folders (`StableDiffusion3Pipeline`)."""

    name = "sd3"
    # not: CLIP's pooled projection is a (batch, width) matmul whose CPU kernel sums differently by batch size
    prompt_cache_exact = False
    pipeline_class_name = "StableDiffusion3Pipeline"
    # joint attention of SD3's JointTransformerBlock: image-stream and context-stream projections
    default_lora_targets = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
    transformer_class = SD3Transformer2DModel
    text_pipeline_class = "StableDiffusion3Pipeline"
    text_modules = ("text_encoder", "text_encoder_2", "text_encoder_3")
    vae_class = "AutoencoderKL"

    # text
    @property
    def max_sequence_length(self) -> int:
        """T5 tokens per prompt: the T5 tokenizer's limit, at most the SD3 pipeline default (256)."""
        return self.tokenizer_limit("tokenizer_3", _SD3_DEFAULT_T5_LENGTH)

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], device: torch.device | str | None = None) -> Conditioning:
        """CLIP-L, CLIP-G and T5 embeddings as `StableDiffusion3Pipeline.encode_prompt(max_sequence_length=...)`.

        `prompt_embeds` (B, L, D): 77 CLIP tokens (both CLIPs side by side, zero-padded to the T5 width) then the T5
        tokens; `pooled_prompt_embeds` (B, P): both CLIPs' pooled outputs.
        Loads the text encoders (CPU, float32) on first use unless `load_text_encoders` ran; `device` moves the result.
        """
        if not prompts:
            raise ValueError("encode_prompts needs at least one prompt")
        pipe = self.text_pipeline()
        prompt_embeds, _, pooled, _ = pipe.encode_prompt(
            prompt=list(prompts),
            prompt_2=None,
            prompt_3=None,
            device=pipe.text_encoder.device,  # computed where the encoders live, then moved
            num_images_per_prompt=1,
            do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length,
        )
        return Conditioning({"prompt_embeds": prompt_embeds, "pooled_prompt_embeds": pooled}).to(device=device)

    # media
    @torch.no_grad()
    def encode_images(self, images: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Normalized latents x0 = (z - shift_factor) * scaling_factor of images (B, 3, H, W) in [-1, 1].

        z is the posterior mode without a generator, a posterior sample drawn with it otherwise. float32.
        """
        return encode_shift_scaled(self.cached_vae(), images, generator)

    def decode_latents(self, x0: torch.Tensor) -> Media:
        """Images (B, 3, H, W) in [0, 1], float32, from normalized latents (the inverse of encode_images)."""
        return decode_shift_scaled(self.cached_vae(), x0)

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
        """The network's velocity at noise levels `sigmas` (B,), timestep 1000 * sigma, float32, latents' shape.

        With guidance_scale > 1: one batched forward of [negative; positive], then uncond + w * (cond - uncond),
        as StableDiffusion3Pipeline does. `negative` may be a batch of one (broadcast).
        """
        check_velocity_inputs(latents, sigmas, embeds)
        batch = latents.shape[0]
        dtype = compute_dtype(transformer)  # the timestep stays fp32, as in StableDiffusion3Pipeline
        timestep = sigmas.to(device=latents.device, dtype=torch.float32) * 1000.0
        hidden, cond = latents, embeds
        guided = guidance_scale > 1.0
        if guided:
            if negative is None:
                raise ValueError("guidance_scale > 1 needs negative embeddings (see encode_negative)")
            cond = Conditioning.cat([negative.expand(batch), embeds])
            hidden, timestep = torch.cat([latents, latents]), torch.cat([timestep, timestep])
        cond = cond.to(device=latents.device, dtype=dtype)
        pred = transformer(
            hidden_states=hidden.to(dtype),
            timestep=timestep,
            encoder_hidden_states=cond["prompt_embeds"],
            pooled_projections=cond["pooled_prompt_embeds"],
            return_dict=False,
        )[0].float()
        if not guided:
            return pred
        uncond, text = pred.chunk(2)
        return uncond + guidance_scale * (text - uncond)

    def load_scheduler(self) -> FlowMatchEulerDiscreteScheduler:
        """The folder's flow-matching scheduler (sigmas and shift as the pipeline uses them)."""
        return FlowMatchEulerDiscreteScheduler.from_pretrained(self.path, subfolder="scheduler", local_files_only=True)

    # geometry
    @property
    def scheduler_shift(self) -> float:
        return float(self.scheduler_config().get("shift", 1.0))

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.cached_json("vae", "config.json")["block_out_channels"]) - 1)

    @property
    def patch_size(self) -> int:
        return int(self.cached_json("transformer", "config.json").get("patch_size", 2))

    @property
    def default_resolution(self) -> int:
        return int(self.cached_json("transformer", "config.json")["sample_size"]) * self.vae_scale_factor

    def latent_shape(self, resolution: int | None = None) -> tuple[int, int, int]:
        """(channels, h, w) of the latents of a square image; resolution defaults to `default_resolution`."""
        resolution = resolution or self.default_resolution
        multiple = self.vae_scale_factor * self.patch_size
        side = square_latent_side(resolution, self.vae_scale_factor, multiple, "VAE factor x patch size")
        return int(self.cached_json("vae", "config.json")["latent_channels"]), side, side
