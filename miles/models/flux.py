"""The FLUX.1 family: FluxTransformer2DModel, CLIP (pooled) + T5 text encoders, AutoencoderKL, flow matching with a
resolution-dependent shift. Computed exactly as `diffusers.FluxPipeline` does, from a local pipeline folder.

Latent layout: miles holds FLUX latents unpacked, (C, H, W) like SD3's; `predict_velocity` packs them into the
pipeline's 2x2 patch sequence (with its image position ids) and unpacks the velocity. Packing is a permutation, so
Euler steps, SDE log-probs (means over dims), encoding, decoding and rewards need nothing FLUX-specific.
"""

from __future__ import annotations

import logging

import torch
from diffusers import FluxTransformer2DModel
from diffusers.pipelines.flux.pipeline_flux import calculate_shift
from torch import nn

from miles.models.base import compute_dtype, register_train_pipeline_config
from miles.models.conditioning import Conditioning
from miles.models.diffusers_family import (
    DiffusersFamily,
    check_velocity_inputs,
    decode_shift_scaled,
    dynamic_sampling_shift,
    dynamic_shift_sigmas,
    encode_shift_scaled,
    square_latent_side,
    training_shift,
)
from miles.models.media import Media
from miles.models.packing import pack_latents, packed_position_ids, unpack_latents

logger = logging.getLogger(__name__)

_FLUX_MAX_T5_LENGTH = 512  # FluxPipeline's default (and maximum) max_sequence_length


@register_train_pipeline_config
class FluxPipelineConfig(DiffusersFamily):
    """FLUX.1 pipeline folders (`FluxPipeline`): dev-style (guidance-distilled, `guidance_embeds`) and schnell-style.

    Guidance: with a guidance embedding, `guidance_scale` is the embedded value (the pipeline's `guidance_scale`,
    one forward, no negative); without one, `guidance_scale > 1` is the pipeline's true CFG (`true_cfg_scale` with a
    negative prompt). The VAE is AutoencoderKL with FluxPipeline's normalization (scale, then shift).
    """

    name = "flux"
    pipeline_class_name = "FluxPipeline"
    # joint attention of the double-stream blocks; the single-stream blocks' to_q/to_k/to_v match too
    default_lora_targets = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
    transformer_class = FluxTransformer2DModel
    text_pipeline_class = "FluxPipeline"
    text_modules = ("text_encoder", "text_encoder_2")
    vae_class = "AutoencoderKL"

    # networks
    def transformer_blocks(self, transformer: nn.Module) -> list[nn.Module]:
        """The double-stream then single-stream blocks FSDP shards one by one."""
        return [*transformer.transformer_blocks, *transformer.single_transformer_blocks]

    @property
    def guidance_embeds(self) -> bool:
        """Whether the folder's transformer is guidance-distilled (FLUX.1-dev) rather than CFG-free (schnell)."""
        return bool(self.cached_json("transformer", "config.json").get("guidance_embeds", False))

    # text
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

    # media: unpacked latents, so FluxPipeline's VAE decode (and its image-to-image encode) as they are
    @torch.no_grad()
    def encode_images(self, images: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Normalized latents (z - shift_factor) * scaling_factor (float32) of images (B, 3, H, W) in [-1, 1]; z the
        posterior mode, or a posterior sample drawn with `generator`."""
        return encode_shift_scaled(self.cached_vae(), images, generator)

    @torch.no_grad()
    def decode_latents(self, x0: torch.Tensor) -> Media:
        """Images (B, 3, H, W) in [0, 1], float32, from normalized latents, as FluxPipeline decodes them."""
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
        """The velocity (float32, latents' shape (B, C, H, W)) at noise levels `sigmas` (B,), as FluxPipeline's
        denoising loop computes it: packed latents, timestep sigma (the scheduler's timestep / 1000), the guidance
        embedding when the transformer has one, else true CFG uncond + w * (cond - uncond) when w > 1 (both
        branches in one batched forward). `negative` may be a batch of one (broadcast).
        """
        check_velocity_inputs(latents, sigmas, embeds)
        batch, _, height, width = latents.shape
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
            img_ids=packed_position_ids(height // 2, width // 2, device, dtype),
            return_dict=False,
        )[0].float()
        if cfg:
            uncond, text = pred.chunk(2)
            pred = uncond + guidance_scale * (text - uncond)
        return unpack_latents(pred, height, width)

    def mu(self, resolution: int | None = None) -> float:
        """FluxPipeline's resolution-dependent shift: `calculate_shift` of the packed sequence length."""
        _, h, w = self.latent_shape(resolution)
        config = self.scheduler_config()
        return calculate_shift(
            (h // 2) * (w // 2),
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", 1.15),
        )

    def sampling_sigmas(self, num_steps: int, resolution: int | None = None) -> torch.Tensor:
        """FluxPipeline's grid: σ = linspace(1, 1/N, N) through the folder's scheduler with `mu(resolution)`, then 0."""
        return dynamic_shift_sigmas(self.scheduler_config(), num_steps, self.mu(resolution))

    def sampling_shift(self, resolution: int | None = None) -> float:
        """FluxPipeline's time shift at `resolution` as a static shift: e^mu (exponential time shift)."""
        return dynamic_sampling_shift(self.scheduler_config(), self.mu(resolution))

    # geometry
    @property
    def scheduler_shift(self) -> float:
        """The training table's shift: 1 under dynamic shifting (FLUX.1: the table is unshifted, as diffusers' FLUX
        training scripts see it), the config's `shift` otherwise."""
        return training_shift(self.scheduler_config())

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.cached_json("vae", "config.json")["block_out_channels"]) - 1)

    @property
    def patch_size(self) -> int:
        return 2  # the pipeline's 2x2 packing (the transformer's own patch_size is 1)

    @property
    def default_resolution(self) -> int:
        """The VAE's sample_size (1024 for FLUX.1: the pipeline's default 128 latents x 8)."""
        return int(self.cached_json("vae", "config.json")["sample_size"])

    def latent_shape(self, resolution: int | None = None) -> tuple[int, int, int]:
        """(channels, h, w) of the unpacked latents of a square image; resolution defaults to `default_resolution`."""
        resolution = resolution or self.default_resolution
        multiple = self.vae_scale_factor * self.patch_size
        side = square_latent_side(resolution, self.vae_scale_factor, multiple, "VAE factor x patch size")
        return int(self.cached_json("vae", "config.json")["latent_channels"]), side, side
