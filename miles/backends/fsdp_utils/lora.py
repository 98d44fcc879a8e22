"""LoRA on the trained transformer through diffusers' PEFT integration: the config from flags, injection before
FSDP2, the LoRA slice of a full state dict (weight sync), the adapter-free base forward (`--ref-mode lora_base`)
and saving a PEFT adapter folder that `load_lora_weights` reads."""

from __future__ import annotations

import argparse
import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import diffusers
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from miles.models.base import all_family_classes, family_class
from miles.models.lora_targets import check_lora_targets

if TYPE_CHECKING:  # peft is imported where it is used (its import costs ~1.5 s per process)
    from peft.tuners.tuners_utils import BaseTunerLayer

logger = logging.getLogger(__name__)

ADAPTER_NAME = "default"  # the name `add_adapter` gives; it appears in the model's state-dict keys

# Only initialisations that leave the base weights untouched: pissa / olora / corda rewrite W into W - BA, so the
# base would no longer be the checkpoint (wrong `--ref-mode lora_base`, and a LoRA-only weight sync would miss it).
LORA_INIT_WEIGHTS: dict[str, bool | str] = {"true": True, "false": False, "gaussian": "gaussian"}


def is_lora_key(name: str) -> bool:
    """Whether a state-dict entry belongs to the LoRA adapter (`...to_q.lora_A.default.weight`)."""
    return any(part.startswith("lora_") for part in name.split("."))


def default_lora_targets(family_name: str) -> list[str]:
    """The registered model family's `default_lora_targets`; an error naming the flag when it declares none."""
    family = family_class(family_name)
    if family is None or not family.default_lora_targets:
        reason = "is not a registered model family" if family is None else "declares no default LoRA targets"
        raise ValueError(
            f"model family {family_name!r} {reason} (families with defaults: "
            f"{sorted(n for n, c in all_family_classes().items() if c.default_lora_targets)}); "
            "pass --lora-target-modules name1,name2,..."
        )
    return list(family.default_lora_targets)


def lora_config_from_args(args: argparse.Namespace, family_name: str) -> dict[str, Any]:
    """`LoraConfig` keyword arguments from `--lora-rank`, `--lora-alpha`, `--lora-target-modules` (default: the
    family's `default_lora_targets`) and `--lora-init-weights`, without dropout (no flag sets it). Plain JSON-able
    values."""
    rank = int(args.lora_rank)
    if rank <= 0:
        raise ValueError(f"--lora-rank must be positive, got {rank}")
    alpha = args.lora_alpha
    alpha = float(rank) if alpha is None else float(alpha)
    targets = args.lora_target_modules
    if targets is None:
        targets = default_lora_targets(family_name)
    elif isinstance(targets, str):
        targets = [t.strip() for t in targets.split(",") if t.strip()]
    else:
        targets = [str(t) for t in targets]
    if not targets:
        raise ValueError("--lora-target-modules is empty; give module names like to_q,to_k,to_v")
    init = args.lora_init_weights
    key = str(init).lower()
    if key not in LORA_INIT_WEIGHTS:
        raise ValueError(
            f"--lora-init-weights {init!r} is not supported; use one of {sorted(LORA_INIT_WEIGHTS)} "
            "(initialisations that rewrite the base weights, like pissa, would break --ref-mode lora_base and "
            "LoRA-only weight sync)"
        )
    return {
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": targets,
        "init_lora_weights": LORA_INIT_WEIGHTS[key],
        "lora_dropout": 0.0,
    }


def apply_lora(transformer: nn.Module, config: dict[str, Any]) -> nn.Module:
    """Inject a LoRA adapter (`transformer.add_adapter(LoraConfig(**config))`), freeze everything else and keep
    the LoRA parameters in float32. Call it BEFORE `apply_fsdp2`; on a model built on the meta device the adapter
    is real (on the CPU, initialised as on a loaded model) and the base stays empty. Returns `transformer`."""
    if isinstance(transformer, FSDPModule):
        raise RuntimeError("apply_lora must run before apply_fsdp2 (FSDP2 has already sharded this model)")
    on_meta = any(p.is_meta for p in transformer.parameters())
    rng = torch.get_rng_state()
    from peft import LoraConfig  # local: peft (and the transformers it imports) costs every rank ~1.5 s to import

    check_lora_targets(transformer, config["target_modules"], "the trained transformer")
    # diffusers' PeftAdapterMixin method, which the nn.Module annotation does not show
    transformer.add_adapter(LoraConfig(**config), adapter_name=ADAPTER_NAME)  # type: ignore[operator]
    if on_meta:
        torch.set_rng_state(rng)
        _initialise_on_cpu(transformer, config["init_lora_weights"])
    for module in tuner_layers(transformer):
        for layer_name in module.adapter_layer_names:
            getattr(module, layer_name).to(torch.float32)
    trainable = total = 0
    for name, param in transformer.named_parameters():
        is_lora = is_lora_key(name)
        param.requires_grad_(is_lora)
        trainable += param.numel() if is_lora else 0
        total += param.numel()
    if trainable == 0:
        raise ValueError(
            f"LoRA targets {config.get('target_modules')} matched no module of {type(transformer).__name__}"
        )
    logger.info(
        "LoRA applied (r=%s, alpha=%s): %d of %d parameters train", config["r"], config["lora_alpha"], trainable, total
    )
    return transformer


def tuner_layers(model: nn.Module) -> list[BaseTunerLayer]:
    """The modules peft injected (its `BaseTunerLayer`s), in module order."""
    from peft.tuners.tuners_utils import BaseTunerLayer  # local, as in `apply_lora`

    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


def _initialise_on_cpu(transformer: nn.Module, init: bool | str) -> None:
    """Give the adapter of a model built on the meta device (sharded loading) real CPU tensors, initialised as on a
    loaded model. peft draws each adapter's values on the CPU (the `nn.Linear`s' own initialisation, then
    `reset_lora_parameters`) and moves them to the meta device with their base layer, which drops them: the caller
    rewinds the CPU generator to where injection began and the same draws are replayed here, layer by layer in the
    same order, so the values and the generator's state after are those of the loaded model's injection."""
    for module in tuner_layers(transformer):
        for layer_name in ("lora_A", "lora_B"):
            layer = getattr(module, layer_name)[ADAPTER_NAME]
            layer.to_empty(device="cpu")
            layer.reset_parameters()
        module.reset_lora_parameters(ADAPTER_NAME, init)  # type: ignore[attr-defined]  # a LoraConfig's layers are LoraLayers
    left = [name for name, p in transformer.named_parameters() if is_lora_key(name) and p.is_meta]
    if left:
        raise RuntimeError(
            f"LoRA parameters left on the meta device (an adapter kind miles does not build): {left[:3]}"
        )


def lora_state_dict(full_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The LoRA entries of a full model state dict (keys as in the model: `...to_q.lora_A.default.weight`).

    An empty dict stays empty (ranks other than 0 get `{}` from `full_state_dict`)."""
    lora = {k: v for k, v in full_state.items() if is_lora_key(k)}
    if full_state and not lora:
        raise ValueError("the state dict holds no LoRA entries: was apply_lora called on this model?")
    return lora


def load_lora_state_dict(transformer: nn.Module, lora_state: dict[str, torch.Tensor]) -> None:
    """Engine side: copy `lora_state` into an unsharded transformer that got the same `add_adapter(...)`.

    Every LoRA parameter must be given, and nothing else."""
    expected = {k for k in transformer.state_dict() if is_lora_key(k)}
    missing, unexpected = sorted(expected - set(lora_state)), sorted(set(lora_state) - expected)
    if missing or unexpected:
        raise KeyError(
            f"LoRA weights do not match the transformer's adapter: missing {missing[:3]}, unexpected "
            f"{unexpected[:3]} (was add_adapter called with the same LoraConfig?)"
        )
    transformer.load_state_dict(lora_state, strict=False)


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """Run `model` as its LoRA base (the `ref` network of `--ref-mode lora_base`); FSDP2-wrapped models work.

    Sets the PEFT layers' disable flag directly: peft's `enable_adapters(False)` would also flip `requires_grad`
    of the adapter weights, which must stay put between the policy forward and its backward under FSDP2."""
    layers = tuner_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no LoRA layers: nothing to disable")
    previous = [layer._disable_adapters for layer in layers]
    try:
        for layer in layers:
            layer._disable_adapters = True
        yield model
    finally:
        for layer, flag in zip(layers, previous):
            layer._disable_adapters = flag


class LoraBaseNetwork(nn.Module):
    """`model` seen without its adapters: the frozen `ref` entry of the trunk's networks mapping."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with adapters_disabled(self.model):
            return self.model(*args, **kwargs)


def _peft_key(key: str) -> str:
    """`a.lora_A.default.weight` -> `a.lora_A.weight` (the adapter-name-free format of saved PEFT adapters)."""
    parts = key.split(".")
    kept = [p for i, p in enumerate(parts) if not (p == ADAPTER_NAME and i > 0 and parts[i - 1].startswith("lora_"))]
    return ".".join(kept)


def save_lora_adapter(
    lora_state: dict[str, torch.Tensor],
    config: dict[str, Any],
    out_dir: str | Path,
    pipeline_class_name: str = "StableDiffusion3Pipeline",
) -> str:
    """Write `lora_state` (from `lora_state_dict`) as a diffusers LoRA folder (`pytorch_lora_weights.safetensors`
    with the LoraConfig in its metadata) that `<pipeline_class_name>.load_lora_weights(out_dir)` loads.

    Returns `out_dir`."""
    if not lora_state:
        raise ValueError("save_lora_adapter got no LoRA weights (call it on rank 0 with lora_state_dict's result)")
    pipeline_class = getattr(diffusers, pipeline_class_name)
    weights = {_peft_key(k): v.detach().to("cpu").contiguous() for k, v in lora_state.items()}
    # The loader builds its LoraConfig from this metadata; without it alpha would be guessed as the rank.
    metadata = {**config, "target_modules": list(config["target_modules"]), "init_lora_weights": True}
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    pipeline_class.save_lora_weights(
        str(out_dir), transformer_lora_layers=weights, transformer_lora_adapter_metadata=metadata
    )
    logger.info("saved LoRA adapter (%d tensors) to %s", len(weights), out_dir)
    return str(out_dir)
