"""FSDP2 as a step applied to a model: dtype names, `fully_shard` per block then the root, full state dicts,
and gradient clipping over DTensor grads."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable import checkpoint as checkpoint_activations
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
from torch.distributed.tensor import DTensor

from miles.models.compile import compile_transformer
from miles.utils.distributed import collective_device
from miles.utils.weight_checksum import TensorChecksum, build_checksums, checksum_terms, tensor_checksums

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
) -> nn.Module:
    """Shard each block with `fully_shard`, then the root (which picks up the remaining parameters).

    With `split_blocks` each block's children (SD3's `norm1`, `attn`, `ff`, ...) become groups of their own before
    the block: a LoRA network's frozen base is gathered a child at a time instead of a block at a time, so the
    gathered parameters and FSDP2's flat all-gather buffer beside them (each a whole block otherwise, 150 MB in fp32
    for a 1024-wide SD3 block) are the largest child's (34 MB). The values gathered and reduced are the same. With
    `gradient_checkpointing` too, a child recomputed in backward gives its parameters back after its recomputed
    forward and gathers them again for its own backward (FSDP2 keeps them gathered from the recompute on, which holds
    the whole block). Not with `compile_mode`: a compiled block keeps one group, whose gathers run around it.

    On gloo (CPU) ranks no group prefetches the next one's gather in backward (`no_backward_prefetch`): without
    streams nothing overlaps it, so it would only hold a second gathered group.

    Needs a default process group (gloo at world size 1 is fine). Gradients are averaged over ranks, so each
    rank's loss should be the mean over its own share of the batch. Returns `model`, now an FSDPModule.

    With `cast_root_inputs=False` the root leaves its inputs as given: the caller casts them to `param_dtype` (recorded
    as `model.compute_dtype`, which `miles.models.base.compute_dtype` reads), so a float timestep can stay fp32 as
    the rollout engines and diffusers pipelines keep it; FSDP2 would round it to bf16 (857 -> 856).

    With `gradient_checkpointing` each block keeps only its inputs in forward and recomputes its activations in
    backward, applied before `fully_shard` as torchtitan does (composable, so parameter names do not change).

    With `compile_mode` (`--compile`, `miles.models.compile.compile_transformer`) the blocks (or the whole model) are
    compiled in place after activation checkpointing and before `fully_shard`, as torchtitan orders them: FSDP2's
    gathers run around each compiled block, and the names FSDP2 and the checkpoints see do not change.

    With `cpu_offload` (FSDP2's `CPUOffloadPolicy`) sharded parameters, gradients and optimizer state live in CPU
    memory and each group is copied to the GPU for its forward and backward. `mesh` (from `build_mesh`) shards within
    its last dimension and replicates across the first (hybrid sharding); None shards over every rank.

    At world size 1 the one rank holds every shard, so per-block groups would only add a gather, a reduce and
    Python hooks per block and micro-batch: the whole model becomes one root group instead.

    The forward computes what the engines' `from_pretrained(dtype=param_dtype)` modules compute: blocks receive
    their inputs uncast (FLUX's and Wan's fp32 rotary embeddings stay fp32), persistent float buffers are held in
    `param_dtype` as diffusers loads them, and the parameters named in `keep_in_fp32` (default
    `keep_in_fp32_names(model)`, read from the model's `_keep_in_fp32_modules`) are computed in fp32. A group
    computes in one dtype (FSDP2 also reduces one gradient dtype per group), so a block or root that mixes both
    kinds is split (`_fp32_split`): its children of the other kind than its own parameters become groups first
    (Wan's block: `attn1`, `attn2`, `ffn` in `param_dtype`, the block's own group `scale_shift_table` and `norm2` in
    fp32). A group whose parameters are all stored in their forward dtypes already (a frozen network loaded with
    `from_pretrained(dtype=param_dtype)`) is gathered as stored, unsplit.
    """
    if not dist.is_initialized():
        raise RuntimeError("apply_fsdp2 needs a process group; call miles.utils.distributed.init_process_group first")
    if gradient_checkpointing:
        for block in blocks:
            checkpoint_activations(block)
    compile_transformer(model, blocks, compile_mode)
    keep = keep_in_fp32_names(model) if keep_in_fp32 is None else set(keep_in_fp32)
    cast_buffers_as_loaded(model, param_dtype, keep)
    if dist.get_world_size() == 1 and not cpu_offload:  # offloading still moves one block at a time
        blocks = []
    placement = {"mesh": mesh, "offload_policy": CPUOffloadPolicy() if cpu_offload else OffloadPolicy()}
    sharder = _GroupSharder(model, keep, param_dtype, reduce_dtype, placement, reshard_after_forward)
    for block in blocks:
        prefix = next(name for name, m in model.named_modules() if m is block)
        for _, child in _forward_children(block, prefix) if split_blocks and compile_mode == "off" else ():
            if next(child.parameters(), None) is not None:
                sharder.shard_with_parts(child, False, reshard_after_forward=reshard_after_forward)
                if gradient_checkpointing:
                    child.register_forward_hook(_reshard_when_recomputed)
        sharder.shard_with_parts(block, False, reshard_after_forward=reshard_after_forward)
    # The root keeps torch's default (no reshard after forward): its parameters are needed again first in backward.
    sharder.shard_with_parts(model, cast_root_inputs)
    model.compute_dtype = param_dtype
    if collective_device().type == "cpu":
        no_backward_prefetch(model)
    sharder.report(len(blocks), gradient_checkpointing)
    return model


def _reshard_when_recomputed(module: nn.Module, args: Any, output: Any) -> None:
    """A forward hook of a block's child (`split_blocks` with activation checkpointing): after a forward run inside
    backward (the block's recompute), free its gathered parameters; the pre-backward hook FSDP2 puts on the output
    gathers them again for the child's own backward. Not a child gathered for its backward already (the one whose
    saved tensors started the recompute), which FSDP2 reshards after that backward."""
    in_backward = torch._C._current_graph_task_id() != -1  # FSDP2's own test (`is_bw`)
    if in_backward and module._get_fsdp_state()._training_state != TrainingState.PRE_BACKWARD:
        module.reshard()


def no_backward_prefetch(model: nn.Module) -> None:
    """No FSDP2 group of `model` gathers the next group's parameters ahead in backward (FSDP2 prefetches one by
    default, which overlaps on CUDA streams only): each names itself as the one to prefetch, already gathered when
    its backward starts, which replaces the default and gathers nothing more."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_modules_to_backward_prefetch([module])


class _GroupSharder:
    """`fully_shard` of one module after another, each group over the parameters no earlier group took, computed in
    one dtype (`_group_param_dtype`); remembers each parameter's compute dtype by name, as `fully_shard` replaces the
    parameter objects. Split-off parts reshard after forward as `parts_reshard_after_forward`."""

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
    children = _forward_children(module, prefix)
    children = [(path, child, {n in keep for n in under(path)}) for path, child in children if under(path)]
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


def full_state_dict(
    model: nn.Module,
    *,
    cpu_offload: bool = True,
    keep: Callable[[str], bool] | None = None,
    as_dtype: Callable[[str], torch.dtype | None] | None = None,
    checksums: dict[str, TensorChecksum] | None = None,
) -> dict[str, torch.Tensor]:
    """Gather the sharded parameters into full tensors (collective: every rank must call it).

    With `cpu_offload=True` only rank 0 receives the dict (on CPU; other ranks get `{}`), which is what
    `--save-hf` and weight export need; it is gathered in flat buckets (`bucketed_full_state_dict`). With
    `cpu_offload=False` every rank receives full tensors on the parameters' device.

    `keep(name)` picks the entries to gather (e.g. only a LoRA adapter's); the others cost no collective. Every rank
    must pass the same filter: ranks that keep different names issue different collectives. `as_dtype(name)`: the
    dtype a floating entry is cast to on its device before it is gathered (None: as stored; with the rank-0 gather
    only), e.g. the engines' forward dtype, so that half the bytes leave the device. `checksums`: a dict that the
    ranks receiving the tensors fill with each one's `TensorChecksum` (the weight sync's; on the device where the
    bucketed gather has it, before it moves to the CPU).
    """
    if cpu_offload and dist.is_initialized():
        return bucketed_full_state_dict(model, keep=keep, as_dtype=as_dtype, checksums=checksums)
    if keep is not None and not cpu_offload:
        # per tensor, as `get_model_state_dict` gathers (it has no filter and would gather every tensor)
        state = model.state_dict()
        state = {name: _full_tensor(value) for name, value in state.items() if keep(name)}
    else:
        options = StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload)
        state = get_model_state_dict(model, options=options)
        state = state if keep is None else {name: value for name, value in state.items() if keep(name)}
    if checksums is not None:
        checksums.update(tensor_checksums(state))
    return state


# Bytes each rank sends per all-gather (a bucket closes once it reaches them; also about the extra memory a gather
# takes), by collective device: small on gloo, where merging small tensors saves per-call cost but large copied
# buckets lose; large on NCCL, one big collective per bucket. Measurements: docs/user-guide/performance.md
# ("Weight sync at dp >= 2").
GATHER_BUCKET_BYTES = {"cpu": 4 << 20, "cuda": 128 << 20}


@dataclass(frozen=True)
class ShardLayout:
    """Where a tensor's dim-0 shards live, read from the mesh's global metadata: the mesh's shape, its global ranks
    (row-major), its dim names and the mesh dim that shards. Equal on every rank for a mesh over the whole world
    (FSDP2's default, `build_mesh`'s); not Python object identity, which differs per `fully_shard` call and rank."""

    shape: tuple[int, ...]
    ranks: tuple[int, ...]
    dim_names: tuple[str, ...] | None
    shard_dim: int

    @property
    def group_size(self) -> int:
        return self.shape[self.shard_dim]


@dataclass(frozen=True)
class GatherEntry:
    """What the gather plan reads of one state-dict tensor: global metadata only, the same on every rank."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    layout: ShardLayout | None  # None: not a dim-0 shard (a buffer, another placement), gathered on its own


@dataclass(frozen=True)
class GatherBucket:
    """One collective of the plan: tensors gathered together, and the bytes each rank of the shard group sends (0
    for a tensor gathered on its own, `layout` None)."""

    names: tuple[str, ...]
    nbytes: int
    layout: ShardLayout | None


def _dim0_shard_dim(value: torch.Tensor) -> int | None:
    """The mesh dim that shards `value` when it is a DTensor sharded along tensor dim 0 on exactly one mesh dim and
    replicated on the others (FSDP2's layout, hybrid sharding included); else None."""
    if not isinstance(value, DTensor):
        return None
    shards = [i for i, p in enumerate(value.placements) if p.is_shard()]
    if len(shards) != 1 or not value.placements[shards[0]].is_shard(0):
        return None
    if not all(p.is_replicate() for i, p in enumerate(value.placements) if i != shards[0]):
        return None
    return shards[0]


def gather_entries(
    state: Mapping[str, torch.Tensor],
    keep: Callable[[str], bool] | None = None,
    as_dtype: Callable[[str], torch.dtype | None] | None = None,
) -> list[GatherEntry]:
    """The plan's inputs for a (sharded) state dict, in its order, only the names `keep` accepts; each floating
    entry's dtype is the one it is sent in (`as_dtype(name)`, when given and not None)."""
    layouts: dict[tuple[int, int], ShardLayout] = {}  # by mesh object: `DeviceMesh.mesh` is rebuilt on every read
    entries = []
    for name, value in state.items():
        if keep is not None and not keep(name):
            continue
        dim, layout = _dim0_shard_dim(value), None
        if dim is not None:
            mesh = value.device_mesh
            layout = layouts.get((id(mesh), dim))
            if layout is None:
                names = tuple(mesh.mesh_dim_names) if mesh.mesh_dim_names is not None else None
                layout = ShardLayout(tuple(mesh.mesh.shape), tuple(mesh.mesh.flatten().tolist()), names, dim)
                layouts[(id(mesh), dim)] = layout
        dtype = as_dtype(name) if as_dtype is not None and value.is_floating_point() else None
        entries.append(GatherEntry(name, tuple(value.shape), dtype or value.dtype, layout))
    return entries


def padded_shard_bytes(shape: tuple[int, ...], dtype: torch.dtype, group_size: int) -> int:
    """Bytes one rank sends for a dim-0 sharded tensor: FSDP2 splits dim 0 as `torch.chunk` does (ceil(rows / N)
    rows, the last ranks' shards shorter or empty), and every rank pads its shard to that largest one."""
    rows, row = shape[0], math.prod(shape[1:])
    return -(-rows // group_size) * row * dtype.itemsize


def gather_plan(entries: Sequence[GatherEntry], bucket_bytes: int) -> list[GatherBucket]:
    """Cut the entries, in order, into the collectives of `bucketed_full_state_dict`.

    A bucket holds consecutive dim-0 shards of one dtype and layout and closes once its padded bytes reach
    `bucket_bytes` (so it goes over by at most one tensor); any other tensor is a step on its own. Pure over global
    metadata: every rank of a shard group computes the same plan and sends the same bytes per bucket. Sizing a bucket
    by a rank's own (unpadded) shard would close it at different tensors on different ranks wherever dim 0 does not
    divide the group (Wan's (1, 6, D) table, LoRA A with rank < dp): mismatched all-gathers, a gloo abort or an
    NCCL hang.
    """
    plan: list[GatherBucket] = []
    names: list[str] = []
    key: tuple | None = None  # what a bucket's tensors share: dtype and layout
    size = 0
    for entry in entries:
        this = None if entry.layout is None else (entry.dtype, entry.layout)
        if names and (this != key or size >= bucket_bytes):
            plan.append(GatherBucket(tuple(names), size, key[1]))
            names, size = [], 0
        if this is None:
            plan.append(GatherBucket((entry.name,), 0, None))
            continue
        key = this
        names.append(entry.name)
        size += padded_shard_bytes(entry.shape, entry.dtype, entry.layout.group_size)
    if names:
        plan.append(GatherBucket(tuple(names), size, key[1]))
    return plan


def bucketed_full_state_dict(
    model: nn.Module,
    *,
    bucket_bytes: int | None = None,
    keep: Callable[[str], bool] | None = None,
    as_dtype: Callable[[str], torch.dtype | None] | None = None,
    checksums: dict[str, TensorChecksum] | None = None,
) -> dict[str, torch.Tensor]:
    """`full_state_dict(model)` on rank 0 (CPU tensors, the state dict's order; `{}` elsewhere), bit-identical, with
    one all-gather per bucket of consecutive parameters instead of one per tensor (collective).

    The tensors of `gathered_tensors` (same arguments), each joined on the CPU. `checksums`: filled on rank 0 with
    each returned tensor's checksum, computed on the collective device over the gathered pieces.
    """
    out: dict[str, torch.Tensor] = {}
    terms: dict[str, torch.Tensor] = {}
    want = checksums is not None
    for name, shape, pieces, term in gathered_tensors(
        model, bucket_bytes=bucket_bytes, keep=keep, as_dtype=as_dtype, checksums=want
    ):
        pieces = [piece.cpu() for piece in pieces]
        out[name] = (pieces[0].clone() if len(pieces) == 1 else torch.cat(pieces)).view(shape)
        if term is not None:
            terms[name] = term
    if want and out:
        checksums.update(build_checksums([(n, t.dtype, tuple(t.shape), terms[n]) for n, t in out.items()]))
    return out


def gathered_tensors(
    model: nn.Module,
    *,
    bucket_bytes: int | None = None,
    keep: Callable[[str], bool] | None = None,
    as_dtype: Callable[[str], torch.dtype | None] | None = None,
    checksums: bool = False,
) -> Iterator[tuple[str, torch.Size, list[torch.Tensor], torch.Tensor | None]]:
    """Gather the full tensors bucket by bucket (collective: every rank runs it to the end) and yield, on rank 0 only,
    each as (name, shape, pieces, checksum terms) in the state dict's order: its flat pieces on the collective device
    (joined in order they are the tensor; they may alias the parameters), until the next step of the iteration.

    The buckets are `gather_plan`'s, from global metadata, so every rank issues the same all-gathers. Each rank lays
    its dim-0 shards of a bucket end to end in one flat tensor, each padded to the largest shard of its tensor; rank 0
    cuts the gathered flats into pieces. Tensors of another layout, and buffers, go one by one. `bucket_bytes`: per
    rank, default `GATHER_BUCKET_BYTES` of the collective device. `keep(name)`: only those entries (the same filter
    on every rank); the others cost no collective. `as_dtype(name)`: the dtype a floating entry is sent in (cast on
    the device, before the gather; None: as stored). `checksums`: yield each tensor's checksum terms
    (`weight_checksum.checksum_terms` over the pieces, on the device), else None.
    """
    if bucket_bytes is None:
        bucket_bytes = GATHER_BUCKET_BYTES.get(collective_device().type, GATHER_BUCKET_BYTES["cuda"])
    rank0 = dist.get_rank() == 0
    state = model.state_dict()
    entries = gather_entries(state, keep, as_dtype)
    dtypes = {entry.name: entry.dtype for entry in entries}
    for bucket in gather_plan(entries, bucket_bytes):
        if bucket.layout is None:
            name = bucket.names[0]
            full = _full_tensor(state[name].to(dtypes[name])).detach()
            if rank0:
                flat = full.reshape(-1)
                yield name, full.shape, [flat], checksum_terms([flat]) if checksums else None
            continue
        pairs = [(name, state[name]) for name in bucket.names]
        for name, shape, pieces in _gather_bucket(pairs, bucket.layout.shard_dim, rank0, dtypes[bucket.names[0]]):
            yield name, shape, pieces, checksum_terms(pieces) if checksums else None


def _full_tensor(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value


def _gather_bucket(
    bucket: list[tuple[str, DTensor]], shard_dim: int, rank0: bool, dtype: torch.dtype
) -> list[tuple[str, torch.Size, list[torch.Tensor]]]:
    """One all-gather of the bucket's dim-0 shards over the group of mesh dim `shard_dim`; on rank 0 each tensor's
    (name, shape, flat pieces on the collective device in rank order), else []."""
    group = bucket[0][1].device_mesh.get_group(shard_dim)
    world, me = dist.get_world_size(group), dist.get_group_rank(group, dist.get_rank())
    device = collective_device()
    layout, locals_ = [], []
    for name, value in bucket:
        rows, row = value.shape[0], math.prod(value.shape[1:])
        chunk = -(-rows // world)  # torch.chunk's split: ceil, the last ranks shorter or empty
        local = value.to_local()
        mine = max(0, min(chunk, rows - me * chunk))
        if local.shape[0] != mine:
            raise RuntimeError(
                f"{name}: rank {me} of {world} holds {local.shape[0]} rows of {rows}, not the {mine} of an even dim-0 "
                "split; cannot gather it in a bucket"
            )
        layout.append((name, value.shape, rows, row, chunk))
        locals_.append(local.detach().reshape(-1))
    # one copy of each shard into the flat send buffer (the padding zeroed, never read back)
    send = torch.empty(sum(chunk * row for *_, row, chunk in layout), dtype=dtype, device=device)
    offset = 0
    for flat, (*_, row, chunk) in zip(locals_, layout):
        send[offset : offset + flat.numel()].copy_(flat)
        send[offset + flat.numel() : offset + chunk * row].zero_()
        offset += chunk * row
    received = [torch.empty_like(send) for _ in range(world)]
    dist.all_gather(received, send, group=group)
    if not rank0:
        return []
    out, offset = [], 0
    for name, shape, rows, row, chunk in layout:
        pieces = [received[r][offset : offset + max(0, min(chunk, rows - r * chunk)) * row] for r in range(world)]
        out.append((name, shape, pieces))
        offset += chunk * row
    return out


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
