"""The loss hub: one entry per (loss type, role) declaring the hooks and what the trunk must hold and do for
them (frozen networks, a per-rollout step, the engines' weights), and the start-up check of their signatures."""

from __future__ import annotations

import argparse
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from miles.backends.fsdp_utils.loss_hub import dmd2, flow_grpo, nft, sft
from miles.utils.misc import load_function

PrepareFn = Callable[..., Any]  # (ctx, batch, *, microbatch_id, optim_step_idx, pad_to_len=None) -> PreparedBatch
FormulaFn = Callable[..., Any]  # (ctx, batch, prepared, *, new_pred, ref_pred, metrics, optim_step_idx,
#                                  frozen_preds, train_output_inputs, write_old_log_prob=False,
#                                  old_log_prob_from_new=False, **kwargs) -> Tensor | None
TrainInputFn = Callable[..., Any]  # (ctx, train_pairs) -> train_pairs
TrainOutputFn = Callable[..., Any]  # (ctx, train_pairs, train_output_inputs) -> Any
AfterTrainFn = Callable[..., Any]  # (ctx, *, global_step) -> {shadow network: decay d}, once per rollout

# Frozen networks an entry may declare. `teacher` is loaded from --teacher-load (when given); a shadow is a copy of
# the trained weights that only the per-rollout step moves (θ_s ← d·θ_s + (1 − d)·θ). `ref` (LoRA base or EMA,
# from --ref-mode) is not declared: every role holds it when --ref-mode asks.
TEACHER = "teacher"
SHADOW_NETWORKS = ("old",)
FROZEN_NETWORKS = (TEACHER, *SHADOW_NETWORKS)


def identity_train_input(ctx: Any, train_pairs: Any) -> Any:
    return train_pairs


def default_train_output(ctx: Any, train_pairs: Any, train_output_inputs: list) -> Any:
    """By default a group hands the next group nothing."""
    return None


def no_after_train(ctx: Any, *, global_step: int) -> dict[str, float]:
    return {}


@dataclass(frozen=True)
class LossHooks:
    """What one (loss type, role) needs from the trunk: its hooks, and declarations the trunk acts on.

    - `frozen_networks`: names from FROZEN_NETWORKS this role holds besides `policy` (and `ref`); a prepare names
      the ones a micro-batch needs (`PreparedBatch.ref_network`, `.frozen_networks`), the trunk runs their forwards.
    - `after_train`: once per rollout after the last window, returns the decay of each shadow network to update.
    - `engine_weights`: the shadow network the rollout engines sample with (None: the trained weights, or their
      EMA with --ema-rollout-policy ema).
    """

    prepare: PrepareFn
    formula: FormulaFn
    train_input: TrainInputFn = identity_train_input
    train_output: TrainOutputFn = default_train_output
    frozen_networks: tuple[str, ...] = ()
    after_train: AfterTrainFn = no_after_train
    engine_weights: str | None = None

    def __post_init__(self) -> None:
        unknown = [n for n in self.frozen_networks if n not in FROZEN_NETWORKS]
        if unknown:
            raise ValueError(f"LossHooks.frozen_networks {unknown} unknown; choose from {FROZEN_NETWORKS}")
        if self.engine_weights is not None and self.engine_weights not in self.frozen_networks:
            raise ValueError(
                f"LossHooks.engine_weights {self.engine_weights!r} must be one of its shadow frozen_networks "
                f"{[n for n in self.frozen_networks if n in SHADOW_NETWORKS]}"
            )

    @property
    def shadows(self) -> tuple[str, ...]:
        """The declared shadow networks (copies of the trained weights kept by the trunk)."""
        return tuple(n for n in self.frozen_networks if n in SHADOW_NETWORKS)


LOSS_HOOKS: dict[tuple[str, str], LossHooks] = {
    ("sft_loss", "actor"): LossHooks(prepare=sft.prepare_sft_batch, formula=sft.sft_formula),
    ("policy_loss", "actor"): LossHooks(prepare=flow_grpo.prepare_policy_batch, formula=flow_grpo.policy_formula),
    ("nft", "actor"): LossHooks(
        prepare=nft.prepare_nft_batch,
        formula=nft.nft_formula,
        frozen_networks=(nft.OLD_NETWORK,),
        after_train=nft.decay_old_policy,
        engine_weights=nft.OLD_NETWORK,  # DiffusionNFT samples its rollouts with the old policy
    ),
    ("dmd2", "critic"): LossHooks(
        prepare=dmd2.prepare_critic_batch,
        formula=dmd2.critic_formula,
        train_input=dmd2.tile_critic_pairs,
        train_output=dmd2.critic_train_output,
        frozen_networks=(TEACHER,),
    ),
    ("dmd2", "actor"): LossHooks(prepare=dmd2.prepare_generator_batch, formula=dmd2.generator_formula),
}

# What each hook must accept (by name, or through **kwargs): the trunk passes all of these.
REQUIRED_KEYWORDS = {
    "prepare": ("microbatch_id", "optim_step_idx"),
    "formula": (
        "new_pred",
        "ref_pred",
        "frozen_preds",
        "metrics",
        "optim_step_idx",
        "train_output_inputs",
        "write_old_log_prob",
        "old_log_prob_from_new",
    ),
    "after_train": ("global_step",),
}
REQUIRED_POSITIONAL = {"prepare": 2, "formula": 3, "train_input": 2, "train_output": 3, "after_train": 1}


class HookSignatureError(TypeError):
    """A hook cannot be called the way the trunk calls it."""


def check_hook_signature(name: str, fn: Callable[..., Any], source: str) -> None:
    """Reject at start-up a hook the trunk could not call, naming the file, the hook and what is missing."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return
    kinds = {p.kind for p in params}
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    wanted = REQUIRED_POSITIONAL[name]
    if len(positional) < wanted and inspect.Parameter.VAR_POSITIONAL not in kinds:
        raise HookSignatureError(
            f"{name} hook {source}: takes {len(positional)} positional parameter(s), the trunk passes {wanted} "
            f"({_positional_doc(name)})"
        )
    if inspect.Parameter.VAR_KEYWORD in kinds:
        return
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    missing = [kw for kw in REQUIRED_KEYWORDS.get(name, ()) if kw not in names]
    if missing:
        raise HookSignatureError(
            f"{name} hook {source}: missing keyword parameter(s) {', '.join(missing)} "
            "(see docs/user-guide/customization.md; add them, or accept **kwargs)"
        )


def _positional_doc(name: str) -> str:
    return {
        "prepare": "ctx, batch",
        "formula": "ctx, batch, prepared",
        "train_input": "ctx, train_pairs",
        "train_output": "ctx, train_pairs, train_output_inputs",
        "after_train": "ctx",
    }[name]


def check_loss_hooks(hooks: LossHooks, sources: dict[str, str] | None = None) -> None:
    sources = sources or {}
    for name in ("prepare", "formula", "train_input", "train_output", "after_train"):
        fn = getattr(hooks, name)
        check_hook_signature(name, fn, sources.get(name, getattr(fn, "__qualname__", repr(fn))))


def _custom_loss_hooks(args: argparse.Namespace) -> tuple[LossHooks, dict[str, str]]:
    paths = {
        "prepare": args.custom_prepare_train_batch_path,
        "formula": args.custom_loss_function_path,
        "train_input": args.custom_train_input_postprocess_path,
        "train_output": args.custom_train_output_path,
    }
    if not paths["prepare"] or not paths["formula"]:
        raise ValueError(
            "--loss-type custom_loss requires --custom-prepare-train-batch-path and --custom-loss-function-path"
        )
    loaded = {name: load_function(path) for name, path in paths.items() if path}
    # a custom loss may read the frozen teacher (ctx.networks["teacher"]) when --teacher-load is given
    return LossHooks(**loaded, frozen_networks=(TEACHER,)), {name: repr(path) for name, path in paths.items() if path}


def get_loss_hooks(args: argparse.Namespace, role: str) -> LossHooks:
    """The hooks of (args.loss_type, role), signature-checked; custom_loss loads them from the path flags."""
    if args.loss_type == "custom_loss":
        if role != "actor":
            raise ValueError(f"custom_loss trains only the actor role, not {role!r}")
        hooks, sources = _custom_loss_hooks(args)
    else:
        key = (args.loss_type, role)
        if key not in LOSS_HOOKS:
            known = ", ".join(f"{lt}/{r}" for lt, r in sorted(LOSS_HOOKS))
            raise ValueError(
                f"no loss hooks registered for --loss-type {args.loss_type} role {role!r} (known: {known})"
            )
        hooks, sources = LOSS_HOOKS[key], {}
    check_loss_hooks(hooks, sources)
    return hooks


def checkpoint_meta(args: argparse.Namespace) -> dict[str, Any]:
    """What a role's checkpoint records of the algorithm that wrote it."""
    return {"loss_type": args.loss_type}
