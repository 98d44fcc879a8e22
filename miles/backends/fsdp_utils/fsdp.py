"""FSDP2 as a step applied to a model: dtype names, `fully_shard` per block then the root, full state dicts,
and gradient clipping over DTensor grads."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable import checkpoint as checkpoint_activations
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

logger = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


def parse_dtype(name: str) -> torch.dtype:
    """`"bf16"` -> `torch.bfloat16`; an unknown name raises with the list of valid ones."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; valid names: {', '.join(DTYPES)}") from None


def apply_fsdp2(
    model: nn.Module,
    blocks: list[nn.Module],
    *,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_after_forward: bool = True,
    cast_root_inputs: bool = True,
    gradient_checkpointing: bool = False,
    cpu_offload: bool = False,
    mesh: DeviceMesh | None = None,
) -> nn.Module:
    """Shard each block with `fully_shard`, then the root (which picks up the remaining parameters).

    Needs a default process group (gloo at world size 1 is fine). Gradients are averaged over ranks, so each
    rank's loss should be the mean over its own share of the batch. Returns `model`, now an FSDPModule.

    With `cast_root_inputs=False` the root leaves its inputs as given: the caller casts them to `param_dtype` (recorded
    as `model.compute_dtype`, which `miles.models.base.compute_dtype` reads), so a float timestep can stay fp32 as
    the rollout engines and diffusers pipelines keep it; FSDP2 would round it to bf16 (857 -> 856).

    With `gradient_checkpointing` each block keeps only its inputs in forward and recomputes its activations in
    backward, applied before `fully_shard` as torchtitan does (composable, so parameter names do not change).

    With `cpu_offload` (FSDP2's `CPUOffloadPolicy`) sharded parameters, gradients and optimizer state live in CPU
    memory and each group is copied to the GPU for its forward and backward. `mesh` (from `build_mesh`) shards within
    its last dimension and replicates across the first (hybrid sharding); None shards over every rank.

    At world size 1 the one rank holds every shard, so per-block groups would only add a gather, a reduce and
    Python hooks per block and micro-batch: the whole model becomes one root group instead.
    """
    if not dist.is_initialized():
        raise RuntimeError("apply_fsdp2 needs a process group; call miles.utils.distributed.init_process_group first")
    if gradient_checkpointing:
        for block in blocks:
            checkpoint_activations(block)
    if dist.get_world_size() == 1 and not cpu_offload:  # offloading still moves one block at a time
        blocks = []
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    placement = {"mesh": mesh, "offload_policy": CPUOffloadPolicy() if cpu_offload else OffloadPolicy()}
    for block in blocks:
        fully_shard(block, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward, **placement)
    # The root keeps torch's default (no reshard after forward): its parameters are needed again first in backward.
    root_policy = MixedPrecisionPolicy(
        param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=cast_root_inputs
    )
    fully_shard(model, mp_policy=root_policy, **placement)
    model.compute_dtype = param_dtype
    logger.info(
        "FSDP2 applied: %d block groups + root, param_dtype=%s, reduce_dtype=%s, activation checkpointing %s",
        len(blocks),
        param_dtype,
        reduce_dtype,
        gradient_checkpointing,
    )
    return model


def build_mesh(world_size: int, shard_size: int | None, device_type: str) -> DeviceMesh | None:
    """The 2-D (replicate, shard) mesh of hybrid sharding: ranks [i*N, (i+1)*N) shard one copy of the model, the
    copies replicate (gradients all-reduced across them). None (plain FSDP2 over every rank) when N is the world."""
    if shard_size is None or shard_size == world_size:
        return None
    if world_size % shard_size != 0:
        raise ValueError(f"--fsdp-shard-size {shard_size} must divide the world size {world_size}")
    return init_device_mesh(device_type, (world_size // shard_size, shard_size), mesh_dim_names=("replicate", "shard"))


def full_state_dict(model: nn.Module, *, cpu_offload: bool = True) -> dict[str, torch.Tensor]:
    """Gather the sharded parameters into full tensors (collective: every rank must call it).

    With `cpu_offload=True` only rank 0 receives the dict (on CPU; other ranks get `{}`), which is what
    `--save-hf` and weight export need. With `cpu_offload=False` every rank receives full tensors on the
    parameters' device.
    """
    options = StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload)
    return get_model_state_dict(model, options=options)


def load_full_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Load full (unsharded) tensors into an FSDP2 model (collective).

    Only rank 0's `state_dict` is read (it is broadcast and each rank keeps its shard); other ranks may pass
    `{}`. The caller's dict is left untouched: torch replaces the entries of the dict it is given by DTensors.
    """
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, dict(state_dict), options=options)


def clip_grad_norm_(params: Iterable[torch.Tensor], max_norm: float) -> float:
    """Clip gradients in place to total L2 norm `max_norm`; returns the norm before clipping as a float.

    Works on DTensor (sharded) gradients: the norm is reduced over all shards, so it equals the norm of the
    full gradient on every rank (collective when grads are DTensors).
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    # FSDP2 shards every gradient along dim 0 (Shard(0)): the squared norms of the local shards add up to the full
    # one. Working on the local tensors skips a DTensor dispatch per op; they share storage with the grads.
    sharded = any(isinstance(g, DTensor) for g in grads)
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    squares = torch.stack([n.float() for n in torch._foreach_norm(local, 2.0)]).pow(2).sum()
    if sharded and dist.is_initialized() and dist.get_world_size() > 1:
        # over the ranks that hold different shards: with hybrid sharding the copies across replicas are equal
        mesh = next(g for g in grads if isinstance(g, DTensor)).device_mesh
        dist.all_reduce(squares, group=mesh.get_group("shard") if mesh.ndim > 1 else None)
    total_norm = float(squares.sqrt().item())
    clip_coef = max_norm / (total_norm + 1e-6)
    if clip_coef < 1.0:
        torch._foreach_mul_(local, clip_coef)
    return total_norm
