"""Rank bodies for the sharding tests: the tiny SD3 transformer under FSDP2 with and without activation
checkpointing (the pipeline folder's path is read from `out_dir/pipeline.txt`); the block model under plain and
hybrid sharding, and a checkpoint carried from one mesh shape to the other."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from miles.backends.fsdp_utils.checkpoint import frozen_weights_digest, load_checkpoint, save_checkpoint
from miles.backends.fsdp_utils.fsdp import apply_fsdp2, build_mesh, clip_grad_norm_
from miles.backends.fsdp_utils.microbatch import accumulate_gradients
from miles.models.base import get_train_pipeline_config
from miles.models.conditioning import Conditioning
from tests.fast.backends.fsdp_utils.fsdp_workers import BATCH as BATCH_ROWS
from tests.fast.backends.fsdp_utils.fsdp_workers import LR, MAX_NORM, WEIGHT_DECAY, build_model, fixed_batch

BATCH = 4


def fixed_inputs(family: Any, config: Any) -> tuple[torch.Tensor, torch.Tensor, Conditioning]:
    gen = torch.Generator().manual_seed(7)
    latents = torch.randn(BATCH, *family.latent_shape(), generator=gen)
    sigmas = torch.rand(BATCH, generator=gen) * 0.9 + 0.05
    embeds = Conditioning(
        {
            "prompt_embeds": torch.randn(BATCH, 8, config.joint_attention_dim, generator=gen),
            "pooled_prompt_embeds": torch.randn(BATCH, config.pooled_projection_dim, generator=gen),
        }
    )
    return latents, sigmas, embeds


def pipeline_dir(out_dir: str) -> str:
    with open(os.path.join(out_dir, "pipeline.txt")) as f:
        return f.read().strip()


def checkpointed_gradients(rank: int, world_size: int, out_dir: str) -> dict[str, Any]:
    """Full gradients of one backward, without then with --gradient-checkpointing, and how often the first
    block's attention ran (twice with checkpointing: forward, then the recompute in backward)."""
    family = get_train_pipeline_config(pipeline_dir(out_dir))
    report: dict[str, Any] = {}
    for checkpointing in (False, True):
        model = family.load_transformer()
        latents, sigmas, embeds = fixed_inputs(family, model.config)
        blocks = family.transformer_blocks(model)
        calls = []
        blocks[0].attn.register_forward_pre_hook(lambda *_, calls=calls: calls.append(1))
        apply_fsdp2(
            model,
            blocks,
            param_dtype=torch.float32,
            reduce_dtype=torch.float32,
            cast_root_inputs=False,
            gradient_checkpointing=checkpointing,
        )
        rows = slice(rank * BATCH // world_size, (rank + 1) * BATCH // world_size)
        velocity = family.predict_velocity(model, latents[rows], sigmas[rows], embeds.map(lambda t, rows=rows: t[rows]))
        weights = torch.linspace(-1.0, 1.0, velocity.numel()).reshape(velocity.shape)
        ((velocity * weights).sum() * world_size / BATCH).backward()
        report[checkpointing] = {
            "grads": {n: p.grad.full_tensor().detach().clone() for n, p in model.named_parameters()},
            "attn_calls": len(calls),
        }
    return report


def hybrid_and_plain(rank: int, world_size: int, out_dir: str) -> dict[str, Any]:
    """Two AdamW steps of the block model under plain FSDP2 and under hybrid sharding (2 replicas x 2 shards);
    then the hybrid state saved and loaded into a plain-FSDP2 model (DCP reshards), which takes one more step."""
    report: dict[str, Any] = {}
    save_dir = os.path.join(out_dir, "ckpt")
    hybrid = build_mesh(world_size, 2, "cpu")
    for name, mesh in (("plain", None), ("hybrid", hybrid)):
        model, optimizer, scheduler = build_sharded_trainer(mesh)
        report[name] = {"norms": [train_step(model, optimizer, scheduler, rank, world_size) for _ in range(2)]}
        report[name]["params"] = full_params(model)
        report[name]["mesh_dims"] = next(model.parameters()).device_mesh.ndim
        if name == "hybrid":
            save_checkpoint(save_dir, 0, "actor", model=model, optimizer=optimizer, lr_scheduler=scheduler)
            train_step(model, optimizer, scheduler, rank, world_size)
            report["hybrid_third_step"] = full_params(model)
    model, optimizer, scheduler = build_sharded_trainer(None, seed=5)  # another mesh shape, other weights
    load_checkpoint(save_dir, "actor", model=model, optimizer=optimizer, lr_scheduler=scheduler, rollout_id=0)
    report["resumed_params"] = full_params(model)
    train_step(model, optimizer, scheduler, rank, world_size)
    report["resumed_third_step"] = full_params(model)
    report["accumulation"] = accumulation_all_reduces(rank, world_size)
    report["frozen_digest"] = {
        name: frozen_weights_digest(frozen_model(mesh)) for name, mesh in (("plain", None), ("hybrid", hybrid))
    }
    return report


def frozen_model(mesh: Any) -> nn.Module:
    """The block model with its first block and head frozen (a LoRA base's part), sharded on `mesh`."""
    model = build_model(0)
    for module in (model.blocks[0], model.head):
        module.requires_grad_(False)
    apply_fsdp2(model, list(model.blocks), param_dtype=torch.float32, reduce_dtype=torch.float32, mesh=mesh)
    return model


def counted(function: Any, calls: list) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return function(*args, **kwargs)

    return wrapper


def accumulation_all_reduces(rank: int, world_size: int) -> dict[str, Any]:
    """One window of two micro-batches on the 2 x 2 hybrid mesh: FSDP2's default (an all-reduce across replicas after
    every backward) against `accumulate_gradients` (after the last only): the full gradients and the all-reduces."""
    x, y = fixed_batch()
    x_local, y_local = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
    report: dict[str, Any] = {}
    for name in ("every_backward", "accumulated"):
        model, _, _ = build_sharded_trainer(build_mesh(world_size, 2, "cpu"))
        calls, all_reduce = [], dist.all_reduce
        dist.all_reduce = counted(all_reduce, calls)  # FSDP2 calls `dist.all_reduce` across the replicas
        try:
            for mb in range(2):
                if name == "accumulated":
                    accumulate_gradients(model, mb == 1, world_size=world_size, cpu_offload=False)
                ((model(x_local[mb : mb + 1]) - y_local[mb : mb + 1]) ** 2).sum().backward()
        finally:
            dist.all_reduce = all_reduce
        grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
        report[name] = {"all_reduces": len(calls), "grads": grads}
    return report


def build_sharded_trainer(mesh: Any, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    model = build_model(seed)
    apply_fsdp2(model, list(model.blocks), param_dtype=torch.float32, reduce_dtype=torch.float32, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    return model, optimizer, scheduler


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, rank: int, world_size: int) -> float:
    x, y = fixed_batch()
    x_local, y_local = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
    optimizer.zero_grad()
    (((model(x_local) - y_local) ** 2).mean(dim=1).sum() * world_size / BATCH_ROWS).backward()
    norm = clip_grad_norm_(model.parameters(), MAX_NORM)
    optimizer.step()
    scheduler.step()
    return norm


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


COMPILE_BATCH = 8  # rows over the ranks; the second call takes 6 (3 per rank at dp 2), to show no recompile


def compiled_gradients(rank: int, world_size: int, out_dir: str) -> dict[str, Any]:
    """The shipped tiny SD3 transformer under FSDP2, eager, with `--compile blocks`, and with both `--compile blocks`
    and activation checkpointing: its velocity and full gradients of one backward, its parameter and state-dict
    names, and the recompiles and compile seconds of a second forward and backward with fewer rows."""
    from miles.models.builtin import resolve_checkpoint
    from miles.models.compile import compile_counters

    family = get_train_pipeline_config(resolve_checkpoint("builtin:tiny-shapes"))
    report: dict[str, Any] = {}
    for name, mode, checkpointing in (("eager", "off", False), ("blocks", "blocks", False), ("ac", "blocks", True)):
        model = family.load_transformer()
        gen = torch.Generator().manual_seed(7)
        latents = torch.randn(COMPILE_BATCH, *family.latent_shape(), generator=gen)
        sigmas = torch.rand(COMPILE_BATCH, generator=gen) * 0.9 + 0.05
        embeds = family.encode_prompts([f"{i % 3 + 1} red circles" for i in range(COMPILE_BATCH)])
        apply_fsdp2(
            model,
            family.transformer_blocks(model),
            param_dtype=torch.float32,
            reduce_dtype=torch.float32,
            cast_root_inputs=False,
            gradient_checkpointing=checkpointing,
            compile_mode=mode,
        )
        out = {}
        for call, rows in enumerate((COMPILE_BATCH, COMPILE_BATCH * 3 // 4)):
            mine = slice(rank * rows // world_size, (rank + 1) * rows // world_size)
            model.zero_grad(set_to_none=True)
            velocity = family.predict_velocity(model, latents[mine], sigmas[mine], embeds.rows(mine))
            weights = torch.linspace(-1.0, 1.0, velocity.numel()).reshape(velocity.shape)
            ((velocity * weights).sum() * world_size / rows).backward()
            if call == 0:
                out["velocity"] = velocity.detach().clone()
                out["grads"] = {n: p.grad.full_tensor().detach().clone() for n, p in model.named_parameters()}
                out["after_first"] = compile_counters()
        out["after_second"] = compile_counters()
        out["names"] = [n for n, _ in model.named_parameters()]
        out["keys"] = list(model.state_dict())
        report[name] = out
    return report
