"""Shadow weights kept next to the FSDP2 shards: the EMA of the trained parameters (`--use-ema`, the EMA `ref`,
EMA rollouts) and DiffusionNFT's old policy, one mechanism for both; plus the EMA decay schedules."""

from __future__ import annotations

import argparse
import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from miles.backends.fsdp_utils.gather import full_state_dict as gather_full_state_dict
from miles.diffusion.shadow import ema_update_

logger = logging.getLogger(__name__)

EMA_WARMUPS = ("none", "power")


def ema_decay(step: int, *, decay: float, warmup: str | None = None) -> float:
    """EMA decay after optimizer step `step` (from 0): constant `decay`, or with `warmup="power"` the usual
    min(decay, (1 + step) / (10 + step)), so early averages do not cling to the initial weights."""
    if not 0.0 <= decay <= 1.0:
        raise ValueError(f"--ema-decay must lie in [0, 1], got {decay}")
    if warmup in (None, "none"):
        return decay
    if warmup == "power":
        return min(decay, (1.0 + step) / (10.0 + step))
    raise ValueError(f"--ema-warmup {warmup!r} is unknown; use one of {EMA_WARMUPS}")


@dataclass(frozen=True)
class EmaConfig:
    """The `--use-ema` settings: whether to keep an EMA, its decay, warm-up and update interval (optimizer steps)."""

    enabled: bool = False
    decay: float = 0.995
    warmup: str = "none"
    update_interval: int = 1

    def __post_init__(self) -> None:
        ema_decay(0, decay=self.decay, warmup=self.warmup)  # validates both
        if self.update_interval < 1:
            raise ValueError(f"--ema-update-interval must be >= 1, got {self.update_interval}")

    def due(self, steps_done: int) -> bool:
        """Whether to update once `steps_done` optimizer steps (counted from 1, the trunk's global_step) are done."""
        return self.enabled and steps_done % self.update_interval == 0

    def decay_at(self, steps_done: int) -> float:
        """The decay for the update after `steps_done` optimizer steps (the first step is warm-up step 0)."""
        return ema_decay(steps_done - 1, decay=self.decay, warmup=self.warmup)


def ema_config_from_args(args: argparse.Namespace) -> EmaConfig:
    """`--use-ema`, `--ema-decay`, `--ema-warmup`, `--ema-update-interval`."""
    return EmaConfig(
        enabled=bool(args.use_ema),
        decay=float(args.ema_decay),
        warmup=str(args.ema_warmup),
        update_interval=int(args.ema_update_interval),
    )


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The rank's own storage of a parameter (the shard of a DTensor, the tensor itself otherwise); writable, for
    reads and in-place writes without gradients. The shard itself: `to_local()` would make a view of it through an
    autograd function on every call (thousands per step over a real model's parameters)."""
    if not isinstance(tensor, DTensor):
        return tensor
    return tensor._local_tensor


def reshard(model: nn.Module) -> None:
    """Put every FSDP2 module of `model` back to its sharded parameters, so the next forward gathers them anew.

    After a forward the root stays unsharded (no reshard after forward); writes into the shards would not be seen."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def swap_bits_(a: torch.Tensor, b: torch.Tensor) -> None:
    """Exchange the contents of two tensors of one dtype and shape in place, bit for bit, with no third buffer
    (a ^= b; b ^= a; a ^= b on integer views of the same bytes)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        raise ValueError(
            f"swap_bits_ needs one dtype and shape, got {a.dtype}{tuple(a.shape)} and {b.dtype}{tuple(b.shape)}"
        )
    x, y = a.view(_SAME_SIZE_INT[a.element_size()]), b.view(_SAME_SIZE_INT[b.element_size()])
    x.bitwise_xor_(y)
    y.bitwise_xor_(x)
    x.bitwise_xor_(y)


class ShadowWeights:
    """float32 copies of a model's trainable parameters exactly as this rank stores them (FSDP2 shards, no gather).

    θ_s ← d·θ_s + (1 − d)·θ with `update(d)`; `swapped_in(model)` runs forwards (or an export) with θ_s in place.
    Build it after `apply_fsdp2` (and after `apply_lora`: only parameters with `requires_grad` are shadowed)."""

    def __init__(self, model: nn.Module) -> None:
        reshard(model)
        # The sharded Parameter objects persist across FSDP2's (un)shard swaps: the optimizer holds the same ones.
        self._params: dict[str, nn.Parameter] = {n: p for n, p in model.named_parameters() if p.requires_grad}
        if not self._params:
            raise ValueError(f"{type(model).__name__} has no trainable parameters to shadow")
        with torch.no_grad():
            self._shadow: dict[str, torch.Tensor] = {
                n: local_tensor(p).detach().to(torch.float32).clone(memory_format=torch.contiguous_format)
                for n, p in self._params.items()
            }
        numel = sum(t.numel() for t in self._shadow.values())
        logger.info("shadow weights: %d tensors, %d local elements (float32)", len(self._shadow), numel)

    def __len__(self) -> int:
        return len(self._shadow)

    def tensors(self) -> list[torch.Tensor]:
        """The rank's θ_s tensors (what a sleep moves to the host)."""
        return list(self._shadow.values())

    @torch.no_grad()
    def update(self, decay: float) -> None:
        """θ_s ← decay·θ_s + (1 − decay)·θ on the local shards; decay 0 copies the live weights exactly."""
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"shadow decay must lie in [0, 1], got {decay}")
        if decay == 0.0:
            self.copy_from_model()
            return
        ema_update_(self._shadow.values(), [local_tensor(p) for p in self._params.values()], decay)

    @torch.no_grad()
    def copy_from_model(self) -> None:
        """θ_s ← θ (NFT's `old = current`, or re-initialising an EMA)."""
        for name, param in self._params.items():
            self._shadow[name].copy_(local_tensor(param))

    @contextlib.contextmanager
    def swapped_in(self, model: nn.Module) -> Iterator[nn.Module]:
        """Inside the block `model`'s trainable parameters hold θ_s (cast to their dtype); afterwards the live values
        are back bitwise. Safe between a policy forward and its backward: FSDP2 re-gathers the live values.

        A float32 parameter and its shadow exchange their bits in place (`swap_bits_`): no copy of the shards, and
        inside the block the shadow holds the live values. A parameter of another dtype keeps a copy of its live
        shard for the block (half θ_s's bytes for bf16)."""
        reshard(model)
        self._check_model(model)
        swapped = [n for n, p in self._params.items() if local_tensor(p).dtype == self._shadow[n].dtype]
        with torch.no_grad():
            live = {n: local_tensor(p).clone() for n, p in self._params.items() if n not in swapped}
            for name, param in self._params.items():
                if name in live:
                    local_tensor(param).copy_(self._shadow[name])
                else:
                    swap_bits_(local_tensor(param), self._shadow[name])
        try:
            yield model
        finally:
            reshard(model)  # drop gathered copies of θ_s before the live values come back
            with torch.no_grad():
                for name in swapped:
                    swap_bits_(local_tensor(self._params[name]), self._shadow[name])
                for name, value in live.items():
                    local_tensor(self._params[name]).copy_(value)

    def network(self, model: nn.Module) -> ShadowNetwork:
        """`model` with θ_s swapped in for each call: the frozen `ref` / `old` entry of the trunk's networks."""
        return ShadowNetwork(model, self)

    def full_state_dict(self, model: nn.Module, *, cpu_offload: bool = True, **gather: Any) -> dict[str, torch.Tensor]:
        """The whole model's full state dict with θ_s in place of the trainable parameters (collective), e.g. EMA
        weights for the rollout engine or `--save-hf`; rank 0 only unless `cpu_offload=False`, like `gather.full_state_dict`
        (whose `keep` / `as_dtype` it passes on)."""
        with self.swapped_in(model):
            state = gather_full_state_dict(model, cpu_offload=cpu_offload, **gather)
            # entries may alias the parameters, which change back on exit
            return {k: v.clone() if k in self._params else v for k, v in state.items()}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Rank-local θ_s: DTensors (sharing the shadow's storage) for sharded parameters, tensors otherwise.

        Save it with torch.distributed.checkpoint next to the model (reshards on load, any world size), or per rank
        with torch.save (loads at the same world size)."""
        out: dict[str, torch.Tensor] = {}
        for name, param in self._params.items():
            shadow = self._shadow[name]
            if isinstance(param, DTensor):
                out[name] = DTensor.from_local(
                    shadow,
                    param.device_mesh,
                    param.placements,
                    run_check=False,
                    shape=param.shape,
                    stride=param.stride(),
                )
            else:
                out[name] = shadow
        return out

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore θ_s from `state_dict()` output (DTensors, or this rank's local shards as plain tensors)."""
        missing, unexpected = sorted(set(self._shadow) - set(state)), sorted(set(state) - set(self._shadow))
        if missing or unexpected:
            raise KeyError(f"shadow state does not match the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
        for name, value in state.items():
            local = value.to_local() if isinstance(value, DTensor) else value
            if local.shape != self._shadow[name].shape:
                raise ValueError(
                    f"shadow {name}: local shard {tuple(local.shape)} != {tuple(self._shadow[name].shape)}; a per-rank "
                    "save loads only at the same world size (use torch.distributed.checkpoint to reshard)"
                )
            self._shadow[name].copy_(local)

    def _check_model(self, model: nn.Module) -> None:
        current = dict(model.named_parameters())
        if any(current.get(n) is not p for n, p in self._params.items()):
            raise ValueError("swapped_in got a different model from the one these shadow weights were built for")


class ShadowNetwork(nn.Module):
    """A frozen view of `model` that forwards with the shadow weights swapped in (call it under `no_grad`)."""

    def __init__(self, model: nn.Module, shadow: ShadowWeights) -> None:
        super().__init__()
        self.model = model
        self._shadow_weights = shadow

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():
            raise RuntimeError("a shadow-weight network is frozen: call it under torch.no_grad()")
        with self._shadow_weights.swapped_in(self.model):
            return self.model(*args, **kwargs)
