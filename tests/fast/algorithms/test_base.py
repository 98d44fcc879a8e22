"""The declaration record itself: where a role's settings live (its flags and dests), the checks that refuse a
malformed network, role or algorithm naming it, and the rules several algorithms share."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from miles.algorithms.base import (
    ACTOR,
    Algorithm,
    Computed,
    FirstWindowMetrics,
    FrozenNetwork,
    Role,
    reference_rule,
    role_dest,
    role_flag,
    stochastic_steps_rule,
)


def test_the_actor_reads_the_runs_flags_and_another_role_its_own_overrides():
    assert (role_dest("actor", "checkpoint"), role_dest("actor", "lr")) == ("hf_checkpoint", "lr")
    assert (role_dest("critic", "checkpoint"), role_dest("critic", "lr")) == ("critic_checkpoint", "critic_lr")
    assert role_flag("actor", "checkpoint") == "--hf-checkpoint"
    assert role_flag("critic", "num_steps_per_rollout") == "--critic-num-steps-per-rollout"
    assert Role("critic").flag("save") == "--critic-save" and Role("critic").dest("load") == "critic_load"
    assert not ACTOR.overridable and Role("critic").overridable
    with pytest.raises(ValueError, match=r"'seed' is not a role override \(one of checkpoint, lr, "):
        role_dest("critic", "seed")


def test_a_frozen_network_is_a_checkpoint_with_its_path_flag_or_a_shadow_without_one():
    assert FrozenNetwork("teacher", "checkpoint", "teacher_load").path_flag == "teacher_load"
    with pytest.raises(ValueError, match="FrozenNetwork 'x': source must be 'checkpoint' or 'shadow', not 'file'"):
        FrozenNetwork("x", "file")
    with pytest.raises(ValueError, match="a checkpoint network names its path_flag, a shadow none"):
        FrozenNetwork("teacher", "checkpoint")
    with pytest.raises(ValueError, match="a checkpoint network names its path_flag, a shadow none"):
        FrozenNetwork("old", "shadow", "old_load")


def test_a_role_name_is_a_flag_part_and_only_a_non_actor_role_takes_defaults():
    Role("critic_2", defaults={"checkpoint": "teacher_load", "lr": Computed(lambda a: a.lr / 2, "half --lr")})
    with pytest.raises(ValueError, match=r"Role 'Critic': a role name is lower case letters, digits and '_'"):
        Role("Critic")
    with pytest.raises(ValueError, match=r"Role 'critic': defaults only for a non-actor role's checkpoint, lr"):
        Role("critic", defaults={"seed": "x"})
    with pytest.raises(ValueError, match=r"Role 'actor': defaults only for a non-actor role's"):
        Role("actor", defaults={"lr": "critic_lr"})


def test_an_algorithm_ends_its_distinct_roles_with_the_actor_and_guards_only_a_ratio():
    two = Algorithm("two", roles=(Role("critic"), ACTOR))
    assert two.role_names == ["critic", "actor"] and two.role("critic").name == "critic"
    with pytest.raises(ValueError, match=r"--loss-type two trains no 'teacher' role \(its roles: critic, actor\)"):
        two.role("teacher")
    for roles in [(), (ACTOR, Role("critic")), (ACTOR, ACTOR)]:
        with pytest.raises(ValueError, match=r"algorithm 'bad': roles .* must be distinct and end with 'actor'"):
            Algorithm("bad", roles=roles)
    with pytest.raises(ValueError, match="first_window_metrics needs log_prob_ratio=True"):
        Algorithm("bad", first_window_metrics=FirstWindowMetrics())
    assert Algorithm("ok", log_prob_ratio=True, first_window_metrics=FirstWindowMetrics()).first_window_metrics


def test_the_shared_rules_name_the_flags_that_fix_them():
    def args(**values):
        return SimpleNamespace(**{"diffusion_kl_beta": 0.0, "ref_mode": "none", "diffusion_sde_type": "sde", **values})

    assert reference_rule(args()) == [] and reference_rule(args(diffusion_kl_beta=0.1, ref_mode="ema")) == []
    assert reference_rule(args(diffusion_kl_beta=0.1)) == [
        "--diffusion-kl-beta > 0 needs a reference: --ref-mode lora_base or ema"
    ]
    assert stochastic_steps_rule("mine", args()) == []
    assert stochastic_steps_rule("mine", args(diffusion_sde_type="ode")) == [
        "--loss-type mine needs stochastic steps: --diffusion-sde-type sde, dance or cps"
    ]
