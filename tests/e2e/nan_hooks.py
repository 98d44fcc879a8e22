"""A custom loss whose value turns NaN from rollout 1 on (the non-finite guard's fault injection)."""

from miles.backends.fsdp_utils.loss_hub import flow_grpo, policy

prepare = policy.prepare_policy_batch


def nan_from_rollout_1(ctx, batch, prepared, **kwargs):
    loss = flow_grpo.policy_formula(ctx, batch, prepared, **kwargs)
    if ctx.rollout_id >= 1 and ctx.dp_rank == 1:  # one rank only: the decision to skip must still be shared
        loss = loss * float("nan")
    return loss
