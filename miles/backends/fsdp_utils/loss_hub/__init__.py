"""The loss hub: hooks keyed by (loss type, role), and the start-up check of their signatures."""

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
#                                  train_output_inputs, write_old_log_prob=False, old_log_prob_from_new=False,
#                                  **kwargs) -> Tensor | None
TrainInputFn = Callable[..., Any]  # (ctx, train_pairs) -> train_pairs
TrainOutputFn = Callable[..., Any]  # (ctx, train_pairs, train_output_inputs) -> Any


def identity_train_input(ctx: Any, train_pairs: Any) -> Any:
    return train_pairs


def default_train_output(ctx: Any, train_pairs: Any, train_output_inputs: list) -> Any:
    """By default a group hands the next group nothing."""
    return None


@dataclass(frozen=True)
class LossHooks:
    prepare: PrepareFn
    formula: FormulaFn
    train_input: TrainInputFn = identity_train_input
    train_output: TrainOutputFn = default_train_output


LOSS_HOOKS: dict[tuple[str, str], LossHooks] = {
    ("sft_loss", "actor"): LossHooks(prepare=sft.prepare_sft_batch, formula=sft.sft_formula),
    ("policy_loss", "actor"): LossHooks(prepare=flow_grpo.prepare_policy_batch, formula=flow_grpo.policy_formula),
    ("nft", "actor"): LossHooks(prepare=nft.prepare_nft_batch, formula=nft.nft_formula),
    ("dmd2", "critic"): LossHooks(
        prepare=dmd2.prepare_critic_batch,
        formula=dmd2.critic_formula,
        train_input=dmd2.tile_critic_pairs,
        train_output=dmd2.critic_train_output,
    ),
    ("dmd2", "actor"): LossHooks(prepare=dmd2.prepare_generator_batch, formula=dmd2.generator_formula),
}

# What each hook must accept (by name, or through **kwargs): the trunk passes all of these.
REQUIRED_KEYWORDS = {
    "prepare": ("microbatch_id", "optim_step_idx"),
    "formula": (
        "new_pred",
        "ref_pred",
        "metrics",
        "optim_step_idx",
        "train_output_inputs",
        "write_old_log_prob",
        "old_log_prob_from_new",
    ),
}
REQUIRED_POSITIONAL = {"prepare": 2, "formula": 3, "train_input": 2, "train_output": 3}


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
    }[name]


def check_loss_hooks(hooks: LossHooks, sources: dict[str, str] | None = None) -> None:
    sources = sources or {}
    for name in ("prepare", "formula", "train_input", "train_output"):
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
    return LossHooks(**loaded), {name: repr(path) for name, path in paths.items() if path}


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
