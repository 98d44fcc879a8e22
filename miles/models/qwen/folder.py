"""`QwenFolderFamily`, the neutral base of the families that load Qwen-Image pipeline folders (text-to-image
`qwen-image`, editing `qwen-image-edit`): what every such folder shares, namely QwenImageTransformer2DModel without a
guidance embedding, its true CFG with the norm rescale (`guided_velocity`), the Qwen2.5-VL text encoding's padded
embeddings and mask, AutoencoderKLQwenImage on one frame with per-channel scaling, the resolution-dependent σ shift
and the geometry of unpacked latents. Each family adds its conditioning and `predict_velocity`.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from diffusers.models.modeling_utils import ModelMixin
from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformer2DModel
from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift
from torch import nn

from miles.models.base import compute_dtype
from miles.models.conditioning import Conditioning
from miles.models.diffusers_family import (
    DiffusersFamily,
    calculate_shift_args,
    channel_stats,
    dynamic_sampling_shift,
    dynamic_shift_sigmas,
    posterior_latents,
    square_latent_side,
    training_shift,
    unit_range,
)
from miles.models.loading.pretrained import module_config
from miles.models.media import Media

logger = logging.getLogger(__name__)

QWEN_DEFAULT_SAMPLE_SIZE = 128  # the Qwen-Image pipelines' default_sample_size: latents per side at the default size
QWEN_TEXT = ("prompt_embeds", "prompt_embeds_mask")  # the VL encoder's part of the conditioning (what a negative is)


class QwenFolderFamily(DiffusersFamily):
    """A Qwen-Image pipeline folder; a subclass declares its pipeline classes, conditioning and `predict_velocity`.

    Guidance: `guidance_scale > 1` is the pipelines' true CFG (`true_cfg_scale` with a negative prompt), the combined
    prediction rescaled to the conditional one's norm per packed token; 1 is the conditional branch alone.
    """

    transformer_class = QwenImageTransformer2DModel
    vae_class = "AutoencoderKLQwenImage"
    # diffusers' Qwen-Image LoRA training default (train_dreambooth_lora_qwen_image.py): the image-stream attention
    default_lora_targets = ("to_k", "to_q", "to_v", "to_out.0")
    # not: Qwen2.5-VL pads a batch's prompts to its longest, and a prompt's hidden states change with that length
    prompt_cache_exact = False

    # networks
    def load_transformer(
        self, path: str | None = None, dtype: torch.dtype = torch.float32, *, empty: bool = False
    ) -> nn.Module:
        """The transformer (`DiffusersFamily`'s loader); a guidance-distilled one (`guidance_embeds`) is refused:
        the pipeline cannot run it either (its timestep embedding takes no guidance)."""
        model = super().load_transformer(path, dtype, empty=empty)
        if module_config(model).get("guidance_embeds", False):
            raise ValueError(
                f"{path or self.path}: this QwenImageTransformer2DModel has guidance_embeds=True, which "
                f"{self.pipeline_class_name} does not run (its timestep embedding takes no guidance); not supported"
            )
        return model

    # text
    def encode_text(
        self, prompts: list[str], device: torch.device | str | None = None, **encode_kwargs: Any
    ) -> Conditioning:
        """The text pipeline's `encode_prompt(prompt=prompts, **encode_kwargs)`: `prompt_embeds` (B, L, D) the text
        encoder's last hidden state of each prompt's tokens after the template's system part, zero-padded to the
        batch's longest; `prompt_embeds_mask` (B, L) int64, 1 on tokens, 0 on padding (all ones where the pipeline
        returns no mask)."""
        pipe = self.text_pipeline()
        embeds, mask = pipe.encode_prompt(prompt=list(prompts), device=pipe.text_encoder.device, **encode_kwargs)
        if mask is None:
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        return Conditioning({"prompt_embeds": embeds, "prompt_embeds_mask": mask}).to(device=device)

    # media
    def encode_images(self, images: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """`encode_qwen_latents` with the folder's VAE."""
        return encode_qwen_latents(self.cached_vae(), images, generator)

    def decode_latents(self, x0: torch.Tensor) -> Media:
        """`decode_qwen_latents` with the folder's VAE."""
        return decode_qwen_latents(self.cached_vae(), x0)

    # the flow
    def guided_velocity(
        self,
        transformer: nn.Module,
        hidden: torch.Tensor,
        img_shapes: list[tuple[int, int, int]],
        sigmas: torch.Tensor,
        embeds: Conditioning,
        *,
        guidance_scale: float,
        negative: Conditioning | None,
        noise_tokens: int | None = None,
    ) -> torch.Tensor:
        """The packed velocity (float32, (B, noise_tokens, 4C)) of the packed sequence `hidden` (B, N, 4C) in the
        transformer's dtype, of one sample's `img_shapes` (frames, rows, columns of 2x2 patches, per image in the
        sequence), at noise levels `sigmas` (B,), as the pipelines' loops compute it: timestep σ (the scheduler's
        timestep / 1000), the prompt mask (none when no token is padding), with w > 1 true CFG against `negative`
        (one row or one per row; the same image tokens), both branches in one batched forward (the pipelines run
        two); the output's first `noise_tokens` tokens (all by default)."""
        batch, device, dtype = hidden.shape[0], hidden.device, compute_dtype(transformer)
        # the pipelines pass scheduler.timesteps (σ·1000, cast to the latents' dtype) divided by 1000
        timestep = (sigmas.to(device=device, dtype=torch.float32) * 1000.0).to(dtype) / 1000
        text = Conditioning({name: embeds[name] for name in QWEN_TEXT})
        cfg = guidance_scale > 1.0
        if cfg:
            if negative is None:
                encoder = "encode_negative_of_images" if self.negative_per_prompt else "see encode_negative"
                raise ValueError(f"guidance_scale > 1 (true CFG) needs negative embeddings ({encoder})")
            text = Conditioning.cat([negative.expand(batch), text])  # padded to one length
            hidden, timestep = torch.cat([hidden, hidden]), torch.cat([timestep, timestep])
        prompt_embeds, mask = trim_prompt_padding(text)
        pred = transformer(
            hidden_states=hidden,
            timestep=timestep,
            guidance=None,
            encoder_hidden_states_mask=None if mask is None else mask.to(device),
            encoder_hidden_states=prompt_embeds.to(device=device, dtype=dtype),
            img_shapes=[img_shapes] * hidden.shape[0],
            return_dict=False,
        )[0][:, :noise_tokens].float()
        if cfg:
            uncond, cond = pred.chunk(2)
            pred = true_cfg(uncond, cond, guidance_scale)
        return pred

    def mu(self, resolution: int | None = None) -> float:
        """The pipelines' resolution-dependent shift: `calculate_shift` of the generated image's packed sequence
        length (its 2 x 2 patches; an editing pipeline's reference tokens do not count)."""
        _, h, w = self.latent_shape(resolution)
        return calculate_shift((h // 2) * (w // 2), *calculate_shift_args(self.scheduler_config()))

    def sampling_sigmas(self, num_steps: int, resolution: int | None = None) -> torch.Tensor:
        """The pipelines' grid: σ = linspace(1, 1/N, N) through the folder's scheduler with `mu(resolution)`
        (Qwen-Image's: exponential time shift, stretched to its shift_terminal), then 0."""
        return dynamic_shift_sigmas(self.scheduler_config(), num_steps, self.mu(resolution))

    def sampling_shift(self, resolution: int | None = None) -> float:
        """The pipelines' time shift at `resolution` as a static shift: e^mu (exponential time shift; its
        shift_terminal stretch, an affine map of σ, is not part of it)."""
        return dynamic_sampling_shift(self.scheduler_config(), self.mu(resolution))

    # geometry
    @property
    def scheduler_shift(self) -> float:
        """The training table's shift: 1 under dynamic shifting (Qwen-Image: the table is unshifted, as diffusers'
        Qwen-Image training script sees it), the config's `shift` otherwise."""
        return training_shift(self.scheduler_config())

    @property
    def vae_scale_factor(self) -> int:
        """2 ** len(temperal_downsample), as the pipelines compute it (8 for Qwen-Image)."""
        return 2 ** len(self.cached_json("vae", "config.json")["temperal_downsample"])

    @property
    def patch_size(self) -> int:
        return 2  # the pipelines' 2x2 packing

    @property
    def default_resolution(self) -> int:
        """The folder's suggested resolution (`folder_default`), else the pipelines' default: default_sample_size
        (128) x vae_scale_factor (1024 for Qwen-Image)."""
        return int(self.folder_default("resolution") or QWEN_DEFAULT_SAMPLE_SIZE * self.vae_scale_factor)

    def latent_shape(self, resolution: int | None = None) -> tuple[int, int, int]:
        """(z_dim, h, w) of the latents of a square image, without the VAE's frame axis."""
        resolution = resolution or self.default_resolution
        multiple = self.vae_scale_factor * self.patch_size
        side = square_latent_side(resolution, self.vae_scale_factor, multiple, "VAE factor x 2x2 packing")
        return int(self.cached_json("vae", "config.json")["z_dim"]), side, side


def _latents_stats(vae: ModelMixin, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The config's per-channel latents_mean and 1 / latents_std, shaped (1, C, 1, 1, 1) as the pipelines have them."""
    mean, std = channel_stats(vae, like)
    return mean, 1.0 / std


@torch.no_grad()
def encode_qwen_latents(
    vae: ModelMixin, images: torch.Tensor, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Normalized latents (B, C, H, W) = (z - latents_mean) / latents_std of images (B, 3, H, W) in [-1, 1], encoded
    as one frame (the Qwen-Image pipelines' `_encode_vae_image`). z is the posterior mode without a generator, a
    posterior sample drawn with it otherwise. float32."""
    z = posterior_latents(vae, images.to(device=vae.device, dtype=vae.dtype).unsqueeze(2), generator)
    mean, inv_std = _latents_stats(vae, z)
    return ((z - mean) * inv_std)[:, :, 0].float()


def decode_qwen_latents(vae: ModelMixin, x0: torch.Tensor) -> Media:
    """Images (B, 3, H, W) in [0, 1], float32, from normalized latents, as the Qwen-Image pipelines decode them:
    z = x0 / (1 / latents_std) + latents_mean, decoded as one frame."""
    z = x0.to(device=vae.device, dtype=vae.dtype).unsqueeze(2)
    mean, inv_std = _latents_stats(vae, z)
    return Media(unit_range(vae.decode(z / inv_std + mean, return_dict=False)[0][:, :, 0]))


def true_cfg(uncond: torch.Tensor, cond: torch.Tensor, scale: float) -> torch.Tensor:
    """The Qwen-Image pipelines' true CFG of packed predictions (B, L, 4C): comb = uncond + w * (cond - uncond),
    rescaled by ||cond|| / ||comb|| over each token's channels."""
    comb = uncond + scale * (cond - uncond)
    return comb * (torch.norm(cond, dim=-1, keepdim=True) / torch.norm(comb, dim=-1, keepdim=True))


def trim_prompt_padding(cond: Conditioning) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`prompt_embeds` and `prompt_embeds_mask` without the trailing columns that are padding in every row; the mask
    is None when no padding is left (what QwenImagePipeline.encode_prompt passes for such a batch)."""
    embeds, mask = cond["prompt_embeds"], cond["prompt_embeds_mask"]
    valid = mask.bool()
    if bool(valid.all()):
        return embeds, None
    length = int(valid.any(dim=0).nonzero().max()) + 1 if bool(valid.any()) else embeds.shape[1]
    embeds, valid = embeds[:, :length], valid[:, :length]
    return embeds, None if bool(valid.all()) else valid
