"""A plugin loss type (`--algorithm-path`, `--loss-type recording`) with a log-prob ratio, so that the trunk runs its
recompute loop, whose hooks record what the trunk passes them (used by the wiring test)."""

import threading

import torch

from miles.algorithms import Algorithm, register_algorithm
from miles.backends.fsdp_utils.loss_hub import LOSS_HOOKS, LossHooks, sft

NAME = "recording"

CALLS: list = []
LIST_IDS: set = set()
PREPARES: list = []  # (microbatch_id, optim_step_idx, grad enabled, on the main thread, pad_to_len) of each call


def prepare(ctx, batch, *, microbatch_id, optim_step_idx, pad_to_len):  # no default: the trunk must pass all three
    main = threading.current_thread() is threading.main_thread()
    PREPARES.append((microbatch_id, optim_step_idx, torch.is_grad_enabled(), main, pad_to_len))
    prepared = sft.prepare_sft_batch(ctx, batch, microbatch_id=microbatch_id, optim_step_idx=optim_step_idx)
    prepared.extras["microbatch_id"] = microbatch_id
    prepared.extras["prepare_step"] = optim_step_idx
    return prepared


def formula(ctx, batch, prepared, *, optim_step_idx, train_output_inputs, write_old_log_prob=False, **kwargs):
    CALLS.append(
        {
            "microbatch_id": prepared.extras["microbatch_id"],
            "prepare_step": prepared.extras["prepare_step"],
            "optim_step_idx": optim_step_idx,
            "write_old_log_prob": write_old_log_prob,
            "old_log_prob_from_new": kwargs["old_log_prob_from_new"],
        }
    )
    LIST_IDS.add(id(train_output_inputs))
    train_output_inputs.append(prepared.extras["microbatch_id"])
    if write_old_log_prob:
        return None
    return sft.sft_formula(
        ctx, batch, prepared, optim_step_idx=optim_step_idx, train_output_inputs=train_output_inputs, **kwargs
    )


def train_output(ctx, train_pairs, train_output_inputs):
    calls = list(CALLS)
    CALLS.clear()
    ids = set(LIST_IDS)
    LIST_IDS.clear()
    prepares = list(PREPARES)
    PREPARES.clear()
    return {
        "calls": calls,
        "prepares": prepares,
        "same_list": ids == {id(train_output_inputs)},
        "appended": list(train_output_inputs),
    }


register_algorithm(
    Algorithm(
        name=NAME,
        log_prob_ratio=True,
        scores_rewards=False,
        samples_sde=False,
        uses_engines=False,
        accepts_train_only=True,
    )
)
LOSS_HOOKS[(NAME, "actor")] = LossHooks(prepare=prepare, formula=formula, train_output=train_output)
