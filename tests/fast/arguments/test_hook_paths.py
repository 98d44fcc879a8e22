"""Rollout-step path flags: loaded and signature-checked before any actor starts, rejected where never read."""

import pytest

from miles.arguments.hook_paths import PATH_FLAGS, load_path_flags
from miles.arguments.parser import parse_args
from miles.utils.misc import HookLoadError

BASE = ["--hf-checkpoint", "builtin:tiny-shapes", "--prompt-data", "builtin:shapes", "--eval-interval", "0"]


def write_hooks(tmp_path):
    path = tmp_path / "hooks.py"
    path.write_text(
        "def keep_spread(args, group):\n    return len({s.reward for s in group}) > 1\n\n"
        "def wrong_arity(args):\n    return True\n\n"
        "def needs_keyword(args, group, *, threshold):\n    return True\n\n"
        "def generate(args, engines, request):\n    return engines.generate(request)\n"
    )
    return str(path)


def test_every_given_path_is_loaded(tmp_path):
    hooks = write_hooks(tmp_path)
    args = parse_args(
        [
            *BASE,
            "--loss-type",
            "policy_loss",
            "--dynamic-sampling-filter-path",
            f"{hooks}:keep_spread",
            "--custom-generate-function-path",
            f"{hooks}:generate",
        ]
    )
    loaded = load_path_flags(args)
    assert sorted(loaded) == ["custom_generate_function_path", "dynamic_sampling_filter_path"]
    assert loaded["dynamic_sampling_filter_path"].__name__ == "keep_spread"


@pytest.mark.parametrize("name", ["wrong_arity", "needs_keyword"])
def test_a_wrong_signature_names_the_flag_the_file_and_the_expected_call(tmp_path, name):
    hooks = write_hooks(tmp_path)
    args = parse_args([*BASE, "--loss-type", "nft", "--dynamic-sampling-filter-path", f"{hooks}:{name}"])
    with pytest.raises(HookLoadError) as info:
        load_path_flags(args)
    message = str(info.value)
    assert "--dynamic-sampling-filter-path" in message and "hooks.py" in message and "fn(args, group)" in message


def test_a_missing_file_or_function_names_the_flag(tmp_path):
    hooks = write_hooks(tmp_path)
    for path, missing in [(str(tmp_path / "nope.py") + ":f", "does not exist"), (f"{hooks}:absent", "absent")]:
        args = parse_args([*BASE, "--loss-type", "policy_loss", "--rollout-sample-filter-path", path])
        with pytest.raises(HookLoadError, match="--rollout-sample-filter-path") as info:
            load_path_flags(args)
        assert missing in str(info.value)


@pytest.mark.parametrize(
    ("loss", "flag"),
    [
        ("dmd2", "--dynamic-sampling-filter-path"),
        ("dmd2", "--rollout-sample-filter-path"),
        ("nft", "--diffusion-step-strategy-path"),
        ("sft_loss", "--data-source-path"),
        ("sft_loss", "--eval-function-path"),
    ],
)
def test_a_path_the_loss_type_never_reads_fails_at_parse_time(tmp_path, loss, flag, capsys):
    extra = {"dmd2": ["--teacher-load", "builtin:tiny-shapes"], "sft_loss": ["--train-only"]}.get(loss, [])
    with pytest.raises(SystemExit):
        parse_args([*BASE, "--loss-type", loss, *extra, flag, "x.py:f"])
    assert flag in capsys.readouterr().err


def test_the_old_expand_flag_is_an_alias_of_the_convert_flag():
    args = parse_args([*BASE, "--loss-type", "policy_loss", "--custom-expand-samples-to-train-pairs-path", "m.f"])
    assert args.custom_convert_samples_to_train_data_path == "m.f"


def test_every_path_flag_is_documented_with_its_signature():
    from pathlib import Path

    doc = (Path(__file__).parents[3] / "docs" / "user-guide" / "customization.md").read_text()
    for spec in PATH_FLAGS:
        assert spec.flag in doc, spec.flag
        assert spec.signature.split(" ->")[0] in doc, spec.signature
