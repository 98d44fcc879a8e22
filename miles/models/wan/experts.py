"""Wan 2.2's two experts as one network: `WanExperts` routes each row to its expert by its timestep, as
`WanPipeline` does (the family that loads it: `miles.models.wan.wan`)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

HIGH_NOISE, LOW_NOISE = "transformer", "transformer_2"  # the experts' pipeline components and submodule names


class WanExperts(nn.Module):
    """Wan 2.2's two experts as one network: `transformer` (high noise) and `transformer_2` (low noise).

    `forward` takes the transformer's arguments and sends each row to its expert by its timestep: rows with
    timestep >= `boundary_timestep` to `transformer`, the others to `transformer_2` (WanPipeline's rule). Its
    state dict holds both (`transformer.*`, `transformer_2.*`), so weight sync and checkpoints carry both.

    Sharded over several ranks (FSDP2), every expert runs in every forward, on a single row scaled by zero when
    none of the rank's rows is its: each expert's parameter gathers are collectives, and ranks whose rows route
    differently must still issue the same ones.
    """

    def __init__(self, transformer: nn.Module, transformer_2: nn.Module, boundary_timestep: float) -> None:
        super().__init__()
        self.transformer = transformer
        self.transformer_2 = transformer_2
        self.boundary_timestep = float(boundary_timestep)

    def forward(
        self,
        hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        return_dict: bool = False,
        **kwargs: Any,
    ) -> tuple[torch.Tensor]:
        batch = hidden_states.shape[0]
        route = timestep.reshape(batch, -1)[:, 0]  # Wan 2.2 TI2V expands the timestep per token, all equal
        high = route >= self.boundary_timestep
        every_expert = isinstance(self, FSDPModule) and dist.is_initialized() and dist.get_world_size() > 1
        parts, zero = [], None
        for expert, rows in ((self.transformer, high), (self.transformer_2, ~high)):
            index = rows.nonzero().squeeze(1)
            if index.numel() == 0 and every_expert:  # keep this rank's collectives in step with the others'
                index = index.new_zeros(1)
                out = self._run(expert, hidden_states, timestep, encoder_hidden_states, index, kwargs)
                zero = out.sum() * 0.0 if zero is None else zero + out.sum() * 0.0
            elif index.numel() > 0:
                parts.append((index, self._run(expert, hidden_states, timestep, encoder_hidden_states, index, kwargs)))
        if len(parts) == 1 and parts[0][0].numel() == batch:
            pred = parts[0][1]
        else:
            pred = parts[0][1].new_zeros((batch, *parts[0][1].shape[1:]))
            for index, out in parts:
                pred = pred.index_copy(0, index, out)
        return (pred if zero is None else pred + zero,)

    @staticmethod
    def _run(expert, hidden_states, timestep, encoder_hidden_states, index, kwargs) -> torch.Tensor:
        """The expert's output on rows `index` (all rows without a copy when they are all of them); tensor keywords
        (the image-to-video pipelines' `encoder_hidden_states_image`) are per row too."""
        if index.numel() != hidden_states.shape[0]:
            hidden_states, timestep = hidden_states[index], timestep[index]
            encoder_hidden_states = encoder_hidden_states[index]
            kwargs = {k: v[index] if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        return expert(
            hidden_states=hidden_states,
            timestep=timestep,
            encoder_hidden_states=encoder_hidden_states,
            return_dict=False,
            **kwargs,
        )[0]
