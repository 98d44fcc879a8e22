"""FSDP2 as a step applied to a model: dtype names, `fully_shard` per block then the root (its groups, their
compute dtypes, prefetch and reshard hooks), the mesh, loading full state dicts and gradient clipping over DTensor
grads. Gathering the shards back into full tensors: `miles.backends.fsdp_utils.gather`."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable import checkpoint as checkpoint_activations
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
from torch.distributed.tensor import DTensor

from miles.backends.fsdp_utils.cpu_gathers import gather_one_group_at_a_time
from miles.backends.fsdp_utils.frozen_mlp import lean_frozen_mlps
from miles.backends.fsdp_utils.joint_attention import lean_joint_attention
from miles.models.compile import compile_transformer
from miles.utils.distributed import collective_device

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
    keep_in_fp32: set[str] | None = None,
    compile_mode: str = "off",
    split_blocks: bool = False,
    lean_activations: bool = True,
) -> nn.Module:
    """Shard each block with `fully_shard`, then the root (which picks up the remaining parameters).

    With `split_blocks` each block's children (and the root's) become groups of their own (`_shard_blocks`).

    Needs a default process group (gloo at world size 1 is fine). Gradients are averaged over ranks, so each
    rank's loss should be the mean over its own share of the batch. Returns `model`, now an FSDPModule.

    With `cast_root_inputs=False` the root leaves its inputs as given: the caller casts them to `param_dtype` (recorded
    as `model.compute_dtype`, which `miles.models.base.compute_dtype` reads), so a float timestep can stay fp32 as
    the rollout engines and diffusers pipelines keep it; FSDP2 would round it to bf16 (857 -> 856).

    With `gradient_checkpointing`, `compile_mode`, `lean_activations` the blocks are prepared first (`_prepare_blocks`).

    With `cpu_offload` (FSDP2's `CPUOffloadPolicy`) sharded parameters, gradients and optimizer state live in CPU
    memory and each group is copied to the GPU for its forward and backward. `mesh` (from `build_mesh`) shards within
    its last dimension and replicates across the first (hybrid sharding); None shards over every rank.

    At world size 1 the one rank holds every shard, so per-block groups would only add a gather, a reduce and
    Python hooks per block and micro-batch: the whole model becomes one root group instead.

    The forward computes what the engines' `from_pretrained(dtype=param_dtype)` modules compute: blocks receive
    their inputs uncast (FLUX's and Wan's fp32 rotary embeddings stay fp32), persistent float buffers are held in
    `param_dtype` as diffusers loads them, and the parameters named in `keep_in_fp32` (default
    `keep_in_fp32_names(model)`, read from the model's `_keep_in_fp32_modules`) are computed in fp32 (`_GroupSharder`).
    """
    if not dist.is_initialized():
        raise RuntimeError("apply_fsdp2 needs a process group; call miles.utils.distributed.init_process_group first")
    _prepare_blocks(model, blocks, gradient_checkpointing, compile_mode, lean_activations)
    keep = keep_in_fp32_names(model) if keep_in_fp32 is None else set(keep_in_fp32)
    cast_buffers_as_loaded(model, param_dtype, keep)
    if dist.get_world_size() == 1 and not cpu_offload:  # offloading still moves one block at a time
        blocks = []
    placement = {"mesh": mesh, "offload_policy": CPUOffloadPolicy() if cpu_offload else OffloadPolicy()}
    sharder = _GroupSharder(model, keep, param_dtype, reduce_dtype, placement, reshard_after_forward)
    split = split_blocks and compile_mode == "off"
    _shard_blocks(sharder, blocks, split, gradient_checkpointing, reshard_after_forward)
    # The root keeps torch's default (no reshard after forward): its parameters are needed again first in backward.
    sharder.shard_with_parts(model, cast_root_inputs)
    model.compute_dtype = param_dtype  # type: ignore[assignment]  # torch types Module.__setattr__ Tensor | Module; any value is stored
    if collective_device().type == "cpu":
        gather_one_group_at_a_time(model)
    sharder.report(len(blocks), gradient_checkpointing)
    return model


def _prepare_blocks(
    model: nn.Module, blocks: list[nn.Module], checkpointing: bool, compile_mode: str, lean: bool
) -> None:
    """The blocks before `fully_shard`, in torchtitan's order.

    Without checkpointing or compiling, `lean` (`lean_activations`) blocks keep less for backward, same numbers:
    frozen GELU MLPs their input, not their 4x-wide hidden activation (`frozen_mlp.py`), SD3's joint attention its
    output once, not twice (`joint_attention.py`).

    With `checkpointing` each block keeps only its inputs in forward and recomputes its activations in
    backward, applied before `fully_shard` as torchtitan does (composable, so parameter names do not change).

    With `compile_mode` (`--compile`, `miles.models.compile.compile_transformer`) the blocks (or the whole model) are
    compiled in place after activation checkpointing and before `fully_shard`, as torchtitan orders them: FSDP2's
    gathers run around each compiled block, and the names FSDP2 and the checkpoints see do not change.
    """
    if checkpointing:
        for block in blocks:
            checkpoint_activations(block)
    elif lean and compile_mode == "off":
        for block in blocks:
            lean_frozen_mlps(block)
            lean_joint_attention(block)
    compile_transformer(model, blocks, compile_mode)


def _shard_blocks(
    sharder: _GroupSharder,
    blocks: list[nn.Module],
    split: bool,
    gradient_checkpointing: bool,
    reshard_after_forward: bool,
) -> None:
    """Each block its own group (with its parts of the other compute dtype before it).

    With `split` (`split_blocks`) each block's children (SD3's `norm1`, `attn`, `ff`, ...) become groups of their own
    before the block: a LoRA network's frozen base is gathered a child at a time instead of a block at a time, so the
    gathered parameters and FSDP2's flat all-gather buffer beside them (each a whole block otherwise, 150 MB in fp32
    for a 1024-wide SD3 block) are the largest child's (34 MB). The values gathered and reduced are the same. With
    `gradient_checkpointing` too, a child recomputed in backward gives its parameters back after its recomputed
    forward and gathers them again for its own backward (FSDP2 keeps them gathered from the recompute on, which holds
    the whole block). Not with `compile_mode`: a compiled block keeps one group, whose gathers run around it.

    With `split` the root's children outside the blocks (SD3's `pos_embed`, `time_text_embed`, `context_embedder`,
    `norm_out`, `proj_out`) become groups too: FSDP2 keeps the root group gathered from the forward's start to the end
    of backward, which held the input embedders (a frozen base never needs them in backward) and the output head
    through every block's backward (17.7 MiB for a 1024-wide SD3). Now the embedders are freed after their forward
    and the head after its own backward. The root keeps its own parameters (Wan's `scale_shift_table`).
    """
    for block in blocks:
        prefix = next(name for name, m in sharder.model.named_modules() if m is block)
        for _, child in _forward_children(block, prefix) if split else ():
            if next(child.parameters(), None) is not None:
                sharder.shard_with_parts(child, False, reshard_after_forward=reshard_after_forward)
                if gradient_checkpointing:
                    child.register_forward_hook(_reshard_when_recomputed)
        sharder.shard_with_parts(block, False, reshard_after_forward=reshard_after_forward)
    held = {id(m) for block in blocks for m in block.modules()}
    for _, child in _forward_children(sharder.model, "") if split and blocks else ():
        mine = {id(p) for p in child.parameters()}  # shard it unless it holds a block or every parameter is in a group
        free = [n for n, p in sharder.model.named_parameters() if id(p) in mine and n not in sharder.computed_in]
        if free and not any(id(m) in held for m in child.modules()):
            sharder.shard_with_parts(child, False, reshard_after_forward=reshard_after_forward)


def _reshard_when_recomputed(module: nn.Module, args: Any, output: Any) -> None:
    """A forward hook of a block's child (`split_blocks` with activation checkpointing): after a forward run inside
    backward (the block's recompute), free its gathered parameters; the pre-backward hook FSDP2 puts on the output
    gathers them again for the child's own backward. Not a child gathered for its backward already (the one whose
    saved tensors started the recompute), which FSDP2 reshards after that backward."""
    in_backward = torch._C._current_graph_task_id() != -1  # FSDP2's own test (`is_bw`)
    sharded = cast(FSDPModule, module)  # the hook is registered on a child `fully_shard` made an FSDPModule
    if in_backward and sharded._get_fsdp_state()._training_state != TrainingState.PRE_BACKWARD:
        sharded.reshard()


class _GroupSharder:
    """`fully_shard` of one module after another, each group over the parameters no earlier group took, computed in
    one dtype (`_group_param_dtype`); remembers each parameter's compute dtype by name, as `fully_shard` replaces the
    parameter objects. Split-off parts reshard after forward as `parts_reshard_after_forward`.

    A group computes in one dtype (FSDP2 also reduces one gradient dtype per group), so a block or root that mixes
    both kinds is split (`_fp32_split`): its children of the other kind than its own parameters become groups first
    (Wan's block: `attn1`, `attn2`, `ffn` in `param_dtype`, the block's own group `scale_shift_table` and `norm2` in
    fp32). A group whose parameters are all stored in their forward dtypes already (a frozen network loaded with
    `from_pretrained(dtype=param_dtype)`) is gathered as stored, unsplit."""

    def __init__(
        self,
        model: nn.Module,
        keep: set[str],
        param_dtype: torch.dtype,
        reduce_dtype: torch.dtype,
        placement: dict[str, Any],
        parts_reshard_after_forward: bool,
    ) -> None:
        self.model, self.keep, self.param_dtype, self.reduce_dtype = model, keep, param_dtype, reduce_dtype
        self.placement, self.parts_reshard_after_forward = placement, parts_reshard_after_forward
        self.computed_in: dict[str, torch.dtype] = {}
        self.groups = 0

    def shard(self, module: nn.Module, cast_inputs: bool, **kwargs: Any) -> None:
        names = {id(p): name for name, p in self.model.named_parameters()}
        params = [p for p in module.parameters() if names[id(p)] not in self.computed_in]  # not in an earlier group
        dtype = _group_param_dtype(params, [names[id(p)] in self.keep for p in params], self.param_dtype)
        policy = MixedPrecisionPolicy(
            param_dtype=dtype, reduce_dtype=self.reduce_dtype, cast_forward_inputs=cast_inputs
        )
        fully_shard(module, mp_policy=policy, **kwargs, **self.placement)
        self.computed_in.update((names[id(p)], dtype or p.dtype) for p in params)
        self.groups += 1

    def shard_with_parts(self, module: nn.Module, cast_inputs: bool, **kwargs: Any) -> None:
        """The module's children of the other compute dtype first (`_fp32_split`), each its own group, then the
        module."""
        remaining = {name: p for name, p in self.model.named_parameters() if name not in self.computed_in}
        prefix = next(name for name, m in self.model.named_modules() if m is module)
        for part in _fp32_split(module, prefix, remaining, self.keep, self.param_dtype):
            self.shard(part, False, reshard_after_forward=self.parts_reshard_after_forward)
        self.shard(module, cast_inputs, **kwargs)

    def report(self, blocks: int, gradient_checkpointing: bool) -> None:
        """Log the groups, and warn about parameters diffusers keeps in fp32 that a group computes in another dtype."""
        logger.info(
            "FSDP2 applied: %d groups (%d blocks), param_dtype=%s, reduce_dtype=%s, activation checkpointing %s",
            self.groups,
            blocks,
            self.param_dtype,
            self.reduce_dtype,
            gradient_checkpointing,
        )
        rounded = sorted(n for n, dtype in self.computed_in.items() if n in self.keep and dtype != torch.float32)
        if rounded:
            logger.warning(
                "%d parameters diffusers keeps in fp32 are computed in %s: each sits directly on a module with %s "
                "ones, and FSDP2 computes a group in one dtype: %s",
                len(rounded),
                self.param_dtype,
                self.param_dtype,
                ", ".join(rounded),
            )


def keep_in_fp32_names(model: nn.Module) -> set[str]:
    """Names of the parameters and buffers diffusers' `from_pretrained(dtype=...)` keeps in float32: those with a
    dotted component in the `_keep_in_fp32_modules` of a model holding them (diffusers' loader rule; Wan's
    `scale_shift_table`, `time_embedder`, `norm2`, ...). Empty for models without that list."""
    names: set[str] = set()
    for prefix, module in model.named_modules():
        kept = getattr(module, "_keep_in_fp32_modules", None) or ()
        kept = {kept} if isinstance(kept, str) else set(kept)
        if not kept:
            continue
        for name, _ in (*module.named_parameters(), *module.named_buffers()):
            if kept.intersection(name.split(".")):
                names.add(f"{prefix}.{name}" if prefix else name)
    return names


def cast_buffers_as_loaded(model: nn.Module, dtype: torch.dtype | None, keep: set[str]) -> None:
    """Hold each float buffer in the dtype `from_pretrained(dtype=dtype)` gives it: persistent buffers (state dict
    entries, such as SD3's `pos_embed`) in `dtype` unless named in `keep`; non-persistent ones as the model built
    them (Wan's rotary tables stay fp32). No-op for `dtype` None."""
    if dtype is None:
        return
    for prefix, module in model.named_modules():
        for name, buffer in module._buffers.items():
            full = f"{prefix}.{name}" if prefix else name
            if (
                buffer is not None
                and buffer.is_floating_point()
                and name not in module._non_persistent_buffers_set
                and full not in keep
            ):
                module._buffers[name] = buffer.to(dtype)


def _fp32_split(
    module: nn.Module,
    prefix: str,
    remaining: dict[str, nn.Parameter],
    keep: set[str],
    param_dtype: torch.dtype | None,
) -> list[nn.Module]:
    """The submodules to shard, in this order, before `module` so that every group holds parameters of one forward
    dtype (all in `keep`, or none): the children of the other kind than `module`'s own parameters, each split in
    turn when it mixes both. Wan's block: `attn1`, `attn2`, `ffn` (`param_dtype`), the block keeping
    `scale_shift_table` and `norm2` (fp32). Empty when one policy computes the whole of `module` exactly (no kept
    parameter, all kept, or all stored in their forward dtypes already); `remaining`: the parameters by name that no
    earlier group holds."""

    def under(path: str) -> list[str]:
        return [name for name in remaining if not path or name.startswith(path + ".")]

    names = under(prefix)
    if _one_policy_is_exact([remaining[n] for n in names], [n in keep for n in names], param_dtype):
        return []
    own = {n in keep for n in names if n.rpartition(".")[0] == prefix}
    named = _forward_children(module, prefix)
    children = [(path, child, {n in keep for n in under(path)}) for path, child in named if under(path)]
    if len(own) > 1:
        return []  # kept and other parameters directly on `module`: no split makes its group exact
    if own:
        kind = own.pop()
    else:  # no parameter of its own: it keeps the kind of most of its children (fewer groups)
        kind = sum(kinds == {True} for *_, kinds in children) > sum(kinds == {False} for *_, kinds in children)
    parts: list[nn.Module] = []
    for path, child, kinds in children:
        if kinds != {kind}:
            parts += [*_fp32_split(child, path, remaining, keep, param_dtype), child]
    return parts


def _forward_children(module: nn.Module, prefix: str) -> list[tuple[str, nn.Module]]:
    """(name, child) of `module`'s children, the modules of a ModuleList / ModuleDict in its place (a container
    without forward, which `fully_shard` refuses)."""
    out = []
    for name, child in module.named_children():
        path = f"{prefix}.{name}" if prefix else name
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            out += _forward_children(child, path)
        else:
            out.append((path, child))
    return out


def _group_param_dtype(
    params: list[nn.Parameter], kept: list[bool], param_dtype: torch.dtype | None
) -> torch.dtype | None:
    """The `param_dtype` of one group's policy: fp32 when all its parameters are kept in fp32; None (each gathered
    as stored) when every float one is stored in its forward dtype already, fp32 for a kept one and `param_dtype` for
    the others; else `param_dtype`."""
    floats = [(p, k) for p, k in zip(params, kept) if p.is_floating_point()]
    if floats and all(k for _, k in floats):
        return torch.float32
    if param_dtype is None or all(p.dtype == (torch.float32 if k else param_dtype) for p, k in floats):
        return None
    return param_dtype


def _one_policy_is_exact(params: list[nn.Parameter], kept: list[bool], param_dtype: torch.dtype | None) -> bool:
    """Whether one group's policy gives each float parameter its forward dtype (fp32 if kept, else `param_dtype`):
    all kept, none kept, or all stored in those dtypes already with the trained ones in one dtype (FSDP2 keeps one
    original dtype per group)."""
    floats = [(p, k) for p, k in zip(params, kept) if p.is_floating_point()]
    if all(k for _, k in floats) or not any(k for _, k in floats):
        return True
    as_stored = all(p.dtype == (torch.float32 if k else param_dtype or p.dtype) for p, k in floats)
    return as_stored and len({p.dtype for p, _ in floats if p.requires_grad}) <= 1


def build_mesh(world_size: int, shard_size: int | None, device_type: str) -> DeviceMesh | None:
    """The 2-D (replicate, shard) mesh of hybrid sharding: ranks [i*N, (i+1)*N) shard one copy of the model, the
    copies replicate (gradients all-reduced across them). None (plain FSDP2 over every rank) when N is the world."""
    if shard_size is None or shard_size == world_size:
        return None
    if world_size % shard_size != 0:
        raise ValueError(f"--fsdp-shard-size {shard_size} must divide the world size {world_size}")
    return init_device_mesh(device_type, (world_size // shard_size, shard_size), mesh_dim_names=("replicate", "shard"))


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
    # Shard(0) grads: the local shards' squared norms add up to the full one (local tensors: no DTensor dispatch)
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
