"""The HunyuanVideo 1.5 text-to-video family (`HunyuanVideo15Pipeline`): a prompt's Qwen2.5-VL embeddings (chat
template, system prefix cropped, 1000 tokens with their mask) and ByT5 embeddings of its quoted glyph text (256 tokens,
zeros without quotes) condition the transformer, whose input also carries the image-to-video channels the T2V pipeline
fills with zeros (condition latents and mask) and zero image embeddings.

Guidance: the pipeline's `guider` (ClassifierFreeGuidance) runs uncond + w (cond - uncond) in two forwards; miles
takes w from --diffusion-guidance-scale and runs both branches in one batched forward (equal to float rounding). The
guider's other settings (rescale, original formulation, a start / stop window) are refused, as is w < 1 (the guider
would extrapolate where miles' convention disables CFG). The σ grid is the pipeline's: linspace(1, 0, N + 1)[:-1]
through the folder's scheduler. diffusers 0.42's pipeline has no LoRA loader, so `--use-lora --save-hf` is refused.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any, ClassVar

import diffusers
import numpy as np
import torch
from diffusers.models.modeling_utils import ModelMixin
from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15Transformer3DModel
from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler
from torch import nn

from miles.models.base import RunAlgorithm, compute_dtype, register_train_pipeline_config
from miles.models.conditioning import Conditioning
from miles.models.diffusers_family import (
    DiffusersFamily,
    check_velocity_inputs,
    diffusers_class,
    posterior_latents,
    square_latent_side,
    unit_range,
)
from miles.models.hunyuan_video15.sequence_parallel import shard_hunyuan_video15_sequence
from miles.models.media import Media
from miles.models.options import options_of
from miles.models.sequence_parallel import SequenceParallelGroup, sequence_parallel_problems

logger = logging.getLogger(__name__)

DEFAULT_NUM_FRAMES = 121  # the pipeline's default
FPS = 24  # HunyuanVideo 1.5's clips: 121 frames for about 5 s
IMAGE_TOKENS = 729  # the pipeline's vision_num_semantic_tokens: the zero image embeddings of text-to-video
# ClassifierFreeGuidance settings whose pipeline maths miles does not run, with the value miles' maths equals
GUIDER_DEFAULTS = {
    "guidance_rescale": 0.0,
    "use_original_formulation": False,
    "start": 0.0,
    "stop": 1.0,
    "enabled": True,
}
EMBEDS = ("prompt_embeds", "prompt_embeds_mask", "prompt_embeds_2", "prompt_embeds_mask_2")


@register_train_pipeline_config
class HunyuanVideo15PipelineConfig(DiffusersFamily):
    """A HunyuanVideo 1.5 text-to-video pipeline folder. Latents are (C, F, H, W) per clip of `num_frames` (option
    --num-frames, default the folder's suggestion or 121, 4k + 1) square frames, F = (num_frames - 1) // 4 + 1."""

    name = "hunyuan-video15"
    prompt_cache_exact = True  # both text encoders at fixed lengths
    pipeline_class_name = "HunyuanVideo15Pipeline"
    transformer_class = HunyuanVideo15Transformer3DModel
    text_pipeline_class = "HunyuanVideo15Pipeline"
    vae_class = "AutoencoderKLHunyuanVideo15"
    non_text_components = ("transformer", "vae")
    text_modules = ("text_encoder", "text_encoder_2")
    options = options_of("hunyuan-video15")
    default_lora_targets = (
        "attn.to_q",
        "attn.to_k",
        "attn.to_v",
        "attn.to_out.0",
        "attn.add_q_proj",
        "attn.add_k_proj",
        "attn.add_v_proj",
        "attn.to_add_out",
    )
    compile_refusal: ClassVar[str | None] = None
    supports_sequence_parallel = True  # Ulysses over --sp-size ranks (miles.models.hunyuan_video15.sequence_parallel)

    def __init__(self, path: str, **options: Any) -> None:
        super().__init__(path, **options)
        guider = self.read_json("guider", "guider_config.json")
        if guider.get("_class_name") != "ClassifierFreeGuidance":
            raise ValueError(f"{self.path}/guider is {guider.get('_class_name')!r}; miles runs ClassifierFreeGuidance")
        differing = {k: guider[k] for k, v in GUIDER_DEFAULTS.items() if k in guider and guider[k] != v}
        if differing:
            raise ValueError(
                f"{self.path}/guider/guider_config.json sets {differing}: miles runs plain CFG uncond + w (cond - "
                f"uncond) at every step ({GUIDER_DEFAULTS}); use a folder whose guider has those values"
            )
        frames = self.family_options.get("num_frames") or self.folder_default("num_frames")
        self.num_frames = int(frames or DEFAULT_NUM_FRAMES)
        temporal = self.vae_scale_factor_temporal
        if self.num_frames < 1 or (self.num_frames - 1) % temporal:
            low = max(1, (self.num_frames - 1) // temporal * temporal + 1)
            raise ValueError(
                f"--num-frames {self.num_frames}: HunyuanVideo 1.5 needs num_frames - 1 divisible by the VAE's "
                f"temporal factor {temporal}, e.g. {low} or {low + temporal}"
            )

    def check_run_args(self, args: argparse.Namespace, algorithm: RunAlgorithm) -> None:
        """Refused at start-up: a guidance scale below 1 (the guider would run CFG with it, miles does not) and a
        LoRA adapter written by --save-hf (the pipeline class has no `save_lora_weights` / `load_lora_weights`)."""
        scale = args.diffusion_guidance_scale
        if scale is not None and scale < 1.0:
            raise ValueError(
                f"--diffusion-guidance-scale {scale}: HunyuanVideo15Pipeline's guider runs CFG at any scale but 1, "
                "miles disables CFG at ≤ 1; use 1 (no CFG) or a scale above 1"
            )
        pipeline = getattr(diffusers, self.pipeline_class_name)
        if args.use_lora and args.save_hf and not hasattr(pipeline, "save_lora_weights"):
            raise ValueError(
                f"--use-lora with --save-hf: diffusers' {self.pipeline_class_name} has no LoRA loader "
                "(save_lora_weights / load_lora_weights), so the adapter could not be written as the pipeline loads "
                "it; train without --save-hf (checkpoints keep the adapter) or train the transformer fully"
            )

    # text
    def load_text_encoders(self, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> Any:
        """The pipeline with its tokenizers and text encoders; its __init__ reads the VAE's config, so it gets the
        family's VAE (`cached_vae`, shared, not a copy)."""
        vae = self._loaded["vae"] if "vae" in self._loaded else self.load_vae(device, dtype)
        return self.load_text_pipeline(
            diffusers_class(self.text_pipeline_class),
            without=("transformer",),
            frozen=self.text_modules,
            device=device,
            dtype=dtype,
            components={"vae": vae},
        )

    def encode_prompts(self, prompts: list[str], device: torch.device | str | None = None) -> Conditioning:
        """The pipeline's `encode_prompt`: `prompt_embeds` (B, 1000, D) and `prompt_embeds_mask` (B, 1000), the
        Qwen2.5-VL hidden states; `prompt_embeds_2` (B, 256, D2) and `prompt_embeds_mask_2`, ByT5's of the glyph
        text (zeros without quoted text). Masks are float, as the pipeline hands them to the transformer."""
        if not prompts:
            raise ValueError("encoding needs at least one prompt")
        pipe = self.text_pipeline()
        with torch.no_grad():
            encoded = pipe.encode_prompt(prompt=list(prompts), device=pipe.text_encoder.device, batch_size=len(prompts))
        return Conditioning({k: v.to(device=device) for k, v in zip(EMBEDS, encoded)})

    # media
    def load_vae(self, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> ModelMixin:
        """The VAE, encoding and decoding one clip at a time: diffusers 0.42's causal attention mask broadcasts
        wrongly over a batch of several clips."""
        vae = super().load_vae(device, dtype)  # tiled with --vae-tiling on
        vae.enable_slicing()
        return vae

    @torch.no_grad()
    def encode_images(self, images: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Latents z · scaling_factor (float32, (B, C, F, H, W); the inverse of the pipeline's decode) of frames
        (B, num_frames, 3, H, W) in [-1, 1], or of images (B, 3, H, W) as still clips of `num_frames` frames."""
        if images.ndim == 4:
            images = images.unsqueeze(1).expand(-1, self.num_frames, -1, -1, -1)
        if images.ndim != 5 or images.shape[1] != self.num_frames or images.shape[2] != 3:
            raise ValueError(
                f"encode_images takes (B, 3, H, W) images or (B, {self.num_frames}, 3, H, W) frames, "
                f"got {tuple(images.shape)}"
            )
        vae = self.cached_vae()
        video = images.permute(0, 2, 1, 3, 4).to(device=vae.device, dtype=vae.dtype)
        return (posterior_latents(vae, video, generator) * vae.config.scaling_factor).float()

    @torch.no_grad()
    def decode_latents(self, x0: torch.Tensor) -> Media:
        """Frames (B, F, 3, H, W) in [0, 1]: the pipeline's latents / scaling_factor, the VAE decode, x / 2 + 0.5."""
        vae = self.cached_vae()
        z = x0.to(device=vae.device, dtype=vae.dtype) / vae.config.scaling_factor
        video = vae.decode(z, return_dict=False)[0]
        return Media(unit_range(video).permute(0, 2, 1, 3, 4), fps=float(FPS))

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
        """The pipeline's velocity: the transformer on [latents, zero condition latents, zero mask] at timesteps
        σ·num_train_timesteps with zero image embeddings; CFG uncond + w (cond - uncond) when w > 1."""
        check_velocity_inputs(latents, sigmas, embeds)
        batch, device = latents.shape[0], latents.device
        dtype = compute_dtype(transformer)
        t = sigmas.to(device=device, dtype=torch.float32) * self.num_train_timesteps
        _, channels, frames, height, width = latents.shape
        zeros = latents.new_zeros(batch, channels + 1, frames, height, width)  # condition latents and mask
        hidden = torch.cat([latents, zeros], dim=1)
        rows = embeds
        guided = guidance_scale > 1.0
        if guided:
            if negative is None:
                raise ValueError("guidance_scale > 1 needs negative embeddings (see encode_negative)")
            rows = Conditioning.cat([negative.expand(batch) if negative.batch_size == 1 else negative, embeds])
            hidden, t = torch.cat([hidden, hidden]), torch.cat([t, t])
        inputs = {k: rows[k].to(device=device, dtype=dtype) for k in EMBEDS}
        pred = transformer(
            hidden_states=hidden.to(dtype),
            timestep=t.to(dtype),
            encoder_hidden_states=inputs["prompt_embeds"],
            encoder_attention_mask=inputs["prompt_embeds_mask"],
            encoder_hidden_states_2=inputs["prompt_embeds_2"],
            encoder_attention_mask_2=inputs["prompt_embeds_mask_2"],
            image_embeds=torch.zeros(hidden.shape[0], IMAGE_TOKENS, self.image_embed_dim, device=device, dtype=dtype),
            return_dict=False,
        )[0].float()
        if not guided:
            return pred
        uncond, cond = pred.chunk(2)
        return uncond + guidance_scale * (cond - uncond)

    def sequence_parallel_problems(self, sp_size: int, resolution: int | None = None) -> list[str]:
        """--sp-size must divide the attention heads (the joint video + text attention) and the video patch tokens
        per sample at `resolution` and `num_frames` (the text stays whole on every rank)."""
        if sp_size == 1:
            return []
        config = self.cached_json("transformer", "config.json")
        _, frames, height, width = self.latent_shape(resolution)
        patch, patch_t = int(config.get("patch_size", 1)), int(config.get("patch_size_t", 1))
        tokens = (frames // patch_t) * (height // patch) * (width // patch)
        return sequence_parallel_problems(
            self.name, sp_size, heads=int(config.get("num_attention_heads", 16)), tokens=tokens
        )

    def apply_sequence_parallel(self, transformer: nn.Module, sp: SequenceParallelGroup) -> None:
        """The video tokens split over the ranks of `sp` (`shard_hunyuan_video15_sequence`)."""
        shard_hunyuan_video15_sequence(transformer, sp)

    @property
    def num_train_timesteps(self) -> int:
        return int(self.scheduler_config().get("num_train_timesteps", 1000))

    @property
    def image_embed_dim(self) -> int:
        return int(self.cached_json("transformer", "config.json").get("image_embed_dim", 1152))

    def sampling_sigmas(self, num_steps: int, resolution: int | None = None) -> torch.Tensor:
        """The pipeline's grid: σ = linspace(1, 0, N + 1)[:-1] through the folder's scheduler (its static shift),
        then 0 (float32, N + 1 values)."""
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        config = self.scheduler_config()
        if config.get("use_dynamic_shifting"):
            raise ValueError(f"{self.path}/scheduler uses dynamic shifting, which HunyuanVideo15Pipeline never sets")
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(config)
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 0.0, num_steps + 1)[:-1])
        return scheduler.sigmas.detach().to(torch.float32).cpu().clone()

    # geometry
    @property
    def scheduler_shift(self) -> float:
        return float(self.scheduler_config().get("shift", 1.0))

    @property
    def vae_scale_factor(self) -> int:
        return int(self.cached_json("vae", "config.json").get("spatial_compression_ratio", 16))

    @property
    def vae_scale_factor_temporal(self) -> int:
        return int(self.cached_json("vae", "config.json").get("temporal_compression_ratio", 4))

    @property
    def default_resolution(self) -> int:
        """The folder's suggestion (`folder_default`), else the transformer's `target_size`: the side of the
        pipeline's square bucket (640 for the 480p models)."""
        suggested = self.folder_default("resolution")
        return int(suggested or self.cached_json("transformer", "config.json").get("target_size", 640))

    def latent_shape(self, resolution: int | None = None) -> tuple[int, int, int, int]:
        """(channels, frames, h, w) of one clip: frames (num_frames - 1) // 4 + 1, sides resolution // 16, the
        resolution a multiple of the VAE factor x the patch size."""
        resolution = resolution or self.default_resolution
        config = self.cached_json("transformer", "config.json")
        multiple = self.vae_scale_factor * int(config.get("patch_size", 1))
        side = square_latent_side(resolution, self.vae_scale_factor, multiple, "VAE factor x patch size")
        channels = int(self.cached_json("vae", "config.json").get("latent_channels", 32))
        frames = (self.num_frames - 1) // self.vae_scale_factor_temporal + 1
        return channels, frames, side, side
