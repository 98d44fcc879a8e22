"""`WanFolderFamily`, the neutral base of the families that load Wan 2.x pipeline folders (text-to-video `wan`,
image-to-video `wan-i2v`): what every such folder shares whatever it generates from, namely one transformer or Wan
2.2's two experts split at a boundary timestep, the UMT5 text encoder, AutoencoderKLWan (4x temporal, 8x spatial,
per-channel latent normalization), the folder's σ grid and the clip geometry. Each family adds its conditioning and
`predict_velocity`; the classifier-free guidance both run (`guided_velocity`) lives here.

Latents are (C, F, H, W) per sample with F = (num_frames - 1) // 4 + 1. What differs from the pipelines: miles samples
with its own Euler/SDE kernels on the σ grid of the folder's scheduler (`sampling_sigmas`), where real Wan folders ship
`UniPCMultistepScheduler`, a multistep solver, and feed the transformer the integer part of σ·1000; miles feeds σ·1000
unrounded, as the Euler scheduler the tiny test pipelines use does (there, ODE sampling equals the pipeline's own
output).

Two experts (model_index.json `boundary_ratio` with a `transformer_2`): `load_transformer` returns one `WanExperts`
module holding both; each row goes to `transformer` (high noise) when its timestep σ·1000 >= boundary_ratio ·
num_train_timesteps, else to `transformer_2`, exactly the pipelines' rule, and CFG uses `guidance_scale` on the
high-noise rows and `guidance_scale_2` (default: the same) on the low-noise ones. Which experts train is the
`trained_experts` option (--wan-trained-experts); the others are frozen.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

import diffusers
import torch
from diffusers.models.transformers.transformer_wan import WanTransformer3DModel
from torch import nn

from miles.models.base import RunAlgorithm, compute_dtype, load_pretrained
from miles.models.conditioning import Conditioning
from miles.models.diffusers_family import (
    DiffusersFamily,
    channel_stats,
    child_blocks,
    posterior_latents,
    square_latent_side,
    unit_range,
)
from miles.models.media import Media
from miles.models.options import TRAINED_EXPERTS
from miles.models.wan.experts import HIGH_NOISE, LOW_NOISE, WanExperts

logger = logging.getLogger(__name__)

WAN_MAX_SEQUENCE_LENGTH = 512  # the Wan pipelines' default max_sequence_length
WAN_DEFAULT_NUM_FRAMES = 81  # the Wan pipelines' default
WAN_DEFAULT_RESOLUTION = 480  # the Wan pipelines' default height (miles samples square frames)
WAN_FPS = 16  # the frame rate Wan 2.1 / 2.2 A14B videos are exported at (diffusers' examples: export_to_video(fps=16))
WAN_TI2V_FPS = 24  # Wan 2.2 TI2V-5B's (the expand_timesteps layout): 121 frames for 5 s


class WanFolderFamily(DiffusersFamily):
    """A Wan 2.1 / 2.2 pipeline folder, one expert or two; a subclass declares its pipeline class, options
    (`num_frames`, `guidance_scale_2`, `trained_experts`: read here), conditioning and `predict_velocity`.

    Options: `num_frames` (--num-frames, default the folder's `folder_default` or 81, must be 4k + 1),
    `guidance_scale_2` (--diffusion-guidance-scale-2: CFG of the low-noise expert, default the high-noise one's, as
    in the pipelines), `trained_experts` (--wan-trained-experts: both | high-noise | low-noise; default both).
    """

    # self- and cross-attention of every WanTransformerBlock
    default_lora_targets = ("to_q", "to_k", "to_v", "to_out.0")
    transformer_class = WanTransformer3DModel
    non_text_components = ("transformer", "transformer_2", "vae")
    vae_class = "AutoencoderKLWan"

    def __init__(self, path: str, **options: Any) -> None:
        super().__init__(path, **options)
        index = self.read_json("model_index.json")
        self.boundary_ratio = index.get("boundary_ratio")
        has_second = isinstance(index.get(LOW_NOISE), list) and index[LOW_NOISE][0] is not None
        has_first = isinstance(index.get(HIGH_NOISE), list) and index[HIGH_NOISE][0] is not None
        if not has_first:
            raise ValueError(f"{self.path}: miles trains Wan folders with a `transformer`; model_index.json has none")
        if has_second != (self.boundary_ratio is not None):
            raise ValueError(
                f"{self.path}: a `transformer_2` needs a `boundary_ratio` in model_index.json and vice versa "
                f"(transformer_2: {has_second}, boundary_ratio: {self.boundary_ratio})"
            )
        self.two_experts = has_second
        self.expand_timesteps = bool(index.get("expand_timesteps", False))
        frames = self.family_options.get("num_frames") or self.folder_default("num_frames")
        self.num_frames = int(frames or WAN_DEFAULT_NUM_FRAMES)
        temporal = self.vae_scale_factor_temporal
        if self.num_frames < 1 or (self.num_frames - 1) % temporal:
            low = max(1, (self.num_frames - 1) // temporal * temporal + 1)
            raise ValueError(
                f"--num-frames {self.num_frames}: Wan needs num_frames - 1 divisible by the VAE's temporal factor "
                f"{temporal}, e.g. {low} or {low + temporal}"
            )
        patch = self.patch_size[0]  # the transformer patches the latent frames by this many (1 in the published)
        latent_frames = (self.num_frames - 1) // temporal + 1
        if latent_frames % patch:
            low = 1 + temporal * (-(-latent_frames // patch) * patch - 1)  # the next count whose latent frames split
            raise ValueError(
                f"--num-frames {self.num_frames}: its {latent_frames} latent frames do not split into the "
                f"transformer's temporal patches of {patch} ({self.path}): e.g. --num-frames {low} or "
                f"{low + temporal * patch}"
            )
        scale_2 = self.family_options.get("guidance_scale_2")
        if scale_2 is not None and not self.two_experts:
            raise ValueError(
                f"--diffusion-guidance-scale-2 is the low-noise expert's CFG scale, but {self.path} has one expert"
            )
        self.guidance_scale_2 = None if scale_2 is None else float(scale_2)
        trained = self.family_options.get("trained_experts") or "both"
        if trained not in TRAINED_EXPERTS:
            raise ValueError(f"--wan-trained-experts {trained!r}: choose one of {', '.join(TRAINED_EXPERTS)}")
        if trained != "both" and not self.two_experts:
            raise ValueError(
                f"--wan-trained-experts {trained}: {self.path} has one expert (no transformer_2 / boundary_ratio); "
                "leave the flag out"
            )
        self.trained_experts = trained

    # networks
    @property
    def boundary_timestep(self) -> float | None:
        """The pipeline's `boundary_ratio * num_train_timesteps`, or None with one expert."""
        if self.boundary_ratio is None:
            return None
        return float(self.boundary_ratio) * self.num_train_timesteps

    def expert_boundary(self) -> float:
        """`boundary_timestep` of a family with two experts (a ValueError with one)."""
        boundary = self.boundary_timestep
        if boundary is None:
            raise ValueError(f"{self.path} has one expert: there is no boundary between experts")
        return boundary

    def load_transformer(
        self, path: str | None = None, dtype: torch.dtype = torch.float32, *, empty: bool = False
    ) -> nn.Module:
        """The transformer (one expert), or `WanExperts` holding both experts with the untrained one frozen; `empty`:
        built on the meta device, no weights read (`load_pretrained`).

        `path`: a pipeline folder of this layout (default: this one), or, for a one-expert family, a folder with a
        transformer's config.json at the top."""
        root = Path(path or self.path)
        if not (root / "transformer" / "config.json").is_file():
            if self.two_experts or not (root / "config.json").is_file():
                need = (
                    "transformer/ and transformer_2/" if self.two_experts else "transformer/config.json or config.json"
                )
                raise FileNotFoundError(f"{root} holds no {need} (a WanTransformer3DModel)")
            return load_pretrained(WanTransformer3DModel, root, None, dtype, empty=empty)
        first = load_pretrained(WanTransformer3DModel, root, HIGH_NOISE, dtype, empty=empty)
        if not self.two_experts:
            return first
        if not (root / LOW_NOISE / "config.json").is_file():
            raise FileNotFoundError(f"{root} has no transformer_2/config.json: this family's folders hold two experts")
        experts = WanExperts(
            first, load_pretrained(WanTransformer3DModel, root, LOW_NOISE, dtype, empty=empty), self.expert_boundary()
        ).eval()
        if self.trained_experts != "both":
            frozen = LOW_NOISE if self.trained_experts == "high-noise" else HIGH_NOISE
            getattr(experts, frozen).requires_grad_(False)
        return experts

    def transformer_blocks(self, transformer: nn.Module) -> list[nn.Module]:
        """The WanTransformerBlocks FSDP shards one by one (both experts' with two)."""
        if isinstance(transformer, WanExperts):
            return child_blocks(transformer, "transformer.blocks", "transformer_2.blocks")
        return child_blocks(transformer, "blocks")

    def save_transformer(
        self, transformer_state_dict: dict[str, torch.Tensor], out_dir: str, dtype: torch.dtype | None = None
    ) -> str:
        """A full pipeline folder: this folder's other components plus the given weights in `transformer/` (and
        `transformer_2/` with two experts, from the `transformer.*` / `transformer_2.*` entries). Weights are
        stored in `dtype`, by default each tensor's dtype in the source checkpoint. Returns `out_dir`."""
        if not self.two_experts:
            return self.save_pipeline({HIGH_NOISE: transformer_state_dict}, out_dir, dtype)
        subfolders = (HIGH_NOISE, LOW_NOISE)
        stray = sorted(k for k in transformer_state_dict if k.split(".")[0] not in subfolders)
        if stray:
            raise ValueError(f"two-expert state dict has entries of neither expert: {stray[:5]}")
        states = {s: {k[len(s) + 1 :]: v for k, v in transformer_state_dict.items() if k.split(".")[0] == s}
                  for s in subfolders}  # fmt: skip
        return self.save_pipeline(states, out_dir, dtype)

    def saved_transformer_dtypes(self) -> dict[str, torch.dtype]:
        """Each entry's source dtype; with two experts named as `save_transformer` takes them (`transformer.*`,
        `transformer_2.*`)."""
        if not self.two_experts:
            return self.checkpoint_dtypes(Path(self.path) / HIGH_NOISE)
        return {
            f"{sub}.{name}": dtype
            for sub in (HIGH_NOISE, LOW_NOISE)
            for name, dtype in self.checkpoint_dtypes(Path(self.path) / sub).items()
        }

    def check_run_args(self, args: argparse.Namespace, algorithm: RunAlgorithm) -> None:
        """LoRA trains one adapter on one transformer: two experts are refused at start-up."""
        if args.use_lora and self.two_experts:
            raise ValueError(
                f"--use-lora with a two-expert Wan folder ({self.path}) is not supported: miles injects one adapter "
                "into one transformer; train the experts fully (--wan-trained-experts picks which)"
            )

    # text
    @property
    def max_sequence_length(self) -> int:
        """UMT5 tokens per prompt: the tokenizer's limit, at most the pipelines' default (512)."""
        return self.tokenizer_limit("tokenizer", WAN_MAX_SEQUENCE_LENGTH)

    def encode_text(self, prompts: list[str], device: torch.device | str | None = None) -> torch.Tensor:
        """The pipelines' `encode_prompt(max_sequence_length=...)`: `prompt_embeds` (B, L, D), UMT5's last hidden
        states trimmed to each prompt's tokens and zero-padded to L (the transformer gets no mask)."""
        if not prompts:
            raise ValueError("encoding needs at least one prompt")
        pipe = self.text_pipeline()
        prompt_embeds, _ = pipe.encode_prompt(
            prompt=list(prompts),
            do_classifier_free_guidance=False,
            num_videos_per_prompt=1,
            max_sequence_length=self.max_sequence_length,
            device=pipe.text_encoder.device,
        )
        return prompt_embeds.to(device=device)

    # media
    @torch.no_grad()
    def encode_images(self, images: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Normalized latents (z - latents_mean) / latents_std (float32, (B, C, F, H, W)) of video frames
        (B, num_frames, 3, H, W) in [-1, 1], or of images (B, 3, H, W) as still clips of `num_frames` frames
        (so that image datasets can feed sft_loss). z is the posterior mode, or a sample with `generator`."""
        if images.ndim == 4:
            images = images.unsqueeze(1).expand(-1, self.num_frames, -1, -1, -1)
        if images.ndim != 5 or images.shape[1] != self.num_frames or images.shape[2] != 3:
            raise ValueError(
                f"encode_images takes (B, 3, H, W) images or (B, {self.num_frames}, 3, H, W) frames, "
                f"got {tuple(images.shape)}"
            )
        vae = self.cached_vae()
        video = images.permute(0, 2, 1, 3, 4).to(device=vae.device, dtype=vae.dtype)  # (B, 3, F, H, W)
        z = posterior_latents(vae, video, generator)
        mean, std = channel_stats(vae, z)
        return ((z - mean) / std).float()

    @torch.no_grad()
    def decode_latents(self, x0: torch.Tensor) -> Media:
        """Frames (B, F, 3, H, W) in [0, 1] at `fps` from normalized latents (B, C, F', H', W'): the pipeline's
        latents * latents_std + latents_mean, the VAE decode, then x / 2 + 0.5 clamped (its video processor)."""
        vae = self.cached_vae()
        z = x0.to(device=vae.device, dtype=vae.dtype)
        mean, std = channel_stats(vae, z)
        video = vae.decode(z * std + mean, return_dict=False)[0]  # (B, 3, F, H, W) in [-1, 1]
        frames = unit_range(video).permute(0, 2, 1, 3, 4)
        return Media(frames, fps=float(self.fps))

    # the flow
    def guided_velocity(
        self,
        transformer: nn.Module,
        hidden: torch.Tensor,
        t: torch.Tensor,
        prompt_embeds: torch.Tensor,
        negative_embeds: torch.Tensor | None,
        *,
        guidance_scale: float,
        timestep: torch.Tensor | None = None,
        image_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The pipelines' velocity (float32, (B, C, F, H, W)) from the transformer input `hidden` (B, C_in, F, H, W)
        at timesteps `t` (B,) = σ·num_train_timesteps (`timestep`: what the transformer gets instead, e.g. one per
        token): with two experts each row's expert by t against the boundary; CFG uncond + w (cond - uncond) when
        guidance_scale > 1, w the high-noise scale or, on low-noise rows, `guidance_scale_2`. Both branches run in one
        batched forward and share `hidden` and the image embeddings `image_embeds` (B, K, D), as the pipelines'
        branches do; `negative_embeds` (the negative prompt's) may be a batch of one."""
        batch, device = hidden.shape[0], hidden.device
        dtype = compute_dtype(transformer)
        timestep = t if timestep is None else timestep
        text = prompt_embeds
        guided = guidance_scale > 1.0
        if guided:
            if negative_embeds is None:
                raise ValueError("guidance_scale > 1 needs negative embeddings (see encode_negative)")
            negative_rows = Conditioning({"prompt_embeds": negative_embeds}).expand(batch)
            text = Conditioning.cat([negative_rows, Conditioning({"prompt_embeds": text})])["prompt_embeds"]
            hidden, timestep = torch.cat([hidden, hidden]), torch.cat([timestep, timestep])
            if image_embeds is not None:
                image_embeds = torch.cat([image_embeds, image_embeds])
        extra = {} if image_embeds is None else {"encoder_hidden_states_image": image_embeds.to(device, dtype)}
        pred = transformer(
            hidden_states=hidden.to(dtype),
            timestep=timestep,
            encoder_hidden_states=text.to(device, dtype),
            return_dict=False,
            **extra,
        )[0].float()
        if not guided:
            return pred
        uncond, cond = pred.chunk(2)
        scale = torch.full((batch,), float(guidance_scale), device=device)
        if self.two_experts and self.guidance_scale_2 is not None:
            scale = torch.where(t >= self.expert_boundary(), scale, torch.full_like(scale, self.guidance_scale_2))
        return uncond + scale.view(batch, 1, 1, 1, 1) * (cond - uncond)

    @property
    def num_train_timesteps(self) -> int:
        return int(self.scheduler_config().get("num_train_timesteps", 1000))

    def sampling_sigmas(self, num_steps: int, resolution: int | None = None) -> torch.Tensor:
        """The σ grid of the folder's own scheduler at `num_steps` (its `sigmas` after `set_timesteps`, float32):
        the Euler scheduler's shifted grid, or UniPC's flow-sigma grid (from 1 - 1e-6, shifted by flow_shift) for
        real Wan folders, which miles then steps with its own kernels (module docstring)."""
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        config = self.scheduler_config()
        scheduler_class = getattr(diffusers, config.get("_class_name", ""), None)
        if scheduler_class is None or not hasattr(scheduler_class, "set_timesteps"):
            raise ValueError(f"{self.path}/scheduler names {config.get('_class_name')!r}, not a diffusers scheduler")
        if config.get("use_dynamic_shifting"):
            raise ValueError(f"{self.path}/scheduler uses dynamic shifting, which WanPipeline never configures")
        if "use_flow_sigmas" in config and not config["use_flow_sigmas"]:
            raise ValueError(f"{self.path}/scheduler is {config['_class_name']} without use_flow_sigmas: not a flow")
        scheduler = scheduler_class.from_config(config)
        scheduler.set_timesteps(num_steps)
        return scheduler.sigmas.detach().to(torch.float32).cpu().clone()

    # geometry
    @property
    def scheduler_shift(self) -> float:
        """The static shift of the training σ table: UniPC's `flow_shift`, or the Euler scheduler's `shift`."""
        config = self.scheduler_config()
        return float(config.get("flow_shift", config.get("shift", 1.0)))

    @property
    def vae_scale_factor(self) -> int:
        return int(self.cached_json("vae", "config.json").get("scale_factor_spatial", 8))

    @property
    def vae_scale_factor_temporal(self) -> int:
        return int(self.cached_json("vae", "config.json").get("scale_factor_temporal", 4))

    @property
    def patch_size(self) -> tuple[int, int, int]:
        return tuple(self.cached_json("transformer", "config.json").get("patch_size", (1, 2, 2)))

    @property
    def fps(self) -> int:
        """Frame rate of the decoded clips: 16 (Wan 2.1, Wan 2.2 A14B), 24 for Wan 2.2 TI2V-5B (expand_timesteps)."""
        return WAN_TI2V_FPS if self.expand_timesteps else WAN_FPS

    @property
    def default_resolution(self) -> int:
        """The folder's suggested resolution (`folder_default`), else 480: WanPipeline's default height (its default
        frame is 480x832; miles samples square frames)."""
        return int(self.folder_default("resolution") or WAN_DEFAULT_RESOLUTION)

    def latent_shape(self, resolution: int | None = None) -> tuple[int, int, int, int]:
        """(channels, frames, h, w) of one clip of `num_frames` square frames: frames (num_frames - 1) // 4 + 1,
        sides resolution // 8; the resolution must be a multiple of VAE factor x patch size (16)."""
        resolution = resolution or self.default_resolution
        multiple = self.vae_scale_factor * self.patch_size[1]
        side = square_latent_side(resolution, self.vae_scale_factor, multiple, "VAE factor x patch size")
        channels = int(self.cached_json("vae", "config.json")["z_dim"])
        frames = (self.num_frames - 1) // self.vae_scale_factor_temporal + 1
        return channels, frames, side, side
