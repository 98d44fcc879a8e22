import copy

import pytest

from miles.arguments.parser import derive_args, parse_args, validate_args

BASE = ["--hf-checkpoint", "/tmp/x", "--prompt-data", "builtin:shapes"]
SFT = BASE + ["--loss-type", "sft_loss", "--train-only"]


def parse_error(argv, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    return capsys.readouterr().err


def test_help_parses(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(["--help"])
    assert exc.value.code == 0
    assert "--loss-type" in capsys.readouterr().out


@pytest.mark.parametrize("loss", ["sft_loss", "nft", "dmd2"])
def test_recompute_flag_rejected_without_log_prob_ratio(loss, capsys):
    argv = BASE + ["--loss-type", loss, "--diffusion-recompute-old-log-prob", "--teacher-load", "/t", "--train-only"]
    assert "--diffusion-recompute-old-log-prob" in parse_error(argv, capsys)


@pytest.mark.parametrize("loss", ["sft_loss", "policy_loss", "nft", "dmd2"])
def test_teacher_load_accepted_under_every_loss(loss):
    argv = BASE + ["--loss-type", loss, "--teacher-load", "/t"] + (["--train-only"] if loss == "sft_loss" else [])
    assert parse_args(argv).teacher_load == "/t"


def test_training_hook_paths_only_under_custom_loss(capsys):
    err = parse_error(SFT + ["--custom-train-output-path", "a.b"], capsys)
    assert "--custom-train-output-path" in err and "custom_loss" in err
    args = parse_args(
        BASE
        + [
            "--loss-type",
            "custom_loss",
            "--custom-prepare-train-batch-path",
            "m.p",
            "--custom-loss-function-path",
            "m.f",
            "--custom-train-output-path",
            "m.o",
        ]
    )
    assert args.custom_train_output_path == "m.o"


def test_batch_invariant_names_the_flags(capsys):
    err = parse_error(SFT + ["--rollout-batch-size", "8", "--global-batch-size", "3"], capsys)
    assert "--rollout-batch-size" in err and "--global-batch-size" in err and "--num-steps-per-rollout" in err
    err = parse_error(SFT + ["--rollout-batch-size", "6", "--global-batch-size", "6", "--dp-size", "4"], capsys)
    assert "divisible by --dp-size" in err


def test_global_batch_size_derived_from_rollout():
    args = parse_args(SFT + ["--rollout-batch-size", "8", "--num-steps-per-rollout", "2"])
    assert args.global_batch_size == 4


def test_missing_load_dir_is_an_error(tmp_path, capsys):
    assert "--load" in parse_error(SFT + ["--load", str(tmp_path / "nope")], capsys)
    args = parse_args(SFT + ["--load", str(tmp_path / "run"), "--save", str(tmp_path / "run")])
    assert args.load == args.save


def test_no_flags_is_the_shipped_shapes_nft_run():
    args = parse_args([])
    assert (args.loss_type, args.hf_checkpoint, args.prompt_data) == ("nft", "builtin:tiny-shapes", "builtin:shapes")
    assert args.dp_size == 2 and args.eval_interval == 20 and args.eval_num_prompts == 500
    assert args.diffusion_guidance_scale == 1.0  # nft samples CFG-free
    assert parse_args(["--loss-type", "dmd2", "--teacher-load", "/t"]).diffusion_guidance_scale == 1.0


@pytest.mark.parametrize("loss", ["nft", "dmd2"])
def test_shared_initial_noise_only_for_sde_rollouts(loss, capsys):
    shared = ["--diffusion-shared-initial-noise"]
    err = parse_error(BASE + ["--loss-type", loss, "--teacher-load", "/t"] + shared, capsys)
    assert "--diffusion-shared-initial-noise" in err and loss in err
    assert parse_args(BASE + ["--loss-type", "policy_loss"] + shared).diffusion_shared_initial_noise


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
