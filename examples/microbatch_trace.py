"""A custom hook that uses `microbatch_id`: Flow-GRPO built from the shared rooms, plus a per-micro-batch trace
(`traced_grpo`). Run it with

    python train_diffusion.py --algorithm-path examples/microbatch_trace.py --loss-type traced_grpo \
        --num-steps-per-rollout 3 --diffusion-recompute-old-log-prob

Each trainer rank writes `<--output-dir>/microbatch_trace/rank<r>.jsonl`, one line per forward: the rollout, the
micro-batch's `microbatch_id` and `optim_step_idx`, the pass (`recompute` or `train`), the pair rows it held and its
mean log-prob. The two passes of a micro-batch carry the same `microbatch_id` within one `train` call (the numbering
rule, docs/user-guide/customization.md), so the trace pairs them: how far the policy moved between the recompute
pass (before any update) and the micro-batch's training forward. `microbatch_id` is a key, never a noise seed: ids
move with --micro-batch-size and --dp-size, pair rows (`pair_index`) do not.

The prepare hook is the only hook that receives `microbatch_id`, so it hands the id to the formula in
`PreparedBatch.extras`; the formula appends its trace record to `train_output_inputs`, the list the trunk passes to
every formula of a `train` call and then to `train_output`, which writes the records.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping
from typing import Any

import torch

from miles.algorithms import Algorithm, reference_rule, register_algorithm, stochastic_steps_rule
from miles.backends.fsdp_utils.loss_hub import LOSS_HOOKS, LossHooks
from miles.backends.fsdp_utils.loss_hub.policy import policy_step, prepare_policy_batch, with_reference_kl
from miles.backends.fsdp_utils.loss_hub.types import PreparedBatch, WindowMetrics
from miles.diffusion.policy import clipped_policy_loss
from miles.rollout.rollout_hub import ROLLOUT_SPECS, RolloutSpec, sde_pairs, sde_request, trained_steps_per_sample
from miles.utils.types import PAIR_INDEX

NAME = "traced_grpo"
TRACE_DIR = "microbatch_trace"


# ---- the train side: prepare, formula and train output, one LOSS_HOOKS entry -------------------------------------
def prepare(ctx, batch, *, microbatch_id: int, optim_step_idx: int, pad_to_len: int | None = None) -> PreparedBatch:
    """The shared policy prepare, with the micro-batch's id kept for the formula's trace."""
    prepared = prepare_policy_batch(
        ctx, batch, microbatch_id=microbatch_id, optim_step_idx=optim_step_idx, pad_to_len=pad_to_len
    )
    prepared.extras["microbatch_id"] = microbatch_id
    return prepared


def trace_record(ctx, batch, prepared: PreparedBatch, optim_step_idx: int, log_prob: torch.Tensor) -> dict[str, Any]:
    """What one forward traces (the float() waits for the device: a debugging aid, not for timed runs)."""
    return {
        "rollout_id": ctx.rollout_id,
        "microbatch_id": prepared.extras["microbatch_id"],
        "optim_step_idx": optim_step_idx,
        "pairs": batch[PAIR_INDEX].tolist(),
        "log_prob_mean": float(log_prob.detach().mean()),
    }


def formula(
    ctx,
    batch,
    prepared: PreparedBatch,
    *,
    new_pred: torch.Tensor,
    frozen_preds: Mapping[str, torch.Tensor],
    metrics: WindowMetrics,
    optim_step_idx: int,
    train_output_inputs: list,
    write_old_log_prob: bool = False,
    old_log_prob_from_new: bool = False,
    **kwargs,
) -> torch.Tensor | None:
    """Flow-GRPO's clipped policy loss (+ the optional KL to `ref`), tracing each forward."""
    args = ctx.args
    step = policy_step(ctx, batch, new_pred)
    log_prob = step.log_prob
    record = trace_record(ctx, batch, prepared, optim_step_idx, log_prob)
    if write_old_log_prob:  # the recompute pass: store the old log-probs, trace, no loss
        batch["old_log_prob"].copy_(log_prob.detach().to(batch["old_log_prob"].device))
        train_output_inputs.append({**record, "pass": "recompute"})
        return None
    old = log_prob.detach() if old_log_prob_from_new else batch["old_log_prob"].to(log_prob.device)
    train_output_inputs.append({**record, "pass": "train", "old_log_prob_mean": float(old.mean())})
    advantage = batch["advantage"].to(log_prob.device)
    loss, _ = clipped_policy_loss(
        log_prob, old, advantage, clip_range=args.diffusion_clip_range, adv_clip_max=args.diffusion_adv_clip_max
    )
    with torch.no_grad():
        metrics.add("train/ratio_mean", torch.exp(log_prob - old))
    metrics.add("train/policy_loss", loss)
    loss = with_reference_kl(ctx, batch, step, frozen_preds, metrics, loss)
    metrics.add("train/loss", loss)
    return loss.sum()


def write_trace(ctx, train_pairs, train_output_inputs: list) -> None:
    """Append this train call's records to the rank's trace file; the next group (none here) receives nothing."""
    folder = os.path.join(ctx.args.output_dir, TRACE_DIR)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"rank{ctx.dp_rank}.jsonl"), "a") as out:
        for record in train_output_inputs:
            out.write(json.dumps(record) + "\n")


# ---- the declaration: a log-prob ratio (so the recompute loop runs), Flow-GRPO's flags read ------------------------
def validate(args: argparse.Namespace) -> list[str]:
    return reference_rule(args) + stochastic_steps_rule(NAME, args)


register_algorithm(
    Algorithm(
        name=NAME,
        log_prob_ratio=True,
        reads=("diffusion_clip_range", "diffusion_kl_beta", "ref_mode"),
        validate=validate,
    )
)
LOSS_HOOKS[(NAME, "actor")] = LossHooks(prepare=prepare, formula=formula, train_output=write_trace)

# ---- the rollout side: the shared SDE request and transition pairs ------------------------------------------------
ROLLOUT_SPECS[NAME] = RolloutSpec(
    build_request=sde_request, convert=sde_pairs, pairs_per_sample=trained_steps_per_sample
)
