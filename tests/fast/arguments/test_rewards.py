"""The reward flags' rules (miles/arguments/rewards.py): a reward that cannot run refused before any model loads (and
only where rewards are scored), a bad --rm-type named, --per-reward-group-norm where nothing would read it."""

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
