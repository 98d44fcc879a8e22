"""Hand-built reward-gradient pairs and a linear differentiable latent reward for the refl, draft and direct_align
hooks: R(x) = gain·Σ w ⊙ x with a fixed pattern w of any latent shape (video latents included), `gain` from each
pair's metadata (× 2 under the control word "pos"), so hand gradients are one line."""

from __future__ import annotations

from pathlib import Path
from types import MappingProxyType

import torch

from miles.arguments.parser import default_args
from miles.backends.fsdp_utils.loss_hub.types import DiffusionLossContext, PreparedBatch, WindowMetrics
from miles.models.shapes_reward.differentiable import DifferentiableReward
from miles.utils.json_column import encode_json_column

B, L, D = 3, 5, 6
THIS_FILE = str(Path(__file__).resolve())


def pattern(shape: tuple[int, ...]) -> torch.Tensor:
    numel = int(torch.tensor(shape).prod())
    return (0.01 * (torch.arange(numel) % 7 - 3).float()).reshape(shape)


def gain(metadata: dict) -> float:
    return float(metadata.get("gain", 1.0)) * (2.0 if metadata.get("control_word") == "pos" else 1.0)


def score(args, latents, metadatas):
    gains = torch.tensor([gain(m) for m in metadatas], dtype=latents.dtype)
    return gains * (latents * pattern(tuple(latents.shape[1:]))).flatten(1).sum(dim=1)


async def rm(args, samples):
    return [float(score(args, s.latents[None], [s.metadata])[0]) for s in samples]


rm.differentiable = DifferentiableReward("latent", score)


async def plain_rm(args, samples):
    return [0.0] * len(samples)


def make_ctx(loss_type: str = "refl", **overrides) -> DiffusionLossContext:
    values = {"rm_type": "custom", "custom_rm_path": f"{THIS_FILE}:rm", "diffusion_guidance_scale": 1.0, **overrides}
    args = default_args(loss_type=loss_type, **values)
    return DiffusionLossContext(
        args=args,
        role="actor",
        rollout_id=1,
        dp_rank=0,
        dp_size=1,
        device=torch.device("cpu"),
        forward_dtype=torch.float32,
        family=None,
        networks=MappingProxyType({}),
    )


def make_batch(latent_shape=(2, 4, 4), sigma=0.3, sigma_next=0.1, seed=0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tail = torch.tensor([sigma, sigma_next, 0.0])
    return {
        "latents": torch.randn(B, *latent_shape, generator=g),
        "next_latents": torch.randn(B, *latent_shape, generator=g),
        "final_latents": torch.randn(B, *latent_shape, generator=g),
        "sigma": torch.full((B,), sigma),
        "sigma_next": torch.full((B,), sigma_next),
        "sigma_tail": tail.expand(B, -1).clone(),
        "reward_metadata": encode_json_column([{"gain": 1.0 + i} for i in range(B)]),
        "cond/prompt_embeds": torch.randn(B, L, D, generator=g),
        "pair_index": torch.arange(B),
    }


def call(formula, ctx, batch, prepared: PreparedBatch, new_pred, frozen=None, **kwargs):
    """The formula as the trunk calls it; returns (loss sum, metrics means)."""
    metrics = WindowMetrics()
    loss = formula(
        ctx,
        batch,
        prepared,
        new_pred=new_pred,
        frozen_preds=MappingProxyType(frozen or {}),
        metrics=metrics,
        optim_step_idx=kwargs.pop("optim_step_idx", 0),
        train_output_inputs=[],
        **kwargs,
    )
    return loss, metrics.means()
