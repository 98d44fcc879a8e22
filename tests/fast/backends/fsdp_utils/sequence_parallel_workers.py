"""Rank body of the sequence-parallel equality job (`rank_jobs.py sp-ws2`): tiny Wan and tiny LTX-2 at --sp-size 2
(dp 1, FSDP2 over both ranks, with and without activation checkpointing; Wan's two-expert layout; LoRA) against the
plain unsharded transformer on one process, for velocities (with and without CFG), a Flow-GRPO SDE log-prob, a
flow-matching (nft/sft-style) loss and every parameter's gradient. One spawn serves both families."""

from __future__ import annotations

import math
import os
from typing import Any

import torch
from diffusers import LTX2VideoTransformer3DModel

from miles.arguments.parser import default_args
from miles.backends.fsdp_utils.fsdp import apply_fsdp2
from miles.backends.fsdp_utils.lora import apply_lora, lora_config_from_args
from miles.diffusion.sde import sde_step
from miles.models.base import get_train_pipeline_config
from miles.models.builtin import resolve_checkpoint
from miles.models.conditioning import Conditioning
from miles.models.sequence_parallel import new_sequence_parallel_group

BATCH = 2
GUIDANCE = 4.5
NOISE_LEVEL = 0.7


def fixed_inputs(family: Any) -> dict[str, Any]:
    """One batch every rank draws alike: x0, noise, σ, the next σ, text embeddings (and a negative one)."""
    gen = torch.Generator().manual_seed(11)
    shape = (BATCH, *family.latent_shape())
    text_dim = family.cached_json("transformer", "config.json")["text_dim"]
    return {
        **_latents(shape, gen),
        "embeds": Conditioning({"prompt_embeds": torch.randn(BATCH, 6, text_dim, generator=gen)}),
        "negative": Conditioning({"prompt_embeds": torch.randn(1, 6, text_dim, generator=gen)}),
    }


def _latents(shape: tuple[int, ...], gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {
        "x0": torch.randn(shape, generator=gen),
        "noise": torch.randn(shape, generator=gen),
        "next_noise": torch.randn(shape, generator=gen),
        "sigma": torch.tensor([0.9, 0.45]),
        "sigma_next": torch.tensor([0.8, 0.3]),
    }


def quantities(family: Any, model: torch.nn.Module, inputs: dict[str, Any]) -> dict[str, Any]:
    """Velocity, CFG velocity, SDE log-prob and flow-matching loss of one batch; backward of their sum, every full
    gradient (FSDP2's DTensors gathered)."""
    sigma, x0, noise = inputs["sigma"], inputs["x0"], inputs["noise"]
    view = sigma.view(-1, *[1] * (x0.ndim - 1))
    x_t = (1 - view) * x0 + view * noise
    embeds, negative = inputs["embeds"], inputs["negative"]
    velocity = family.predict_velocity(model, x_t, sigma, embeds)
    guided = family.predict_velocity(model, x_t, sigma, embeds, guidance_scale=GUIDANCE, negative=negative)
    step = sde_step(
        x_t, guided, sigma, inputs["sigma_next"], noise_level=NOISE_LEVEL, sigma_max=0.95, noise=inputs["next_noise"]
    )
    fm_loss = ((velocity - (noise - x0)) ** 2).mean()
    (fm_loss + step.log_prob.mean()).backward()
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad
        if grad is not None:  # frozen: the base weights under LoRA
            grads[name] = (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).detach().clone()
    return {
        "velocity": velocity.detach(),
        "guided": guided.detach(),
        "log_prob": step.log_prob.detach(),
        "fm_loss": fm_loss.detach(),
        "grads": grads,
    }


def sp_equality(rank: int, world_size: int, out_dir: str) -> dict[str, Any]:
    """Every family's report in one spawn: Wan's at the top level, LTX-2's under "ltx2", HunyuanVideo 1.5's under
    "hunyuan_video15"."""
    return {
        **wan_sp_equality(rank, world_size, out_dir),
        "ltx2": ltx2_sp_equality(rank, world_size, out_dir),
        "hunyuan_video15": hunyuan_video15_sp_equality(rank, world_size, out_dir),
    }


def wan_sp_equality(rank: int, world_size: int, out_dir: str) -> dict[str, Any]:
    """The plain transformer (no process group used), then --sp-size 2 with FSDP2 over both ranks, without and with
    activation checkpointing; each rank reports all three."""
    os.environ["MILES_CACHE"] = os.path.join(out_dir, "cache")  # its own tiny folders (one rank builds, under a lock)
    family = get_train_pipeline_config(resolve_checkpoint("builtin:tiny-wan"))
    inputs = fixed_inputs(family)
    plain = family.load_transformer().train()
    report: dict[str, Any] = {"plain": quantities(family, plain, inputs), "tokens": _tokens(plain, inputs["x0"])}
    sp = sequence_parallel_group(world_size)
    report["sp_rank"] = sp.rank
    for checkpointing in (False, True):
        model = family.load_transformer().train()
        family.apply_sequence_parallel(model, sp)
        seen = report.setdefault("tokens_in_last_block", [])  # that the blocks really ran on a chunk
        model.blocks[-1].register_forward_pre_hook(lambda _, args, seen=seen: seen.append(args[0].shape[1]))
        apply_fsdp2(
            model,
            family.transformer_blocks(model),
            param_dtype=torch.float32,
            reduce_dtype=torch.float32,
            cast_root_inputs=False,
            gradient_checkpointing=checkpointing,
        )
        report["sp_checkpointed" if checkpointing else "sp"] = quantities(family, model, inputs)
    # two experts (Wan 2.2 A14B layout): t = 900 goes to the high-noise expert, 450 to the low-noise one
    experts = get_train_pipeline_config(resolve_checkpoint("builtin:tiny-wan-2-experts"))
    report["experts_plain"] = quantities(experts, experts.load_transformer().train(), inputs)
    model = experts.load_transformer().train()
    experts.apply_sequence_parallel(model, sp)
    apply_fsdp2(
        model, experts.transformer_blocks(model), param_dtype=torch.float32, reduce_dtype=torch.float32,
        cast_root_inputs=False,
    )  # fmt: skip
    report["experts_sp"] = quantities(experts, model, inputs)
    # LoRA: the Ulysses processor calls the adapted projections
    report["lora_plain"] = quantities(family, with_lora(family), inputs)
    model = with_lora(family)
    family.apply_sequence_parallel(model, sp)
    apply_fsdp2(
        model, family.transformer_blocks(model), param_dtype=torch.float32, reduce_dtype=torch.float32,
        cast_root_inputs=False,
    )  # fmt: skip
    report["lora_sp"] = quantities(family, model, inputs)
    return report


def ltx2_sp_equality(rank: int, world_size: int, out_dir: str) -> dict[str, Any]:
    """Tiny LTX-2 (video and audio tokens split, 121 frames at 32 px: 64 video and 126 audio tokens, 2 heads of each
    kind): the plain transformer, then --sp-size 2 under FSDP2 without and with activation checkpointing, and LoRA;
    each velocity also reported per stream."""
    os.environ["MILES_CACHE"] = os.path.join(out_dir, "cache")
    family = get_train_pipeline_config(resolve_checkpoint("builtin:tiny-ltx2"))
    inputs = ltx2_inputs(family)
    sp = sequence_parallel_group(world_size)
    video_shape, audio_shape = family.stream_shapes()
    report: dict[str, Any] = {"video_tokens": math.prod(video_shape[1:]), "audio_tokens": audio_shape[1]}
    report["plain"] = ltx2_quantities(family, family.load_transformer().train(), inputs)
    for checkpointing in (False, True):
        model = family.load_transformer().train()
        family.apply_sequence_parallel(model, sp)
        seen = report.setdefault("tokens_in_last_block", [])
        model.transformer_blocks[-1].register_forward_pre_hook(
            lambda _, args, kwargs, seen=seen: seen.append(
                (kwargs["hidden_states"].shape[1], kwargs["audio_hidden_states"].shape[1])
            ),
            with_kwargs=True,
        )
        sharded(family, model, checkpointing)
        report["sp_checkpointed" if checkpointing else "sp"] = ltx2_quantities(family, model, inputs)
    report["lora_plain"] = ltx2_quantities(family, with_lora(family), inputs)
    model = with_lora(family)
    family.apply_sequence_parallel(model, sp)
    report["lora_sp"] = ltx2_quantities(family, sharded(family, model, False), inputs)
    report["variant_plain"] = ltx2_quantities(family, ltx2_variant(family), inputs)
    model = ltx2_variant(family)
    family.apply_sequence_parallel(model, sp)
    report["variant_sp"] = ltx2_quantities(family, sharded(family, model, False), inputs)
    return report


def ltx2_variant(family: Any) -> torch.nn.Module:
    """The tiny transformer's configuration with LTX-2.3's block options (interleaved rotary, per-head attention
    gates, cross-attention modulation, the perturbed-attention processors) and 4 video heads (2 per rank), seeded."""
    config = dict(family.cached_json("transformer", "config.json"))
    config.update(
        rope_type="interleaved",
        gated_attn=True,
        audio_gated_attn=True,
        cross_attn_mod=True,
        audio_cross_attn_mod=True,
        perturbed_attn=True,
        num_attention_heads=4,
        attention_head_dim=4,
    )
    torch.manual_seed(3)
    return LTX2VideoTransformer3DModel.from_config(config).train()


def hunyuan_video15_sp_equality(rank: int, world_size: int, out_dir: str) -> dict[str, Any]:
    """Tiny HunyuanVideo 1.5 (5 frames at 32 px: 2 x 8 x 8 = 128 video tokens, 2 heads; the joint attention's text
    whole): the plain transformer, then --sp-size 2 under FSDP2 without and with activation checkpointing, and
    LoRA (its targets include the text stream's projections)."""
    os.environ["MILES_CACHE"] = os.path.join(out_dir, "cache")
    family = get_train_pipeline_config(resolve_checkpoint("builtin:tiny-hunyuan-video15"))
    inputs = hunyuan_video15_inputs(family)
    sp = sequence_parallel_group(world_size)
    report: dict[str, Any] = {"tokens": math.prod(family.latent_shape()[1:])}
    report["plain"] = quantities(family, family.load_transformer().train(), inputs)
    for checkpointing in (False, True):
        model = family.load_transformer().train()
        family.apply_sequence_parallel(model, sp)
        seen = report.setdefault("tokens_in_last_block", [])
        model.transformer_blocks[-1].register_forward_pre_hook(lambda _, args, seen=seen: seen.append(args[0].shape[1]))
        sharded(family, model, checkpointing)
        report["sp_checkpointed" if checkpointing else "sp"] = quantities(family, model, inputs)
    report["lora_plain"] = quantities(family, with_lora(family), inputs)
    model = with_lora(family)
    family.apply_sequence_parallel(model, sp)
    report["lora_sp"] = quantities(family, sharded(family, model, False), inputs)
    return report


def hunyuan_video15_inputs(family: Any) -> dict[str, Any]:
    """HunyuanVideo 1.5's batch: latents, then both text encoders' embeddings (short sequences: the transformer takes
    any length) with masks that leave some tokens out, the prompts' and the negative's."""
    gen = torch.Generator().manual_seed(17)
    config = family.cached_json("transformer", "config.json")

    def text(rows: int, valid: list[int]) -> Conditioning:
        mask, mask_2 = torch.zeros(rows, 8, dtype=torch.int64), torch.zeros(rows, 4, dtype=torch.int64)
        for row, count in enumerate(valid):
            mask[row, :count], mask_2[row, : count // 2] = 1, 1
        return Conditioning(
            {
                "prompt_embeds": torch.randn(rows, 8, config["text_embed_dim"], generator=gen),
                "prompt_embeds_mask": mask,
                "prompt_embeds_2": torch.randn(rows, 4, config["text_embed_2_dim"], generator=gen),
                "prompt_embeds_mask_2": mask_2,
            }
        )

    return {**_latents((BATCH, *family.latent_shape()), gen), "embeds": text(BATCH, [8, 5]), "negative": text(1, [3])}


def ltx2_inputs(family: Any) -> dict[str, Any]:
    """LTX-2's batch: joint latents, then both streams' text (the connectors' width) with a left-padded mask."""
    gen = torch.Generator().manual_seed(13)
    width = family.cached_json("transformer", "config.json")["caption_channels"]
    mask = torch.ones(BATCH, 6, dtype=torch.int64)
    mask[0, :2] = 0  # the first prompt is two tokens shorter (left padding)

    def text(rows: int) -> Conditioning:
        return Conditioning(
            {
                "prompt_embeds": torch.randn(rows, 6, width, generator=gen),
                "audio_prompt_embeds": torch.randn(rows, 6, width, generator=gen),
                "attention_mask": mask[:rows].clone(),
            }
        )

    return {**_latents((BATCH, *family.latent_shape()), gen), "embeds": text(BATCH), "negative": text(1)}


def ltx2_quantities(family: Any, model: torch.nn.Module, inputs: dict[str, Any]) -> dict[str, Any]:
    """`quantities`, with the velocities' video and audio streams apart too."""
    out = quantities(family, model, inputs)
    for key in ("velocity", "guided"):
        out[f"{key}_video"], out[f"{key}_audio"] = (t.clone() for t in family.split_latents(out[key]))
    return out


def sharded(family: Any, model: torch.nn.Module, checkpointing: bool) -> torch.nn.Module:
    """FSDP2 over both ranks in fp32 (what the trainer applies after the split)."""
    apply_fsdp2(
        model,
        family.transformer_blocks(model),
        param_dtype=torch.float32,
        reduce_dtype=torch.float32,
        cast_root_inputs=False,
        gradient_checkpointing=checkpointing,
    )
    return model


_GROUPS: dict[int, Any] = {}


def sequence_parallel_group(world_size: int) -> Any:
    """This rank's group, created once per process (new_group is collective: every rank creates it alike)."""
    if world_size not in _GROUPS:
        _GROUPS[world_size] = new_sequence_parallel_group(world_size)
    return _GROUPS[world_size]


def with_lora(family: Any) -> torch.nn.Module:
    """The transformer with a LoRA adapter whose A and B are both random (seeded), so every adapter weight has a
    gradient (B = 0 at the usual init would leave A's at zero)."""
    model = apply_lora(family.load_transformer().train(), lora_config_from_args(default_args(), family.name))
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    return model


def _tokens(model: torch.nn.Module, latents: torch.Tensor) -> int:
    """Patch tokens per sample of `latents` (B, C, F, H, W)."""
    p_t, p_h, p_w = model.config.patch_size
    return latents.shape[2] // p_t * (latents.shape[3] // p_h) * (latents.shape[4] // p_w)
