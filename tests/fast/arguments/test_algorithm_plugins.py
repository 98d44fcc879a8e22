"""A plugin given with --algorithm-path is read in the parser's first pass: its declaration adds a flag with its own
range and rule, and a role whose `--<role>-*` overrides exist, are refused without the role, derive their defaults
and lock the role's save folder."""

from __future__ import annotations

import pytest

from miles.algorithms import ALGORITHMS, training_order
from miles.arguments.parser import parse_args
from miles.ray.checkpoint_folders import lock_save_folders
from miles.utils.locks import FolderLockedError
from tests.fast.arguments.test_parser import BASE, parse_error

PLUGIN = """
from miles.algorithms import Algorithm, Computed, Role, register_algorithm
from miles.utils.ranges import Range


def add_arguments(parser):
    group = parser.add_argument_group("twin (a plugin's own flags)")
    group.add_argument("--twin-weight", type=float, default=1.0, help="Weight of the twin's loss.")
    group.add_argument("--twin-teacher", default=None, help="The twin's teacher.")


def validate(args):
    return ["--twin-weight above 2 needs --twin-teacher"] if args.twin_weight > 2 and not args.twin_teacher else []


TWIN = Role("critic2", defaults={"num_steps_per_rollout": Computed(lambda a: 3 * a.num_steps_per_rollout, "3 x")})
register_algorithm(
    Algorithm(
        name="twin",
        roles=(TWIN, Role("actor")),
        add_arguments=add_arguments,
        flag_ranges={"twin_weight": Range(0, low_open=True)},
        validate=validate,
    )
)
"""


@pytest.fixture
def plugin(tmp_path):
    """The plugin file; the registry is restored afterwards (a process imports a plugin once)."""
    saved = dict(ALGORITHMS)
    path = tmp_path / "twin_plugin.py"
    path.write_text(PLUGIN)
    yield ["--algorithm-path", str(path)]
    ALGORITHMS.clear()
    ALGORITHMS.update(saved)


TWIN = BASE + ["--loss-type", "twin", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2"]


def test_the_plugins_flag_and_role_overrides_parse_and_derive_their_defaults(plugin, tmp_path):
    save, own = str(tmp_path / "run"), str(tmp_path / "critic2")
    args = parse_args(
        [*plugin, *TWIN, "--twin-weight", "0.5", "--critic2-lr", "1e-5", "--num-steps-per-rollout", "2"]
        + ["--save", save, "--load", save, "--critic2-save", own]
    )
    assert args.twin_weight == 0.5 and args.critic2_lr == 1e-5 and args.lr == 1e-4
    assert args.critic2_num_steps_per_rollout == 6  # the role's Computed default: 3 x --num-steps-per-rollout 2
    assert (args.critic2_micro_batch_size, args.critic2_checkpoint) == (args.micro_batch_size, args.hf_checkpoint)
    assert (args.critic2_save, args.critic2_load) == (own, own)  # its own folder: it resumes from there
    assert training_order(args) == ["critic2", "actor"]
    defaults = parse_args([*plugin, *TWIN])
    assert (defaults.critic2_lr, defaults.critic2_num_steps_per_rollout, defaults.critic2_save) == (1e-4, 3, None)


def test_the_plugins_rule_and_ranges_name_its_flags(plugin, capsys):
    assert "--twin-weight above 2 needs --twin-teacher" in parse_error([*plugin, *TWIN, "--twin-weight", "3"], capsys)
    assert "--twin-weight must be > 0, got -1.0" in parse_error([*plugin, *TWIN, "--twin-weight", "-1"], capsys)
    assert "--critic2-lr must be > 0, got 0.0" in parse_error([*plugin, *TWIN, "--critic2-lr", "0"], capsys)


def test_without_the_plugin_its_flags_do_not_exist(capsys):
    assert "unrecognized arguments: --twin-weight" in parse_error([*BASE, "--twin-weight", "0.5"], capsys)
    assert "unrecognized arguments: --critic2-lr" in parse_error([*BASE, "--critic2-lr", "1e-5"], capsys)
    err = parse_error([*BASE, "--loss-type", "twin"], capsys)
    assert "--loss-type 'twin' is unknown" in err and "--algorithm-path" in err


def test_a_roles_overrides_are_refused_under_an_algorithm_without_it(plugin, capsys):
    err = parse_error([*plugin, *BASE, "--loss-type", "nft", "--critic2-lr", "1e-5"], capsys)
    assert "--critic2-lr only apply to an algorithm with a critic2 role (twin); --loss-type nft trains actor" in err
    err = parse_error([*plugin, *TWIN, "--critic-lr", "1e-5"], capsys)
    assert "--critic-lr only apply to an algorithm with a critic role (dmd2)" in err


def test_a_config_file_may_name_the_plugin_and_set_its_flags(plugin, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(f"algorithm-path: {plugin[1]}\nloss_type: twin\ntwin-weight: 0.25\ncritic2_lr: 2e-5\n")
    args = parse_args([*BASE, "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--config", str(config)])
    assert (args.loss_type, args.twin_weight, args.critic2_lr) == ("twin", 0.25, 2e-5)


def test_help_lists_the_plugins_flags(plugin, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args([*plugin, "--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0 and "--twin-weight" in out and "--critic2-micro-batch-size" in out


def test_the_roles_save_folder_is_locked_like_the_actors(plugin, tmp_path):
    own = str(tmp_path / "critic2")
    args = parse_args([*plugin, *TWIN, "--save", str(tmp_path / "run"), "--critic2-save", own])
    locks = lock_save_folders(args)
    try:
        other = parse_args([*plugin, *TWIN, "--save", str(tmp_path / "other"), "--critic2-save", own])
        with pytest.raises(FolderLockedError, match=f"--critic2-save {own} is in use by another run"):
            lock_save_folders(other)
    finally:
        locks.release()


def test_a_plugin_that_fails_to_import_names_the_path(tmp_path, capsys):
    broken = tmp_path / "broken_plugin.py"
    broken.write_text("import not_a_module_anywhere\n")
    err = parse_error([*BASE, "--algorithm-path", str(broken)], capsys)
    assert f"--algorithm-path: module '{broken}': importing '{broken}' failed" in err


@pytest.mark.parametrize(
    ("declaration", "message"),
    [
        ("Algorithm(name='clash', add_arguments=lambda p: p.add_argument('--lr'))", "the flags of algorithm 'clash'"),
        ("Algorithm(name='clash', roles=(Role('teacher'), Role('actor')))", "the 'teacher' role of clash"),
    ],
)
def test_a_plugin_whose_flags_clash_fails_naming_the_algorithm(tmp_path, capsys, declaration, message):
    saved = dict(ALGORITHMS)
    path = tmp_path / "clash_plugin.py"
    path.write_text(
        f"from miles.algorithms import Algorithm, Role, register_algorithm\nregister_algorithm({declaration})\n"
    )
    try:
        err = parse_error([*BASE, "--algorithm-path", str(path)], capsys)
    finally:
        ALGORITHMS.clear()
        ALGORITHMS.update(saved)
    assert message in err and "conflicting option string" in err
