"""Loading a network straight into its FSDP2 shards: built on the meta device, sharded, then each rank reads only its
own rows of every tensor from the checkpoint's safetensors files, so no rank ever holds a full copy (§11)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from miles.models.base import TrainPipelineConfig
from miles.models.loading.checkpoint_files import (
    checkpoint_folders,
    fill_from_checkpoint,
    local_part,
    materialize,
    safetensors_files,
    takes_empty,
)
from miles.utils.simulation import simulating

logger = logging.getLogger(__name__)


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
    every rank first, as before, with a warning: that costs a full copy per rank. Under the planner's simulation
    (`miles.utils.simulation`) the shards are fake: nothing is read."""
    model = family.load_transformer(path, dtype=dtype, empty=True) if takes_empty(family) else None
    if model is None:
        logger.warning(
            "model family %s: load_transformer takes no `empty`; every rank loads the whole network", family.name
        )
    elif not simulating() and not all(safetensors_files(folder) for folder in checkpoint_folders(model).values()):
        logger.warning("%s: no safetensors weights to read shards from; every rank loads the whole network", path)
        model = None
    sharded_read = model is not None
    if model is None:
        model = family.load_transformer(path, dtype=dtype).to(device)
    if prepare is not None:
        prepare(model)
    shard(model)
    if sharded_read:
        empty = [name for name, value in model.state_dict().items() if local_part(value).is_meta]
        materialize(model, device)
        if not simulating():
            fill_from_checkpoint(model, empty)
    return model
