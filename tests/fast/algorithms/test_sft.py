"""The sft_loss declaration: one sample per prompt, and --train-only implied and said."""

from __future__ import annotations

from miles.arguments.parser import parse_args
from tests.fast.arguments.test_parser import BASE, SFT


def test_sft_trains_each_pair_once_and_implies_train_only():
    assert parse_args(SFT + ["--n-samples-per-prompt", "4", "--rollout-batch-size", "8"]).n_samples_per_prompt == 1
    args = parse_args(BASE + ["--loss-type", "sft_loss"])
    assert args.train_only and args.default_notes == ("--loss-type sft_loss trains on dataset pairs: --train-only",)
