"""The held-out evaluation's flags (miles/arguments/evaluation.py): what they cannot be combined with, the OCR
eval's package checked at parse time, and the interval and prompts a run evaluates on when the flags are unset."""

from __future__ import annotations

import pytest

from miles.algorithms import ALGORITHMS
from miles.arguments.evaluation import eval_defaults, eval_enabled, eval_rules
from miles.arguments.parser import default_args
from miles.arguments.reward_spec import REWARD_PACKAGES

NFT, SFT = ALGORITHMS["nft"], ALGORITHMS["sft_loss"]  # evaluated every 20 rollouts on the shapes world / never


def test_eval_only_refuses_train_only_and_skipping_the_eval_it_is():
    assert eval_rules(default_args()) == []
    assert eval_rules(default_args(eval_only=True, train_only=True, no_eval_before_train=True)) == [
        "--eval-only samples with the rollout engine; it cannot be combined with --train-only",
        "--eval-only is the eval before training; it cannot be combined with --no-eval-before-train",
    ]


def test_an_unknown_built_in_prompt_set_is_named_with_the_known_ones():
    known = "the built-in ones: builtin:shapes, builtin:shapes-edit, builtin:moving-shapes, builtin:ocr"
    assert eval_rules(default_args(prompt_data="builtin:nope", eval_prompt_data="builtin:shape")) == [
        f"--prompt-data builtin:nope: no such built-in prompt set; {known}",  # it said "file not found"
        f"--eval-prompt-data builtin:shape: no such built-in prompt set; {known}",
    ]
    for data in ("builtin:shapes", "builtin:shapes-edit", "builtin:moving-shapes", "builtin:ocr", "prompts.jsonl"):
        assert eval_rules(default_args(prompt_data=data, eval_prompt_data=data, eval_interval=0)) == []


def test_the_ocr_eval_without_its_package_is_refused_only_when_something_evaluates(monkeypatch):
    monkeypatch.setitem(REWARD_PACKAGES, "ocr", ("no_such_ocr_module", "pip install miles[ocr]"))
    ocr = {"eval_prompt_data": "builtin:ocr"}
    message = "--eval-prompt-data builtin:ocr is scored by OCR, which needs the no_such_ocr_module package: pip install"
    assert eval_rules(default_args(**ocr, eval_interval=5))[0].startswith(message)
    assert eval_rules(default_args(**ocr, eval_only=True))[0].startswith(message)
    assert eval_rules(default_args(**ocr, eval_interval=0)) == []  # no eval: nothing to score
    assert eval_rules(default_args(**ocr, eval_interval=5, eval_function_path="m.fn")) == []  # scored by the user's


@pytest.mark.parametrize(
    ("flags", "algorithm", "interval"),
    [
        ({}, NFT, 20),  # the shapes world with an image family: the algorithm's
        ({}, SFT, None),  # an algorithm without a shapes eval
        ({"eval_interval": 0}, NFT, None),  # 0 is off
        ({"eval_interval": 7}, SFT, 7),  # given: kept
        ({"debug_rollout_only": True}, NFT, None),
        ({"prompt_data": "prompts.jsonl"}, NFT, None),  # not a built-in world: off unless asked
        ({"prompt_data": "builtin:moving-shapes"}, NFT, None),  # the video world with an image family
        ({"prompt_data": "builtin:moving-shapes", "hf_checkpoint": "builtin:tiny-wan"}, NFT, 20),
        ({"hf_checkpoint": "builtin:tiny-wan"}, NFT, None),  # the image world with a video family
    ],
)
def test_the_interval_when_unset_is_the_algorithms_on_its_world_and_family(flags, algorithm, interval):
    assert eval_defaults(default_args(**flags), algorithm)["eval_interval"] == interval


def test_training_on_an_other_world_evaluates_on_its_eval_split_unless_other_prompts_are_named():
    assert "eval_prompt_data" not in eval_defaults(default_args(), NFT)
    edit = eval_defaults(default_args(prompt_data="builtin:shapes-edit"), NFT)
    assert edit == {"eval_interval": 20, "eval_prompt_data": "builtin:shapes-edit"}
    moving = default_args(prompt_data="builtin:moving-shapes", hf_checkpoint="builtin:tiny-wan")
    assert eval_defaults(moving, NFT)["eval_prompt_data"] == "builtin:moving-shapes"
    moving.eval_prompt_data = "held_out.jsonl"
    assert "eval_prompt_data" not in eval_defaults(moving, NFT)


def test_eval_is_enabled_by_an_interval_or_eval_only():
    assert not eval_enabled(default_args())  # unset: derive_args fills it in first
    assert eval_enabled(default_args(eval_interval=20)) and eval_enabled(default_args(eval_only=True))
