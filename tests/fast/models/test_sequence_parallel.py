"""Which runs --sp-size refuses at start-up, before any actor: families that do not declare sequence parallelism,
attention heads or latent tokens per sample that the size does not divide (LTX-2: of each attention kind and each
stream, named; HunyuanVideo 1.5: its heads and video tokens), Wan 2.2 TI2V's per-token timesteps."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from miles.arguments.parser import parse_args
from miles.models.base import all_family_classes, get_train_pipeline_config
from miles.startup import check_startup


def test_wan_ltx2_and_hunyuan_video15_declare_sequence_parallelism():
    declared = {name for name, cls in all_family_classes().items() if cls.supports_sequence_parallel}
    assert declared == {"wan", "ltx2", "hunyuan-video15"}


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
    with pytest.raises(ValueError, match=r"--sp-size 2: the sd3 family does not support sequence parallelism") as err:
        check_startup(args)
    assert "declare supports_sequence_parallel do: hunyuan-video15, ltx2, wan)" in str(err.value)
    check_startup(parse_args(["--hf-checkpoint", tiny_pipeline_dir, "--dp-size", "1"]))  # sp 1: nothing to refuse


def test_tiny_ltx2_splits_both_streams_over_two_ranks(tiny_ltx2_dir):
    family = get_train_pipeline_config(tiny_ltx2_dir)  # 121 frames: 16 x 2 x 2 = 64 video and 126 audio tokens
    assert family.sequence_parallel_problems(1, 32) == []
    assert family.sequence_parallel_problems(2, 32) == []  # 2 video heads, 2 audio heads


def test_ltx2_names_each_attention_kind_and_stream_it_cannot_split(tiny_ltx2_dir):
    problems = get_train_pipeline_config(tiny_ltx2_dir).sequence_parallel_problems(4, 32)
    assert problems == [
        "--sp-size 4 must divide the transformer's 2 video attention heads (each rank attends with heads / sp-size "
        "of them); choose a divisor",
        "--sp-size 4 must divide the transformer's 2 audio attention heads (each rank attends with heads / sp-size "
        "of them); choose a divisor",
        "--sp-size 4 must divide the 126 audio latent tokens per sample of this run's geometry (--resolution, "
        "--num-frames); choose a divisor or change the geometry",
    ]  # the 64 video tokens divide by 4
    odd = get_train_pipeline_config(tiny_ltx2_dir, num_frames=9)  # 2 latent frames x 2 x 2; 9 / 24 s -> 9 audio
    assert odd.sequence_parallel_problems(2, 32) == [
        "--sp-size 2 must divide the 9 audio latent tokens per sample of this run's geometry (--resolution, "
        "--num-frames); choose a divisor or change the geometry"
    ]


def test_ltx2_at_an_indivisible_geometry_is_refused_at_start_up(tiny_ltx2_dir):
    base = [
        "--hf-checkpoint",
        tiny_ltx2_dir,
        "--dp-size",
        "1",
        "--resolution",
        "32",
        "--loss-type",
        "nft",
        "--eval-interval",
        "0",
    ]
    with pytest.raises(ValueError, match=r"--sp-size 4 must divide the transformer's 2 video attention heads"):
        check_startup(parse_args([*base, "--sp-size", "4"]))
    check_startup(parse_args([*base, "--sp-size", "2"]))


def test_hunyuan_video15_splits_its_video_tokens_and_names_what_it_cannot(tiny_hunyuan_video15_dir):
    family = get_train_pipeline_config(tiny_hunyuan_video15_dir, num_frames=5)  # 2 x 8 x 8 = 128 tokens, 2 heads
    assert family.sequence_parallel_problems(2, 32) == []
    assert family.sequence_parallel_problems(4, 32) == [
        "--sp-size 4 must divide the transformer's 2 attention heads (each rank attends with heads / sp-size of "
        "them); choose a divisor"
    ]
    assert "--sp-size 2 must divide the 9 latent tokens per sample" in " ".join(
        get_train_pipeline_config(tiny_hunyuan_video15_dir, num_frames=1).sequence_parallel_problems(2, 12)
    )  # 1 latent frame of 3 x 3
