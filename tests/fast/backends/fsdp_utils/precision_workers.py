"""Rank bodies for the precision tests: a bf16 trainer (fp32 master weights under FSDP2) against the engine's module
(`from_pretrained(dtype=bf16)`, no FSDP) on the same inputs; the pipeline folder and family options are read from
`out_dir/case.json`."""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from miles.backends.fsdp_utils.fsdp import apply_fsdp2
from miles.models.base import get_train_pipeline_config


def write_case(out_dir: str, pipeline_dir: str, **options: Any) -> str:
    with open(os.path.join(out_dir, "case.json"), "w") as f:
        json.dump({"path": pipeline_dir, "options": options}, f)
    return out_dir


def engine_and_trainer(rank: int, world_size: int, out_dir: str) -> dict[str, Any]:
    """Velocities and gradients (of the mean squared velocity) of the engine's module and of the sharded trainer
    with activation checkpointing, every rank on the same batch (so the averaged gradient is one rank's)."""
    with open(os.path.join(out_dir, "case.json")) as f:
        case = json.load(f)
    family = get_train_pipeline_config(case["path"], **case["options"])
    engine = family.load_transformer(dtype=torch.bfloat16)
    engine.compute_dtype = torch.bfloat16  # what predict_velocity casts to: the engine's forward dtype
    trainer = family.load_transformer()
    blocks = family.transformer_blocks(trainer)
    seen: dict[str, list[torch.dtype]] = {}  # the first block's float inputs, after FSDP2's pre-forward

    def record(name: str) -> Any:
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            seen.setdefault(name, _float_dtypes([*args, *kwargs.values()]))

        return hook

    for name, net in (("engine", engine), ("trainer", trainer)):
        family.transformer_blocks(net)[0].register_forward_pre_hook(record(name), with_kwargs=True)
    apply_fsdp2(
        trainer,
        blocks,
        param_dtype=torch.bfloat16,
        reduce_dtype=torch.float32,
        cast_root_inputs=False,
        gradient_checkpointing=True,
    )
    gen = torch.Generator().manual_seed(0)
    latents = torch.stack([family.draw_noise(gen) for _ in range(2)])
    sigmas = torch.tensor([0.857, 0.43])
    embeds = family.encode_prompts(["a red circle", "two blue squares"])
    report: dict[str, Any] = {"block_inputs": seen}
    for name, net in (("engine", engine), ("trainer", trainer)):
        velocity = family.predict_velocity(net, latents, sigmas, embeds)
        velocity.square().mean().backward()
        report[name] = {
            "velocity": velocity.detach(),
            "grads": {n: _full(p.grad).float() for n, p in net.named_parameters() if p.grad is not None},
        }
    return report


def _float_dtypes(values: list[Any]) -> list[torch.dtype]:
    flat = [t for v in values for t in (v if isinstance(v, (tuple, list)) else [v])]
    return [t.dtype for t in flat if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
