"""Filling a network built on the meta device (`load_pretrained(..., empty=True)`) from its folder's safetensors files,
tensor by tensor with plain reads, straight into each tensor's dtype and device: the trainer's sharded load reads a
rank's rows of each shard this way, the rollout engine each whole tensor (`load_transformer_direct`)."""

from __future__ import annotations

import inspect
import json
import logging
import math
import struct
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from miles.models.base import TrainPipelineConfig
from miles.models.loading.pretrained import CHECKPOINT_FOLDER_ATTR, SAFETENSORS_DTYPES
from miles.utils.simulation import simulating

logger = logging.getLogger(__name__)

_PEFT_BASE = ".base_layer"  # peft's wrapper renames `x.weight` of a LoRA target to `x.base_layer.weight`


def takes_empty(family: TrainPipelineConfig) -> bool:
    """Whether the family's `load_transformer` can build its network without weights (`empty=True`)."""
    return "empty" in inspect.signature(family.load_transformer).parameters


def load_transformer_direct(
    family: TrainPipelineConfig, path: str | None = None, *, dtype: torch.dtype, device: torch.device | str
) -> nn.Module:
    """The family's network from `path` (default: its own folder) in `dtype` on `device`, without a host copy: built
    on the meta device, given storage on `device`, then filled tensor by tensor from the safetensors files (the load
    peak is the weights plus one tensor). A family whose `load_transformer` takes no `empty`, or a folder without
    safetensors weights, is loaded by `from_pretrained` and moved, as before (a warning says what that costs)."""
    model = family.load_transformer(path, dtype=dtype, empty=True) if takes_empty(family) else None
    planning = simulating()  # the planner's fake tensors: nothing to read
    if model is not None and (planning or all(safetensors_files(f) for f in checkpoint_folders(model).values())):
        empty = [name for name, value in model.state_dict().items() if local_part(value).is_meta]
        materialize(model, torch.device(device))
        if not planning:
            fill_from_checkpoint(model, empty)
        cast_buffers_as_from_pretrained(model, dtype)
        return model
    logger.warning(
        "model family %s: %s; loading the whole network on the host first, then moving it (a copy of its weights)",
        family.name,
        "load_transformer takes no `empty`" if model is None else "no safetensors weights to read tensor by tensor",
    )
    return family.load_transformer(path, dtype=dtype).to(device)


def cast_buffers_as_from_pretrained(model: nn.Module, dtype: torch.dtype) -> None:
    """Floating buffers computed at construction (SD3's position table) in `dtype`, as from_pretrained leaves them,
    except in the class's `_keep_in_fp32_modules`; the forward then runs exactly as on a from_pretrained network."""
    kept: set[str] = set()
    for module in model.modules():
        kept.update(getattr(module, "_keep_in_fp32_modules", None) or ())
    for name, module in model.named_modules():
        if kept.intersection(name.split(".")):
            continue
        for key, buffer in module._buffers.items():
            if buffer is not None and buffer.is_floating_point() and buffer.dtype != dtype:
                module._buffers[key] = buffer.to(dtype)


def checkpoint_folders(model: nn.Module) -> dict[str, Path]:
    """Module prefix (`""` for the root, `"transformer_2."` for a submodule) -> the folder its weights live in, from
    the tags `load_pretrained(..., empty=True)` leaves."""
    folders = {}
    for name, module in model.named_modules():
        folder = getattr(module, CHECKPOINT_FOLDER_ATTR, None)
        if folder is not None:
            folders[f"{name}." if name else ""] = Path(folder)
    return folders


def materialize(model: nn.Module, device: torch.device) -> None:
    """Give every tensor still on the meta device (sharded or not) uninitialised storage on `device`; real tensors
    (buffers computed at construction, a LoRA adapter initialised on the CPU) are left as they are."""
    model._apply(lambda t: torch.empty_like(t, device=device) if local_part(t).is_meta else t)


def fill_from_checkpoint(model: nn.Module, names: list[str]) -> None:
    """Read into each named state-dict entry this rank's part of it from the checkpoint (its rows of a dim-0 shard;
    the whole tensor when not sharded), cast to the entry's dtype as from_pretrained casts. Also the checkpoint's
    values of persistent buffers, which from_pretrained loads too. Missing or misshapen weights raise, naming them."""
    folders = checkpoint_folders(model)
    wanted = set(names)
    files: dict[Path, SafetensorsFile] = {}
    index = {prefix: _key_files(folder, files) for prefix, folder in folders.items()}
    missing = []
    for name, value in model.state_dict().items():
        buffer_from_file = name not in wanted and not isinstance(value, DTensor)
        if name not in wanted and not buffer_from_file:
            continue
        prefix = max((p for p in folders if name.startswith(p)), key=len, default=None)
        key = file = None
        if prefix is not None:
            key = name[len(prefix) :].replace(_PEFT_BASE, "")
            file = index[prefix].get(key)
        if file is None or key is None:  # a file is looked up by its key
            if not buffer_from_file:
                missing.append(name)
            continue
        _read_part(value, files[file], key)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(
            f"the checkpoint in {', '.join(str(f) for f in folders.values())} holds no weights for {shown}"
        )


class SafetensorsFile:
    """One safetensors file's header, and reads of consecutive dim-0 rows of a tensor into a tensor (plain file
    reads: safetensors' own mmap would leave the pages it touched in the process's resident set)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        header.pop("__metadata__", None)
        self.tensors: dict[str, dict] = header
        self.data_start = 8 + length

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.tensors[key]["shape"])

    def read_rows(self, key: str, start: int, out: torch.Tensor) -> None:
        """Rows [start, start + len(out)) of `key` into `out` (any dtype and device: cast and copied as needed).

        Through a bytes buffer of this one tensor's part: reading into `out`'s own memory would need a NumPy view of
        it, and NumPy views make a storage unresizable for good (sleep / wake resizes storages to free them)."""
        entry = self.tensors[key]
        dtype = SAFETENSORS_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise ValueError(f"{self.path}:{key} is stored as {entry['dtype']}, which miles cannot load")
        row_bytes = math.prod(entry["shape"][1:]) * dtype.itemsize
        buffer = bytearray(out.numel() * dtype.itemsize)
        with open(self.path, "rb") as f:
            f.seek(self.data_start + entry["data_offsets"][0] + start * row_bytes)
            if f.readinto(buffer) != len(buffer):
                raise ValueError(f"{self.path} is truncated: {key} does not fit in the file")
        if buffer:
            out.copy_(torch.frombuffer(buffer, dtype=dtype).view(out.shape))


def _read_part(value: torch.Tensor, file: SafetensorsFile, key: str) -> None:
    shape = file.shape(key)
    if shape != tuple(value.shape):
        raise ValueError(f"{file.path}:{key} has shape {list(shape)}, the model expects {list(value.shape)}")
    target = local_part(value)
    if target.numel() == 0:
        return
    offset: Sequence[int] = [0] * value.dim()
    if isinstance(value, DTensor):
        local_shape, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
        if any(offset[1:]) or tuple(local_shape[1:]) != shape[1:]:
            raise ValueError(f"{key}: sharded along a dimension other than 0 ({value.placements}); cannot read it")
    with torch.no_grad():
        file.read_rows(key, offset[0] if offset else 0, target)


def local_part(value: torch.Tensor) -> torch.Tensor:
    return value.to_local() if isinstance(value, DTensor) else value


def safetensors_files(folder: Path) -> list[Path]:
    """The weights from_pretrained reads: diffusers' or transformers' file name when present (a folder may also
    hold variants, `*.fp16.safetensors`), else every safetensors file."""
    for name in ("diffusion_pytorch_model.safetensors", "model.safetensors"):
        if (folder / name).is_file():
            return [folder / name]
    return sorted(folder.glob("*.safetensors"))


def _key_files(folder: Path, files: dict[Path, SafetensorsFile]) -> dict[str, Path]:
    """Tensor name -> the safetensors file in `folder` that holds it (the index's weight map when there is one),
    opening each file's header into `files`."""
    indexes = sorted(folder.glob("*.safetensors.index.json"))
    paths = (
        sorted({folder / f for f in json.loads(indexes[0].read_text())["weight_map"].values()})
        if indexes
        else safetensors_files(folder)
    )
    keys = {}
    for path in paths:
        files.setdefault(path, SafetensorsFile(path))
        keys.update(dict.fromkeys(files[path].tensors, path))
    return keys
