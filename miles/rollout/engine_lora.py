"""The rollout engine's LoRA adapter (`--use-lora`): injected into the engine's transformer as the trainer's is, and
the map from the names the trainer sends (the engine's own, PEFT's adapter-less export names, diffusers' files'
`transformer.`-prefixed keys) to the transformer's parameters, which a weight update or sync writes into."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from miles.models.lora_targets import check_lora_targets
from miles.utils.weight_checksum import WeightSyncError
from miles.weight_sync.protocol import SyncPlan


class EngineLora:
    """The adapter injected into `transformer` from `lora_config` (PEFT's `LoraConfig` arguments)."""

    def __init__(self, transformer: nn.Module, lora_config: dict[str, Any]) -> None:
        from peft import LoraConfig  # local: peft costs ~1.3 s per process and only LoRA engines need it

        check_lora_targets(transformer, lora_config["target_modules"], "the rollout engine's transformer")
        # add_adapter is diffusers' PEFT mixin's; mypy sees an nn.Module, whose unknown attributes are tensors
        transformer.add_adapter(LoraConfig(**lora_config))  # type: ignore[operator]
        names = [n for n, _ in transformer.named_parameters() if "lora_" in n]
        self.transformer = transformer
        # accept the engine's own names and PEFT's adapter-less export names (".lora_A.weight")
        self.names: dict[str, str] = {n: n for n in names} | {n.replace(".default.", "."): n for n in names}

    @staticmethod
    def key(key: str) -> str:
        return key.removeprefix("transformer.")  # diffusers' LoRA files prefix keys with the component name

    def sync_targets(self, plan: SyncPlan) -> dict[str, torch.Tensor]:
        """The LoRA weights a sync writes into, by the names the trainer sends (a plan must carry every one)."""
        params: dict[str, torch.Tensor] = dict(self.transformer.named_parameters())
        targets = {k: params[self.names[self.key(k)]] for k in plan.names if self.key(k) in self.names}
        missing = sorted(set(self.names.values()) - {self.names[self.key(k)] for k in targets})
        if missing:
            raise WeightSyncError(f"the weight sync is missing {len(missing)} LoRA weights, e.g. {missing[:3]}")
        return targets

    def load(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copy the adapter's weights in; the parameters they were copied into, by the keys of `weights`. Every
        exported adapter tensor must have a weight in this engine's adapter and every weight of it must be sent
        (else it would keep its init)."""
        unknown = sorted(k for k in weights if self.key(k) not in self.names)
        if unknown:
            raise WeightSyncError(
                f"update_weights got {len(unknown)} adapter tensors this engine's adapter has no weight for, e.g. "
                f"{unknown[:3]}: the trainer's and the engine's LoRA targets differ (a LoRA engine takes only keys "
                "containing 'lora_')"
            )
        targets = {self.names[self.key(k)]: v for k, v in weights.items()}
        missing = sorted(set(self.names.values()) - set(targets))
        if missing:
            raise WeightSyncError(f"update_weights is missing {len(missing)} LoRA weights, e.g. {missing[:3]}")
        params: dict[str, torch.Tensor] = dict(self.transformer.named_parameters())
        for name, value in targets.items():
            params[name].copy_(value.to(device=params[name].device, dtype=params[name].dtype))
        return {key: params[self.names[self.key(key)]] for key in weights}
