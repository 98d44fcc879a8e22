"""Whole SFT runs through the driver: 2 FSDP ranks learn, checkpoints resume exactly, --save-hf loads."""

import pytest
import torch

import train_diffusion
from miles.arguments.parser import parse_args
from miles.backends.fsdp_utils.checkpoint import read_extra
from miles.data.shapes import write_shapes_jsonl
from miles.utils.tracking import read_metrics

pytestmark = pytest.mark.e2e


def sft_args(pipeline_dir, out, *extra):
    return parse_args(
        [
            "--loss-type",
            "sft_loss",
            "--train-only",
            "--hf-checkpoint",
            pipeline_dir,
            "--dp-size",
            "2",
            "--rollout-batch-size",
            "16",
            "--global-batch-size",
            "8",
            "--num-steps-per-rollout",
            "2",
            "--micro-batch-size",
            "4",
            "--lr",
            "1e-3",
            "--lr-warmup-steps",
            "4",
            "--output-dir",
            str(out),
            "--no-progress",
            "--log-level",
            "WARNING",
            *extra,
        ]
    )


def actor_steps(path):
    return [m for m in read_metrics(path) if m.get("role") == "actor"]


def test_two_rank_sft_from_jsonl_learns_and_exports(ray_cluster, tiny_pipeline_dir, tmp_path):
    data = write_shapes_jsonl(tmp_path / "data" / "shapes.jsonl", 128, seed=0)
    out = tmp_path / "run"
    agreement = {}

    def check_ranks(groups):
        states = groups["actor"].call("full_state_dict_every_rank")
        agreement["max_diff"] = max((states[0][k] - states[1][k]).abs().max().item() for k in states[0])

    args = sft_args(
        tiny_pipeline_dir, out, "--prompt-data", str(data), "--num-rollout", "30", "--save-hf", str(tmp_path / "hf")
    )
    train_diffusion.run(args, before_shutdown=check_ranks)
    losses = [m["train/loss"] for m in actor_steps(out / "metrics.jsonl")]
    assert len(losses) == 60
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert last < 0.8 * first, f"train/loss did not fall: first 10 steps {first:.3f}, last 10 {last:.3f}"
    assert agreement["max_diff"] == 0.0

    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(str(tmp_path / "hf"))
    image = pipe(
        "two red circles on the left",
        num_inference_steps=4,
        height=32,
        width=32,
        max_sequence_length=32,
        generator=torch.Generator().manual_seed(0),
        output_type="np",
    ).images[0]
    assert image.shape == (32, 32, 3) and float(image.std()) > 0


def test_resume_continues_the_metric_series_exactly(ray_cluster, tiny_pipeline_dir, tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    common = ("--prompt-data", "builtin:shapes", "--builtin-dataset-size", "64", "--num-rollout", "4")
    train_diffusion.run(sft_args(tiny_pipeline_dir, straight, *common))
    ckpt = str(tmp_path / "ckpt")
    first = sft_args(tiny_pipeline_dir, resumed, *common, "--save", ckpt, "--save-interval", "2")
    first.num_rollout = 2
    train_diffusion.run(first)
    train_diffusion.run(sft_args(tiny_pipeline_dir, resumed, *common, "--save", ckpt, "--load", ckpt))
    a, b = actor_steps(straight / "metrics.jsonl"), actor_steps(resumed / "metrics.jsonl")
    assert [m["step"] for m in b] == [1, 2, 3, 4, 5, 6, 7, 8]
    saved = read_extra(ckpt, 1, "actor")["data_source"]
    assert saved["next_rollout_id"] == 2 and saved["num_records"] == 64
    for x, y in zip(a, b):
        assert x["train/loss"] == y["train/loss"] and x["train/grad_norm"] == y["train/grad_norm"], (x, y)
