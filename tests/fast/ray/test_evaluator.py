"""Held-out evaluation: which eval a prompt file selects (OCR when no record has shapes metadata, then every prompt
needs quoted text; shapes otherwise), the eval samples with the run's rollout entry's sampler (none for a
dataset entry, which starts no engine), the evaluator's flag record, and with --gold-rm-type the eval's samples
scored by the trained reward and the gold."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from miles.algorithms import get_algorithm
from miles.arguments.parser import default_args, parse_args
from miles.data.ocr import ocr_prompts
from miles.data.shapes import shapes_items
from miles.ray.evaluator import OCR_EVAL, SHAPES_EVAL, EvalFlags, Evaluator, load_eval_records
from miles.rollout.guard import GOLD_KEY, PROXY_KEY
from miles.rollout.requests import ode_eval
from miles.rollout.rm_hub.jpeg import JPEG_SCALE_KB, jpeg_size_kb
from miles.rollout.rollout_hub import generator_eval
from tests.fast.data.test_ocr import data_args
from tests.fast.ray.test_rollout_manager import BASE, sft_args


def test_prompt_file_picks_the_held_out_eval(tmp_path):
    kind, records = load_eval_records(data_args(eval_num_prompts=5))
    assert kind == OCR_EVAL and records == ocr_prompts("eval")[:5]
    quoted = tmp_path / "ocr.jsonl"
    quoted.write_text(json.dumps({"prompt": 'a sign that says "OPEN"'}) + "\n")
    assert load_eval_records(data_args(eval_prompt_data=str(quoted))) == (
        OCR_EVAL,
        [{"prompt": 'a sign that says "OPEN"', "metadata": {}}],
    )
    shapes = tmp_path / "shapes.jsonl"
    meta = {"color": "red", "shape": "circle", "count": 1, "position": "left"}
    shapes.write_text(json.dumps({"prompt": "a red circle on the left", "metadata": meta}) + "\n")
    assert load_eval_records(data_args(eval_prompt_data=str(shapes)))[0] == SHAPES_EVAL
    plain = tmp_path / "plain.txt"
    plain.write_text("a red circle\n")
    with pytest.raises(ValueError, match=r"plain.txt record 1: 'a red circle' has neither shapes metadata nor"):
        load_eval_records(data_args(eval_prompt_data=str(plain)))


def test_the_eval_samples_with_the_entrys_sampler(tiny_pipeline_dir):
    common = [*BASE, "--hf-checkpoint", tiny_pipeline_dir, "--eval-num-prompts", "2"]
    assert Evaluator(parse_args([*common, "--loss-type", "nft"])).sampler is ode_eval
    dmd2 = parse_args([*common, "--loss-type", "dmd2", "--teacher-load", tiny_pipeline_dir])
    assert Evaluator(dmd2).sampler is generator_eval
    with pytest.raises(
        ValueError, match="sft_loss trains on dataset pairs here with none started: pass --eval-interval"
    ):
        Evaluator(sft_args(tiny_pipeline_dir))


def test_the_eval_record_holds_the_evaluators_flags(tmp_path):
    defaults = EvalFlags.from_args(default_args())
    assert (defaults.n_samples_per_eval_prompt, defaults.eval_seed, defaults.ocr_num_threads) == (1, 0, 1)
    assert (defaults.diffusion_guidance_scale, defaults.resolution, defaults.negative_prompt) == (None, None, "")
    args = parse_args(
        [
            "--hf-checkpoint", "unused", "--prompt-data", "builtin:shapes", "--loss-type", "policy_loss",
            "--eval-num-prompts", "2", "--n-samples-per-eval-prompt", "3", "--eval-seed", "9", "--resolution", "32",
            "--negative-prompt", "blurry", "--output-dir", str(tmp_path), "--media-max-samples", "2",
        ]
    )  # fmt: skip
    flags = EvalFlags.from_args(args)
    assert (flags.loss_type, flags.n_samples_per_eval_prompt, flags.eval_seed, flags.resolution) == (
        "policy_loss",
        3,
        9,
        32,
    )
    assert (flags.negative_prompt, flags.output_dir, flags.media_max_samples) == ("blurry", str(tmp_path), 2)
    assert flags.diffusion_guidance_scale == get_algorithm("policy_loss").guidance_scale  # the computed default
    assert Evaluator(args).flags == flags


class ShapesRenderer:
    """An engine that draws each eval prompt's own scene (the eval's records: builtin:shapes' eval split)."""

    def __init__(self, num: int, seed: int) -> None:
        items = shapes_items(num, seed=seed, split="eval")
        self.images = {item["prompt"]: np.asarray(item["image"].convert("RGB")) for item in items}

    def generate(self, request):
        images = np.stack([self.images[prompt] for prompt in request.prompts])
        return SimpleNamespace(images=images, audio=None, fps=None, sample_rate=None)


def test_with_a_gold_the_eval_scores_its_samples_with_the_trained_reward_and_the_gold(tmp_path):
    common = [*BASE, "--hf-checkpoint", "unused", "--eval-num-prompts", "3", "--eval-seed", "2", "--output-dir",
              str(tmp_path), "--rm-type", "jpeg_compressibility"]  # fmt: skip
    engine = ShapesRenderer(3, seed=2)
    metrics = Evaluator(parse_args([*common, "--gold-rm-type", "shapes"])).evaluate(engine, rollout_id=4)
    images = list(engine.images.values())
    assert len(images) == 3  # three scenes, three captions
    assert metrics[GOLD_KEY] == pytest.approx(metrics["eval/shapes_reward_mean"])  # the same reward, two paths
    assert metrics[PROXY_KEY] == pytest.approx(np.mean([-jpeg_size_kb(image) / JPEG_SCALE_KB for image in images]))
    plain = Evaluator(parse_args(common)).evaluate(engine, rollout_id=4)
    assert {k: v for k, v in metrics.items() if k not in (GOLD_KEY, PROXY_KEY, "perf/eval_s")} == {
        k: v for k, v in plain.items() if k != "perf/eval_s"
    }  # without a gold: the eval as it was
