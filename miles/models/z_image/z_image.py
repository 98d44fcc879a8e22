"""The Z-Image family: ZImageTransformer2DModel (a single-stream DiT over each sample's image tokens then caption
tokens), a Qwen3 text encoder, AutoencoderKL with FLUX.1's shift-and-scale, flow matching on the scheduler's shifted
grid. Computed exactly as `diffusers.ZImagePipeline` does, from a local pipeline folder.

The pipeline's conventions, which differ from the other families': the transformer takes the time 1 − σ (its 0 is
pure noise) and predicts the negative of the velocity the scheduler steps with; its `guidance_scale` g weighs
(cond − uncond) added to cond, so miles' w (uncond + w·(cond − uncond)) is g + 1: w = 1 is the pipeline's 0 (the
conditional branch alone, Z-Image-Turbo's setting), its default 5 is w = 6. Its CFG options are family options:
`cfg_normalization` (--z-image-cfg-normalization) and `cfg_truncation` (--z-image-cfg-truncation).

Latents are the pipeline's own (C, H, W); the transformer patchifies them itself. Prompts are held padded with a
mask (`prompt_embeds_mask`) and handed to the transformer as the pipeline hands them: one tensor per prompt of its
tokens alone.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from diffusers.models.transformers.transformer_z_image import ZImageTransformer2DModel
from diffusers.pipelines.z_image.pipeline_z_image import calculate_shift, get_default_z_image_sigmas
from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler
from torch import nn
from torch.nn.utils.rnn import pad_sequence

from miles.models.base import compute_dtype, register_train_pipeline_config
from miles.models.conditioning import Conditioning
from miles.models.diffusers_family import (
    DiffusersFamily,
    calculate_shift_args,
    check_velocity_inputs,
    child_blocks,
    decode_shift_scaled,
    dynamic_sampling_shift,
    encode_shift_scaled,
    square_latent_side,
    training_shift,
)
from miles.models.media import Media
from miles.models.options import options_of
from miles.utils.simulation import simulating

logger = logging.getLogger(__name__)

Z_IMAGE_MAX_SEQUENCE_LENGTH = 512  # ZImagePipeline.__call__'s default max_sequence_length
Z_IMAGE_DEFAULT_RESOLUTION = 1024  # ZImagePipeline.__call__'s default height and width
PATCH_SIZE = 2  # the pipeline's transformer patch size (its forward's default `patch_size`)


@register_train_pipeline_config
class ZImagePipelineConfig(DiffusersFamily):
    """Z-Image pipeline folders (`ZImagePipeline`: Z-Image, Z-Image-Turbo).

    Guidance: w > 1 is the pipeline's CFG with guidance_scale w − 1, one batched forward of the prompts and their
    negatives: cond + (w − 1)·(cond − uncond) per sample, then with `cfg_normalization` c > 0 scaled down to at most
    c·‖cond‖ (norms over the whole sample), and the conditional branch alone on steps whose 1 − σ exceeds
    `cfg_truncation` (default 1: none). w ≤ 1 is the conditional branch alone.
    """

    name = "z-image"
    prompt_cache_exact = True  # Qwen3 at a fixed length, each prompt's own tokens kept
    pipeline_class_name = "ZImagePipeline"
    text_pipeline_class = "ZImagePipeline"
    transformer_class = ZImageTransformer2DModel
    vae_class = "AutoencoderKL"
    # diffusers' Z-Image LoRA training default (train_dreambooth_lora_z_image.py): every block's attention
    default_lora_targets = ("to_k", "to_q", "to_v", "to_out.0")
    options = options_of("z-image")

    def __init__(self, path: str, **options: Any) -> None:
        super().__init__(path, **options)
        normalization = self.family_options.get("cfg_normalization")
        truncation = self.family_options.get("cfg_truncation")
        # the pipeline's defaults: cfg_normalization False (off), cfg_truncation 1.0 (1 − σ never exceeds it)
        self.cfg_normalization = 0.0 if normalization is None else float(normalization)
        self.cfg_truncation = 1.0 if truncation is None else float(truncation)
        for flag, value in (("normalization", self.cfg_normalization), ("truncation", self.cfg_truncation)):
            if not value >= 0:  # the parser checks the flags; this, options given in code (an engine's)
                raise ValueError(f"--z-image-cfg-{flag} must be >= 0, got {value}")

    # networks
    def transformer_blocks(self, transformer: nn.Module) -> list[nn.Module]:
        """The blocks FSDP shards one by one: the image tokens' refiner, the caption tokens' refiner, then the main
        layers over both."""
        return child_blocks(transformer, "noise_refiner", "context_refiner", "layers")

    # text
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], device: torch.device | str | None = None) -> Conditioning:
        """`ZImagePipeline.encode_prompt(max_sequence_length=512)`: each prompt in the Qwen3 chat template (a user
        turn and the assistant header), the text encoder's second-to-last hidden states of its tokens (padding
        dropped). `prompt_embeds` (B, L, D) zero-padded to the batch's longest, `prompt_embeds_mask` (B, L) int64, 1
        on tokens."""
        if not prompts:
            raise ValueError("encode_prompts needs at least one prompt")
        pipe = self.text_pipeline()
        embeds, _ = pipe.encode_prompt(
            prompt=list(prompts),  # the pipeline writes the templated prompts into the list it is given
            device=pipe.text_encoder.device,
            do_classifier_free_guidance=False,
            max_sequence_length=Z_IMAGE_MAX_SEQUENCE_LENGTH,
        )
        lengths = torch.tensor([len(e) for e in embeds])
        mask = (torch.arange(int(lengths.max()))[None, :] < lengths[:, None]).long()
        padded = pad_sequence(list(embeds), batch_first=True)
        return Conditioning({"prompt_embeds": padded, "prompt_embeds_mask": mask.to(padded.device)}).to(device=device)

    # media: the pipeline's own latents, so its VAE decode (and the training script's encode) as they are
    @torch.no_grad()
    def encode_images(self, images: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Normalized latents (z - shift_factor) * scaling_factor (float32) of images (B, 3, H, W) in [-1, 1]; z the
        posterior mode, or a posterior sample drawn with `generator`."""
        return encode_shift_scaled(self.cached_vae(), images, generator)

    def decode_latents(self, x0: torch.Tensor) -> Media:
        """Images (B, 3, H, W) in [0, 1], float32: z = x0 / scaling_factor + shift_factor decoded, as the pipeline."""
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
        """The velocity (float32, latents' shape (B, C, H, W)) at noise levels `sigmas` (B,), as ZImagePipeline's
        denoising loop computes it: each latent as one frame (C, 1, H, W) with its prompt's tokens, the transformer's
        time (1000 − σ·T) / 1000 (T the scheduler's num_train_timesteps; the pipeline's conversion of its
        timesteps), its output negated. With w > 1 the rows not truncated (`cfg_truncation`) run with their negative
        (`negative`: one row or one per row) in the same forward, combined per sample as the pipeline
        (`guided_prediction`)."""
        check_velocity_inputs(latents, sigmas, embeds)
        batch, _, height, width = latents.shape
        if height % PATCH_SIZE or width % PATCH_SIZE:
            raise ValueError(f"Z-Image latents patchify 2x2: height and width must be even, got {height}x{width}")
        device, dtype = latents.device, compute_dtype(transformer)
        timesteps = sigmas.to(device=device, dtype=torch.float32) * self.num_train_timesteps
        time = (1000 - timesteps) / 1000  # the pipeline's: 0 at pure noise; also its CFG truncation's measure
        rows = self.guided_rows(time, guidance_scale)
        captions = prompt_list(embeds, device, dtype)
        if rows:
            if negative is None:
                raise ValueError("guidance_scale > 1 (CFG) needs negative embeddings (see encode_negative)")
            uncond = prompt_list(negative.expand(batch), device, dtype)
            captions += [uncond[i] for i in rows]
        index = torch.tensor(list(range(batch)) + rows, device=device)
        frames = latents.to(dtype)[index].unsqueeze(2)  # (C, 1, H, W) per sample: one frame
        out = transformer(list(frames.unbind(0)), time[index], captions, return_dict=False)[0]
        pred = [sample.float().squeeze(1) for sample in out]
        for k, i in enumerate(rows):
            pred[i] = self.guided_prediction(pred[i], pred[batch + k], guidance_scale)
        return -torch.stack(pred[:batch])

    def guided_rows(self, time: torch.Tensor, guidance_scale: float) -> list[int]:
        """The rows the pipeline guides at the transformer times `time` (B,): none unless w > 1, else those whose
        time (the pipeline's (1000 − t) / 1000, compared as a Python float) does not exceed `cfg_truncation`."""
        if guidance_scale <= 1.0:
            return []
        return [i for i, t in enumerate(time.tolist()) if not t > self.cfg_truncation]

    def guided_prediction(self, cond: torch.Tensor, uncond: torch.Tensor, guidance_scale: float) -> torch.Tensor:
        """One sample's guided transformer output (float32), as the pipeline's loop: cond + (w − 1)·(cond − uncond),
        then with `cfg_normalization` c > 0 scaled to c·‖cond‖ where its norm exceeds that (norms over the sample)."""
        pred = cond + (guidance_scale - 1.0) * (cond - uncond)
        if self.cfg_normalization > 0.0:
            limit = torch.linalg.vector_norm(cond) * self.cfg_normalization
            norm = torch.linalg.vector_norm(pred)
            if norm > limit:
                pred = pred * (limit / norm)
        return pred

    @property
    def num_train_timesteps(self) -> int:
        """The scheduler's num_train_timesteps T: its timesteps are σ·T."""
        return int(self.scheduler_config().get("num_train_timesteps", 1000))

    def mu(self, resolution: int | None = None) -> float:
        """The pipeline's `calculate_shift` of the image's token count ((h/2)·(w/2) patches); the scheduler uses it
        only under dynamic shifting (Z-Image's scheduler shifts statically)."""
        _, h, w = self.latent_shape(resolution)
        return calculate_shift((h // 2) * (w // 2), *calculate_shift_args(self.scheduler_config()))

    def sampling_sigmas(self, num_steps: int, resolution: int | None = None) -> torch.Tensor:
        """The pipeline's grid: its default sigmas (torch.linspace(1, 1/N, N) in float32) through the folder's
        scheduler with `mu(resolution)`, then 0 (float32, N + 1 values)."""
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(self.scheduler_config())
        scheduler.set_timesteps(sigmas=get_default_z_image_sigmas(num_steps), mu=self.mu(resolution))
        return scheduler.sigmas.detach().to(torch.float32).cpu().clone()

    def sampling_shift(self, resolution: int | None = None) -> float:
        """The grid's shift as a static shift: the scheduler's `shift` (e^mu under dynamic shifting)."""
        return dynamic_sampling_shift(self.scheduler_config(), self.mu(resolution))

    # geometry
    @property
    def scheduler_shift(self) -> float:
        """The training table's shift: the scheduler's static `shift` (3 in Z-Image-Turbo), 1 under dynamic
        shifting."""
        return training_shift(self.scheduler_config())

    @property
    def vae_scale_factor(self) -> int:
        """2 ** (len(block_out_channels) - 1), as the pipeline computes it (8 for Z-Image's VAE)."""
        return 2 ** (len(self.cached_json("vae", "config.json")["block_out_channels"]) - 1)

    @property
    def default_resolution(self) -> int:
        """The folder's suggested resolution (`folder_default`), else the pipeline's default, 1024."""
        return int(self.folder_default("resolution") or Z_IMAGE_DEFAULT_RESOLUTION)

    def latent_shape(self, resolution: int | None = None) -> tuple[int, int, int]:
        """(in_channels, h, w) of a square image's latents: the transformer's input channels, as the pipeline draws
        its noise, at resolution / vae_scale_factor per side (a multiple of the VAE factor x 2x2 patches)."""
        resolution = resolution or self.default_resolution
        multiple = self.vae_scale_factor * PATCH_SIZE
        side = square_latent_side(resolution, self.vae_scale_factor, multiple, "VAE factor x 2x2 patches")
        return int(self.cached_json("transformer", "config.json")["in_channels"]), side, side


def prompt_list(embeds: Conditioning, device: torch.device, dtype: torch.dtype) -> list[torch.Tensor]:
    """Each row's prompt tokens (L_i, D) without its padding, in `dtype` on `device`: what the pipeline's
    `encode_prompt` returns and its transformer takes. Under the planner's fake tensors the mask holds no values: every
    row keeps all its tokens (the longest prompt's cost)."""
    tokens = embeds["prompt_embeds"].to(device=device, dtype=dtype)
    if simulating():
        return list(tokens)
    mask = embeds["prompt_embeds_mask"].to(device).bool()
    return [row[keep] for row, keep in zip(tokens, mask)]
