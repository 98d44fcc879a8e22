import pytest

from miles.arguments.parser import parse_args

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
