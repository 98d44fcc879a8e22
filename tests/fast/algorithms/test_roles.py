"""The roles a run trains: their order (a critic before the actor it scores for), none for a debug rollout, what
differs between roles (their overrides, defaults filled at parse), and which algorithms declare an extra role."""

from __future__ import annotations

from miles.algorithms import BUILTIN_ALGORITHMS
from miles.algorithms.roles import extra_roles, role_settings, trained_roles, training_order
from miles.arguments.parser import parse_args
from tests.fast.arguments.test_parser import BASE

DMD2 = [*BASE, "--loss-type", "dmd2", "--teacher-load", "/t"]


def test_a_critic_trains_before_the_actor_and_a_debug_rollout_trains_nothing():
    assert training_order(parse_args([*BASE, "--loss-type", "nft"])) == ["actor"]
    assert training_order(parse_args(DMD2)) == trained_roles(parse_args(DMD2)) == ["critic", "actor"]
    assert trained_roles(parse_args([*DMD2, "--debug-rollout-only"])) == []


def test_each_role_has_its_own_overrides_with_the_run_defaults_filled():
    args = parse_args([*DMD2, "--critic-lr", "1e-5", "--lr", "2e-4"])
    critic, actor = role_settings(args, "critic"), role_settings(args, "actor")
    assert (critic["checkpoint"], critic["lr"]) == ("/t", 1e-5)  # the critic starts from the teacher
    assert (actor["checkpoint"], actor["lr"]) == ("/tmp/x", 2e-4)
    assert critic["micro_batch_size"] == actor["micro_batch_size"]  # not overridden: the run's


def test_only_dmd2_declares_an_extra_role():
    assert {role: [a.name for a in holders] for role, holders in extra_roles(BUILTIN_ALGORITHMS).items()} == {
        "critic": ["dmd2"]
    }


def test_an_output_folder_that_is_a_file_is_refused_naming_the_flag_once(tmp_path, capsys):
    from tests.fast.arguments.test_parser import parse_error

    taken = tmp_path / "a_file"
    taken.write_text("")
    line = f"{taken}: a file is there, not a folder: give a folder path"
    assert f"--output-dir {line}" in parse_error([*BASE, "--output-dir", str(taken)], capsys)
    assert f"--save-hf {line}" in parse_error([*BASE, "--save-hf", str(taken)], capsys)
    assert f"--prompt-cache {line}" in parse_error([*BASE, "--prompt-cache", str(taken)], capsys)
    err = parse_error([*DMD2, "--save", str(taken)], capsys)  # the critic's save defaults to it: one line
    assert f"--save {line}" in err and f"--critic-save {taken}" not in err
    assert f"--critic-save {line}" in parse_error([*DMD2, "--critic-save", str(taken)], capsys)
    parse_args([*BASE, "--output-dir", str(tmp_path), "--save", str(tmp_path / "new")])  # a folder, or none yet


def test_an_output_folder_that_cannot_be_made_is_refused_and_one_that_can_is_not_left_behind(tmp_path, capsys):
    from tests.fast.arguments.test_parser import parse_error

    taken = tmp_path / "a_file"
    taken.write_text("")
    err = parse_error([*BASE, "--output-dir", str(taken / "run")], capsys)  # a file on the way
    assert f"--output-dir {taken / 'run'}: cannot be made (Not a directory" in err
    err = parse_error([*BASE, "--save", "/proc/miles-no-such/ckpt"], capsys)  # the kernel refuses, even root
    assert "--save /proc/miles-no-such/ckpt: cannot be made (No such file or directory at /proc/miles-no-such)" in err
    parse_args([*BASE, "--output-dir", str(tmp_path / "new" / "deeper"), "--save-hf", str(tmp_path / "hf")])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]  # tried, then removed: the run makes them
