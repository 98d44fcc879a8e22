"""Held-out evaluation: which eval a prompt file selects (OCR when no record has shapes metadata, then every prompt
needs quoted text; shapes otherwise), and the eval samples with the run's rollout entry's sampler (none for a
dataset entry, which starts no engine)."""

from __future__ import annotations

import json

import pytest

from miles.arguments.parser import parse_args
from miles.data.ocr import ocr_prompts
from miles.ray.evaluator import OCR_EVAL, SHAPES_EVAL, Evaluator, load_eval_records
from miles.rollout.requests import ode_eval
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
