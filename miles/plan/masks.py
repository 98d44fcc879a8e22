"""What the planner knows of a fake tensor's elements: all nonzero (True), all zero (False), or nothing (None),
from the ops that make, move, negate and combine masks, for `nonzero` (`PlanTensorMode`).

A fake tensor holds no values, so `nonzero` of a mask of unknown values answers every element: the planner's tokens
are all attended (its tokenizers attend every token of the longest prompt). Its complement must then answer none:
diffusers' HunyuanVideo 1.5 transformer orders its text tokens as `x[mask]` then `x[~mask]` (the attended first),
which counted every text token twice on fake tensors (its engine's generate planned 3.0x the same steps on real
tensors, on the tiny folder). Tracked here: masks made as ones or zeros (a text-to-video run's image mask is zeros),
their views, copies and casts, `~`, `&`, `|` and concatenation; real tensors (the tokenizers' masks) by their values.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

aten = torch.ops.aten
# id(a fake tensor's storage) -> (a weak reference to the storage, True: all nonzero / False: all zero). By storage:
# a view reads its base's, and a write through a view is a write to its base; kept beside the tensors, not on them
# (an attribute would travel into the `nn.Parameter` a module makes of a tensor)
_FILLS: dict[int, tuple[weakref.ref, bool]] = {}
REAL_LIMIT = 1 << 20  # a real tensor's values are read up to this many elements (masks, not weights)

# the output's elements are some of the first argument's (views, copies, casts, selections): its fill is kept
_KEEPS = {
    aten._to_copy.default,
    aten.view.default,
    aten._unsafe_view.default,
    aten.expand.default,
    aten.repeat.default,
    aten.clone.default,
    aten.slice.Tensor,
    aten.select.int,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.squeeze.default,
    aten.permute.default,
    aten.transpose.int,
    aten.t.default,
    aten.alias.default,
    aten.detach.default,
    aten.index.Tensor,
    aten.unbind.int,
    aten.split.Tensor,
    aten.split_with_sizes.default,
    aten.lift_fresh.default,
    aten.lift_fresh_copy.default,
    aten.as_strided.default,
}
_ONES = {aten.ones.default, aten.ones_like.default, aten.new_ones.default}
_ZEROS = {aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default}
_FULL = {aten.full.default: 1, aten.full_like.default: 1, aten.new_full.default: 2}  # the fill value's position
_NOT = {aten.bitwise_not.default, aten.logical_not.default}
_AND = {aten.bitwise_and.Tensor, aten.logical_and.default}
_OR = {aten.bitwise_or.Tensor, aten.logical_or.default}
_JOIN = {aten.cat.default, aten.stack.default}


def fill_of(value: Any) -> bool | None:
    """True when every element of `value` is known nonzero, False when every one is zero, else None."""
    if isinstance(value, FakeTensor):
        storage = value.untyped_storage()
        known = _FILLS.get(id(storage))
        return known[1] if known is not None and known[0]() is storage else None
    if isinstance(value, torch.Tensor) and value.device.type != "meta" and value.numel() <= REAL_LIMIT:
        if value.dtype == torch.bool or not (value.is_floating_point() or value.is_complex()):
            with torch._C._DisableTorchDispatch():  # a real mask's values, read outside the fake mode
                return True if bool(value.all()) else False if not bool(value.any()) else None
    return None


def presumed_empty(mask: Any) -> bool:
    """Whether `nonzero(mask)` has no rows: only a mask known to be all zero (every other one is presumed all set)."""
    return fill_of(mask) is False


def _output_fill(func: Any, args: tuple, kwargs: dict) -> bool | None:
    if func in _KEEPS:
        return fill_of(args[0])
    if func in _ONES:
        return True
    if func in _ZEROS:
        return False
    if func in _FULL:
        value = args[_FULL[func]] if len(args) > _FULL[func] else kwargs.get("fill_value")
        return bool(value) if isinstance(value, (bool, int, float)) else None
    if func in _NOT:
        return fill_of(args[0]) is False  # the complement of a mask presumed all set is all clear
    if func in _AND | _OR:
        fills = [fill_of(a) for a in args[:2]]
        decisive = func in _AND and False in fills or func in _OR and True in fills
        return (func in _OR) if decisive else fills[0] if fills[0] == fills[1] else None
    if func in _JOIN:
        joined = {fill_of(t) for t in args[0]}
        return joined.pop() if len(joined) == 1 else None
    if func is aten.constant_pad_nd.default:
        value = args[2] if len(args) > 2 else kwargs.get("value", 0)
        inner = fill_of(args[0])
        return inner if inner is not None and bool(value) == inner else None
    return None


_KNOWN = _KEEPS | _ONES | _ZEROS | set(_FULL) | _NOT | _AND | _OR | _JOIN | {aten.constant_pad_nd.default}
_WRITES_FIRST: dict[Any, bool] = {}  # op -> whether it writes its first argument in place


def _writes_first(func: Any) -> bool:
    if func not in _WRITES_FIRST:
        schema = getattr(func, "_schema", None)
        first = schema.arguments[0].alias_info if schema is not None and schema.arguments else None
        _WRITES_FIRST[func] = first is not None and first.is_write
    return _WRITES_FIRST[func]


def _tag(out: Any, fill: bool | None) -> None:
    for tensor in out if isinstance(out, (tuple, list)) else (out,):
        if not isinstance(tensor, FakeTensor):
            continue
        storage = tensor.untyped_storage()
        key = id(storage)
        if fill is None:
            _FILLS.pop(key, None)
        else:
            _FILLS[key] = (weakref.ref(storage, functools.partial(_forget, key)), fill)


def _forget(key: int, _: object) -> None:
    """A tracked storage died (its weak reference's callback)."""
    _FILLS.pop(key, None)


def _written_fill(func: Any, args: tuple) -> bool | None:
    """What the storage of `args[0]` holds after the in-place `func` wrote it: the written value where it is one
    (`fill_`, `zero_`, a `copy_` of a known source) and the write covers the whole storage, the fill it had where
    the written value is that fill, else nothing known."""
    target, before = args[0], fill_of(args[0])
    written: bool | None
    if func is aten.fill_.Scalar:
        written = bool(args[1])
    elif func is aten.zero_.default:
        written = False
    elif func is aten.copy_.default:
        written = fill_of(args[1])
    else:
        return None
    whole = target.numel() * target.element_size() == target.untyped_storage().nbytes()
    return written if whole or written == before else None


def note_op(func: Any, args: tuple, kwargs: dict | None, out: Any) -> None:
    """After `func` ran on fake tensors: what is known of its output's elements, or, where it wrote its first
    argument in place, of that argument's storage (`_written_fill`)."""
    if _writes_first(func):
        if args and isinstance(args[0], FakeTensor):
            _tag(args[0], _written_fill(func, args))
        return
    if func in _KNOWN:
        _tag(out, _output_fill(func, args, kwargs or {}))
