"""A reward that cannot run on this run's prompts or model is refused by the start-up, before any actor or model
loads (`startup_checks`, what the driver runs beside `ray.init`), naming the reward and what to do; a reward whose
model folder is missing is refused when the flags are parsed."""

from __future__ import annotations

import pytest

from miles.arguments import reward_spec
from miles.arguments.parser import parse_args
from miles.rollout.input_files import InputFileError
from miles.startup import startup_checks


def checked(*flags: str) -> None:
    startup_checks(parse_args(["--loss-type", "nft", "--eval-interval", "0", *flags]))


@pytest.mark.parametrize(
    ("reward", "message"),
    [
        ("temporal_consistency", "--rm-type temporal_consistency scores video (sample.frames), and sd3 makes images"),
        ("shapes:1,motion_direction:0.5", "--rm-type motion_direction scores video"),
        ("edit_preservation", "--rm-type edit_preservation compares each result with its source image, and sd3 takes"),
    ],
)
def test_a_reward_that_cannot_score_what_the_family_makes_is_refused_at_start_up(reward, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        checked("--rm-type", reward)  # the default model: builtin:tiny-shapes, an SD3 image family


def test_a_gold_that_cannot_score_the_evals_samples_is_refused_at_start_up():
    with pytest.raises(ValueError, match=r"--gold-rm-type motion_direction scores video \(sample.frames\)"):
        startup_checks(parse_args(["--loss-type", "nft", "--eval-interval", "5", "--gold-rm-type", "motion_direction"]))


def test_ocr_on_prompts_without_quoted_text_is_refused_at_start_up(monkeypatch, tmp_path):
    monkeypatch.setitem(reward_spec.REWARD_PACKAGES, "ocr", ("json", "pip install miles[ocr]"))  # as if installed
    with pytest.raises(InputFileError, match=r"--rm-type ocr reads .* --prompt-data builtin:shapes have none: use "):
        checked("--rm-type", "ocr")  # the default prompts: the shapes world's captions
    prompts = tmp_path / "prompts.txt"
    prompts.write_text('a sign that says "OPEN"\na red circle\n')
    with pytest.raises(InputFileError, match=r"record 2 \(1 of 2 unquoted\): 'a red circle' has no target text"):
        checked("--rm-type", "ocr", "--prompt-data", str(prompts), "--allow-repeated-prompts")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--rm-type", "clip_score"], "--rm-type clip_score needs --clip-model-path DIR, a local folder"),
        (
            ["--rm-type", "pickscore", "--pickscore-model-path", "/nonexistent/ps"],
            "--pickscore-model-path /nonexistent/",
        ),
        (
            ["--loss-type", "dmd2", "--teacher-load", "builtin:tiny-shapes", "--rm-type", "clip_score"],
            "clip-model-path",
        ),
    ],
)
def test_a_reward_without_its_model_folder_is_refused_when_parsing(flags, message, capsys):
    """Under dmd2, which scores no rewards, a --rm-type is still scored (logged): it must be able to run too."""
    with pytest.raises(SystemExit):
        parse_args(flags)
    assert message in capsys.readouterr().err


def test_a_model_folder_without_a_model_is_refused_when_parsing(tmp_path, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--rm-type", "clip_score", "--clip-model-path", str(tmp_path)])
    assert f"--clip-model-path {tmp_path}: no config.json in it" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{}")
    parse_args(["--rm-type", "clip_score", "--clip-model-path", str(tmp_path)])


def test_a_missing_optional_package_is_refused_when_parsing(monkeypatch, capsys):
    """The ocr reward, and the OCR eval of builtin:ocr, without the package they read images with."""
    monkeypatch.setitem(reward_spec.REWARD_PACKAGES, "ocr", ("no_such_ocr_module", "pip install miles[ocr]"))
    with pytest.raises(SystemExit):
        parse_args(["--rm-type", "ocr", "--prompt-data", "builtin:ocr"])
    assert "reward 'ocr' needs the no_such_ocr_module package: pip install miles[ocr]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--eval-prompt-data", "builtin:ocr", "--eval-interval", "5"])
    message = "--eval-prompt-data builtin:ocr is scored by OCR, which needs the no_such_ocr_module package"
    assert message in capsys.readouterr().err
    parse_args(["--eval-prompt-data", "builtin:ocr", "--eval-interval", "0"])  # no eval: nothing to score
