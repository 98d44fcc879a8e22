"""The Qwen-Image family: QwenImageTransformer2DModel, a Qwen2.5-VL text encoder, AutoencoderKLQwenImage, flow matching
with a resolution-dependent shift. Computed exactly as `diffusers.QwenImagePipeline` does, from a local pipeline folder.

Latent layout: miles holds Qwen-Image latents unpacked and without the VAE's frame axis, (C, H, W) like SD3's and
FLUX's. The pipeline draws its noise as (1, C, H, W) per sample and packs 2x2 patches into a (H/2 * W/2, 4C)
sequence; its VAE is a video VAE that sees images as one frame. `predict_velocity` packs (and unpacks the velocity),
`encode_images` / `decode_latents` add and drop the frame axis. Packing is a permutation and the frame axis has size
1, so a seed gives the pipeline's noise, and Euler steps, SDE log-probs (means over dims), rewards and the trainer need
nothing Qwen-specific; only true CFG's norm rescale reads the packed layout (the norm over each patch's 4C values),
and it is computed there.

Prompts: the pipeline wraps each prompt in its chat template, runs the text encoder, keeps the last hidden state
of the valid tokens, drops the template's first 34 tokens (its system part) and pads the batch to its longest prompt
with a 0/1 mask. Lengths vary between batches, so the conditioning holds that mask (`prompt_embeds_mask`) next to
the embeddings; `Conditioning.cat` zero-pads sequences to one length (padding the mask with 0), and
`predict_velocity` trims the columns that are padding in every row and passes no mask when none is left, as the
pipeline does for a batch without padding.
"""

from __future__ import annotations

import logging

import torch
from diffusers import QwenImageTransformer2DModel
from torch import nn

from miles.models.base import compute_dtype, register_train_pipeline_config
from miles.models.conditioning import Conditioning
from miles.models.diffusers_family import (
    DiffusersFamily,
    check_velocity_inputs,
    dynamic_sampling_shift,
    dynamic_shift_sigmas,
    square_latent_side,
    training_shift,
)
from miles.models.media import Media
from miles.models.packing import pack_latents, unpack_latents
from miles.models.qwen_common import (
    check_no_guidance_embeds,
    decode_qwen_latents,
    encode_qwen_latents,
    qwen_mu,
    qwen_vae_scale_factor,
    trim_prompt_padding,
    true_cfg,
)

logger = logging.getLogger(__name__)

_QWEN_MAX_SEQUENCE_LENGTH = 512  # QwenImagePipeline.__call__'s default max_sequence_length
_QWEN_DEFAULT_SAMPLE_SIZE = 128  # QwenImagePipeline.default_sample_size: latents per side at the default resolution


@register_train_pipeline_config
class QwenImagePipelineConfig(DiffusersFamily):
    """Qwen-Image pipeline folders (`QwenImagePipeline`).

    Guidance: `guidance_scale > 1` is the pipeline's true CFG (`true_cfg_scale` with a negative prompt), the
    combined prediction rescaled to the conditional one's norm per packed token; 1 is the conditional branch alone.
    The VAE is Qwen's video VAE on one frame, normalized per channel.
    """

    name = "qwen-image"
    pipeline_class_name = "QwenImagePipeline"
    transformer_class = QwenImageTransformer2DModel
    text_pipeline_class = "QwenImagePipeline"
    vae_class = "AutoencoderKLQwenImage"
    # diffusers' Qwen-Image LoRA training default (train_dreambooth_lora_qwen_image.py): the image-stream attention
    default_lora_targets = ("to_k", "to_q", "to_v", "to_out.0")

    # networks
    def load_transformer(
        self, path: str | None = None, dtype: torch.dtype = torch.float32, *, empty: bool = False
    ) -> nn.Module:
        """The transformer (`DiffusersFamily`'s loader); a guidance-distilled one (`guidance_embeds`) is refused:
        QwenImagePipeline cannot run it either (its timestep embedding takes no guidance)."""
        model = super().load_transformer(path, dtype, empty=empty)
        check_no_guidance_embeds(model, path or self.path, self.pipeline_class_name)
        return model

    # text
    @property
    def max_sequence_length(self) -> int:
        """Text tokens kept per prompt (after the template's): QwenImagePipeline's default, 512."""
        return _QWEN_MAX_SEQUENCE_LENGTH

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], device: torch.device | str | None = None) -> Conditioning:
        """`QwenImagePipeline.encode_prompt(max_sequence_length=512)`: `prompt_embeds` (B, L, D) the text encoder's
        last hidden state of each prompt's tokens after the template's system part, zero-padded to the batch's
        longest; `prompt_embeds_mask` (B, L) int64, 1 on tokens, 0 on padding (all ones where the pipeline
        returns no mask)."""
        if not prompts:
            raise ValueError("encode_prompts needs at least one prompt")
        pipe = self.text_pipeline()
        prompt_embeds, mask = pipe.encode_prompt(
            prompt=list(prompts),
            device=pipe.text_encoder.device,
            num_images_per_prompt=1,
            max_sequence_length=self.max_sequence_length,
        )
        if mask is None:
            mask = torch.ones(prompt_embeds.shape[:2], dtype=torch.long, device=prompt_embeds.device)
        return Conditioning({"prompt_embeds": prompt_embeds, "prompt_embeds_mask": mask}).to(device=device)

    # media
    def encode_images(self, images: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """`encode_qwen_latents` with the folder's VAE."""
        return encode_qwen_latents(self.cached_vae(), images, generator)

    def decode_latents(self, x0: torch.Tensor) -> Media:
        """`decode_qwen_latents` with the folder's VAE."""
        return decode_qwen_latents(self.cached_vae(), x0)

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
        """The velocity (float32, latents' shape (B, C, H, W)) at noise levels `sigmas` (B,), as QwenImagePipeline's
        denoising loop computes it: packed latents, `img_shapes` of one frame of (H/2, W/2) patches, timestep sigma
        (the scheduler's timestep / 1000), the prompt mask (none when no token is padding). With
        `guidance_scale` w > 1, true CFG: comb = uncond + w * (cond - uncond), rescaled by
        ||cond|| / ||comb|| over each packed token's channels; both branches run in one batched forward (the
        pipeline runs two). `negative` may be a batch of one (broadcast).
        """
        check_velocity_inputs(latents, sigmas, embeds)
        batch, _, height, width = latents.shape
        if height % 2 or width % 2:
            raise ValueError(
                f"Qwen-Image latents pack 2x2 patches: height and width must be even, got {height}x{width}"
            )
        dtype = compute_dtype(transformer)
        device = latents.device
        # the pipeline passes scheduler.timesteps (σ·1000, cast to the latents' dtype) divided by 1000
        timestep = (sigmas.to(device=device, dtype=torch.float32) * 1000.0).to(dtype) / 1000
        hidden, cond = pack_latents(latents.to(dtype)), embeds
        cfg = guidance_scale > 1.0
        if cfg:
            if negative is None:
                raise ValueError("guidance_scale > 1 (true CFG) needs negative embeddings (see encode_negative)")
            cond = Conditioning.cat([negative.expand(batch), embeds])  # padded to one length
            hidden, timestep = torch.cat([hidden, hidden]), torch.cat([timestep, timestep])
        prompt_embeds, mask = trim_prompt_padding(cond)
        pred = transformer(
            hidden_states=hidden,
            timestep=timestep,
            guidance=None,
            encoder_hidden_states_mask=None if mask is None else mask.to(device),
            encoder_hidden_states=prompt_embeds.to(device=device, dtype=dtype),
            img_shapes=[[(1, height // 2, width // 2)]] * hidden.shape[0],
            return_dict=False,
        )[0].float()
        if cfg:
            pred = true_cfg(*pred.chunk(2), guidance_scale)
        return unpack_latents(pred, height, width)

    def mu(self, resolution: int | None = None) -> float:
        """QwenImagePipeline's resolution-dependent shift: `calculate_shift` of the packed sequence length."""
        _, h, w = self.latent_shape(resolution)
        return qwen_mu(self.scheduler_config(), h, w)

    def sampling_sigmas(self, num_steps: int, resolution: int | None = None) -> torch.Tensor:
        """QwenImagePipeline's grid: σ = linspace(1, 1/N, N) through the folder's scheduler with `mu(resolution)`
        (Qwen-Image's: exponential time shift, stretched to its shift_terminal), then 0."""
        return dynamic_shift_sigmas(self.scheduler_config(), num_steps, self.mu(resolution))

    def sampling_shift(self, resolution: int | None = None) -> float:
        """QwenImagePipeline's time shift at `resolution` as a static shift: e^mu (exponential time shift; its
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
        """2 ** len(temperal_downsample), as QwenImagePipeline computes it (8 for Qwen-Image)."""
        return qwen_vae_scale_factor(self.cached_json("vae", "config.json"))

    @property
    def patch_size(self) -> int:
        return 2  # the pipeline's 2x2 packing

    @property
    def default_resolution(self) -> int:
        """The folder's suggested resolution (`folder_default`), else QwenImagePipeline's default: default_sample_size
        (128) x vae_scale_factor (1024 for Qwen-Image)."""
        return int(self.folder_default("resolution") or _QWEN_DEFAULT_SAMPLE_SIZE * self.vae_scale_factor)

    def latent_shape(self, resolution: int | None = None) -> tuple[int, int, int]:
        """(z_dim, h, w) of the latents of a square image, without the VAE's frame axis."""
        resolution = resolution or self.default_resolution
        multiple = self.vae_scale_factor * self.patch_size
        side = square_latent_side(resolution, self.vae_scale_factor, multiple, "VAE factor x 2x2 packing")
        return int(self.cached_json("vae", "config.json")["z_dim"]), side, side
