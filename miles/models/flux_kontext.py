"""The FLUX.1 Kontext family (image editing): FLUX.1's networks with the source image's VAE latents appended to the
noise tokens, computed exactly as `diffusers.FluxKontextPipeline` does, from a local pipeline folder.

Latent layout as in the flux family: unpacked (C, H, W); `predict_velocity` packs the noise latents and the source
image's latents into 2x2 patch sequences, joins them, and keeps the noise tokens of the output.
"""

from __future__ import annotations

import argparse
import logging

import numpy as np
import torch
from diffusers import FluxTransformer2DModel
from diffusers.image_processor import VaeImageProcessor
from diffusers.pipelines.flux.pipeline_flux_kontext import calculate_shift
from PIL import Image
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

_KONTEXT_MAX_T5_LENGTH = 512  # FluxKontextPipeline's default (and maximum) max_sequence_length
_TEXT = ("prompt_embeds", "pooled_prompt_embeds")  # the conditioning a negative prompt replaces


@register_train_pipeline_config
class FluxKontextPipelineConfig(DiffusersFamily):
    """FLUX.1 Kontext pipeline folders (`FluxKontextPipeline`): one source image per prompt, edited.

    Conditioning: the prompt's T5 sequence and CLIP pooled output (as FLUX.1's), and `image_latents` (B, C, h, w), the
    source image's VAE posterior mode normalised (z - shift_factor) * scaling_factor, unpacked. In `predict_velocity`
    they are packed and appended after the noise tokens with position ids whose first coordinate is 1; the output's
    noise tokens are the velocity.

    Guidance as the pipeline's: with a guidance embedding (FLUX.1-Kontext-dev), `guidance_scale` is the embedded
    value, one forward; without one, w > 1 is its true CFG (`true_cfg_scale` with a negative prompt), the negative
    text with the same source image. The pipeline can also run true CFG on top of the guidance embedding (two
    scales); miles has one scale, so a --negative-prompt with a guidance-distilled folder is refused at start-up.

    Difference from `FluxKontextPipeline.__call__`: the pipeline resizes the source image to the preferred Kontext
    resolution of its aspect ratio (`_auto_resize`, PREFERRED_KONTEXT_RESOLUTIONS) and generates at `max_area`; miles'
    data loader resizes the source image to the run's --resolution and generates at that size, so this family is the
    pipeline called with `_auto_resize=False`, `height = width = max_area ** 0.5 = resolution` (the image's sides
    rounded down to a multiple of vae_scale_factor * 2, as the pipeline rounds them).
    """

    name = "flux-kontext"
    pipeline_class_name = "FluxKontextPipeline"
    # FLUX.1's joint-attention projections (the single-stream blocks' to_q/to_k/to_v match too)
    default_lora_targets = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
    transformer_class = FluxTransformer2DModel
    text_pipeline_class = "FluxKontextPipeline"
    text_modules = ("text_encoder", "text_encoder_2")
    vae_class = "AutoencoderKL"
    source_image_range = (1, 1)  # the pipeline takes one image per prompt

    def check_run_args(self, args: argparse.Namespace) -> None:
        """Refused at start-up: a negative prompt the guidance-distilled transformer would not use."""
        if self.guidance_embeds and getattr(args, "negative_prompt", ""):
            raise ValueError(
                f"--negative-prompt with the guidance-distilled {self.path}: --diffusion-guidance-scale is its "
                "embedded guidance and FluxKontextPipeline's true CFG on top of it (a second scale) is not supported; "
                "drop --negative-prompt"
            )

    # networks
    def transformer_blocks(self, transformer: nn.Module) -> list[nn.Module]:
        """The double-stream then single-stream blocks FSDP shards one by one."""
        return [*transformer.transformer_blocks, *transformer.single_transformer_blocks]

    @property
    def guidance_embeds(self) -> bool:
        """Whether the folder's transformer is guidance-distilled (FLUX.1-Kontext-dev)."""
        return bool(self.cached_json("transformer", "config.json").get("guidance_embeds", False))

    # text and source images
    @property
    def max_sequence_length(self) -> int:
        """T5 tokens per prompt: the T5 tokenizer's limit, at most the pipeline's default (512)."""
        return self.tokenizer_limit("tokenizer_2", _KONTEXT_MAX_T5_LENGTH)

    @torch.no_grad()
    def encode_prompts(
        self,
        prompts: list[str],
        device: torch.device | str | None = None,
        *,
        images: list[list[np.ndarray]] | None = None,
    ) -> Conditioning:
        """`FluxKontextPipeline.encode_prompt`: `prompt_embeds` (B, L, D), `pooled_prompt_embeds` (B, P) (the text
        ids, zeros, are rebuilt in `predict_velocity`); with `images` (one (H, W, 3) uint8 image per prompt) also
        `image_latents` (B, C, h, w), float32. Without images (a negative prompt): the text only."""
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
        tensors = {"prompt_embeds": prompt_embeds, "pooled_prompt_embeds": pooled}
        if images is not None:
            if len(images) != len(prompts):
                raise ValueError(f"{len(prompts)} prompts but {len(images)} source image lists")
            problem = self.source_image_problem([len(i) for i in images])
            if problem is not None:
                raise ValueError(problem)
            tensors["image_latents"] = self.encode_source_images([i[0] for i in images]).to(prompt_embeds.device)
        return Conditioning(tensors).to(device=device)

    @torch.no_grad()
    def encode_source_images(self, images: list[np.ndarray]) -> torch.Tensor:
        """Normalised VAE latents (B, C, h, w), float32, of (H, W, 3) uint8 images, as the pipeline prepares its
        `image` with `_auto_resize=False`: every image resized (PIL, Lanczos) to the first one's sides rounded down to
        a multiple of vae_scale_factor * 2 (no change at the run's resolution), x / 255 * 2 - 1, the posterior's
        mode, (z - shift_factor) * scaling_factor. One VAE call per image, as the pipeline encodes with a generator
        per prompt: a sample's latents do not depend on its batchmates (a batched call differs by ~1e-5)."""
        multiple = self.vae_scale_factor * 2
        height, width = (side // multiple * multiple for side in images[0].shape[:2])
        processor = VaeImageProcessor(vae_scale_factor=multiple)
        pixels = processor.preprocess([Image.fromarray(image) for image in images], height, width)
        # slices of the processor's channels-last tensor, as the pipeline's: the VAE's kernels follow the layout
        return torch.cat([encode_shift_scaled(self.cached_vae(), pixels[i : i + 1], None) for i in range(len(pixels))])

    # media: unpacked latents, so the pipeline's VAE decode as it is
    @torch.no_grad()
    def encode_images(self, images: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Normalized latents (z - shift_factor) * scaling_factor (float32) of images (B, 3, H, W) in [-1, 1]; z the
        posterior mode, or a posterior sample drawn with `generator`."""
        return encode_shift_scaled(self.cached_vae(), images, generator)

    @torch.no_grad()
    def decode_latents(self, x0: torch.Tensor) -> Media:
        """Images (B, 3, H, W) in [0, 1], float32, from normalized latents, as the pipeline decodes them."""
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
        """The velocity (float32, latents' shape (B, C, H, W)) at noise levels `sigmas` (B,), as the pipeline's loop
        computes it: [noise tokens; source image tokens] with their position ids (first coordinate 0, then 1), the
        timestep sigma, the guidance embedding when the transformer has one, else true CFG uncond + w * (cond -
        uncond) when w > 1 (the negative text with each row's source image, both branches in one batched forward);
        the output's noise tokens. `negative` (text) may be a batch of one (broadcast).
        """
        check_velocity_inputs(latents, sigmas, embeds)
        if "image_latents" not in embeds:
            raise ValueError(
                f"the {self.name} family needs each prompt's source image latents: encode the prompts with their "
                "source images (encode_prompts(prompts, images=...))"
            )
        batch, _, height, width = latents.shape
        source = embeds["image_latents"]
        if height % 2 or width % 2 or source.shape[-2] % 2 or source.shape[-1] % 2:
            raise ValueError(
                f"FLUX latents pack 2x2 patches: height and width must be even, got {height}x{width} (noise) and "
                f"{source.shape[-2]}x{source.shape[-1]} (source image)"
            )
        dtype = compute_dtype(transformer)
        device = latents.device
        # the pipeline passes scheduler.timesteps (σ·1000, cast to the latents' dtype) divided by 1000
        timestep = (sigmas.to(device=device, dtype=torch.float32) * 1000.0).to(dtype) / 1000
        noise_tokens = pack_latents(latents.to(dtype))
        hidden = torch.cat([noise_tokens, pack_latents(source.to(device=device, dtype=dtype))], dim=1)
        img_ids = torch.cat(
            [
                packed_position_ids(height // 2, width // 2, device, dtype),
                packed_position_ids(source.shape[-2] // 2, source.shape[-1] // 2, device, dtype, first=1.0),
            ]
        )
        text = Conditioning({name: embeds[name] for name in _TEXT})
        guidance = None
        if self.guidance_embeds:
            guidance = torch.full((batch,), float(guidance_scale), device=device, dtype=torch.float32)
        cfg = guidance is None and guidance_scale > 1.0
        if cfg:
            if negative is None:
                raise ValueError("true CFG (guidance_scale > 1 without a guidance embedding) needs negative embeddings")
            uncond_text = Conditioning({name: negative[name] for name in _TEXT}).expand(batch)
            text = Conditioning.cat([uncond_text, text])
            hidden, timestep = torch.cat([hidden, hidden]), torch.cat([timestep, timestep])
        text = text.to(device=device, dtype=dtype)
        pred = transformer(
            hidden_states=hidden,
            timestep=timestep,
            guidance=guidance,
            pooled_projections=text["pooled_prompt_embeds"],
            encoder_hidden_states=text["prompt_embeds"],
            txt_ids=torch.zeros(text["prompt_embeds"].shape[1], 3, device=device, dtype=dtype),
            img_ids=img_ids,
            return_dict=False,
        )[0][:, : noise_tokens.shape[1]].float()
        if cfg:
            uncond, cond = pred.chunk(2)
            pred = uncond + guidance_scale * (cond - uncond)
        return unpack_latents(pred, height, width)

    def mu(self, resolution: int | None = None) -> float:
        """The pipeline's resolution-dependent shift: `calculate_shift` of the noise tokens' count (the source
        image's tokens do not count)."""
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
        """The pipeline's grid: σ = linspace(1, 1/N, N) through the folder's scheduler with `mu(resolution)`, then 0."""
        return dynamic_shift_sigmas(self.scheduler_config(), num_steps, self.mu(resolution))

    def sampling_shift(self, resolution: int | None = None) -> float:
        """The pipeline's time shift at `resolution` as a static shift: e^mu (exponential time shift)."""
        return dynamic_sampling_shift(self.scheduler_config(), self.mu(resolution))

    # geometry
    @property
    def scheduler_shift(self) -> float:
        """The training table's shift: 1 under dynamic shifting (unshifted), the config's `shift` otherwise."""
        return training_shift(self.scheduler_config())

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.cached_json("vae", "config.json")["block_out_channels"]) - 1)

    @property
    def patch_size(self) -> int:
        return 2  # the pipeline's 2x2 packing (the transformer's own patch_size is 1)

    @property
    def default_resolution(self) -> int:
        """The VAE's sample_size (1024 for FLUX.1 Kontext: the pipeline's default 128 latents x 8)."""
        return int(self.cached_json("vae", "config.json")["sample_size"])

    def latent_shape(self, resolution: int | None = None) -> tuple[int, int, int]:
        """(channels, h, w) of the unpacked latents of a square image; resolution defaults to `default_resolution`."""
        resolution = resolution or self.default_resolution
        multiple = self.vae_scale_factor * self.patch_size
        side = square_latent_side(resolution, self.vae_scale_factor, multiple, "VAE factor x patch size")
        return int(self.cached_json("vae", "config.json")["latent_channels"]), side, side
