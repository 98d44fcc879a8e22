"""The steps of `load_checkpoint` (`miles.backends.fsdp_utils.checkpoint`): the role dir checked against this run
(meta.json, the frozen weights, the sizes of the files every rank reads), the state DCP fills, this rank's small
files (RNG, LR schedule, `extra`), and the state set back on the model and optimizer."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from miles.backends.fsdp_utils.checkpoint_files import (
    MANIFEST_FILE,
    CheckpointError,
    check_sizes,
    identity_mismatch,
    model_identity,
    read_manifest,
    read_tree,
    set_rng_state,
)
from miles.backends.fsdp_utils.checkpoint_files import verify_checksums as verify_checksums_of
from miles.backends.fsdp_utils.checkpoint_layout import (
    EXTRA_STEM,
    LR_SCHEDULER_STEM,
    META_FILE,
    SET_TRAINED,
    TRAINED_ONLY,
    read_meta,
    rng_stem,
)


def check_role_dir(
    path: str, role: str, rollout_id: int, model: nn.Module, frozen: dict[str, int]
) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """meta.json and the frozen weights against this run, then the sizes of the files every rank reads alike (same
    files, same verdict) before DCP's own collectives. Returns meta.json, the manifest and those files' names."""
    meta = check_meta(path, role, rollout_id, model)
    check_frozen_weights(path, role, meta, frozen)
    manifest = read_manifest(path)
    shared = [n for n in manifest if not n.startswith("rng_rank")]
    check_sizes(path, manifest, shared)
    return meta, manifest, shared


def state_to_load(
    model: nn.Module, optimizer: Optimizer, sharded: dict[str, dict[str, torch.Tensor]] | None, *, load_optimizer: bool
) -> dict[str, Any]:
    """The state dict DCP fills in place: the trained parameters, with `load_optimizer` the optimizer's state, and
    the `sharded` shadows."""
    state = {"model": get_model_state_dict(model, options=TRAINED_ONLY), **(sharded or {})}
    if load_optimizer:
        model_state, optim_state = get_state_dict(model, optimizer, options=TRAINED_ONLY)
        state = {"model": model_state, "optimizer": optim_state, **(sharded or {})}
    return state


def restore(
    model: nn.Module,
    optimizer: Optimizer,
    lr_scheduler: LRScheduler | None,
    state: dict[str, Any],
    schedule: Any,
    rng: Any,
    *,
    load_optimizer: bool,
) -> None:
    """Set the loaded state back: the model, with `load_optimizer` the optimizer and the LR `schedule`, then this
    rank's RNG streams (None: not restored, a resume at another world size)."""
    if load_optimizer:
        set_state_dict(
            model,
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
            options=SET_TRAINED,
        )
        if schedule is not None and lr_scheduler is not None:  # a schedule is read only for a scheduler
            lr_scheduler.load_state_dict(schedule)
    else:
        set_model_state_dict(model, state["model"], options=SET_TRAINED)
    if rng is not None:
        set_rng_state(rng)


def read_small_files(
    path: str, manifest: dict[str, Any], rank: int | None, *, with_schedule: bool, verify: bool
) -> tuple[Any, Any, Any]:
    """Rank `rank`'s RNG state (checked against the manifest; None for `rank` None), the LR schedule when asked and
    the `extra` dict (None when none was saved) of the role dir `path`."""
    rng = None
    if rank is not None:
        rng_names = [n for n in manifest if n.startswith(rng_stem(rank) + ".")]
        if not rng_names:
            raise CheckpointError(f"{os.path.join(path, rng_stem(rank))}.json is not listed in {MANIFEST_FILE}")
        check_sizes(path, manifest, rng_names)
        if verify:
            verify_checksums_of(path, manifest, rng_names)
        rng = read_tree(os.path.join(path, rng_stem(rank)))
    schedule = None
    if with_schedule:
        if f"{LR_SCHEDULER_STEM}.json" not in manifest:
            raise FileNotFoundError(
                f"{os.path.join(path, LR_SCHEDULER_STEM)}.json does not exist: the checkpoint was saved without "
                "an LR scheduler"
            )
        schedule = read_tree(os.path.join(path, LR_SCHEDULER_STEM))
    extra = read_tree(os.path.join(path, EXTRA_STEM)) if f"{EXTRA_STEM}.json" in manifest else None
    return rng, schedule, extra


def check_meta(path: str, role: str, rollout_id: int, model: nn.Module) -> dict[str, Any]:
    """meta.json against this run: the same place, the same model (any world size: DCP reshards, see
    `load_checkpoint`)."""
    meta = read_meta(path)
    meta_path = os.path.join(path, META_FILE)
    if meta["rollout_id"] != rollout_id or meta["role"] != role:
        raise ValueError(
            f"{meta_path} records rollout {meta['rollout_id']} role {meta['role']!r}, "
            f"but it sits where rollout {rollout_id} role {role!r} belongs"
        )
    mismatch = identity_mismatch(meta.get("model"), model_identity(model))
    if mismatch is not None:
        raise CheckpointError(f"{meta_path}: refusing to load this {role} checkpoint: {mismatch}")
    return meta


def check_frozen_weights(path: str, role: str, meta: dict[str, Any], here: dict[str, int]) -> None:
    """The frozen weights this run rebuilt from its model folder are the ones the checkpoint was trained on (they are
    not in the checkpoint). Checkpoints from before the digest stored them and carry none: nothing to check."""
    saved = meta.get("frozen_weights")
    if saved is None or saved == here:
        return
    raise CheckpointError(
        f"{os.path.join(path, META_FILE)}: refusing to load this {role} checkpoint: its frozen weights ({saved['tensors']} "
        f"tensors, {saved['elements']} values, e.g. a LoRA base) are not stored in it and this run's differ "
        f"({here['tensors']} tensors, {here['elements']} values, word sum {here['words']} against {saved['words']}); "
        "resume from the same --hf-checkpoint (and --teacher-load / --critic-* model folders) the checkpoint was "
        "trained from"
    )
