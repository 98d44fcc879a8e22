"""Every flag declares which runs read it, or is read by every run; a flag the user set (command line or --config)
that the run does not read is refused at parse time, naming the flag and what reads it. Defaults never count."""

from __future__ import annotations

import argparse

from miles.algorithms import ALGORITHMS, BUILTIN_ALGORITHMS
from miles.arguments import flag_readers
from miles.arguments.flag_readers import ByAlgorithm, ByFlag, ByReward, flag_of, given_dests, readers_of, unread_flags
from miles.arguments.parser import build_parser, parse_args
from miles.arguments.reward_spec import reward_spec_from_args
from tests.fast.arguments.test_parser import BASE, parse_error

# what turns on a flag-level reader, and a reward run that reads the reward-level ones
ENABLERS = {
    "use_lora": True,
    "use_ema": True,
    "use_wandb": True,
    "max_restarts": 1,
    "dynamic_sampling_filter_path": "m.f",
    "gold_rm_type": "shapes",
}
JUDGE_RUN = {"rm_type": "vlm_judge", "rm_url": ["http://judge/v1"], "rm_model": "m"}


def restricted(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {flag_of(a): a for a in parser._actions if readers_of(a) is not None}


def test_the_walk_lists_every_flag_that_declares_its_readers():
    parser = build_parser(BUILTIN_ALGORITHMS)
    flags = restricted(parser)
    shared = {
        "--allow-rollout-mismatch",
        "--diffusion-recompute-old-log-prob",
        "--lora-rank",
        "--lora-alpha",
        "--lora-target-modules",
        "--lora-init-weights",
        "--ema-decay",
        "--ema-warmup",
        "--ema-update-interval",
        "--wandb-project",
        "--wandb-group",
        "--wandb-run-name",
        "--restart-timeout",
        "--dynamic-sampling-max-rounds",
        "--diffusion-sde-type",
        "--diffusion-noise-level",
        "--diffusion-num-sde-steps",
        "--diffusion-sde-window-range",
        "--ref-mode",
        *(f"--vlm-judge-{k}" for k in ("prompt-file", "max-score", "unparsable", "default-score", "frames")),
        "--vlm-judge-max-tokens",
        "--shapes-learned-dir",
    }
    assert shared <= set(flags), sorted(shared - set(flags))
    for algorithm in BUILTIN_ALGORITHMS:  # every algorithm's own flags are declared (read by it)
        own = argparse.ArgumentParser()
        algorithm.add_arguments(own)
        assert {flag_of(a) for a in own._actions if a.dest != "help"} <= set(flags), algorithm.name
    undeclared = {flag_of(a) for a in parser._actions if a.option_strings and a.dest != "help"} - set(flags)
    assert {"--lr", "--seed", "--use-lora", "--loss-type", "--rm-type"} <= undeclared  # read by every run


def test_each_declared_flag_is_refused_exactly_where_nothing_reads_it(monkeypatch):
    """Every declared flag given alone under every algorithm: refused, naming the flag and the algorithms that were
    not refused, or not refused; a flag-level or reward-level reader accepts it once its flag or reward is on."""
    monkeypatch.setattr(flag_readers, "ALGORITHMS", {a.name: a for a in BUILTIN_ALGORITHMS})  # no test's plugins
    parser = build_parser(BUILTIN_ALGORITHMS)
    runs = {a.name: parser.parse_args(["--loss-type", a.name]) for a in BUILTIN_ALGORITHMS}
    for flag, action in restricted(parser).items():
        readers = readers_of(action)
        problems = {name: unread_flags(parser, {action.dest}, run) for name, run in runs.items()}
        if isinstance(readers, ByAlgorithm):
            reading = [name for name in runs if not problems[name]]
            assert reading, f"{flag}: no algorithm reads it"
            for name in set(runs) - set(reading):
                names = ", ".join(reading)
                who = f"the algorithms {readers.says} ({names})" if readers.says else f"--loss-type {names}"
                assert problems[name] == [f"{flag} is read only by {who}; --loss-type {name} ignores it: drop it"]
            continue
        for name, run in runs.items():
            if isinstance(readers, ByFlag):
                needed = readers.says or "--" + readers.dest.replace("_", "-")
                assert problems[name] == [
                    f"{flag} is read only with {needed}, which this run does not set: add it or drop {flag}"
                ]
                enabled = {readers.dest: ENABLERS[readers.dest]}
            else:
                assert isinstance(readers, ByReward)
                if not problems[name]:  # read by the run's default reward (a reward-gradient loss's shapes_learned)
                    assert set(readers.names) & {n for n, _ in reward_spec_from_args(run)}, (flag, name)
                    continue
                assert len(problems[name]) == 1
                wanted = " or ".join(readers.names)
                assert problems[name][0].startswith(f"{flag} is read only by the {wanted} reward; this run's rewards")
                enabled = JUDGE_RUN if "vlm_judge" in readers.names else {"rm_type": readers.names[0]}
            assert unread_flags(parser, {action.dest}, argparse.Namespace(**{**vars(run), **enabled})) == [], flag


def test_only_the_flags_the_user_set_count():
    parser = build_parser()
    assert given_dests(parser, ["--loss-type", "nft"]) == {"loss_type"}  # every default stays unset
    assert given_dests(parser, ["--no-globalize-reward-std"], {"lora-rank": 8}) == {"globalize_reward_std", "lora_rank"}
    parse_args(BASE + ["--loss-type", "nft"])  # nft's defaults hold --allow-rollout-mismatch, --lora-rank, ...


def test_the_issue_case_is_refused_on_the_command_line(capsys):
    err = parse_error(BASE + ["--loss-type", "nft", "--allow-rollout-mismatch"], capsys)
    assert "--allow-rollout-mismatch is read only by the algorithms with the first-window guard (" in err
    assert "policy_loss" in err and "--loss-type nft ignores it" in err
    err = parse_error(BASE + ["--loss-type", "policy_loss", "--diffusion-nft-beta", "2"], capsys)
    assert "--diffusion-nft-beta is read only by --loss-type nft" in err


def test_a_config_key_counts_as_set_even_at_its_default_value(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("lora-rank: 8\n")
    err = parse_error(BASE + ["--config", str(config)], capsys)
    assert "--lora-rank is read only with --use-lora" in err
    assert parse_args(BASE + ["--config", str(config), "--use-lora"]).lora_rank == 8


def test_the_sde_flags_are_read_where_rollouts_sample_sde_steps(capsys):
    err = parse_error(BASE + ["--loss-type", "nft", "--diffusion-sde-type", "cps"], capsys)
    assert "--diffusion-sde-type is read only by the algorithms that sample SDE trajectories (" in err
    assert "awm" in err and "policy_loss" in err and "--loss-type nft ignores it" in err
    assert parse_args(BASE + ["--loss-type", "awm", "--awm-sampler", "sde", "--diffusion-sde-type", "cps"])


def test_an_algorithm_reads_the_flags_its_declaration_lists():
    """grpo_guard and flow_dppo read policy_loss's --diffusion-kl-beta; custom_loss's hooks read any algorithm's flag
    but another algorithm's exclusive ones."""
    for name in ("policy_loss", "grpo_guard", "flow_dppo"):
        assert parse_args(BASE + ["--loss-type", name, "--diffusion-kl-beta", "0"]).diffusion_kl_beta == 0
    hooks = ["--custom-prepare-train-batch-path", "m.p", "--custom-loss-function-path", "m.f"]
    assert (
        parse_args(BASE + ["--loss-type", "custom_loss", *hooks, "--diffusion-nft-beta", "2"]).diffusion_nft_beta == 2
    )
    parser = build_parser()
    custom = parser.parse_args(["--loss-type", "custom_loss"])
    assert unread_flags(parser, {"grpo_guard_no_step_reweight"}, custom)  # grpo_guard's exclusive flag
    assert "custom_loss" in ALGORITHMS
