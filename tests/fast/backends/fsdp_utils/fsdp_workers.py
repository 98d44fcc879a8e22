"""Rank bodies for the FSDP2 and checkpoint tests: a tiny block model, fixed data, and a spawner with a deadline."""

from __future__ import annotations

import errno
import os
import random
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.fsdp import fully_shard

from miles.backends.fsdp_utils import checkpoint_save
from miles.backends.fsdp_utils.checkpoint import load_checkpoint, save_checkpoint, write_latest
from miles.backends.fsdp_utils.checkpoint_space import CheckpointSpaceError
from miles.backends.fsdp_utils.fsdp import apply_fsdp2, clip_grad_norm_, load_full_state_dict
from miles.backends.fsdp_utils.gather import bucketed_full_state_dict, full_state_dict
from miles.utils.distributed import destroy_process_group, find_free_port, init_process_group

BATCH = 8
DIM = 8
LR = 1e-2
WEIGHT_DECAY = 0.1
MAX_NORM = 0.1
TRAIN_STEPS = 2


class BlockModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(DIM, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def build_model(seed: int) -> BlockModel:
    torch.manual_seed(seed)
    return BlockModel()


class OddModel(nn.Module):
    """Rows that do not split evenly over 2 ranks (5 -> 3 + 2, 1 -> 1 + 0), a bf16 block and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(DIM, 5), nn.Linear(5, 1), nn.Linear(1, 3).to(torch.bfloat16)])
        self.register_buffer("scale", torch.arange(3.0))


def build_odd_fsdp_model() -> OddModel:
    torch.manual_seed(3)
    model = OddModel()
    for block in model.blocks:
        fully_shard(block)
    return fully_shard(model)


def build_fsdp_model(seed: int, split_blocks: bool = False, checkpointing: bool = False) -> BlockModel:
    model = build_model(seed)
    dtypes = {"param_dtype": torch.float32, "reduce_dtype": torch.float32}
    return apply_fsdp2(
        model, list(model.blocks), **dtypes, split_blocks=split_blocks, gradient_checkpointing=checkpointing
    )


def fixed_batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1234)
    return torch.randn(BATCH, DIM, generator=gen), torch.randn(BATCH, 2, generator=gen)


def run_ranks(fn: Callable[[int, int, str], dict], world_size: int, out_dir: str, timeout: float = 90.0) -> list[dict]:
    """Run `fn(rank, world_size, out_dir)` on `world_size` spawned gloo ranks; returns what each rank returned."""
    port = find_free_port()
    context = mp.spawn(_entry, args=(fn, world_size, port, out_dir), nprocs=world_size, join=False)
    deadline = time.monotonic() + timeout
    while not context.join(timeout=max(deadline - time.monotonic(), 0.1)):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            raise TimeoutError(f"{fn.__name__} on {world_size} ranks did not finish within {timeout} s")
    return [torch.load(os.path.join(out_dir, f"rank{rank}.pt"), weights_only=False) for rank in range(world_size)]


def _entry(rank: int, fn: Callable[[int, int, str], dict], world_size: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    init_process_group(rank, world_size, "127.0.0.1", port, "cpu", timeout=timedelta(seconds=60))
    try:
        torch.save(fn(rank, world_size, out_dir), os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()  # no rank tears its group down (rank 0: the store) while a peer still uses it
    finally:
        destroy_process_group()
    # The report is on disk: leave without the interpreter's teardown. Gloo threads still owned by objects the
    # collector had not freed were destroyed there and aborted a rank once in CI ("terminate called without an
    # active exception", SIGABRT after a passing body).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def trained_fsdp(rank: int, world_size: int, **sharding: bool) -> tuple[BlockModel, list[float]]:
    """The block model after 2 AdamW steps with FSDP2, each rank on its slice of the batch, and its gradient norms."""
    model = build_fsdp_model(0, **sharding)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    x, y = fixed_batch()
    x_local, y_local = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
    norms = []
    for _ in range(TRAIN_STEPS):
        optimizer.zero_grad()
        per_sample = ((model(x_local) - y_local) ** 2).mean(dim=1)
        # FSDP averages gradients over ranks: scale the local sum so the average is the full-batch mean.
        (per_sample.sum() * world_size / BATCH).backward()
        norms.append(clip_grad_norm_(model.parameters(), MAX_NORM))
        optimizer.step()
    return model, norms


def train_fsdp(rank: int, world_size: int, out_dir: str) -> dict[str, Any]:
    """Train the block model with FSDP2 (`trained_fsdp`), also with each block's children grouped apart
    (`split_blocks`, without and with activation checkpointing); report what happened."""
    model, norms = trained_fsdp(rank, world_size)
    all_dtensor = all(type(p).__name__ == "DTensor" for p in model.parameters())
    split, split_norms = trained_fsdp(rank, world_size, split_blocks=True)
    recomputed, recomputed_norms = trained_fsdp(rank, world_size, split_blocks=True, checkpointing=True)
    full_every_rank = full_state_dict(model, cpu_offload=False)
    full_rank0_only = full_state_dict(model)
    source = {k: v.clone() for k, v in full_rank0_only.items()}
    other = build_fsdp_model(99)
    load_full_state_dict(other, source)
    reloaded = full_state_dict(other, cpu_offload=False)
    per_tensor = StateDictOptions(full_state_dict=True, cpu_offload=True)
    odd = build_odd_fsdp_model()
    return {
        "per_tensor": get_model_state_dict(model, options=per_tensor),
        # 1 byte: a bucket per tensor; 200 bytes: several per bucket; 1 GB: one bucket
        "bucketed": [bucketed_full_state_dict(model, bucket_bytes=size) for size in (1, 200, 1 << 30)],
        "odd_per_tensor": get_model_state_dict(odd, options=per_tensor),
        "odd_bucketed": bucketed_full_state_dict(odd),
        "all_dtensor": all_dtensor,
        "norms": norms,
        "full": {k: v.detach().cpu().clone() for k, v in full_every_rank.items()},
        "split": (split_norms, full_state_dict(split, cpu_offload=False)),
        "split_checkpointed": (recomputed_norms, full_state_dict(recomputed, cpu_offload=False)),
        "rank0_only_keys": sorted(full_rank0_only),
        "rank0_only": full_rank0_only,
        "source_untouched": all(type(v) is torch.Tensor for v in source.values()),
        "reloaded": {k: v.detach().cpu().clone() for k, v in reloaded.items()},
    }


def build_trainer(seed: int) -> tuple[BlockModel, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    model = build_fsdp_model(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    return model, optimizer, scheduler


def noisy_step(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, rank: int, world_size: int) -> None:
    """One step whose data noise draws from the torch, python and numpy RNGs, so resuming needs all three."""
    x, y = fixed_batch()
    x_local, y_local = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
    scale = 1.0 + 0.1 * random.random() + 0.1 * float(np.random.rand())
    x_local = scale * x_local + 0.1 * torch.randn_like(x_local)
    optimizer.zero_grad()
    per_sample = ((model(x_local) - y_local) ** 2).mean(dim=1)
    (per_sample.sum() * world_size / BATCH).backward()
    clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    scheduler.step()


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any) -> dict[str, Any]:
    """Full (gathered) parameters and optimizer state, scheduler state and this rank's RNG states, on CPU."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=False)
    optim_state = get_optimizer_state_dict(model, optimizer, options=options)
    return {
        "params": {k: v.detach().cpu().clone() for k, v in full_state_dict(model, cpu_offload=False).items()},
        "optimizer": _to_cpu(optim_state),
        "scheduler": scheduler.state_dict(),
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()},
    }


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def one_rank_fills(rank: int, save_dir: str, model: nn.Module, optimizer: Any, scheduler: Any) -> str:
    """Rank 1's device fills while it writes its RNG file of rollout 4 (rank 0's writes went through): what each
    rank raised. Every rank must raise the same error rather than wait in a collective for rank 1."""
    real = checkpoint_save.write_tree

    def full(encoded: Any, stem: str) -> None:
        if rank == 1 and os.path.basename(stem).startswith("rng"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(encoded, stem)

    checkpoint_save.write_tree = full
    try:
        save_checkpoint(save_dir, 4, "actor", model=model, optimizer=optimizer, lr_scheduler=scheduler)
    except CheckpointSpaceError as exc:
        return str(exc)
    finally:
        checkpoint_save.write_tree = real
    return "saved"


def save_and_resume(rank: int, world_size: int, out_dir: str) -> dict[str, Any]:
    """Train, save at rollout 3, then resume (in place after mutating, and into fresh objects) and step again."""
    save_dir = os.path.join(out_dir, "ckpt")
    model, optimizer, scheduler = build_trainer(0)
    torch.manual_seed(100 + rank)
    random.seed(200 + rank)
    np.random.seed(300 + rank)
    for _ in range(2):
        noisy_step(model, optimizer, scheduler, rank, world_size)
    extra = {"ema": {"head.weight": torch.ones(2, DIM)}, "data_source": {"epoch": 1, "offset": 5}}
    save_checkpoint(
        save_dir, 3, "actor", model=model, optimizer=optimizer, lr_scheduler=scheduler, extra=extra,
        meta={"loss_type": "sft_loss"},
    )  # fmt: skip
    write_latest(save_dir, 3)
    saved = snapshot(model, optimizer, scheduler)
    noisy_step(model, optimizer, scheduler, rank, world_size)
    uninterrupted = snapshot(model, optimizer, scheduler)["params"]

    # In place: move every piece of state away from the save, then load.
    noisy_step(model, optimizer, scheduler, rank, world_size)
    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)
    loaded = load_checkpoint(save_dir, "actor", model=model, optimizer=optimizer, lr_scheduler=scheduler)
    restored_in_place = snapshot(model, optimizer, scheduler)
    noisy_step(model, optimizer, scheduler, rank, world_size)
    resumed_in_place = snapshot(model, optimizer, scheduler)["params"]

    # Fresh objects, as a new process would build them.
    model, optimizer, scheduler = build_trainer(5)
    torch.manual_seed(7)
    load_checkpoint(save_dir, "actor", model=model, optimizer=optimizer, lr_scheduler=scheduler, rollout_id=3)
    restored_fresh = snapshot(model, optimizer, scheduler)
    noisy_step(model, optimizer, scheduler, rank, world_size)
    resumed_fresh = snapshot(model, optimizer, scheduler)["params"]

    # Weights only: the optimizer and schedule keep their own state.
    model, optimizer, scheduler = build_trainer(6)
    noisy_step(model, optimizer, scheduler, rank, world_size)
    before = snapshot(model, optimizer, scheduler)
    load_checkpoint(save_dir, "actor", model=model, optimizer=optimizer, lr_scheduler=scheduler, load_optimizer=False)
    weights_only = snapshot(model, optimizer, scheduler)
    return {
        "full_disk": one_rank_fills(rank, save_dir, model, optimizer, scheduler),
        "saved": saved,
        "uninterrupted": uninterrupted,
        "loaded": {"rollout_id": loaded.rollout_id, "extra": loaded.extra, "meta": loaded.meta},
        "restored_in_place": restored_in_place,
        "resumed_in_place": resumed_in_place,
        "restored_fresh": restored_fresh,
        "resumed_fresh": resumed_fresh,
        "weights_only_before": before,
        "weights_only": weights_only,
    }
