"""Loading a network straight into its FSDP2 shards: built on the meta device, sharded, then each rank reads only its
own rows of every tensor from the checkpoint's safetensors files, so no rank ever holds a full copy (§11)."""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from miles.models.base import CHECKPOINT_FOLDER_ATTR, TrainPipelineConfig

logger = logging.getLogger(__name__)

_PEFT_BASE = ".base_layer"  # peft's wrapper renames `x.weight` of a LoRA target to `x.base_layer.weight`


def takes_empty(family: TrainPipelineConfig) -> bool:
    """Whether the family's `load_transformer` can build its network without weights (`empty=True`)."""
    return "empty" in inspect.signature(family.load_transformer).parameters


def load_sharded(
    family: TrainPipelineConfig,
    path: str | None,
    *,
    dtype: torch.dtype,
    device: torch.device,
    shard: Callable[[nn.Module], object],
    prepare: Callable[[nn.Module], object] | None = None,
) -> nn.Module:
    """The family's network from `path`, sharded by `shard` (e.g. `apply_fsdp2`) with each rank's shards filled from
    the checkpoint on `device`; `prepare` runs on the unsharded module first (LoRA injection). Collective.

    A family whose `load_transformer` takes no `empty`, or a folder without safetensors weights, is loaded whole on
    every rank first, as before, with a warning: that costs a full copy per rank."""
    model = family.load_transformer(path, dtype=dtype, empty=True) if takes_empty(family) else None
    if model is not None and not all(_safetensors_files(folder) for folder in checkpoint_folders(model).values()):
        logger.warning("%s: no safetensors weights to read shards from; every rank loads the whole network", path)
        model = None
    if model is None:
        if not takes_empty(family):
            logger.warning(
                "model family %s: load_transformer takes no `empty`; every rank loads the whole network", family.name
            )
        model = family.load_transformer(path, dtype=dtype).to(device)
        if prepare is not None:
            prepare(model)
        shard(model)
        return model
    if prepare is not None:
        prepare(model)
    shard(model)
    empty = [name for name, value in model.state_dict().items() if _local(value).is_meta]
    materialize(model, device)
    fill_from_checkpoint(model, empty)
    return model


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
    model._apply(lambda t: torch.empty_like(t, device=device) if _local(t).is_meta else t)


def fill_from_checkpoint(model: nn.Module, names: list[str]) -> None:
    """Copy into each named state-dict entry this rank's part of it from the checkpoint (its rows of a dim-0 shard;
    the whole tensor when not sharded), cast to the entry's dtype as from_pretrained casts. Also the checkpoint's
    values of persistent buffers, which from_pretrained loads too. Missing or misshapen weights raise, naming them."""
    folders = checkpoint_folders(model)
    wanted = set(names)
    with contextlib.ExitStack() as stack:
        handles: dict[Path, object] = {}
        index = {prefix: _key_files(folder) for prefix, folder in folders.items()}
        missing = []
        for name, value in model.state_dict().items():
            buffer_from_file = name not in wanted and not isinstance(value, DTensor)
            if name not in wanted and not buffer_from_file:
                continue
            prefix = max((p for p in folders if name.startswith(p)), key=len, default=None)
            key = None if prefix is None else name[len(prefix) :].replace(_PEFT_BASE, "")
            file = None if key is None else index[prefix].get(key)
            if file is None:
                if not buffer_from_file:
                    missing.append(name)
                continue
            if file not in handles:
                handles[file] = stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
            _copy_part(value, handles[file].get_slice(key), f"{file}:{key}")
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise ValueError(
                f"the checkpoint in {', '.join(str(f) for f in folders.values())} holds no weights for {shown}"
            )


def _copy_part(value: torch.Tensor, source, where: str) -> None:
    shape = tuple(source.get_shape())
    if shape != tuple(value.shape):
        raise ValueError(f"{where} has shape {list(shape)}, the model expects {list(value.shape)}")
    if isinstance(value, DTensor):
        local_shape, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
    else:
        local_shape, offset = tuple(value.shape), (0,) * value.dim()
    target = _local(value)
    if target.numel() == 0:
        return
    part = source[tuple(slice(o, o + n) for o, n in zip(offset, local_shape))] if value.dim() else source[:]
    with torch.no_grad():
        target.copy_(part.reshape(target.shape))


def _local(value: torch.Tensor) -> torch.Tensor:
    return value.to_local() if isinstance(value, DTensor) else value


def _safetensors_files(folder: Path) -> list[Path]:
    """The weights from_pretrained reads: diffusers' or transformers' file name when present (a folder may also
    hold variants, `*.fp16.safetensors`), else every safetensors file."""
    for name in ("diffusion_pytorch_model.safetensors", "model.safetensors"):
        if (folder / name).is_file():
            return [folder / name]
    return sorted(folder.glob("*.safetensors"))


def _key_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file in `folder` that holds it (the index's weight map, else each file's
    header)."""
    for index in sorted(folder.glob("*.safetensors.index.json")):
        weight_map = json.loads(index.read_text())["weight_map"]
        return {key: folder / file for key, file in weight_map.items()}
    keys = {}
    for file in _safetensors_files(folder):
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            keys.update(dict.fromkeys(handle.keys(), file))
    return keys
