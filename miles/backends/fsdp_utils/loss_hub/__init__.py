"""The loss hub: one entry per (loss type, role) with its hooks and what the trunk does for them (a per-rollout step,
the engines' weights), checked at start-up against the hooks' signatures and the algorithm's declaration."""

from __future__ import annotations

import argparse
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from miles.algorithms import Role, algorithm_of
from miles.backends.fsdp_utils.loss_hub import (
    awm,
    direct_align,
    dmd2,
    dpo,
    draft,
    flow_dppo,
    flow_grpo,
    grpo_guard,
    nft,
    policy,
    refl,
    sft,
)
from miles.utils.misc import load_function

PrepareFn = Callable[..., Any]  # (ctx, batch, *, microbatch_id, optim_step_idx, pad_to_len=None) -> PreparedBatch
FormulaFn = Callable[..., Any]  # (ctx, batch, prepared, *, new_pred, frozen_preds, metrics, optim_step_idx,
#                                  train_output_inputs, **kwargs) -> Tensor | None; with a log-prob ratio also
#                                  write_old_log_prob, old_log_prob_from_new
TrainInputFn = Callable[..., Any]  # (ctx, train_pairs) -> train_pairs
TrainOutputFn = Callable[..., Any]  # (ctx, train_pairs, train_output_inputs) -> Any
AfterTrainFn = Callable[..., Any]  # (ctx, *, global_step) -> {shadow network: decay d}, once per rollout


def identity_train_input(ctx: Any, train_pairs: Any) -> Any:
    return train_pairs


def default_train_output(ctx: Any, train_pairs: Any, train_output_inputs: list) -> Any:
    """By default a group hands the next group nothing."""
    return None


def no_after_train(ctx: Any, *, global_step: int) -> dict[str, float]:
    return {}


@dataclass(frozen=True)
class LossHooks:
    """The train side of one (loss type, role): its hooks, and what the trunk does for them. Which frozen networks
    the role holds is the algorithm's declaration (`algorithm_of(args).role(role).frozen_networks`), not this entry.

    - `after_train`: once per rollout after the last window, returns the decay of each declared shadow to update.
    - `engine_weights`: the declared shadow the rollout engines sample with (None: the trained weights, or their
      EMA with --ema-rollout-policy ema).
    - `pair_weight`: a per-pair column w of the train pairs (0/1: trained or not) the formula multiplies its losses
      by; the trunk then divides a window's loss sums by its weight, not its pair count, so the step follows the mean
      over the pairs that train (`microbatch.weighted_denominator`). None: every pair counts.
    """

    prepare: PrepareFn
    formula: FormulaFn
    train_input: TrainInputFn = identity_train_input
    train_output: TrainOutputFn = default_train_output
    after_train: AfterTrainFn = no_after_train
    engine_weights: str | None = None
    pair_weight: str | None = None


LOSS_HOOKS: dict[tuple[str, str], LossHooks] = {
    ("sft_loss", "actor"): LossHooks(prepare=sft.prepare_sft_batch, formula=sft.sft_formula),
    ("policy_loss", "actor"): LossHooks(prepare=policy.prepare_policy_batch, formula=flow_grpo.policy_formula),
    ("grpo_guard", "actor"): LossHooks(prepare=policy.prepare_policy_batch, formula=grpo_guard.guard_formula),
    ("flow_dppo", "actor"): LossHooks(prepare=policy.prepare_policy_batch, formula=flow_dppo.dppo_formula),
    ("nft", "actor"): LossHooks(
        prepare=nft.prepare_nft_batch,
        formula=nft.nft_formula,
        after_train=nft.decay_old_policy,
        engine_weights=nft.OLD_NETWORK,  # DiffusionNFT samples its rollouts with the old policy
    ),
    ("dmd2", "critic"): LossHooks(
        prepare=dmd2.prepare_critic_batch,
        formula=dmd2.critic_formula,
        train_input=dmd2.tile_critic_pairs,
        train_output=dmd2.critic_train_output,
    ),
    ("dmd2", "actor"): LossHooks(prepare=dmd2.prepare_generator_batch, formula=dmd2.generator_formula),
    ("dpo", "actor"): LossHooks(
        prepare=dpo.prepare_dpo_batch,
        formula=dpo.dpo_formula,
        after_train=dpo.refresh_reference,
        pair_weight=dpo.PAIR_WEIGHT,  # a dropped (zero-spread) group's rows: weight 0, not in the step's mean
    ),
    ("awm", "actor"): LossHooks(
        prepare=awm.prepare_awm_batch, formula=awm.awm_formula, after_train=awm.decay_ema_anchor
    ),
    ("refl", "actor"): LossHooks(prepare=refl.prepare_refl_batch, formula=refl.refl_formula),
    ("draft", "actor"): LossHooks(prepare=draft.prepare_draft_batch, formula=draft.draft_formula),
    ("direct_align", "actor"): LossHooks(
        prepare=direct_align.prepare_direct_align_batch, formula=direct_align.direct_align_formula
    ),
}

# What each hook must accept (by name, or through **kwargs): the trunk passes all of these.
REQUIRED_KEYWORDS = {
    "prepare": ("microbatch_id", "optim_step_idx", "pad_to_len"),
    "formula": ("new_pred", "frozen_preds", "metrics", "optim_step_idx", "train_output_inputs"),
    "after_train": ("global_step",),
}
# formula keywords passed only when the algorithm's declaration says `log_prob_ratio` (ARCHITECTURE §6)
RATIO_KEYWORDS = ("write_old_log_prob", "old_log_prob_from_new")
# keywords the trunk passed once and no longer does, with what replaced them
RETIRED_KEYWORDS = {"ref_pred": 'frozen_preds["ref"] (name "ref" in PreparedBatch.frozen_networks)'}
REQUIRED_POSITIONAL = {"prepare": 2, "formula": 3, "train_input": 2, "train_output": 3, "after_train": 1}


class HookSignatureError(TypeError):
    """A hook cannot be called the way the trunk calls it."""


def check_hook_signature(name: str, fn: Callable[..., Any], source: str, keywords: tuple[str, ...] = ()) -> None:
    """Reject at start-up a hook the trunk could not call, naming the file, the hook and what is missing;
    `keywords` are required besides REQUIRED_KEYWORDS[name]."""
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
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    retired = [kw for kw in RETIRED_KEYWORDS if kw in names]
    if retired:  # even with **kwargs: it would never be passed again (None where it has a default)
        raise HookSignatureError(
            f"{name} hook {source}: takes {', '.join(retired)}, which the trunk no longer passes: "
            + "; ".join(f"{kw} became {RETIRED_KEYWORDS[kw]}" for kw in retired)
            + " (see docs/user-guide/customization.md)"
        )
    if inspect.Parameter.VAR_KEYWORD in kinds:
        return
    missing = [kw for kw in (*REQUIRED_KEYWORDS.get(name, ()), *keywords) if kw not in names]
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


def check_loss_hooks(hooks: LossHooks, sources: dict[str, str] | None = None, *, log_prob_ratio: bool = False) -> None:
    """Every hook's signature; with `log_prob_ratio` the formula also takes the recompute keywords."""
    sources = sources or {}
    for name in ("prepare", "formula", "train_input", "train_output", "after_train"):
        fn = getattr(hooks, name)
        keywords = RATIO_KEYWORDS if name == "formula" and log_prob_ratio else ()
        check_hook_signature(name, fn, sources.get(name, getattr(fn, "__qualname__", repr(fn))), keywords)


def check_declaration(hooks: LossHooks, role: Role, where: str) -> None:
    """What the entry asks of the trunk must be in the role's declaration: `engine_weights` names a declared shadow."""
    shadows = [network.name for network in role.frozen_networks if network.source == "shadow"]
    if hooks.engine_weights is not None and hooks.engine_weights not in shadows:
        raise ValueError(
            f"{where}: engine_weights {hooks.engine_weights!r} must name a shadow network the {role.name!r} role "
            f"declares (its frozen_networks' shadows: {shadows})"
        )


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
    loaded: dict[str, Any] = {name: load_function(path) for name, path in paths.items() if path}
    return LossHooks(**loaded), {name: repr(path) for name, path in paths.items() if path}


def get_loss_hooks(args: argparse.Namespace, role: str) -> LossHooks:
    """The hooks of (args.loss_type, role), checked against their signatures and the algorithm's declaration;
    custom_loss loads them from the path flags."""
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
    algorithm = algorithm_of(args)
    check_declaration(hooks, algorithm.role(role), f"the loss hooks of --loss-type {args.loss_type} role {role!r}")
    check_loss_hooks(hooks, sources, log_prob_ratio=algorithm.log_prob_ratio)
    return hooks


def checkpoint_meta(args: argparse.Namespace) -> dict[str, Any]:
    """What a role's checkpoint records of the algorithm that wrote it, and what it trained: a LoRA adapter's rank
    (None: full weights), which a resume checks before any actor starts (`check_resume_settings`)."""
    return {"loss_type": args.loss_type, "lora_rank": args.lora_rank if args.use_lora else None}
