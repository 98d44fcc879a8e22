"""What the rollout engines sample with, as the trainer sends it (`export_weights`, the weight sync, `--save-hf`):
which weights (the declared shadow the loss-hub entry names, EMA weights, or the live ones), which entries (only the
adapter's with LoRA) and in which dtype (the engines' forward dtype, cast before the weights leave the device)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from miles.backends.fsdp_utils.checkpoint_space import export_space_error, tensor_bytes
from miles.backends.fsdp_utils.ema import ShadowWeights
from miles.backends.fsdp_utils.fsdp import keep_in_fp32_names
from miles.backends.fsdp_utils.gather import full_state_dict
from miles.backends.fsdp_utils.lora import is_lora_key, lora_state_dict, save_lora_adapter
from miles.models.base import TrainPipelineConfig
from miles.utils.weight_checksum import TensorChecksum

Keep = Callable[[str], bool] | None
AsDtype = Callable[[str], torch.dtype | None] | None


@dataclass(frozen=True)
class EngineExport:
    """One trainer rank's export of `model` for the engines (collective where it gathers: every rank calls it)."""

    model: nn.Module
    family: TrainPipelineConfig
    rank: int
    forward_dtype: torch.dtype
    lora_config: dict[str, Any] | None
    engine_weights: str | None  # the declared shadow the loss-hub entry names (e.g. NFT's old policy), if any
    shadows: Mapping[str, ShadowWeights]
    ema: ShadowWeights | None
    ema_rollout_policy: str  # --ema-rollout-policy

    def weights_in(self) -> contextlib.AbstractContextManager:
        """The model holding the weights the engines sample with: the declared shadow the loss-hub entry names
        (`engine_weights`, e.g. NFT's old policy), else EMA weights with `--ema-rollout-policy ema`, else the live
        ones."""
        if self.engine_weights is not None:
            return self.shadows[self.engine_weights].swapped_in(self.model)
        if self.ema is not None and self.ema_rollout_policy == "ema":
            return self.ema.swapped_in(self.model)
        return contextlib.nullcontext(self.model)

    def filters(self) -> tuple[Keep, AsDtype]:
        """(keep, as_dtype) of an export: only the LoRA entries with LoRA; the rest in the engines' dtype, cast
        before it leaves the device."""
        return (is_lora_key if self.lora_config is not None else None), self._engine_dtype()

    def _engine_dtype(self) -> AsDtype:
        """`as_dtype` of the weight export: the forward dtype the engines hold their transformer in, except what
        diffusers keeps in fp32 there too and the LoRA adapter (sent as trained); None when that is fp32."""
        if self.forward_dtype == torch.float32:
            return None
        kept = keep_in_fp32_names(self.model)
        return lambda name: None if name in kept or is_lora_key(name) else self.forward_dtype

    def weights(self) -> tuple[dict[str, torch.Tensor] | None, dict[str, TensorChecksum] | None]:
        """(weights, their checksums) for the engines on rank 0, (None, None) elsewhere; collective."""
        checksums: dict[str, TensorChecksum] = {}
        keep, as_dtype = self.filters()
        with self.weights_in():  # the gather returns fresh tensors: nothing aliases the swapped-in shadow
            state = full_state_dict(self.model, keep=keep, as_dtype=as_dtype, checksums=checksums)
        if self.rank != 0:
            return None, None
        if self.lora_config is not None:
            state = lora_state_dict(state)
        return state, {name: checksums[name] for name in state}

    def save_hf(self, out_dir: str) -> str | None:
        """A diffusers pipeline folder with the trained transformer, or a PEFT LoRA adapter folder with LoRA."""
        if self.lora_config is not None:
            state = full_state_dict(self.model, keep=is_lora_key)  # the adapter, as trained
        else:  # cast on the device to the dtypes the folder stores: rank 0 never holds the fp32 masters of bf16 weights
            state = full_state_dict(self.model, as_dtype=self.family.saved_transformer_dtypes().get)
        if self.rank != 0:
            return None
        try:
            os.makedirs(out_dir, exist_ok=True)
            if self.lora_config is not None:
                save_lora_adapter(lora_state_dict(state), self.lora_config, out_dir, self.family.pipeline_class_name)
            else:
                self.family.save_transformer(state, out_dir)
        except Exception as err:  # a full device is named as such, not as a deep writer error
            full = export_space_error(err, "--save-hf", out_dir, tensor_bytes([state]))
            if full is None:
                raise
            raise full from err
        return out_dir
