"""The reward flags' rules (miles/arguments/rewards.py): a reward that cannot run refused before any model loads (and
only where rewards are scored), a bad --rm-type named, groups of one under a loss that trains on group advantages,
--per-reward-group-norm where nothing would read it."""

from __future__ import annotations

from miles.algorithms import ALGORITHMS
from miles.arguments.parser import default_args, parse_args
from miles.arguments.rewards import reward_rules
from tests.fast.arguments.test_parser import BASE, parse_error

NFT, DMD2 = ALGORITHMS["nft"], ALGORITHMS["dmd2"]


def test_a_reward_without_its_model_folder_is_refused_where_rewards_are_scored():
    assert reward_rules(default_args(), NFT) == []
    missing = "--rm-type clip_score needs --clip-model-path DIR, a local folder with its model and processor"
    assert reward_rules(default_args(rm_type="clip_score"), NFT) == [missing]
    assert reward_rules(default_args(rm_type="clip_score"), DMD2) == [missing]  # given to log: it must run too
    assert reward_rules(default_args(rm_type="clip_score", train_only=True), NFT) == []  # no rollouts: no rewards


def test_a_bad_reward_spec_is_reported_with_the_other_rules():
    errors = reward_rules(default_args(rm_type="shape", rm_url=["localhost:1"]), NFT)
    assert errors[0] == "--rm-url 'localhost:1' must start with http:// or https://"
    assert errors[1].startswith("--rm-type 'shape': unknown reward 'shape'; valid rewards: shapes, ")


def test_groups_of_one_are_refused_where_the_loss_trains_on_group_advantages(capsys):
    group_losses = sorted(name for name, algorithm in ALGORITHMS.items() if algorithm.group_advantages)
    assert group_losses == ["awm", "flow_dppo", "grpo_guard", "nft", "policy_loss"]
    for name in group_losses:
        errors = reward_rules(default_args(loss_type=name, n_samples_per_prompt=1), ALGORITHMS[name])
        assert errors == [
            f"--n-samples-per-prompt 1: --loss-type {name} trains on each sample's reward against the others of its "
            "prompt group, and a group of one has none (every advantage would be 0 and nothing would train): use "
            "--n-samples-per-prompt 2 or more, or --custom-reward-post-process-path"
        ]
        assert reward_rules(default_args(loss_type=name, n_samples_per_prompt=2), ALGORITHMS[name]) == []
    own = default_args(n_samples_per_prompt=1, custom_reward_post_process_path="m.py:fn")  # its advantages
    assert reward_rules(own, NFT) == []
    for name in ("refl", "draft", "direct_align", "dmd2", "custom_loss"):  # the reward itself, or the user's hooks
        assert not ALGORITHMS[name].group_advantages
    # through the parser: the rule comes before any model loads (the run this replaces trained with grad norm 0)
    err = parse_error(BASE + ["--loss-type", "policy_loss", "--n-samples-per-prompt", "1"], capsys)
    assert "--n-samples-per-prompt 1: --loss-type policy_loss trains on each sample's reward" in err


def test_rewards_that_all_weigh_0_are_refused_where_the_loss_trains_on_group_advantages():
    errors = reward_rules(default_args(rm_type="shapes:0"), NFT)
    assert errors == [
        "--rm-type shapes:0: every reward weighs 0, so every advantage would be 0 and --loss-type nft would train "
        "nothing: give the reward to train on a weight above 0"
    ]  # the run trained with every advantage 0 (the zero-advantage warning said so in rollout 0)
    assert reward_rules(default_args(rm_type="shapes,jpeg_compressibility:0"), NFT) == []  # one logged, one trained
    assert reward_rules(default_args(rm_type="shapes:0"), DMD2) == []  # scored to log only
    assert reward_rules(default_args(rm_type="shapes:0", custom_reward_post_process_path="m.py:fn"), NFT) == []


def test_per_reward_group_norm_is_refused_where_no_advantages_come_from_rewards():
    errors = reward_rules(default_args(per_reward_group_norm=True), DMD2)
    assert errors == ["--per-reward-group-norm would be ignored: --loss-type dmd2 computes no advantages from rewards"]
    assert reward_rules(default_args(per_reward_group_norm=True), NFT) == []


def test_per_reward_group_norm_refused_where_it_would_be_ignored(capsys):
    argv = BASE + [
        "--loss-type",
        "policy_loss",
        "--per-reward-group-norm",
        "--rm-type",
        "shapes,jpeg_compressibility:0.1",
    ]
    assert parse_args(argv).per_reward_group_norm
    err = parse_error(argv + ["--custom-reward-post-process-path", "m.py:fn"], capsys)
    assert "--per-reward-group-norm would be ignored: --custom-reward-post-process-path" in err
