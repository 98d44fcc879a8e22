"""`FluxFolderFamily`, the neutral base of the families that load FLUX.1 pipeline folders (text-to-image `flux`,
editing `flux-kontext`): what every such folder shares, namely FluxTransformer2DModel and its guidance embedding or
true CFG (`guided_velocity`), the CLIP (pooled) + T5 text encoders, AutoencoderKL with FLUX.1's shift-and-scale, the
resolution-dependent σ shift and the geometry of unpacked latents. Each family adds its conditioning and
`predict_velocity` (what it packs into the transformer's sequence, with which position ids).
"""

from __future__ import annotations

import logging

import torch
from diffusers.models.transformers.transformer_flux import FluxTransformer2DModel
from diffusers.pipelines.flux.pipeline_flux import calculate_shift
from torch import nn

from miles.models.base import compute_dtype
from miles.models.conditioning import Conditioning
from miles.models.diffusers_family import (
    DiffusersFamily,
    calculate_shift_args,
    child_blocks,
    decode_shift_scaled,
    dynamic_sampling_shift,
    dynamic_shift_sigmas,
    encode_shift_scaled,
    square_latent_side,
    training_shift,
)
from miles.models.media import Media

logger = logging.getLogger(__name__)

FLUX_MAX_T5_LENGTH = 512  # the FLUX.1 pipelines' default (and maximum) max_sequence_length
FLUX_TEXT = ("prompt_embeds", "pooled_prompt_embeds")  # the text encoders' conditioning (what a negative replaces)


class FluxFolderFamily(DiffusersFamily):
    """A FLUX.1 pipeline folder, guidance-distilled (`guidance_embeds`: dev, Kontext-dev) or not (schnell); a
    subclass declares its pipeline classes, conditioning and `predict_velocity`.

    Guidance: with a guidance embedding, `guidance_scale` is the embedded value (one forward, no negative); without
    one, `guidance_scale > 1` is the pipelines' true CFG (`true_cfg_scale` with a negative prompt).
    """

    # joint attention of the double-stream blocks; the single-stream blocks' to_q/to_k/to_v match too
    default_lora_targets = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
    transformer_class = FluxTransformer2DModel
    text_modules = ("text_encoder", "text_encoder_2")
    vae_class = "AutoencoderKL"

    # networks
    def transformer_blocks(self, transformer: nn.Module) -> list[nn.Module]:
        """The double-stream then single-stream blocks FSDP shards one by one."""
        return child_blocks(transformer, "transformer_blocks", "single_transformer_blocks")

    @property
    def guidance_embeds(self) -> bool:
        """Whether the folder's transformer is guidance-distilled (FLUX.1-dev, Kontext-dev) rather than CFG-free."""
        return bool(self.cached_json("transformer", "config.json").get("guidance_embeds", False))

    # text
    @property
    def max_sequence_length(self) -> int:
        """T5 tokens per prompt: the T5 tokenizer's limit, at most the pipelines' default (512)."""
        return self.tokenizer_limit("tokenizer_2", FLUX_MAX_T5_LENGTH)

    def encode_text(self, prompts: list[str]) -> Conditioning:
        """The text pipeline's `encode_prompt(max_sequence_length=...)`, on the text encoders' device: `prompt_embeds`
        (B, L, D) the T5 sequence, `pooled_prompt_embeds` (B, P) CLIP's pooled output. The text ids are all zeros
        (L, 3), rebuilt in `guided_velocity` rather than stored per pair."""
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
        return Conditioning({"prompt_embeds": prompt_embeds, "pooled_prompt_embeds": pooled})

    # media: unpacked latents, so the pipelines' VAE decode (and their image encode) as they are
    @torch.no_grad()
    def encode_images(self, images: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Normalized latents (z - shift_factor) * scaling_factor (float32) of images (B, 3, H, W) in [-1, 1]; z the
        posterior mode, or a posterior sample drawn with `generator`."""
        return encode_shift_scaled(self.cached_vae(), images, generator)

    def decode_latents(self, x0: torch.Tensor) -> Media:
        """Images (B, 3, H, W) in [0, 1], float32, from normalized latents, as the pipelines decode them."""
        return decode_shift_scaled(self.cached_vae(), x0)

    # the flow
    def guided_velocity(
        self,
        transformer: nn.Module,
        hidden: torch.Tensor,
        img_ids: torch.Tensor,
        sigmas: torch.Tensor,
        embeds: Conditioning,
        *,
        guidance_scale: float,
        negative: Conditioning | None,
        noise_tokens: int | None = None,
    ) -> torch.Tensor:
        """The packed velocity (float32, (B, noise_tokens, 4C)) of the packed sequence `hidden` (B, N, 4C) in the
        transformer's dtype, positioned by `img_ids` (N, 3), at noise levels `sigmas` (B,), as the pipelines' loops
        compute it: timestep σ (the scheduler's timestep / 1000), the text of `embeds` with zero text ids, the
        guidance embedding when the transformer has one, else true CFG uncond + w * (cond - uncond) when w > 1 (the
        negative text, a batch of one or one per row, with the same image tokens; both branches in one batched
        forward); the output's first `noise_tokens` tokens (all by default)."""
        batch, device, dtype = hidden.shape[0], hidden.device, compute_dtype(transformer)
        # the pipelines pass scheduler.timesteps (σ·1000, cast to the latents' dtype) divided by 1000
        timestep = (sigmas.to(device=device, dtype=torch.float32) * 1000.0).to(dtype) / 1000
        text = Conditioning({name: embeds[name] for name in FLUX_TEXT})
        guidance = None
        if self.guidance_embeds:
            guidance = torch.full((batch,), float(guidance_scale), device=device, dtype=torch.float32)
        cfg = guidance is None and guidance_scale > 1.0
        if cfg:
            if negative is None:
                raise ValueError("true CFG (guidance_scale > 1 without a guidance embedding) needs negative embeddings")
            uncond_text = Conditioning({name: negative[name] for name in FLUX_TEXT}).expand(batch)
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
        )[0][:, :noise_tokens].float()
        if cfg:
            uncond, cond = pred.chunk(2)
            pred = uncond + guidance_scale * (cond - uncond)
        return pred

    def mu(self, resolution: int | None = None) -> float:
        """The pipelines' resolution-dependent shift: `calculate_shift` of the generated image's packed token count
        (an editing pipeline's source image tokens do not count)."""
        _, h, w = self.latent_shape(resolution)
        return calculate_shift((h // 2) * (w // 2), *calculate_shift_args(self.scheduler_config()))

    def sampling_sigmas(self, num_steps: int, resolution: int | None = None) -> torch.Tensor:
        """The pipelines' grid: σ = linspace(1, 1/N, N) through the folder's scheduler with `mu(resolution)`, then 0."""
        return dynamic_shift_sigmas(self.scheduler_config(), num_steps, self.mu(resolution))

    def sampling_shift(self, resolution: int | None = None) -> float:
        """The pipelines' time shift at `resolution` as a static shift: e^mu (exponential time shift)."""
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
        return 2  # the pipelines' 2x2 packing (the transformer's own patch_size is 1)

    @property
    def default_resolution(self) -> int:
        """The VAE's sample_size (1024 for FLUX.1: the pipelines' default 128 latents x 8)."""
        return int(self.cached_json("vae", "config.json")["sample_size"])

    def latent_shape(self, resolution: int | None = None) -> tuple[int, int, int]:
        """(channels, h, w) of the unpacked latents of a square image; resolution defaults to `default_resolution`."""
        resolution = resolution or self.default_resolution
        multiple = self.vae_scale_factor * self.patch_size
        side = square_latent_side(resolution, self.vae_scale_factor, multiple, "VAE factor x patch size")
        return int(self.cached_json("vae", "config.json")["latent_channels"]), side, side
