"""The parser's rules: validation leaves the arguments as given and derivation fills the defaults in one step, every
broken rule of a stage is reported at once, and the batch invariants name their flags."""

from __future__ import annotations

import copy

from miles.arguments.parser import parse_args
from miles.arguments.rules import derive_args, validate_args
from tests.fast.arguments.test_parser import BASE, SFT, parse_error


def test_batch_invariant_names_the_flags(capsys):
    err = parse_error(SFT + ["--rollout-batch-size", "8", "--global-batch-size", "3"], capsys)
    assert "--rollout-batch-size" in err and "--global-batch-size" in err and "--num-steps-per-rollout" in err
    err = parse_error(SFT + ["--rollout-batch-size", "6", "--global-batch-size", "6", "--dp-size", "4"], capsys)
    assert "divisible by --dp-size" in err


def test_validation_leaves_the_args_as_given_and_derivation_fills_the_defaults_in_one_step(tmp_path):
    argv = BASE + ["--loss-type", "dmd2", "--teacher-load", "/t", "--rollout-batch-size", "6", "--n-samples-per-prompt"]
    args = parse_args(argv + ["2", "--num-steps-per-rollout", "3", "--save", str(tmp_path)], validate=False)
    given = copy.deepcopy(vars(args))
    validate_args(args)
    assert vars(args) == given
    derive_args(args)
    assert args.global_batch_size == 6 * 2 // 3 and args.diffusion_guidance_scale == 1.0 and args.eval_interval == 20
    assert given["micro_batch_size"] == "auto" and args.micro_batch_size == 32  # auto: concrete at once (CPU's)
    assert (args.critic_lr, args.critic_micro_batch_size) == (given["lr"], args.micro_batch_size)
    assert args.critic_num_steps_per_rollout == 5 * 3  # --dmd2-critic-updates-per-step 5 x --num-steps-per-rollout 3
    assert (args.critic_checkpoint, args.critic_save, args.critic_load) == ("/t", str(tmp_path), None)
    changed = {k for k in given if given[k] != vars(args)[k]}
    assert changed >= {"global_batch_size", "diffusion_guidance_scale", "eval_interval", "critic_lr"}
    assert not changed & {"lr", "rollout_batch_size", "n_samples_per_prompt", "save", "load", "teacher_load"}


def test_every_broken_rule_of_a_stage_is_reported_at_once(capsys):
    flags = ["--loss-type", "nft", "--train-only", "--eval-only", "--ref-mode", "ema", "--no-eval-before-train"]
    err = parse_error(BASE + flags, capsys)
    assert "--train-only skips the rollout engine, which --loss-type nft needs" in err
    assert "--eval-only samples with the rollout engine" in err and "--ref-mode ema needs --use-ema" in err
    assert "--eval-only is the eval before training; it cannot be combined with --no-eval-before-train" in err
