"""`Flux2Family`, the neutral base of the FLUX.2 families (`flux2.py`: FLUX.2 [klein] and [dev]): what every FLUX.2
pipeline folder shares, namely `Flux2Transformer2DModel`, `AutoencoderKLFlux2` with its batch-norm latent
normalisation, 4D (t, h, w, l) position ids, the empirical σ shift of the resolution and the step count, and
text-to-image plus multi-reference editing in one pipeline. Each family adds its text encoder and its guidance.

Latent layout: miles holds a sample as the pipeline's initial latent, the VAE latent 2x2-patchified to (4C, H/2, W/2)
and batch-norm normalised (the noise the pipeline draws has this shape, so seeds give the same noise); a token is one
(h, w) position's 4C channels, so packing is a flatten and the velocity needs no unpatchify.
"""

from __future__ import annotations

import argparse
import logging
from abc import abstractmethod
from pathlib import Path
from typing import Any

import numpy as np
import torch
from diffusers.models.modeling_utils import ModelMixin
from diffusers.models.transformers.transformer_flux2 import Flux2Transformer2DModel
from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu
from PIL import Image
from torch import nn

from miles.models.base import RunAlgorithm, compute_dtype
from miles.models.conditioning import Conditioning
from miles.models.diffusers_family import (
    DiffusersFamily,
    check_velocity_inputs,
    child_blocks,
    dynamic_shift_sigmas,
    posterior_latents,
    square_latent_side,
    training_shift,
    unit_range,
)
from miles.models.loading.pretrained import read_model_index
from miles.models.media import Media
from miles.utils.simulation import simulating

logger = logging.getLogger(__name__)

FLUX2_MAX_TEXT_LENGTH = 512  # both pipelines' default max_sequence_length (the tokenizer pads to it)
FLUX2_DEFAULT_LATENT_SIDE = 128  # the pipeline's default_sample_size: 128 VAE latents per side (1024 px)
FLUX2_REFERENCE_AREA = 1024 * 1024  # the pipeline shrinks a reference image larger than this to this area
FLUX2_MAX_REFERENCES = 10  # reference images per prompt (the pipelines set none; BFL recommends at most 10)
REFERENCE_TIME_SCALE = 10  # `_prepare_image_ids`: reference k's time coordinate is 10 + 10k (the noise's is 0)
FLUX2_MIN_REFERENCE_SIDE = 64  # `Flux2ImageProcessor.check_image_input`: smaller reference images are refused
FLUX2_TEXT_LAYERS = (9, 18, 27)  # Flux2KleinPipeline's default text_encoder_out_layers
FLUX2_DEV_TEXT_LAYERS = (10, 20, 30)  # Flux2Pipeline's default text_encoder_out_layers
FLUX2_TEXT = ("prompt_embeds",)  # the text conditioning (what a negative replaces)


def patchify(z: torch.Tensor) -> torch.Tensor:
    """`Flux2Pipeline._patchify_latents`: (B, C, H, W) -> (B, 4C, H/2, W/2), channel c's 2x2 patch at 4c .. 4c+3."""
    b, c, h, w = z.shape
    return z.view(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4).reshape(b, c * 4, h // 2, w // 2)


def unpatchify(x: torch.Tensor) -> torch.Tensor:
    """`Flux2Pipeline._unpatchify_latents`, the inverse of `patchify`."""
    b, c, h, w = x.shape
    return x.reshape(b, c // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3).reshape(b, c // 4, h * 2, w * 2)


def pack(x: torch.Tensor) -> torch.Tensor:
    """`Flux2Pipeline._pack_latents`: (B, C, H, W) -> (B, H*W, C), tokens in row-major order."""
    return x.flatten(2).transpose(1, 2)


def position_ids(height: int, width: int, time: int = 0) -> torch.Tensor:
    """(height * width, 4) int64 ids (t, h, w, 0) of a packed latent (`_prepare_latent_ids`: t 0;
    `_prepare_image_ids`: reference k at t = 10 + 10k)."""
    return torch.cartesian_prod(torch.tensor([time]), torch.arange(height), torch.arange(width), torch.arange(1))


def bn_stats(vae: ModelMixin, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The VAE's batch-norm mean and std (sqrt(running_var + batch_norm_eps)) as (1, 4C, 1, 1) on `like`."""
    mean = vae.bn.running_mean.view(1, -1, 1, 1).to(like.device, like.dtype)
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(like.device, like.dtype)
    return mean, std


class Flux2Family(DiffusersFamily):
    """What FLUX.2 [klein] and [dev] folders share: text-to-image, and editing with 1 to FLUX2_MAX_REFERENCES
    reference images per prompt (`source_image_range = (0, 10)`). A subclass declares its pipeline class, text
    pipeline, default hidden-state layers and guidance (`true_cfg`, `embedded_guidance`).

    Conditioning: `prompt_embeds` (B, L, 3D), the text encoder's hidden states the pipeline stacks; `image_tokens`
    (B, T, 4C) the reference images' normalised latents packed one after the other, `image_ids` (B, T, 4) their
    position ids and `image_token_counts` (B,) how many of a row's T are real (rows of a batch may carry different
    numbers of images; the rest is zero padding). In `predict_velocity` the reference tokens follow the noise tokens,
    as in the pipelines' loops; rows are run in groups of equal reference layout.

    Difference from the pipelines' `__call__`: a pipeline takes one list of reference images for the whole batch;
    miles gives each prompt its own (`encode_prompts(..., images=)`), which is the pipeline called per prompt.
    """

    vae_class = "AutoencoderKLFlux2"
    transformer_class = Flux2Transformer2DModel
    # the double-stream blocks' joint attention and the single-stream blocks' fused qkv+MLP input projection
    default_lora_targets = (
        "to_q",
        "to_k",
        "to_v",
        "to_out.0",
        "add_q_proj",
        "add_k_proj",
        "add_v_proj",
        "to_add_out",
        "to_qkv_mlp_proj",
    )
    source_image_range = (0, FLUX2_MAX_REFERENCES)
    prompt_cache_exact = True  # the text encoder at a fixed length, one VAE call per reference image
    checkpoint_name: str  # the model's name in messages ("FLUX.2 [klein]")
    default_text_layers: tuple[int, ...]  # the pipeline's default text_encoder_out_layers

    def __init__(self, path: str, **options: Any) -> None:
        super().__init__(path, **options)
        self.index = read_model_index(Path(self.path))
        class_name = self.index.get("_class_name")
        if class_name != self.pipeline_class_name:
            raise ValueError(
                f"{self.path} is a {class_name} folder; the {self.name} family covers {self.pipeline_class_name} "
                f"({self.checkpoint_name}) folders only"
            )
        if self.scheduler_config().get("use_flow_sigmas", False):
            raise ValueError(
                f"{self.path}: a scheduler with use_flow_sigmas is not supported by the {self.name} family"
            )

    def check_run_args(self, args: argparse.Namespace, algorithm: RunAlgorithm) -> None:
        """Refused at start-up: MixGRPO-Flash (its compressed grid needs one static shift of the resolution;
        FLUX.2's shift depends on the step count too) and a resolution under 64 px (miles loads reference images at
        the run's resolution, and the pipelines refuse smaller ones)."""
        resolution = args.resolution or self.default_resolution
        if resolution < FLUX2_MIN_REFERENCE_SIDE:
            raise ValueError(
                f"--resolution {resolution}: the {self.name} family loads reference images at the run's resolution "
                f"and {self.pipeline_class_name} takes none smaller than {FLUX2_MIN_REFERENCE_SIDE} px a side; use "
                f"at least {FLUX2_MIN_REFERENCE_SIDE}"
            )
        if args.mixgrpo_flash:
            raise ValueError(
                f"--mixgrpo-flash is not supported by the {self.name} family: its σ shift depends on the step count "
                "(compute_empirical_mu), not on the resolution alone"
            )

    # guidance
    @abstractmethod
    def true_cfg(self, guidance_scale: float) -> bool:
        """Whether `predict_velocity` at `guidance_scale` runs true CFG (two branches, a negative text)."""

    @abstractmethod
    def embedded_guidance(self, guidance_scale: float, batch: int, device: torch.device) -> torch.Tensor | None:
        """The transformer's `guidance` input for `batch` rows at `guidance_scale` (None: the pipeline passes none)."""

    # networks
    def transformer_blocks(self, transformer: nn.Module) -> list[nn.Module]:
        """The double-stream then single-stream blocks FSDP shards one by one."""
        return child_blocks(transformer, "transformer_blocks", "single_transformer_blocks")

    # text and reference images
    @property
    def max_sequence_length(self) -> int:
        """Text tokens per prompt: the tokenizer's limit, at most the pipeline's default (512)."""
        return self.tokenizer_limit("tokenizer", FLUX2_MAX_TEXT_LENGTH)

    @property
    def text_encoder_out_layers(self) -> tuple[int, ...]:
        """The text encoder's hidden states stacked per token: the pipeline's default (klein (9, 18, 27), dev
        (10, 20, 30)), or the folder's run default (a tiny folder's shallow encoder)."""
        return tuple(self.folder_default("text_encoder_out_layers") or self.default_text_layers)

    @property
    def in_channels(self) -> int:
        return int(self.cached_json("transformer", "config.json")["in_channels"])

    @torch.no_grad()
    def encode_prompts(
        self,
        prompts: list[str],
        device: torch.device | str | None = None,
        *,
        images: list[list[np.ndarray]] | None = None,
    ) -> Conditioning:
        """The pipeline's `encode_prompt(max_sequence_length=..., text_encoder_out_layers=...)`: `prompt_embeds`
        (B, L, 3D); the reference
        images of each prompt (`images`: a list of (H, W, 3) uint8 per prompt, possibly empty; None: none) as
        `image_tokens`, `image_ids` and `image_token_counts` (zero-length without images)."""
        if not prompts:
            raise ValueError("encode_prompts needs at least one prompt")
        pipe = self.text_pipeline()
        prompt_embeds, _ = pipe.encode_prompt(
            prompt=list(prompts),
            device=pipe.text_encoder.device,
            max_sequence_length=self.max_sequence_length,
            text_encoder_out_layers=self.text_encoder_out_layers,
        )
        if images is not None:
            self.check_source_images(len(prompts), images)
        rows = [self.encode_references(row) for row in (images or [[] for _ in prompts])]
        longest = max(tokens.shape[0] for tokens, _ in rows)
        tokens = torch.zeros(len(prompts), longest, self.in_channels)
        ids = torch.zeros(len(prompts), longest, 4, dtype=torch.int64)
        for i, (row_tokens, row_ids) in enumerate(rows):
            tokens[i, : len(row_tokens)], ids[i, : len(row_ids)] = row_tokens, row_ids
        counts = torch.tensor([len(row_tokens) for row_tokens, _ in rows], dtype=torch.int64)
        conditioning = {"prompt_embeds": prompt_embeds, "image_tokens": tokens, "image_ids": ids}
        return Conditioning({**conditioning, "image_token_counts": counts}).to(device=device or prompt_embeds.device)

    @torch.no_grad()
    def encode_references(self, images: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        """One prompt's reference images as the pipeline prepares them: each shrunk to 1024² pixels if larger, its
        sides rounded down to a multiple of vae_scale_factor * 2, preprocessed (center crop, [-1, 1]), its posterior
        mode patchified and batch-norm normalised, packed; tokens (T, 4C) float32 and ids (T, 4) with reference k
        at t = 10 + 10k. One VAE call per image, as the pipeline's."""
        from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor

        if not images:
            return torch.zeros(0, self.in_channels), torch.zeros(0, 4, dtype=torch.int64)
        vae, multiple = self.cached_vae(), self.vae_scale_factor * 2
        processor = Flux2ImageProcessor(vae_scale_factor=multiple)
        tokens, ids = [], []
        for k, array in enumerate(images):
            image = processor.check_image_input(Image.fromarray(array))  # >= 64 px a side, aspect ratio <= 8
            if image.width * image.height > FLUX2_REFERENCE_AREA:
                image = processor._resize_to_target_area(image, FLUX2_REFERENCE_AREA)
            width, height = image.width // multiple * multiple, image.height // multiple * multiple
            pixels = processor.preprocess(image, height=height, width=width, resize_mode="crop")
            latents = patchify(posterior_latents(vae, pixels.to(device=vae.device, dtype=vae.dtype), None))
            mean, std = bn_stats(vae, latents)
            latents = (latents - mean) / std
            tokens.append(pack(latents)[0].float().cpu())
            ids.append(position_ids(latents.shape[-2], latents.shape[-1], REFERENCE_TIME_SCALE * (k + 1)))
        return torch.cat(tokens), torch.cat(ids)

    # media: the pipeline's normalised, patchified latents
    @torch.no_grad()
    def encode_images(self, images: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Normalised latents (B, 4C, H/2v, W/2v), float32, of images (B, 3, H, W) in [-1, 1]: the posterior mode (or
        a sample drawn with `generator`) patchified and batch-norm normalised, as the pipeline encodes references."""
        vae = self.cached_vae()
        z = patchify(posterior_latents(vae, images.to(device=vae.device, dtype=vae.dtype), generator))
        mean, std = bn_stats(vae, z)
        return ((z - mean) / std).float()

    def decode_latents(self, x0: torch.Tensor) -> Media:
        """Images (B, 3, H, W) in [0, 1], float32, as the pipeline decodes: x * std + mean, unpatchified, decoded."""
        vae = self.cached_vae()
        x = x0.to(device=vae.device, dtype=vae.dtype)
        mean, std = bn_stats(vae, x)
        return Media(unit_range(vae.decode(unpatchify(x * std + mean), return_dict=False)[0]))

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
        """The velocity (float32, latents' shape (B, 4C, h, w)) at noise levels `sigmas` (B,), as the pipeline's loop
        computes it: the noise tokens (ids (0, i, j, 0)) followed by the row's reference tokens, timestep σ, text ids
        (0, 0, 0, l), the guidance embedding's input w (dev); for w > 1 on klein-base, true CFG uncond + w (cond -
        uncond) with the negative text and the same reference tokens (both branches in one batched forward); w > 1
        on a step-distilled klein is an error. `negative` may be a batch of one (broadcast); dev ignores it."""
        check_velocity_inputs(latents, sigmas, embeds)
        cfg_negative = None  # the negative text rows of true CFG
        if self.true_cfg(guidance_scale):
            if negative is None:
                raise ValueError("true CFG (guidance_scale > 1 on klein-base) needs negative embeddings")
            cfg_negative = Conditioning({name: negative[name] for name in FLUX2_TEXT}).expand(latents.shape[0])
        counts = embeds["image_token_counts"].tolist()
        groups: dict[tuple[int, bytes], list[int]] = {}
        fake = simulating()  # the planner's fake ids hold no positions: its rows group by count alone
        for row, count in enumerate(counts):  # rows whose reference tokens sit at the same positions
            ids = b"" if fake else embeds["image_ids"][row, :count].cpu().numpy().tobytes()
            groups.setdefault((count, ids), []).append(row)
        out = torch.empty(latents.shape, dtype=torch.float32, device=latents.device)
        for (count, _), rows in groups.items():
            index = torch.tensor(rows, device=latents.device)
            group_negative = None if cfg_negative is None else cfg_negative.rows(rows)
            out[index] = self.group_velocity(
                transformer, latents[index], sigmas[index], embeds.rows(rows), count, guidance_scale, group_negative
            )
        return out

    def group_velocity(
        self,
        transformer: nn.Module,
        latents: torch.Tensor,
        sigmas: torch.Tensor,
        embeds: Conditioning,
        count: int,
        guidance_scale: float,
        negative: Conditioning | None,
    ) -> torch.Tensor:
        """`predict_velocity` of rows whose `count` reference tokens share their position ids."""
        batch, _, height, width = latents.shape
        device, dtype = latents.device, compute_dtype(transformer)
        noise_tokens = height * width
        hidden = pack(latents.to(dtype))
        img_ids = position_ids(height, width).to(device)
        if count:
            references = embeds["image_tokens"][:, :count].to(device=device, dtype=dtype)
            hidden = torch.cat([hidden, references], dim=1)
            img_ids = torch.cat([img_ids, embeds["image_ids"][0, :count].to(device)])
        # the pipeline passes scheduler.timesteps (σ·1000 in float32, cast to the latents' dtype) divided by 1000
        timestep = (sigmas.to(device=device, dtype=torch.float32) * 1000.0).to(dtype) / 1000
        text = embeds["prompt_embeds"]
        if negative is not None:
            text = torch.cat([negative["prompt_embeds"].to(device), text.to(device)])
            hidden, timestep = torch.cat([hidden, hidden]), torch.cat([timestep, timestep])
        text = text.to(device=device, dtype=dtype)
        txt_ids = position_ids(1, 1).repeat(text.shape[1], 1)
        txt_ids[:, 3] = torch.arange(text.shape[1])  # `_prepare_text_ids`: (0, 0, 0, l)
        pred = transformer(
            hidden_states=hidden,
            timestep=timestep,
            guidance=self.embedded_guidance(guidance_scale, hidden.shape[0], device),
            encoder_hidden_states=text,
            txt_ids=txt_ids.to(device),
            img_ids=img_ids,
            return_dict=False,
        )[0][:, :noise_tokens].float()
        if negative is not None:
            uncond, cond = pred.chunk(2)
            pred = uncond + guidance_scale * (cond - uncond)
        return pred.transpose(1, 2).reshape(batch, -1, height, width)

    def mu(self, num_steps: int, resolution: int | None = None) -> float:
        """The pipeline's shift: `compute_empirical_mu` of the generated image's token count and the step count
        (reference tokens do not count)."""
        _, h, w = self.latent_shape(resolution)
        return compute_empirical_mu(image_seq_len=h * w, num_steps=num_steps)

    def sampling_sigmas(self, num_steps: int, resolution: int | None = None) -> torch.Tensor:
        """The pipeline's grid: σ = linspace(1, 1/N, N) through the folder's scheduler with `mu(N, resolution)`,
        then 0."""
        return dynamic_shift_sigmas(self.scheduler_config(), num_steps, self.mu(num_steps, resolution))

    def sampling_shift(self, resolution: int | None = None) -> float:
        """Not defined: the pipeline's shift depends on the step count as well (MixGRPO-Flash is refused at
        start-up, `check_run_args`)."""
        raise ValueError(
            f"the {self.name} family's σ shift depends on the step count (compute_empirical_mu), so it has no static "
            "shift of the resolution alone (--mixgrpo-flash)"
        )

    # geometry
    @property
    def scheduler_shift(self) -> float:
        """The training table's shift: 1 under dynamic shifting (FLUX.2's config), the config's `shift` otherwise."""
        return training_shift(self.scheduler_config())

    @property
    def vae_scale_factor(self) -> int:
        """The VAE's downsampling (the pipeline's vae_scale_factor); a latent position is twice that (2x2 patches)."""
        return 2 ** (len(self.cached_json("vae", "config.json")["block_out_channels"]) - 1)

    @property
    def default_resolution(self) -> int:
        """The pipeline's default 128 VAE latents per side x vae_scale_factor (1024), or the folder's run default."""
        return int(self.folder_default("resolution") or FLUX2_DEFAULT_LATENT_SIDE * self.vae_scale_factor)

    def latent_shape(self, resolution: int | None = None) -> tuple[int, int, int]:
        """(4C, h, w) of a square image's patchified latents; resolution defaults to `default_resolution`."""
        resolution = resolution or self.default_resolution
        multiple = self.vae_scale_factor * 2
        side = square_latent_side(resolution, multiple, multiple, "VAE factor x 2x2 patchify")
        return self.in_channels, side, side
