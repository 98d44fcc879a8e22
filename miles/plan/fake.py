"""The planner's fake world: one process plays rank r of a world of N under torch's fake process group (collectives
do nothing) and a `FakeTensorMode` (tensors have shapes, dtypes and devices, no bytes), so the library's own start-up,
training window and engine step run at real size on a CPU in seconds."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, overload
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore

from miles.plan.masks import note_op, presumed_empty

# What a fake tensor's `.item()` answers: fake tensors hold no values, and the code under simulation reads scalars
# only to check them (a loss is finite, ranks agree on a count), so the answer is the one that lets it go on.
_SCALAR_ANSWERS = {"bool": True, "int": 1, "float": 0.0}


def plan_tensor_mode(fake: bool = True) -> contextlib.AbstractContextManager:
    """The planner's fake tensor mode, or (`fake=False`) nothing: the same steps on real tensors."""
    return PlanTensorMode() if fake else contextlib.nullcontext()


class PlanTensorMode(FakeTensorMode):
    """`FakeTensorMode` that answers `.item()` (`aten._local_scalar_dense`) of a value-less tensor with a neutral
    scalar (`_SCALAR_ANSWERS`) instead of raising, `torch.equal` with True and `nonzero` with every element (the
    planner's tokens are all attended), or none where the mask is known all zero (`masks`), and takes real tensors made before it as inputs. An in-place op that only
    writes values (`add_`, `lerp_`, `copy_`, ...) returns its tensor without the fake dispatch: on fake tensors it
    changes nothing (about a tenth of a real-size window's ops: AdamW's, the shadow update's, FSDP2's copies)."""

    def __init__(self) -> None:
        super().__init__(allow_non_fake_inputs=True)

    def dispatch(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        writes = _writes_values_only(func)
        if writes is not None and self._unchanged_by(writes, args, kwargs):
            note_op(func, args, kwargs, args[0])  # what `fill_` / `zero_` made known of its values
            return args[0]
        if func is torch.ops.aten._local_scalar_dense.default:
            tensor = args[0]
            constant = getattr(tensor, "constant", None)
            if constant is not None:
                return constant.item()
            kind = "bool" if tensor.dtype == torch.bool else "float" if tensor.is_floating_point() else "int"
            return _SCALAR_ANSWERS[kind]
        if func is torch.ops.aten.equal.default:  # a truncation check of token ids: they are equal
            return True
        if func is torch.ops.aten.split_with_sizes.default:  # rows of attended tokens split by their counts
            args = _equal_split(args)
        if func is torch.ops.aten._pin_memory.default:  # a page-locked copy (--fsdp-cpu-offload's host shards)
            return super().dispatch(torch.ops.aten.clone.default, types, (args[0],), {})
        if func is torch.ops.aten.nonzero.default:  # a mask of attended tokens: every element set (`masks`)
            tensor = args[0]
            rows = 0 if presumed_empty(tensor) else tensor.numel()
            return super().dispatch(
                torch.ops.aten.new_empty.default, types, (tensor, [rows, tensor.dim()]), {"dtype": torch.long}
            )
        out = super().dispatch(func, types, args, kwargs)
        note_op(func, args, kwargs, out)
        return out

    def _unchanged_by(self, kind: str, args: tuple, kwargs: dict | None) -> bool:
        """Whether an in-place op that writes values only (`_writes_values_only`) changes nothing a fake tensor
        has: it writes a strided fake tensor of this mode that holds no constant, from such tensors that broadcast
        to its shape on its device; arithmetic ("same") into a floating tensor from its dtype (or a 0-dim real
        one). Otherwise the op goes through the fake mode, which raises what the real op would raise."""
        out = args[0]
        if not isinstance(out, FakeTensor) or out.fake_mode is not self or out.constant is not None:
            return False
        if out.layout != torch.strided or (kind == "same" and not out.is_floating_point()):
            return False
        for value in (*args[1:], *(kwargs or {}).values()):
            if not isinstance(value, torch.Tensor):
                continue
            if not isinstance(value, FakeTensor) or value.fake_mode is not self or value.layout != torch.strided:
                return False
            if value.fake_device != out.fake_device and value.dim() > 0:
                return False
            if kind == "same" and value.dtype != out.dtype and (value.dim() > 0 or value.dtype.is_complex):
                return False
            if value.shape != out.shape and not _broadcasts_to(value.shape, out.shape):
                return False
        return True


def _broadcasts_to(shape: torch.Size, target: torch.Size) -> bool:
    try:
        return torch.broadcast_shapes(target, shape) == target
    except RuntimeError:
        return False


# in-place ops that write values only and are not tagged pointwise (any dtype in, as the real ops allow)
_ANY_DTYPE_WRITES = (torch.ops.aten.copy_.default, torch.ops.aten.zero_.default, torch.ops.aten.fill_.Scalar)
_WRITES_VALUES_ONLY: dict[Any, str | None] = {}


def _writes_values_only(func: Any) -> str | None:
    """ "same" for a pointwise in-place op (`add_`, `lerp_`, `addcmul_`: it writes its first argument's values and
    returns it, its shape, strides and storage unchanged), "any" for `copy_`, `zero_`, `fill_`, else None. On a
    fake tensor such an op changes nothing (no values, no storage): `PlanTensorMode` returns its tensor as it is."""
    if func in _WRITES_VALUES_ONLY:
        return _WRITES_VALUES_ONLY[func]
    kind = None
    if func in _ANY_DTYPE_WRITES:
        kind = "any"
    elif isinstance(func, torch._ops.OpOverload) and torch.Tag.pointwise in func.tags:
        schema = func._schema
        first = schema.arguments[0].alias_info if schema.arguments else None
        returns = schema.returns
        written = first is not None and first.is_write and torch.Tag.inplace_view not in func.tags
        if written and len(returns) == 1 and returns[0].alias_info is not None:
            kind = "same"
    _WRITES_VALUES_ONLY[func] = kind
    return kind


def _equal_split(args: tuple) -> tuple:
    """`split_with_sizes` whose sizes came from value-less counts (each answered 1, `_SCALAR_ANSWERS`) and so do not
    add up: equal parts instead, as every row's count is equal when every token is attended."""
    tensor, sizes, *rest = args
    dim = rest[0] if rest else 0
    total = tensor.shape[dim]
    if sum(sizes) != total and sizes and len(set(sizes)) == 1 and total % len(sizes) == 0:
        sizes = [total // len(sizes)] * len(sizes)
    return (tensor, sizes, *rest)


@contextlib.contextmanager
def fake_process_group(rank: int, world_size: int, *, fake: bool = True) -> Iterator[None]:
    """The default process group as rank `rank` of `world_size` on torch's fake backend (every collective returns at
    once, its output untouched); torn down on exit. `fake=False`: a real gloo group (world size 1 alone; more
    through MASTER_ADDR / MASTER_PORT), for measuring what the simulation predicts."""
    if dist.is_initialized():
        raise RuntimeError("the planner needs its own process group: a default one exists already")
    if fake:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    elif world_size == 1:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    else:
        dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def movable_fake_modules() -> Iterator[None]:
    """`module.to(...)` (and every `_apply`) on modules holding fake parameters, for the simulation's duration.

    torch swaps a fake parameter's object in place on conversion, which fails for parameters made under a fake mode
    (the mode keeps a weak reference to each): here a converted parameter is replaced by a new `Parameter` instead
    (nothing else holds the engine's parameters at that point). Modules without fake parameters (FSDP2's DTensor
    shards) keep torch's own conversion."""
    original = nn.Module._apply

    def _apply(module: nn.Module, fn: Any, recurse: bool = True) -> nn.Module:
        if not any(isinstance(p, FakeTensor) for p in module._parameters.values()):
            return original(module, fn, recurse)
        if recurse:
            for child in module.children():
                child._apply(fn)
        with torch.no_grad():
            for key, param in module._parameters.items():
                if param is not None:
                    applied = fn(param)
                    if applied is not param:
                        module._parameters[key] = nn.Parameter(applied, param.requires_grad)
        for key, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[key] = fn(buffer)
        return module

    with mock.patch.object(nn.Module, "_apply", _apply):
        yield


# ---- equivalents of third-party code whose cost on fake tensors is per element, not per tensor -------------------
def _hunyuan_video15_causal_mask(n_frame: int, n_hw: int, dtype: Any, device: Any, batch_size: int | None = None):
    """diffusers' `HunyuanVideo15AttnBlock.prepare_causal_attention_mask` (a position may attend to every position of
    its own and earlier latent frames) without its Python loop over the frames x positions rows: the same values,
    dtype and result size, from the frames' (n_frame, n_frame) mask repeated per position."""
    frames = torch.full((n_frame, n_frame), float("-inf"), dtype=dtype, device=device).triu(1)
    mask = frames.repeat_interleave(n_hw, dim=0).repeat_interleave(n_hw, dim=1)
    return mask if batch_size is None else mask.unsqueeze(0).expand(batch_size, -1, -1)


@contextlib.contextmanager
def per_tensor_equivalents() -> Iterator[None]:
    """Third-party functions whose loops run once per element swapped, for the simulation's duration, for
    equivalents that give the same tensors (values, dtype, size) with a few operations: on fake tensors every
    operation costs the same whatever its size, so a loop over a video's 50k latent positions took minutes."""
    try:
        from diffusers.models.autoencoders.autoencoder_kl_hunyuanvideo15 import HunyuanVideo15AttnBlock
    except ImportError:  # an older diffusers without the family: nothing to swap
        yield
        return
    equivalent = staticmethod(_hunyuan_video15_causal_mask)
    with mock.patch.object(HunyuanVideo15AttnBlock, "prepare_causal_attention_mask", equivalent):
        yield


@contextlib.contextmanager
def device_paths(planned_device: str, fake: bool = True) -> Iterator[None]:
    """The trainer's device-dependent choices as on `planned_device`, though the simulation runs on the fake CPU
    device: for a CUDA plan, FSDP2's gathers keep their defaults (the next group prefetched in backward, the flat
    all-gather buffer kept until the next copy-out: `cpu_gathers`) and SD3's joint attention keeps q, k, v for the
    CUDA kernels (its recompute is for the CPU flash kernel: `joint_attention`)."""
    if not fake or planned_device == "cpu":
        yield
        return
    from unittest import mock

    from miles.backends.fsdp_utils import fsdp, joint_attention

    with (
        mock.patch.object(fsdp, "gather_one_group_at_a_time", lambda model: None),
        mock.patch.object(joint_attention, "_cpu_flash", lambda states: False),
    ):
        yield


class _Chunks(Sequence):
    """`torch.chunk(tensor, count, dim)` padded with empty tensors to `count` (FSDP2's `_chunk_with_empty`), each
    view made when it is read: FSDP2 reads one rank's chunk and the first of every parameter it shards, and on fake
    tensors the other views (63 of 64 at dp 64) are dispatches that make no storage. The views are torch.chunk's."""

    def __init__(self, tensor: torch.Tensor, count: int, dim: int) -> None:
        self.tensor, self.chunks, self.dim = tensor, count, dim
        self.chunk_size = -(-tensor.shape[dim] // count)  # torch.chunk's chunk size

    def __len__(self) -> int:
        return self.chunks

    @overload
    def __getitem__(self, index: int) -> torch.Tensor: ...
    @overload
    def __getitem__(self, index: slice) -> list[torch.Tensor]: ...
    def __getitem__(self, index: int | slice) -> torch.Tensor | list[torch.Tensor]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self.chunks))]
        if not -self.chunks <= index < self.chunks:
            raise IndexError(f"chunk {index} of {self.chunks}")
        start = (index % self.chunks) * self.chunk_size
        length = self.tensor.shape[self.dim]
        if start >= length:
            return self[0].new_empty(0)
        return self.tensor.narrow(self.dim, start, min(self.chunk_size, length - start))


def _lazy_chunks(original: Any) -> Any:
    def chunk_with_empty(tensor: torch.Tensor, num_chunks: int, dim: int) -> Any:
        if isinstance(tensor, FakeTensor) and tensor.dim() > 0 and tensor.shape[dim] > 0:
            return _Chunks(tensor, num_chunks, dim)
        return original(tensor, num_chunks, dim)

    return chunk_with_empty


@contextlib.contextmanager
def value_only_ops_skipped() -> Iterator[None]:
    """The library's operations that only move values, skipped on fake tensors (which hold none) for the
    simulation's duration: `swap_bits_` (the shadow weights' swap in and out, three in-place XORs on two views of
    every trainable shard, twice per shadow forward and export) makes no storage and issues no collective, so the
    plan is the same without its 5 dispatches per tensor. Its checks still run; real tensors are swapped. And FSDP2's
    chunks of a parameter it shards are made as they are read (`_Chunks`)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param

    from miles.backends.fsdp_utils import ema

    original = ema.swap_bits_
    chunks = mock.patch.object(_fsdp_param, "_chunk_with_empty", _lazy_chunks(_fsdp_param._chunk_with_empty))

    def swap_bits_(a: torch.Tensor, b: torch.Tensor) -> None:
        if isinstance(a, FakeTensor) and isinstance(b, FakeTensor):
            if a.dtype != b.dtype or a.shape != b.shape:
                original(a, b)  # raises, naming both
            return
        original(a, b)

    ema.swap_bits_ = swap_bits_
    try:
        with chunks:
            yield
    finally:
        ema.swap_bits_ = original
