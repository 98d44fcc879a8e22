"""FSDP2 as a step applied to a model: dtype names, `fully_shard` per block then the root, full state dicts,
and gradient clipping over DTensor grads."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
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
) -> nn.Module:
    """Shard each block with `fully_shard`, then the root (which picks up the remaining parameters).

    Needs a default process group (gloo at world size 1 is fine). Gradients are averaged over ranks, so each
    rank's loss should be the mean over its own share of the batch. Returns `model`, now an FSDPModule.

    With `cast_root_inputs=False` the root leaves its inputs as given: the caller casts them to `param_dtype` (recorded
    as `model.compute_dtype`, which `miles.models.base.compute_dtype` reads), so a float timestep can stay fp32 as
    the rollout engines and diffusers pipelines keep it; FSDP2 would round it to bf16 (857 -> 856).

    At world size 1 the one rank holds every shard, so per-block groups would only add a gather, a reduce and
    Python hooks per block and micro-batch: the whole model becomes one root group instead.
    """
    if not dist.is_initialized():
        raise RuntimeError("apply_fsdp2 needs a process group; call miles.utils.distributed.init_process_group first")
    if dist.get_world_size() == 1:
        blocks = []
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for block in blocks:
        fully_shard(block, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)
    # The root keeps torch's default (no reshard after forward): its parameters are needed again first in backward.
    root_policy = MixedPrecisionPolicy(
        param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=cast_root_inputs
    )
    fully_shard(model, mp_policy=root_policy)
    model.compute_dtype = param_dtype
    logger.info(
        "FSDP2 applied: %d block groups + root, param_dtype=%s, reduce_dtype=%s", len(blocks), param_dtype, reduce_dtype
    )
    return model


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
        dist.all_reduce(squares)
    total_norm = float(squares.sqrt().item())
    clip_coef = max_norm / (total_norm + 1e-6)
    if clip_coef < 1.0:
        torch._foreach_mul_(local, clip_coef)
    return total_norm
