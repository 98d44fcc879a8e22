"""The Wan 2.x text-to-video family (`WanPipeline`): a prompt's UMT5 embeddings condition the transformer, one
expert or Wan 2.2's two, and Wan 2.2 TI2V-5B's per-token timesteps (`expand_timesteps`) without an image. What every
Wan folder shares (experts, VAE normalization, σ grid, geometry, the guidance) is `miles.models.wan.folder`'s.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from miles.models.base import register_train_pipeline_config
from miles.models.conditioning import Conditioning
from miles.models.diffusers_family import check_velocity_inputs
from miles.models.options import options_of
from miles.models.sequence_parallel import SequenceParallelGroup, sequence_parallel_problems
from miles.models.wan.experts import WanExperts
from miles.models.wan.folder import WanFolderFamily
from miles.models.wan.sequence_parallel import shard_wan_sequence

logger = logging.getLogger(__name__)


@register_train_pipeline_config
class WanPipelineConfig(WanFolderFamily):
    """Wan 2.1 / 2.2 text-to-video pipeline folders (`WanPipeline`), one expert or two; options as
    `WanFolderFamily`'s."""

    name = "wan"
    prompt_cache_exact = True  # UMT5 at a fixed length
    pipeline_class_name = "WanPipeline"
    options = options_of("wan")
    supports_sequence_parallel = True  # Ulysses over --sp-size ranks (miles.models.wan.sequence_parallel)
    text_pipeline_class = "WanPipeline"

    def sequence_parallel_problems(self, sp_size: int, resolution: int | None = None) -> list[str]:
        """--sp-size must divide the attention heads and the patch tokens per sample at `resolution`; Wan 2.2 TI2V's
        per-token timesteps (expand_timesteps) are refused: its per-token modulation is not split."""
        if sp_size == 1:
            return []
        config = self.cached_json("transformer", "config.json")
        _, frames, height, width = self.latent_shape(resolution)
        p_t, p_h, p_w = self.patch_size
        tokens = (frames // p_t) * (height // p_h) * (width // p_w)
        problems = sequence_parallel_problems(
            self.name, sp_size, heads=int(config["num_attention_heads"]), tokens=tokens
        )
        if self.expand_timesteps:
            problems.append(
                f"--sp-size {sp_size} with {self.path}: Wan 2.2 TI2V's per-token timesteps (expand_timesteps) are not "
                "split over the sequence-parallel ranks; use --sp-size 1"
            )
        return problems

    def apply_sequence_parallel(self, transformer: nn.Module, sp: SequenceParallelGroup) -> None:
        """Every expert's tokens split over the ranks of `sp` (`shard_wan_sequence`)."""
        experts = (
            [transformer.transformer, transformer.transformer_2]
            if isinstance(transformer, WanExperts)
            else [transformer]
        )
        for expert in experts:
            shard_wan_sequence(expert, sp)

    # text
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], device: torch.device | str | None = None) -> Conditioning:
        """`prompt_embeds` (B, L, D): `encode_text`, WanPipeline.encode_prompt's."""
        return Conditioning({"prompt_embeds": self.encode_text(prompts, device)})

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
        """The velocity (float32, latents' shape (B, C, F, H, W)) at noise levels `sigmas` (B,), as WanPipeline's
        loop computes it: timestep t = σ·num_train_timesteps (per token with `expand_timesteps`), the experts and
        guidance of `guided_velocity`; `negative` may be a batch of one."""
        batch = latents.shape[0]
        if latents.ndim != 5:
            raise ValueError(f"Wan latents are (B, C, F, H, W), got {tuple(latents.shape)}")
        check_velocity_inputs(latents, sigmas, embeds)
        t = sigmas.to(device=latents.device, dtype=torch.float32) * self.num_train_timesteps  # the Euler timesteps
        timestep = None
        if self.expand_timesteps:  # Wan 2.2 TI2V: one timestep per 1x2x2 patch of the first sample's mask
            _, _, frames, height, width = latents.shape
            tokens = frames * ((height + 1) // 2) * ((width + 1) // 2)
            timestep = t[:, None].expand(batch, tokens)
        return self.guided_velocity(
            transformer,
            latents,
            t,
            embeds["prompt_embeds"].to(latents.device),
            None if negative is None else negative["prompt_embeds"].to(latents.device),
            guidance_scale=guidance_scale,
            timestep=timestep,
        )
