"""--train-pipeline-config-path: a user's model family class from a file, resolved in every process."""

import pytest

from miles.models.base import get_train_pipeline_config, load_family_class
from miles.utils.arguments import parse_args

FAMILY = """
from miles.models.sd3 import SD3PipelineConfig


class MySD3(SD3PipelineConfig):
    name = "my_sd3"
    default_resolution = 32


class NotAFamily:
    pass
"""


def test_a_family_class_from_a_file_is_used_for_the_pipeline(tmp_path, tiny_pipeline_dir):
    path = tmp_path / "family.py"
    path.write_text(FAMILY)
    args = parse_args(
        ["--hf-checkpoint", tiny_pipeline_dir, "--prompt-data", "builtin:shapes", "--eval-interval", "0",
         "--train-pipeline-config-path", f"{path}:MySD3"]
    )  # fmt: skip
    family = get_train_pipeline_config(args.hf_checkpoint, args.model_family)  # what every actor calls
    assert type(family).__name__ == "MySD3" and family.name == "my_sd3" and family.default_resolution == 32
    assert family.latent_shape(32)[0] == get_train_pipeline_config(tiny_pipeline_dir).latent_shape(32)[0]


def test_a_class_that_is_not_a_family_is_refused_naming_the_flag(tmp_path):
    path = tmp_path / "family.py"
    path.write_text(FAMILY)
    with pytest.raises(TypeError, match="--train-pipeline-config-path .*not a TrainPipelineConfig"):
        load_family_class(f"{path}:NotAFamily")


def test_model_family_and_the_class_path_exclude_each_other(capsys):
    with pytest.raises(SystemExit):
        parse_args(
            ["--hf-checkpoint", "x", "--prompt-data", "builtin:shapes", "--model-family", "sd3",
             "--train-pipeline-config-path", "f.py:C"]
        )  # fmt: skip
    assert "--train-pipeline-config-path" in capsys.readouterr().err


def test_a_family_whose_run_check_takes_no_algorithm_is_refused(tmp_path):
    path = tmp_path / "family.py"
    path.write_text(FAMILY + "\n\nclass OldCheck(MySD3):\n    def check_run_args(self, args):\n        pass\n")
    with pytest.raises(TypeError, match=r"OldCheck\.check_run_args must take \(self, args, algorithm\)"):
        load_family_class(f"{path}:OldCheck")
