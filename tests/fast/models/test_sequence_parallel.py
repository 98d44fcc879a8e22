"""Which runs --sp-size refuses at start-up, before any actor: families that do not declare sequence parallelism,
attention heads or latent tokens per sample that the size does not divide, Wan 2.2 TI2V's per-token timesteps."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from miles.models.base import all_family_classes, get_train_pipeline_config
from miles.startup import check_startup
from miles.utils.arguments import parse_args


def test_only_wan_declares_sequence_parallelism():
    declared = {name for name, cls in all_family_classes().items() if cls.supports_sequence_parallel}
    assert declared == {"wan"}


def test_tiny_wan_splits_over_two_ranks_at_its_geometry(tiny_wan_dir):
    family = get_train_pipeline_config(tiny_wan_dir, num_frames=5)
    assert family.sequence_parallel_problems(1, 32) == []
    assert family.sequence_parallel_problems(2, 32) == []  # 2 heads, 2 x 2 x 2 = 8 tokens


def test_heads_not_divisible_are_refused(tiny_wan_dir):
    problems = get_train_pipeline_config(tiny_wan_dir, num_frames=5).sequence_parallel_problems(4, 32)
    assert problems == [
        "--sp-size 4 must divide the transformer's 2 attention heads (each rank attends with heads / sp-size of "
        "them); choose a divisor"
    ]


def test_a_token_count_not_divisible_is_refused(tiny_wan_dir):
    # 9 frames -> 3 latent frames; 48 px -> 6 x 6 latents -> 3 x 3 patches: 27 tokens, 2 heads
    problems = get_train_pipeline_config(tiny_wan_dir, num_frames=9).sequence_parallel_problems(2, 48)
    assert len(problems) == 1 and "--sp-size 2 must divide the 27 latent tokens per sample" in problems[0]


def test_per_token_timesteps_are_refused(tiny_wan_dir, tmp_path):
    folder = Path(shutil.copytree(tiny_wan_dir, tmp_path / "ti2v"))
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, "expand_timesteps": True}))
    problems = get_train_pipeline_config(str(folder), num_frames=5).sequence_parallel_problems(2, 32)
    assert len(problems) == 1 and "expand_timesteps" in problems[0] and "--sp-size 2" in problems[0]


def test_a_family_without_support_is_refused_at_start_up_naming_it(tiny_pipeline_dir):
    args = parse_args(["--hf-checkpoint", tiny_pipeline_dir, "--dp-size", "1", "--sp-size", "2"])
    with pytest.raises(ValueError, match=r"--sp-size 2: the sd3 family does not support sequence parallelism"):
        check_startup(args)
    check_startup(parse_args(["--hf-checkpoint", tiny_pipeline_dir, "--dp-size", "1"]))  # sp 1: nothing to refuse
