"""Where a checkpoint's parts lie (ARCHITECTURE §10): `SAVE_DIR/iter_{rollout_id:07d}/{role}/` with its DCP folder, the
LR schedule, the per-rank RNG files, `extra` and `meta.json`; what its state holds (the trained parameters only); the
rank helpers and the atomic text write the save, the load and the latest pointer share."""

from __future__ import annotations

import json
import os
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions

LATEST_FILE = "latest_checkpointed_iteration.txt"
META_FILE = "meta.json"
DCP_DIR = "dcp"
LR_SCHEDULER_STEM = "lr_scheduler"
EXTRA_STEM = "extra"
REQUIRED_META = ("rollout_id", "role", "world_size", "miles_version", "time")
RESERVED_META = (*REQUIRED_META, "model", "frozen_weights")
# Frozen parameters (a LoRA base, Wan's untrained expert) never change while training: a resumed run rebuilds them
# from its model folder, so a checkpoint holds only what trains (a LoRA run saves its adapter, not the whole base).
# meta.json keeps a digest of the frozen weights that were left out, checked when the run that loads has rebuilt its own.
TRAINED_ONLY = StateDictOptions(ignore_frozen_params=True)
# setting them back: the state holds exactly TRAINED_ONLY's keys, so non-strict only lets the frozen ones be absent
SET_TRAINED = StateDictOptions(ignore_frozen_params=True, strict=False)


def checkpoint_dir(save_dir: str, rollout_id: int, role: str) -> str:
    return os.path.join(save_dir, f"iter_{rollout_id:07d}", role)


def current_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def current_world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def rng_stem(rank: int) -> str:
    return f"rng_rank{rank}"


def read_meta(path: str) -> dict[str, Any]:
    meta_path = os.path.join(path, META_FILE)
    if not os.path.isfile(meta_path):
        raise FileNotFoundError(f"{path} has no {META_FILE}: the save did not finish; load an earlier iteration")
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{meta_path} is corrupt (not valid JSON: {err})") from None
    missing = [key for key in REQUIRED_META if not isinstance(meta, dict) or key not in meta]
    if missing:
        raise ValueError(f"{meta_path} is corrupt: missing fields {missing}")
    return meta
