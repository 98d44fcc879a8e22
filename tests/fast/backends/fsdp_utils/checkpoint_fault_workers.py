"""Rank bodies and helpers of the checkpoint fault tests: damage a saved checkpoint, then load it on every rank."""

from __future__ import annotations

import json
import os
import time
import zlib
from typing import Any

import torch.distributed as dist
from torch import nn

from miles.backends.fsdp_utils.checkpoint import checkpoint_dir, load_checkpoint, save_checkpoint, write_latest
from miles.backends.fsdp_utils.fsdp import apply_fsdp2
from tests.fast.backends.fsdp_utils.fsdp_workers import DIM, build_trainer, noisy_step


class LayeredModel(nn.Module):
    """A stand-in for a diffusers model: blocks plus a public `config` with its layer count."""

    def __init__(self, num_layers: int) -> None:
        super().__init__()
        self.config = {"num_layers": num_layers, "dim": DIM}
        self.blocks = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(num_layers))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def build_layered(num_layers: int) -> dict[str, Any]:
    model = LayeredModel(num_layers)
    apply_fsdp2(model, list(model.blocks), param_dtype=None, reduce_dtype=None)
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return {"model": model, "optimizer": optimizer, "lr_scheduler": None}


def flip_bytes(path: str, count: int = 64) -> None:
    """XOR `count` bytes in the middle of a file (tensor data, for a DCP shard)."""
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        middle = len(data) // 2
        for i in range(middle, min(middle + count, len(data))):
            data[i] ^= 0xFF
        f.seek(0)
        f.write(data)


def relist(role_dir: str, name: str) -> None:
    """Update the manifest entry of `name` to its current bytes, as a crafted or re-written checkpoint would."""
    manifest_path = os.path.join(role_dir, "manifest.json")
    with open(manifest_path) as f:
        manifest = json.load(f)
    with open(os.path.join(role_dir, name), "rb") as f:
        data = f.read()
    manifest["files"][name] = {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}
    with open(manifest_path, "w") as f:
        json.dump(manifest, f)


def damaged_checkpoint_loads(rank: int, world_size: int, out_dir: str) -> dict[str, Any]:
    """Each scenario damages the saved checkpoint on rank 0 and loads it on every rank; reports what each raised."""
    save_dir = os.path.join(out_dir, "ckpt")
    model, optimizer, scheduler = build_trainer(0)
    trainer = {"model": model, "optimizer": optimizer, "lr_scheduler": scheduler}
    noisy_step(model, optimizer, scheduler, rank, world_size)
    role_dir = checkpoint_dir(save_dir, 1, "actor")
    report: dict[str, Any] = {}

    def fresh_save() -> None:
        save_checkpoint(save_dir, 1, "actor", extra={"data_source": {"epoch": 0}}, **trainer)
        write_latest(save_dir, 1)

    def attempt(name: str, damage) -> None:
        fresh_save()
        if rank == 0:
            damage()
        dist.barrier()
        started = time.monotonic()
        try:
            load_checkpoint(save_dir, "actor", **trainer)
            report[name] = None
        except Exception as err:
            report[name] = (type(err).__name__, str(err))
        report[f"{name}_s"] = time.monotonic() - started
        dist.barrier()

    def garbage_rng() -> None:  # parses on rank 1, not on rank 0: the ranks must still finish together
        with open(os.path.join(role_dir, "rng_rank0.json"), "w") as f:
            f.write("\x00garbage")
        relist(role_dir, "rng_rank0.json")

    attempt("garbage_rng", garbage_rng)
    attempt("flipped_shard", lambda: flip_bytes(os.path.join(role_dir, "dcp", "__1_0.distcp")))
    attempt("intact", lambda: None)
    return report
